-- Benchmarks: training-step time of three models, ours (bench/models.lua) and PyTorch's
-- (bench/torch_models.py run by /usr/bin/python3), side by side, with the ratio ours/torch.
--
--   make bench                       (THREADS=2 by default; sets OPENBLAS/OMP_NUM_THREADS)
--   luajit bench/run.lua [--threads N] [--warmup W] [--iters I] [--rounds R]
--                        [--models mlp,conv,transformer] [--no-torch] [--python /usr/bin/python3]
--
-- A step is zero_grad + forward + loss + backward + optimizer step on one fixed random batch;
-- a round reports the median over its timed steps, after warmup steps. Ours and torch run
-- alternately, R rounds each per model, so a change in machine load hits both sides alike; the
-- table shows each side's median round and the range of the per-round ratios.
-- See bench/README.md for how to read the table.
local root = (arg and arg[0] or ""):match("^(.*)/bench/[^/]*$") or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. root .. "/bench/?.lua;" .. package.path
package.cpath = root .. "/?.so;" .. package.cpath

local ffi = require "ffi"
local fsdp = require "fsdp"
local models = require "models"
local U = require "util"

-- ---- arguments -------------------------------------------------------------------------------------
local opts = {
  threads = tonumber(os.getenv("OMP_NUM_THREADS") or "") or 2,
  warmup = 3, iters = 10, rounds = 3, models = table.concat(models.order, ","), torch = true,
  python = "/usr/bin/python3", target = 0.8,
}
U.parse_args("bench/run.lua", opts, "[--threads N] [--warmup W] [--iters I] [--rounds R] [--models mlp,conv,transformer] [--no-torch] [--python PATH]", { ["--no-torch"] = function(o) o.torch = false end })
fsdp.set_num_threads(opts.threads)

-- ---- timing ---------------------------------------------------------------------------------------
pcall(ffi.cdef, [[
typedef struct { long tv_sec; long tv_nsec; } fsdp_bench_timespec;
int clock_gettime(int clk_id, fsdp_bench_timespec* tp);
]])
local ts = ffi.new("fsdp_bench_timespec")
local function now_ms()
  ffi.C.clock_gettime(1, ts) -- CLOCK_MONOTONIC
  return tonumber(ts.tv_sec) * 1e3 + tonumber(ts.tv_nsec) * 1e-6
end

local function median(t)
  local s = { unpack(t) }
  table.sort(s)
  local n = #s
  if n % 2 == 1 then return s[(n + 1) / 2] end
  return (s[n / 2] + s[n / 2 + 1]) / 2
end

local function bench_ours(name)
  local model, opt, loss_fn = models.case(name)
  local function step()
    opt:zero_grad()
    local loss = loss_fn()
    loss:backward()
    opt:step()
    return loss
  end
  for _ = 1, opts.warmup do step() end
  collectgarbage("collect")
  local times, loss = {}, nil
  for k = 1, opts.iters do
    local t0 = now_ms()
    loss = step()
    times[k] = now_ms() - t0
  end
  return median(times), loss:item()
end

local function shell_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local torch_ok, torch_why = false, "skipped (--no-torch)"
if opts.torch then
  local ok = os.execute(shell_quote(opts.python) .. " -c 'import torch' >/dev/null 2>&1")
  torch_ok = ok == 0 or ok == true
  torch_why = torch_ok and "" or ("PyTorch not available to " .. opts.python .. " (apt-get install python3-torch)")
end

-- PyTorch runs with the thread settings we run with: OPENBLAS/OMP_NUM_THREADS from make bench, and
-- idle OpenMP threads that sleep (OMP_WAIT_POLICY=passive, as lua/fsdp/init.lua sets for us). This is
-- PyTorch's best setting here: with libgomp's default spinning, Debian's torch 1.13 keeps its OpenMP
-- threads spinning while its OpenBLAS threads run the GEMMs, 4 busy threads on 2 cores, and its MLP
-- step takes 88-97 ms instead of 43-46 ms.
local function bench_torch(name)
  local cmd = ("OMP_WAIT_POLICY=passive %s %s --threads %d --warmup %d --iters %d --models %s 2>&1"):format(
    shell_quote(opts.python), shell_quote(root .. "/bench/torch_models.py"), opts.threads, opts.warmup,
    opts.iters, name)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  local ms = out:match('"ms":%s*([-%d%.eE+]+)')
  local loss = out:match('"loss":%s*([-%d%.eE+]+)')
  local ver = out:match('"torch":%s*"([^"]*)"')
  if not ms then return nil, out end
  return tonumber(ms), tonumber(loss), ver
end

-- ---- run ---------------------------------------------------------------------------------------------
print(("fsdp %s benchmark: %d thread(s), %d round(s) of %d warmup + %d timed steps, median ms per training step")
  :format(ffi.string(fsdp.C.fsdp_version()), opts.threads, opts.rounds, opts.warmup, opts.iters))
-- the machine: CPU model, widest vector ISA, OpenBLAS's kernels, and one core's measured FMA peak
local cpu_model = "unknown CPU"
local f = io.open("/proc/cpuinfo", "r")
if f then
  cpu_model = f:read("*a"):match("model name%s*:%s*([^\n]+)") or cpu_model
  f:close()
