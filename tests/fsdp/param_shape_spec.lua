-- Sharded parameters keep their logical shape (tests/scripts/param_shape.lua, at 1, 2 and 4 ranks):
-- shape, size, dim, numel, #p and printing answer the full shape as before wrapping, p:to_local() is
-- this rank's piece, the nanoGPT weight-decay groups (p:dim() >= 2) are the same after wrapping, and
-- training with them, num_parameters and clip_grad_norm match one process on the unwrapped model.
-- Its last check: a load_state_dict into a submodule that holds pieces names both shapes. Here,
-- on one rank: what a tensor that is no parameter answers.
local fsdp = require "fsdp"
local H = require "helpers"

local function run(n)
  local rc, out
  if n == 1 then
    rc, out = H.sh(("luajit %sparam_shape.lua"):format(H.scripts),
      ("LUA_PATH='%s/lua/?.lua;%s/lua/?/init.lua;;' LUA_CPATH='%s/?.so;;'"):format(H.root, H.root, H.root))
  else
    rc, out = H.sh(("%s -n %d %sparam_shape.lua"):format(H.fsdprun, n, H.scripts), nil, 240)
  end
  assert.equal(0, rc, out)
  for r = 0, n - 1 do assert.truthy(out:find("param_shape OK rank " .. r, 1, true), out) end
end

describe("sharded parameters keep their logical shape", function()
  it("on one rank", function() run(1) end)
  it("on 2 ranks", function()
    if not H.has_mpi() then pending("no mpirun or libfsdp_mpi.so") return end
    run(2)
  end)
  it("on 4 ranks", function()
    if not H.has_mpi() then pending("no mpirun or libfsdp_mpi.so") return end
    run(4)
  end)

  it("leaves other tensors as they are: to_local is the tensor, size speaks 1-based", function()
    local x = fsdp.randn(3, 4)
    assert.equal(x, x:to_local())
    assert.same({ 3, 4 }, x:size())
    assert.equal(4, x:size(-1))
    assert.equal(3, x:size(-2))
    H.assert_error(function() return x:size(3) end, "size: dimension 3 out of range for a tensor with 2 dims")
    H.assert_error(function() return x:size(-3) end, "size: dimension -3 out of range for a tensor with 2 dims")
  end)
end)
