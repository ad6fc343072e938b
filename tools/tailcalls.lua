-- tools/tailcalls.lua FILE...: prints FILE:LINE for every tail call (`return f(...)`) in the given
-- Lua files, one per line; exit status 1 when there is any.
--
-- Why: LuaJIT's trace recorder counts every tail call in a trace against its loop-unroll limit
-- (15) and never resets the count, so a hot loop whose body makes more than 15 of them (each
-- tensor op used to make one or two) is never compiled. The library writes `return (f(...))`
-- or `local r = f(...); return r` on its hot paths; tests/core/jit_spec.lua runs this over them.
local util = require "jit.util"
local vmdef = require "jit.vmdef"

-- opcode name of the instruction word `ins`
local function opname(ins)
  local op = bit.band(ins, 0xff)
  return vmdef.bcnames:sub(op * 6 + 1, op * 6 + 6):gsub(" ", "")
end

local found = 0
local function scan(fn, file)
  local pc = 1
  while true do
    local ins = util.funcbc(fn, pc)
    if not ins then break end
    local name = opname(ins)
    if name == "CALLT" or name == "CALLMT" then
      local info = util.funcinfo(fn, pc)
      print(("%s:%d"):format(file, info.currentline))
      found = found + 1
    end
    pc = pc + 1
  end
  -- nested functions are the prototype's negative constants
  local k = -1
  while true do
    local c = util.funck(fn, k)
    if c == nil then break end
    if type(c) == "proto" then scan(c, file) end
    k = k - 1
  end
end

for _, file in ipairs(arg) do
  local chunk = assert(loadfile(file))
  scan(chunk, file)
end
os.exit(found == 0 and 0 or 1)
