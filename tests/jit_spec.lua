-- Tensor arithmetic with numbers in hot loops: LuaJIT's trace recorder compiles `pointer + number`
-- as pointer arithmetic (see lua/fsdp/init.lua), which crashed or returned garbage before fsdp
-- turned the JIT compiler off. Runs in a child process so a crash fails the test, not busted.
local H = require "helpers"

describe("tensor arithmetic in hot loops", function()
  it("gives the right values and does not crash", function()
    local script = os.tmpname() .. ".lua"
    local f = assert(io.open(script, "w"))
    f:write([[
package.path = "]] .. H.root .. [[/lua/?.lua;]] .. H.root .. [[/lua/?/init.lua;" .. package.path
package.cpath = "]] .. H.root .. [[/?.so;" .. package.cpath
local fsdp = require "fsdp"
local function check(fn, x) local s = 0; for i = 1, 12 do s = s + fn(x):sum():item() end; return s end
local total = 0
for iter = 1, 300 do
  local x = fsdp.ones(2, 2)
  total = total + check(function(t) return t + 3 end, x) + check(function(t) return 1 - t end, x)
    + check(function(t) return t - 0.5 end, x) + check(function(t) return 2 + t end, x)
end
-- per iteration: 12 * (4*4 + 4*0 + 4*0.5 + 4*3) = 12 * 30 = 360
print(("total %.1f"):format(total))
]])
    f:close()
    local rc, out = H.sh("luajit " .. script, nil, 120)
    os.remove(script)
    assert.equal(0, rc, out)
    assert.truthy(out:find("total 108000.0", 1, true), out)
  end)
end)
