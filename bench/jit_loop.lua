-- A pure-Lua loop (a byte histogram over 2 MB of text, the kind of loop a tokenizer or a data
-- pipeline runs), timed in a process that loaded fsdp and in one that did not. fsdp must not slow
-- the user's own Lua down: before tensors were handles, fsdp turned LuaJIT's JIT compiler off and
-- this loop ran about 9x slower.
--
--   luajit bench/jit_loop.lua             prints both times and the ratio (3 rounds, median)
--   luajit bench/jit_loop.lua --child [--fsdp]   one timing, in ms (used by the above)
local root = (arg and arg[0] or ""):match("^(.*)/bench/[^/]*$") or "."

local function loop_ms()
  local ffi = require "ffi"
  pcall(ffi.cdef, "typedef struct { long tv_sec; long tv_nsec; } jl_timespec; int clock_gettime(int, jl_timespec*);")
  local ts = ffi.new("jl_timespec")
  local function now()
    ffi.C.clock_gettime(1, ts)
    return tonumber(ts.tv_sec) * 1e3 + tonumber(ts.tv_nsec) * 1e-6
  end
  local words = { "the ", "quick ", "brown ", "fox ", "jumps ", "over ", "a ", "lazy ", "dog. " }
  local parts = {}
  local n = 0
  while n < 2 * 1024 * 1024 do
    local w = words[#parts % #words + 1]
    parts[#parts + 1] = w
    n = n + #w
  end
  local text = table.concat(parts)
  local t0 = now()
  local counts = {}
  for c = 0, 255 do counts[c] = 0 end
  for i = 1, #text do
    local c = text:byte(i)
    counts[c] = counts[c] + 1
  end
  local ms = now() - t0
  assert(counts[32] > 0)
  return ms
end

if arg[1] == "--child" then
  if arg[2] == "--fsdp" then
    package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
    package.cpath = root .. "/?.so;" .. package.cpath
    require "fsdp"
  end
  io.write(("%.3f\n"):format(loop_ms()))
  os.exit(0)
end

local function child(with_fsdp)
  local p = io.popen(("luajit %s/bench/jit_loop.lua --child%s"):format(root, with_fsdp and " --fsdp" or ""))
  local out = p:read("*a")
  p:close()
  return assert(tonumber(out), "bench/jit_loop.lua: child printed " .. out)
end

local function median(t)
  table.sort(t)
  return t[math.floor((#t + 1) / 2)]
end

local plain, loaded = {}, {}
for r = 1, 3 do
  plain[r] = child(false)
  loaded[r] = child(true)
end
local a, b = median(plain), median(loaded)
print(("pure-Lua loop (byte histogram of 2 MB): %.2f ms without fsdp, %.2f ms after require \"fsdp\", ratio %.2f")
  :format(a, b, b / a))