end
local peak = fsdp.C.fsdp_cpu_fma_peak(0.3)
print(("CPU: %s, %s; OpenBLAS kernels %s; GEMMs: %s; FMA peak %.1f GFLOP/s per core (measured)")
  :format(cpu_model, ffi.string(fsdp.C.fsdp_cpu_isa()), ffi.string(fsdp.C.fsdp_cpu_blas_core()),
    ffi.string(fsdp.C.fsdp_cpu_gemm_backend()), peak))
io.stdout:flush()
local rows, torch_ver = {}, nil
for name in opts.models:gmatch("[^,]+") do
  local row = { name = name, ours_r = {}, torch_r = {}, ratio_r = {} }
  for r = 1, opts.rounds do
    io.stderr:write(("  %s, round %d: ours ...\n"):format(name, r))
    local ok, ms, loss = pcall(bench_ours, name)
    if not ok then row.err = ms; break end
    row.ours_r[r], row.ours_loss = ms, loss
    if torch_ok then
      io.stderr:write(("  %s, round %d: torch ...\n"):format(name, r))
      local tms, tloss, ver = bench_torch(name)
      if not tms then row.torch_err = tloss; break end
      row.torch_r[r], row.torch_loss, torch_ver = tms, tloss, ver
      row.ratio_r[r] = ms / tms
    end
    collectgarbage("collect")
  end
  row.ours = not row.err and median(row.ours_r) or nil
  row.torch = #row.torch_r == opts.rounds and median(row.torch_r) or nil
  rows[#rows + 1] = row
end

print(("%-12s %-52s %10s %10s %11s %12s %16s"):format("model", "configuration", "fsdp ms", "torch ms", "fsdp/torch",
  "round range", "loss fsdp/torch"))
local failed, slow = 0, 0
for _, r in ipairs(rows) do
  local ratio = (r.ours and r.torch) and r.ours / r.torch or nil
  if not r.ours then failed = failed + 1 end
  if ratio and ratio > opts.target then slow = slow + 1 end
  local range = "-"
  if ratio then
    local lo, hi = math.min(unpack(r.ratio_r)), math.max(unpack(r.ratio_r))
    range = ("%.2f-%.2f"):format(lo, hi)
  end
  print(("%-12s %-52s %10s %10s %11s %12s %16s"):format(r.name, models.describe[r.name] or "",
    r.ours and ("%.2f"):format(r.ours) or "FAILED",
    r.torch and ("%.2f"):format(r.torch) or (torch_ok and "FAILED" or "-"),
    ratio and ("%.2f%s"):format(ratio, ratio <= opts.target and "" or " !") or "-", range,
    (r.ours_loss and ("%.3f"):format(r.ours_loss) or "-") .. "/" .. (r.torch_loss and ("%.3f"):format(r.torch_loss) or "-")))
end
for _, r in ipairs(rows) do
  if r.err then print(("  %s (fsdp) failed: %s"):format(r.name, tostring(r.err))) end
  if r.torch_err then print(("  %s (torch) failed: %s"):format(r.name, r.torch_err:sub(-600))) end
end
if torch_ok then
  print(("torch %s; target fsdp/torch <= %.2f: %d of %d model(s) slower than that (marked !)")
    :format(torch_ver or "?", opts.target, slow, #rows))
else
  print("note: " .. torch_why .. "; only our times are shown")
end

-- The GEMM floor: each model's Linear GEMMs alone through raw OpenBLAS, split perfectly over the
-- threads (bench/gemm_floor.lua). No step on this OpenBLAS is faster, so floor/torch is the lowest
-- ours/torch can go; the rest of our step is what sits above the floor.
local floor_ok, gemm_floor = pcall(require, "gemm_floor")
if floor_ok then
  print(("\nGEMM floor: the step's Linear GEMMs alone, raw %s sgemm on one thread each, divided by %d threads;")
    :format(gemm_floor.library, opts.threads))
  print("  their rate per thread as a fraction of the FMA peak above (the roofline of these GEMMs on this BLAS)")
  for _, r in ipairs(rows) do
    local ms, gflop = gemm_floor.floor_ms(r.name, opts.threads)
    if ms then
      local rate = gflop / (ms * opts.threads) * 1e3
      print(("  %-12s floor %8.2f ms   fsdp above floor %7.2f ms   floor/torch %s   GEMMs %6.1f GFLOP/s = %3.0f%% of peak")
        :format(r.name, ms, r.ours and r.ours - ms or 0 / 0, r.torch and ("%.2f"):format(ms / r.torch) or "-", rate,
          100 * rate / peak))
      -- per layer: each distinct GEMM shape (C (M, N) = op(A) (M, K) op(B) (K, N), T: transposed)
      for _, g in ipairs(gemm_floor.per_gemm(r.name) or {}) do
        print(("      %s%s %5d x %5d x %5d  x%-2d %6.1f GFLOP/s = %3.0f%%"):format(g[1] and "T" or "N", g[2] and "T" or "N",
          g[3], g[4], g[5], g[6], g[7], 100 * g[7] / peak))
      end
    end
  end
end

-- engineer B's GEMM micro-benchmark, when present
local sgemm = root .. "/bench/linear_sgemm.lua"
local f = io.open(sgemm, "r")
if f then
  f:close()
  print("\n== bench/linear_sgemm.lua")
  io.stdout:flush()
  local luajit = arg and arg[-1] or "luajit"
  os.execute(shell_quote(luajit) .. " " .. shell_quote(sgemm))
end

if failed > 0 then os.exit(1) end
