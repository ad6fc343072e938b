-- Activation checkpointing (fsdp.checkpoint, nn.Checkpoint, fsdp.wrap's {checkpoint = true}): the
-- same outputs and gradients as without it, bit for bit (dropout's draws replayed), the function run
-- once more in backward and not at all again under no_grad, less activation memory, clear errors;
-- and under FSDP at 1 and 2 ranks (tests/scripts/act_ckpt.lua): units around checkpointed forwards,
-- a checkpointed region around units, and units checkpointing part of their forward.
local fsdp = require "fsdp"
local nn, F = fsdp.nn, fsdp.nn.functional
local H = require "helpers"

local function mlp(depth, width)
  fsdp.manual_seed(0)
  local layers = {}
  for i = 1, depth do
    layers[#layers + 1] = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.3))
  end
  return nn.Sequential(unpack(layers))
end

-- loss, input gradient and parameter gradients of one backward of sum(m(x)^2), with the RNG at seed
local function run(m, x, seed, call)
  fsdp.manual_seed(seed)
  for _, p in ipairs(m:parameters()) do p.grad = nil end
  x.grad = nil
  local loss = (call or m)(x):pow(2):sum()
  loss:backward()
  local g = { x = x.grad:clone() }
  for name, p in m:named_parameters() do g[name] = p.grad:clone() end
  return loss:item(), g
end

local function assert_same(a, b)
  for k, v in pairs(a) do assert.equal(0, (v - b[k]):abs():max():item(), k) end
end

describe("activation checkpointing", function()
  it("gives the same loss and gradients, running the function once more in backward", function()
    local m = mlp(3, 16)
    local x = fsdp.randn(6, 16):requires_grad_()
    local l1, g1 = run(m, x, 5)
    local calls = 0
    local l2, g2 = run(m, x, 5, function(a)
      return fsdp.checkpoint(function(b)
        calls = calls + 1
        return m(b)
      end, a)
    end)
    assert.equal(l1, l2)
    assert_same(g1, g2)
    assert.equal(2, calls)  -- the forward, and once again in backward (the dropout masks replayed)
    -- without grad mode there is nothing to recompute: the function runs once
    calls = 0
    fsdp.no_grad(function() return fsdp.checkpoint(function(b) calls = calls + 1; return m(b) end, x) end)
    assert.equal(1, calls)
  end)

  it("as a module (nn.Checkpoint): same results, same names", function()
    local m = mlp(3, 16)
    local x = fsdp.randn(6, 16):requires_grad_()
    local l1, g1 = run(m, x, 9)
    local keys = H.sorted_keys(m:state_dict())
    for _, b in ipairs(m:children()) do assert.equal(b, nn.Checkpoint(b)) end
    local l2, g2 = run(m, x, 9)
    assert.equal(l1, l2)
    assert_same(g1, g2)
    assert.same(keys, H.sorted_keys(m:state_dict()))
  end)

  it("keeps a retained graph for a second backward without running again", function()
    local m = mlp(2, 8)
    local x = fsdp.randn(4, 8):requires_grad_()
    local calls = 0
    fsdp.manual_seed(3)
    local loss = fsdp.checkpoint(function(b) calls = calls + 1; return m(b) end, x):pow(2):sum()
    loss:backward({ retain_graph = true })
    local g = x.grad:clone()
    loss:backward()
    assert.equal(2, calls)
    assert.equal(0, (x.grad - g * 2):abs():max():item())
  end)

  it("needs less activation memory: each block's activations live only during its backward", function()
    local m = mlp(8, 512)
    local x = fsdp.randn(256, 512)
    local function peak()
      collectgarbage()
      fsdp.reset_peak_memory_stats()
      fsdp.manual_seed(1)
      m(x):pow(2):sum():backward()
      return fsdp.memory_stats().activations.peak
    end
    local plain = peak()
    for _, b in ipairs(m:children()) do nn.Checkpoint(b) end
    local ckpt = peak()
    assert(ckpt * 1.8 < plain, ("activation peak %d bytes checkpointed, %d without"):format(ckpt, plain))
  end)

  it("says what is wrong", function()
    H.assert_error(function() fsdp.checkpoint(3) end, "checkpoint: expected a function (or a module) to run, got number")
    -- a function that runs other ops the second time
    local m = mlp(2, 8)
    local x = fsdp.randn(4, 8):requires_grad_()
    local calls = 0
    local y = fsdp.checkpoint(function(b)
      calls = calls + 1
      if calls == 1 then return m(b) end
      return m:children()[1](b)
    end, x)
    H.assert_error(function() y:sum():backward() end, "checkpoint: the forward saved", "when it ran again for backward",
      "must run the same ops both times")
    -- one that fails when it runs again
    calls = 0
    y = fsdp.checkpoint(function(b)
      calls = calls + 1
      if calls > 1 then error("boom on the rerun") end
      return m(b)
    end, x)
    H.assert_error(function() y:sum():backward() end, "checkpoint: running the forward again for backward", "boom on the rerun")
    -- and the process goes on working
    local l = run(m, x, 1)
    assert.is_true(l > 0)
  end)

  local function fsdp_case(layout, n)
    local rc, out
    if n == 1 then
      rc, out = H.sh(("luajit %sact_ckpt.lua %s"):format(H.scripts, layout),
        ("LUA_PATH='%s/lua/?.lua;%s/lua/?/init.lua;;' LUA_CPATH='%s/?.so;;'"):format(H.root, H.root, H.root))
    else
      rc, out = H.sh(("%s -n %d %sact_ckpt.lua %s"):format(H.fsdprun, n, H.scripts, layout), nil, 240)
    end
    assert.equal(0, rc, out)
    for r = 0, n - 1 do assert.truthy(out:find(("act_ckpt %s OK rank %d"):format(layout, r), 1, true), out) end
    -- a unit's checkpointed forward keeps less than its activations
    local a, b = out:match("act_peak (%d+) (%d+)")
    if layout ~= "around" then assert(tonumber(b) < tonumber(a), out) end
  end
  for _, layout in ipairs { "unit", "around", "inside" } do
    for _, n in ipairs { 1, 2 } do
      it(("under FSDP at %d rank(s): %s"):format(n, layout), function()
        if n > 1 and not H.has_mpi() then pending("no mpirun or libfsdp_mpi.so") return end
        fsdp_case(layout, n)
      end)
    end
  end
end)
