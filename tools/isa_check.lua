-- tools/isa_check.lua LIB LINK_MAP: proves LIB (libfsdp.so) runs on any x86-64-v2 CPU (make isa-check).
--
-- The library is compiled for x86-64-v2, except its kernel files' AVX2 and AVX-512 copies
-- (src/backend/cpu/cpu.h), which run only where cpuid says the CPU has them. So: every instruction
-- of LIB that needs more than x86-64-v2 must lie in the code of an object named *.avx2.o or
-- *.avx512.o, and the AVX2 copies must need no AVX-512. Where each object's code went comes from
-- the linker's map (-Wl,-Map: every input .text section with its address, size and object).
--
-- An instruction's level, read from its bytes (objdump -d -w):
--   4 (AVX-512)  an EVEX prefix, 0x62 (BOUND, its old meaning, does not exist in 64-bit mode)
--   3 (AVX2...)  a VEX prefix, 0xc4 or 0xc5 (AVX, AVX2, FMA, F16C, BMI1/2), AMD's XOP (0x8f in
--                the same form), LZCNT or MOVBE
--   2            anything else. (TZCNT is REP BSF, which older CPUs run as BSF: GCC emits it for
--                __builtin_ctz without BMI, so it does not count.)
-- Prints every offending function with its object and first such instruction; exits 1 if there is
-- one, 2 when an input is missing or the copies hold no code of their level (a build without them).
local lib, map = arg[1], arg[2]
if not lib or not map then io.stderr:write("usage: luajit tools/isa_check.lua LIB LINK_MAP\n"); os.exit(2) end
for _, f in ipairs { lib, map } do
  local h = io.open(f)
  if not h then io.stderr:write(("isa_check: %s is missing (run make first)\n"):format(f)); os.exit(2) end
  h:close()
end

-- the objects' code from the map: input sections .text* as "name addr size object", or the name
-- alone on its line and "addr size object" on the next when the name is long
local regions, pending = {}, false
for line in io.lines(map) do
  local name, a, s, obj = line:match("^ (%.text%S*)%s+0x(%x+)%s+0x(%x+)%s+(%S+)$")
  if not name and pending then a, s, obj = line:match("^%s+0x(%x+)%s+0x(%x+)%s+(%S+)$") end
  pending = line:match("^ %.text%S*$") ~= nil
  if a and tonumber(s, 16) > 0 then
    local allowed = obj:match("%.avx512%.o$") and 4 or obj:match("%.avx2%.o$") and 3 or 2
    regions[#regions + 1] = { lo = tonumber(a, 16), hi = tonumber(a, 16) + tonumber(s, 16), obj = obj, allowed = allowed }
  end
end
table.sort(regions, function(x, y) return x.lo < y.lo end)
local function region_of(addr)  -- binary search: the region holding addr, or nil
  local i, j = 1, #regions
  while i <= j do
    local m = math.floor((i + j) / 2)
    local r = regions[m]
    if addr < r.lo then j = m - 1 elseif addr >= r.hi then i = m + 1 else return r end
  end
end

local prefixes = { ["26"] = 1, ["2e"] = 1, ["36"] = 1, ["3e"] = 1, ["64"] = 1, ["65"] = 1, ["67"] = 1 }
local function level_of(bytes, insn)
  local b = bytes:gmatch("%x%x")
  local first = b()
  while first and prefixes[first] do first = b() end
  if first == "62" then return 4 end
  if first == "c4" or first == "c5" or (first == "8f" and insn:match("^v")) then return 3 end
  if insn:match("^lzcnt") or insn:match("^movbe") then return 3 end
  return 2
end

local fn, bad, order, seen = "?", {}, {}, { [3] = 0, [4] = 0 }
local p = assert(io.popen(("objdump -d -w %q"):format(lib)))
for line in p:lines() do
  local name = line:match("^%x+ <(.*)>:$")
  if name then
    fn = name
  else
    local addr, bytes, insn = line:match("^%s*(%x+):\t([%x ]+)\t(.*)$")
    if insn then
      local level = level_of(bytes, insn)
      if level > 2 then
        local r = region_of(tonumber(addr, 16))
        local allowed = r and r.allowed or 2
        if allowed >= 3 and level == allowed then seen[level] = seen[level] + 1 end
        if level > allowed then
          local key = fn .. " in " .. (r and r.obj or "(no object)")
          if not bad[key] then bad[key] = { first = insn, n = 0 }; order[#order + 1] = key end
          bad[key].n = bad[key].n + 1
        end
      end
    end
  end
end
p:close()

for _, key in ipairs(order) do
  print(("isa_check: %s: %d instructions above its level, the first: %s"):format(key, bad[key].n, bad[key].first))
end
if #order > 0 then
  print(("isa_check: FAILED: %d functions outside the AVX2/AVX-512 copies need more than x86-64-v2 "
    .. "(or of an AVX2 copy, AVX-512)"):format(#order))
  os.exit(1)
end
if seen[3] == 0 or seen[4] == 0 then
  print("isa_check: the AVX2 or the AVX-512 copies hold no code of their level: were they built?")
  os.exit(2)
end
print(("isa_check: ok: nothing above x86-64-v2 outside the copies; %d AVX2-level instructions in the AVX2 "
  .. "copies, %d AVX-512 ones in the AVX-512 copies"):format(seen[3], seen[4]))
