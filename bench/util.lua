-- Shared by the benchmarks: clocks, medians and command-line options.
local ffi = require "ffi"

local U = {}

pcall(ffi.cdef, [[
typedef struct { long tv_sec; long tv_nsec; } fsdp_bench_timespec;
int clock_gettime(int clk_id, fsdp_bench_timespec* tp);
]])
local ts = ffi.new("fsdp_bench_timespec")
U.MONOTONIC, U.PROCESS_CPU, U.THREAD_CPU = 1, 2, 3

-- seconds on the given clock (CLOCK_MONOTONIC unless told otherwise)
function U.seconds(clock)
  ffi.C.clock_gettime(clock or U.MONOTONIC, ts)
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end
function U.now_ms(clock) return U.seconds(clock) * 1e3 end

-- the CPU's model name (/proc/cpuinfo), for reports: a number means little without it
function U.cpu_model()
  local f = io.open("/proc/cpuinfo", "r")
  local m = f and f:read("*a"):match("model name%s*:%s*([^\n]+)")
  if f then f:close() end
  return m or "unknown CPU"
end

function U.median(t)
  local s = { unpack(t) }
  table.sort(s)
  local n = #s
  if n == 0 then return 0 / 0 end
  if n % 2 == 1 then return s[(n + 1) / 2] end
  return (s[n / 2] + s[n / 2 + 1]) / 2
end

-- Parses `--key value` pairs into opts (numbers stay numbers), `-h`/`--help` prints usage and
-- exits; flags maps a bare argument (e.g. "--no-torch") to a function(opts). Unknown arguments
-- exit with status 2 naming the script.
function U.parse_args(name, opts, usage, flags)
  local i = 1
  while arg and i <= #arg do
    local a = arg[i]
    local key = a:match("^%-%-([%w_%-]+)$")
    if flags and flags[a] then
      flags[a](opts)
    elseif a == "-h" or a == "--help" then
      print("usage: luajit " .. name .. " " .. usage)
      os.exit(0)
    elseif key and opts[key] ~= nil and arg[i + 1] then
      local v = arg[i + 1]
      opts[key] = type(opts[key]) == "number" and assert(tonumber(v), a .. " expects a number") or v
      i = i + 1
    else
      io.stderr:write(("%s: unknown argument %s (try --help)\n"):format(name, a))
      os.exit(2)
    end
    i = i + 1
  end
  return opts
end

-- s quoted for the shell
function U.shell_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

-- the two OpenMP wait settings a torch runs under (bench/run.lua takes the faster per model), as an
-- `env` prefix: our own process has set OMP_WAIT_POLICY and GOMP_SPINCOUNT (lua/fsdp/init.lua), and
-- children would inherit them
U.torch_waits = {
  { name = "default", env = "env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT" }, -- libgomp's: spin, then sleep
  { name = "passive", env = "env -u GOMP_SPINCOUNT OMP_WAIT_POLICY=passive" }, -- sleep at once
}

-- The two PyTorch builds a benchmark compares with: A, Debian's (opts.python), and B, the PyPI one
-- in tmp/torch-venv (opts.python2: "auto" for that venv, "none", or a path). Each is asked once for
-- its version and libraries (bench/torch_models.py --info). Returns both, each {label, python} with
-- version and config when it answered, or why it is left out; opts.torch == false leaves both out.
function U.torches(root, opts)
  local venv = root .. "/tmp/torch-venv/bin/python"
  local function executable(path)
    local ok = os.execute("test -x " .. U.shell_quote(path))
    return ok == 0 or ok == true
  end
  local torches = {
    { label = "A", python = opts.python, hint = "apt-get install python3-torch" },
    { label = "B", python = opts.python2 == "auto" and venv or opts.python2, hint = "make bench-deps" },
  }
  for _, t in ipairs(torches) do
    if opts.torch == false then
      t.why = "skipped (--no-torch)"
    elseif t.label == "B" and opts.python2 == "none" then
      t.why = "skipped (--python2 none)"
    elseif t.label == "B" and t.python == opts.python then
      t.why = "the same python as torch A"
    elseif t.label == "B" and opts.python2 == "auto" and not executable(venv) then
      t.why = ("no PyPI torch at %s (make bench-deps installs one)"):format(venv)
    else
      local p = io.popen(("%s %s --info 2>&1"):format(U.shell_quote(t.python), U.shell_quote(root .. "/bench/torch_models.py")))
      local out = p:read("*a")
      p:close()
      t.version = out:match('"torch":%s*"([^"]*)"')
      if t.version then
        t.config = ("BLAS %s, oneDNN %s, kernels %s"):format(out:match('"blas":%s*"([^"]*)"') or "?",
          out:match('"onednn":%s*"([^"]*)"') or "?", out:match('"isa":%s*"([^"]*)"') or "?")
      else
        t.why = ("PyTorch not available to %s (%s): %s"):format(t.python, t.hint,
          (out:match("([^\n]+)\n?$") or "no output"):sub(1, 200))
      end
    end
  end
  return torches
end

return U
