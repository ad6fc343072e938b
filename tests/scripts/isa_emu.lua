-- The two halves of tools/isa_emu.sh (make isa-emu-check), run in the checkout's root:
--   luajit tests/scripts/isa_emu.lua lower DIR   here: the sse2 and avx2 copies' runs into DIR
--   luajit tests/scripts/isa_emu.lua guest DIR   in the Bochs guest (an AVX-512 CPU): proves the
--        avx512f copy is the one installed, runs it into DIR, and compares it with DIR's sse2 and
--        avx2 runs (tests/backends/isa_levels.lua: the runs and the comparison portable_spec.lua
--        makes on a CPU that has the levels); ends with the line "ISA-EMU RESULT: PASS" or
--        "ISA-EMU RESULT: FAIL ...", which the host script waits for
-- The lower copies run here, on a real CPU, so the emulated one runs only what needs AVX-512.
package.path = "lua/?.lua;lua/?/init.lua;tests/?.lua;" .. package.path
local levels = require "backends.isa_levels"
local mode, dir = arg[1], arg[2]
if not (mode == "lower" or mode == "guest") or not dir then
  io.stderr:write("usage: luajit tests/scripts/isa_emu.lua lower|guest DIR\n")
  os.exit(2)
end

local function say(fmt, ...)
  io.write(fmt:format(...), "\n")
  io.flush()
end

-- the copy a child under FSDP_CPU_ISA=level installs (fsdp_cpu_isa() reads the device table); level
-- nil: the CPU's own
local function installed(level)
  local env = level and "FSDP_CPU_ISA=" .. level or "env -u FSDP_CPU_ISA"
  local p = io.popen(("%s luajit -e 'package.path = \"lua/?.lua;lua/?/init.lua;\" .. package.path; "
    .. "io.write(require(\"ffi\").string(require(\"fsdp\").C.fsdp_cpu_isa()))' 2>&1"):format(env))
  local out = p:read("*a")
  p:close()
  return out
end

local function run_level(level)
  local isa = installed(level)
  if isa ~= levels.names[level] then
    say("ISA-EMU RESULT: FAIL FSDP_CPU_ISA=%s installs %q, not %s", level, isa, levels.names[level])
    os.exit(1)
  end
  say("%s: fsdp_cpu_isa() = %s; running the op-case table and the wide cases", level, isa)
  local t0 = os.time()
  -- the guest's clock is the emulator's: no timeout there that could cut a slow run short
  local err = levels.run_level(".", level, dir, mode == "guest" and 1e6 or 600)
  if err then
    say("%s", err)
    say("ISA-EMU RESULT: FAIL the %s run failed", level)
    os.exit(1)
  end
  -- (Bochs's guest clock does not keep to real time: the host script times the guest)
  if mode == "lower" then say("%s: done in %d s", level, os.time() - t0) end
end

if mode == "lower" then
  run_level("sse2")
  run_level("avx2")
  os.exit(0)
end

-- the guest: AVX-512 in the CPU and the kernel's flags, and the library's choice without a cap
local flags = io.open("/proc/cpuinfo"):read("*a"):match("\nflags%s*:([^\n]*)") or ""
local have = {}
for f in flags:gmatch("%S+") do have[f] = true end
local want = { "avx2", "fma", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl" }
local shown = {}
for _, f in ipairs(want) do shown[#shown + 1] = f .. (have[f] and "" or " (MISSING)") end
say("guest /proc/cpuinfo flags: %s", table.concat(shown, " "))
local isa = installed(nil)
say("guest fsdp_cpu_isa() without FSDP_CPU_ISA: %s", isa)
if not have.avx512f or isa ~= "avx512f" then
  say("ISA-EMU RESULT: FAIL the guest does not run the avx512f copy")
  os.exit(1)
end
run_level("avx512f")
local top = levels.read_level("avx512f", dir)
local failures = 0
for _, lower in ipairs { "sse2", "avx2" } do
  local got = levels.read_level(lower, dir)
  for _, d in ipairs(levels.dumps) do
    local what = ("%s against avx512f, %s"):format(lower, d)
    local r = levels.compare(got[d], top[d], what)
    say("%s", levels.summary(r, what))
    for i = 1, math.min(#r.failures, 20) do say("  %s", r.failures[i]) end
    if #r.failures > 20 then say("  ... and %d more", #r.failures - 20) end
    failures = failures + #r.failures
  end
end
if failures > 0 then
  say("ISA-EMU RESULT: FAIL %d outputs differ between the avx512f copy and the lower ones", failures)
  os.exit(1)
end
say("ISA-EMU RESULT: PASS")
