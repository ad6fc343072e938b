-- Tensor code in hot loops with LuaJIT's JIT compiler on. A tensor is a handle (a one-field
-- struct, see lua/fsdp/init.lua), so `x + 1` goes through the metatype in compiled traces too;
-- a bare `fsdp_tensor*` was compiled as pointer arithmetic and crashed or returned garbage.
-- The loops run in a child process, so a crash fails the test instead of killing busted. Each
-- loop checks its values on every iteration, reports the iteration at which LuaJIT compiled it
-- (jit.attach's "trace" events), and the process ends by checking that no tensor leaked.
local H = require "helpers"

local script = [[
package.path = ROOT .. "/lua/?.lua;" .. ROOT .. "/lua/?/init.lua;" .. package.path
package.cpath = ROOT .. "/?.so;" .. package.cpath
local jit = require "jit"
local fsdp = require "fsdp"
local F = fsdp.F
print("jit on " .. tostring(jit.status()))

-- which loop function got a compiled trace, and at which iteration
local now, compiled_at = 0, {}
jit.attach(function(what, _, func)
  if what == "stop" and compiled_at[func] == nil then compiled_at[func] = now end
end, "trace")
function tick(i) now = i end

local N = 3000
local loops = {}

-- every arithmetic operator, tensor (x) number in both orders, tensor (x) tensor, unary minus
loops.arithmetic = [=[
  local x = fsdp.ones(2, 2)
  local y = fsdp.full({ 2, 2 }, 2)
  local bad = 0
  for i = 1, N do
    tick(i)
    local a = (x + i) * 2 - y / 4 + 1 - x * 3 + 3 * x - (-x) ^ 2 + 2 / y + (1 - y) + (y - 1)
    -- each element: 2 + 2i - 0.5 + 1 - 3 + 3 - 1 + 1 - 1 + 1 = 2i + 2.5; four of them
    if a:sum():item() ~= 8 * i + 10 then bad = bad + 1 end
  end
  return bad
]=]

-- comparisons (handle identity, eq, numbers from tensors) and queries
loops.compare = [=[
  local z = fsdp.arange(6):float():view(2, 3)   -- 0 1 2 / 3 4 5
  local w = fsdp.ones(3):requires_grad_()
  local loss = (w * 2):sum()
  loss:backward()
  local bad = 0
  for i = 1, N do
    tick(i)
    local t = z:t()
    local same = w.grad == w.grad and not (t == z) and t ~= z  -- two handles of one tensor are equal
    local shape = #t == 3 and t:size(2) == 2 and t:numel() == 6 and t:dim() == 2 and not t:is_contiguous()
    local hits = z:eq(i % 6):sum():item()                       -- exactly one element matches
    local big = (z * i):max():item() > 5 * i - 1                -- the max is 5i
    if not (same and shape and hits == 1 and big) then bad = bad + 1 end
  end
  return bad
]=]

-- view and nn methods
loops.methods = [=[
  local z = fsdp.arange(6):float():view(2, 3)
  local col = fsdp.ones(3, 1)
  local bad = 0
  for i = 1, N do
    tick(i)
    local row = z:reshape(3, 2):narrow(1, 2, 1):sum():item()    -- row 2 of (3, 2) is {2, 3}
    local act = F.relu(z - i % 3):matmul(col):sum():item()      -- relu(0..5 - k) summed
    local want = ({ [0] = 15, 10, 6 })[i % 3]
    if not (row == 5 and act == want) then bad = bad + 1 end
  end
  return bad
]=]

-- Each loop runs as a fresh function (a new prototype) up to three times. A finalizer that runs
-- while LuaJIT records a trace aborts the recording (every loop that makes tensors frees some),
-- and after enough aborts LuaJIT blacklists the loop for good; that is LuaJIT's GC, not fsdp.
-- What must hold is that nothing in fsdp stops a loop from compiling.
for _, name in ipairs { "arithmetic", "compare", "methods" } do
  local total_bad, at, attempts = 0, nil, 0
  while at == nil and attempts < 3 do
    attempts = attempts + 1
    local loop = assert(load("local fsdp, F, N = ...\n" .. loops[name]))
    total_bad = total_bad + loop(fsdp, F, N)
    at = compiled_at[loop]
  end
  print(("%s bad %d compiled %s attempts %d"):format(name, total_bad, tostring(at), attempts))
end
collectgarbage()
collectgarbage()
local live = 0
for _, v in pairs(fsdp.memory_stats()) do live = live + v.current end
print(("live bytes %d"):format(live))
]]

describe("tensor code in hot loops with the JIT on", function()
  local out
  setup(function()
    local path = os.tmpname() .. ".lua"
    local f = assert(io.open(path, "w"))
    f:write(("local ROOT = %q\n"):format(H.root), script)
    f:close()
    local rc
    rc, out = H.sh("luajit " .. path, nil, 120)
    os.remove(path)
    assert.equal(0, rc, out)
  end)

  it("leaves the JIT compiler on", function()
    assert.truthy(out:find("jit on true", 1, true), out)
  end)

  it("computes every operator with numbers on either side correctly, compiled", function()
    local bad, at = out:match("arithmetic bad (%d+) compiled (%w+)")
    assert.equal("0", bad, out)
    assert.is_not.equal("nil", at, "the arithmetic loop never compiled:\n" .. out)
  end)

  it("compares handles, tensors and numbers correctly, compiled", function()
    local bad, at = out:match("compare bad (%d+) compiled (%w+)")
    assert.equal("0", bad, out)
    assert.is_not.equal("nil", at, "the comparison loop never compiled:\n" .. out)
  end)

  it("calls view and nn methods correctly, compiled", function()
    local bad, at = out:match("methods bad (%d+) compiled (%w+)")
    assert.equal("0", bad, out)
    assert.is_not.equal("nil", at, "the methods loop never compiled:\n" .. out)
  end)

  it("keeps tail calls out of the tensor and functional hot paths (tools/tailcalls.lua)", function()
    local cmd = ("luajit {R}/tools/tailcalls.lua {R}/lua/fsdp/tensor.lua {R}/lua/fsdp/nn/functional.lua"):gsub("{R}", H.root)
    local rc, list = H.sh(cmd)
    assert.equal(0, rc, "tail calls count against LuaJIT's loop-unroll limit; write return (f(...)):\n" .. list)
  end)

  it("leaks no tensor", function()
    assert.equal("0", out:match("live bytes (%d+)"), out)
  end)
end)
