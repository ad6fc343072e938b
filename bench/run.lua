-- Benchmarks: training-step time of the models in bench/models.lua, ours against two PyTorch
-- builds (bench/torch_models.py): Debian's (/usr/bin/python3, torch 1.13) and a current one from
-- PyPI in tmp/torch-venv (make bench-deps), side by side, with the ratio ours / (the faster torch).
--
--   make bench                       (THREADS=2 by default; sets OPENBLAS/OMP_NUM_THREADS)
--   luajit bench/run.lua [--threads N] [--warmup W] [--iters I] [--rounds R] [--models mlp,conv,...]
--                        [--no-torch] [--python /usr/bin/python3] [--python2 tmp/torch-venv/bin/python|none]
--
-- A step is zero_grad + forward + loss + backward + optimizer step on one fixed random batch;
-- a round reports the median over its timed steps, after warmup steps. Ours and each torch run
-- in turn, R rounds per model, so a change in machine load hits all sides alike; the table shows
-- each side's median round and the range of the per-round ratios.
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
  warmup = 3, iters = 0, rounds = 3, models = table.concat(models.order, ","), torch = true,
  python = "/usr/bin/python3", python2 = "auto", target = 0.8,
}
U.parse_args("bench/run.lua", opts, "[--threads N] [--warmup W] [--iters I] [--rounds R] [--models "
  .. table.concat(models.order, ",") .. "] [--no-torch] [--python PATH] [--python2 PATH|none]",
  { ["--no-torch"] = function(o) o.torch = false end })
fsdp.set_num_threads(opts.threads)
-- timed steps per round: --iters, else the model's own default (bench/models.lua), else 10
local function iters_of(name) return opts.iters > 0 and opts.iters or models.iters[name] or 10 end
local function target_of(name) return models.target[name] or opts.target end

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
  for k = 1, iters_of(name) do
    local t0 = now_ms()
    loss = step()
    times[k] = now_ms() - t0
  end
  return median(times), loss:item()
end

local shell_quote = U.shell_quote

-- ---- the two torches (bench/util.lua, U.torches) ---------------------------------------------------
local torches = U.torches(root, opts)
local live = {} -- the torches that answered
for _, t in ipairs(torches) do if t.version then live[#live + 1] = t end end

-- PyTorch runs with the thread counts we run with (OPENBLAS/OMP_NUM_THREADS from make bench) and, per
-- model, under the faster of two OpenMP wait settings (U.torch_waits): libgomp's default (idle threads
-- spin ~300000 pauses before they sleep: what a user gets) or OMP_WAIT_POLICY=passive (they sleep at
-- once). Round 1 runs both and the faster one runs the later rounds. Neither is best everywhere: with
-- the default, Debian's torch 1.13 keeps its OpenMP threads spinning while its OpenBLAS threads run
-- the GEMMs (4 busy threads on 2 cores; its MLP step 88-97 ms instead of 43-46 on a Zen 1), while
-- PyPI's torch 2.15 (MKL on OpenMP) is 15-20% slower under passive on a Xeon family 6 model 143.
local function bench_torch(t, name, wait)
  local cmd = ("%s %s %s --threads %d --warmup %d --iters %d --models %s 2>&1"):format(wait.env,
    shell_quote(t.python), shell_quote(root .. "/bench/torch_models.py"), opts.threads, opts.warmup,
    iters_of(name), name)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  local ms = out:match('"ms":%s*([-%d%.eE+]+)')
  local loss = out:match('"loss":%s*([-%d%.eE+]+)')
  if not ms then return nil, out end
  return tonumber(ms), tonumber(loss)
end

-- ---- run ---------------------------------------------------------------------------------------------
local iters_line = opts.iters > 0 and tostring(opts.iters) or "10"
if opts.iters == 0 then
  local per = {}
  for _, name in ipairs(models.order) do
    if models.iters[name] then per[#per + 1] = ("%d for %s"):format(models.iters[name], name) end
  end
  if #per > 0 then iters_line = iters_line .. " (" .. table.concat(per, ", ") .. ")" end
end
print(("fsdp %s benchmark: %d thread(s), %d round(s) of %d warmup + %s timed steps, median ms per training step")
  :format(ffi.string(fsdp.C.fsdp_version()), opts.threads, opts.rounds, opts.warmup, iters_line))
-- the machine: CPU model, widest vector ISA, OpenBLAS's kernels, and one core's measured FMA peak
local cpu_model = U.cpu_model()
local peak = fsdp.C.fsdp_cpu_fma_peak(0.3)
print(("CPU: %s, %s; OpenBLAS kernels %s; GEMMs: %s; FMA peak %.1f GFLOP/s per core (measured)")
  :format(cpu_model, ffi.string(fsdp.C.fsdp_cpu_isa()), ffi.string(fsdp.C.fsdp_cpu_blas_core()),
    ffi.string(fsdp.C.fsdp_cpu_gemm_backend()), peak))
for _, t in ipairs(torches) do
  if t.version then
    print(("torch %s: %s (%s): %s"):format(t.label, t.version, t.python, t.config))
  else
    print(("torch %s: -, left out: %s"):format(t.label, t.why))
  end
end
io.stdout:flush()

-- the faster of the torches' times in tbl (keyed by torch), and which torch that was
local function fastest(tbl)
  local best, who = nil, nil
  for _, t in ipairs(live) do
    local v = tbl[t.label]
    if v and (not best or v < best) then best, who = v, t end
  end
  return best, who
end

local rows = {}
for name in opts.models:gmatch("[^,]+") do
  local row = { name = name, ours_r = {}, torch_r = {}, torch_loss = {}, torch_err = {}, ratio_r = {}, wait = {} }
  for _, t in ipairs(live) do row.torch_r[t.label] = {} end
  for r = 1, opts.rounds do
    io.stderr:write(("  %s, round %d: ours ...\n"):format(name, r))
    local ok, ms, loss = pcall(bench_ours, name)
    if not ok then row.err = ms; break end
    row.ours_r[r], row.ours_loss = ms, loss
    local round = {}
    for _, t in ipairs(live) do
      if not row.torch_err[t.label] then
        io.stderr:write(("  %s, round %d: torch %s ...\n"):format(name, r, t.version))
        local tms, tloss, wait
        for _, w in ipairs(r == 1 and U.torch_waits or { row.wait[t.label] }) do -- round 1: each setting
          local wms, wloss = bench_torch(t, name, w)
          if not wms then tms, tloss = nil, wloss; break end
          if not tms or wms < tms then tms, tloss, wait = wms, wloss, w end
        end
        row.wait[t.label] = wait
        if tms then
          row.torch_r[t.label][r], row.torch_loss[t.label], round[t.label] = tms, tloss, tms
        else
          row.torch_err[t.label] = tloss
        end
      end
    end
    local best = fastest(round)
    if best then row.ratio_r[#row.ratio_r + 1] = ms / best end
    collectgarbage("collect")
  end
  row.ours = not row.err and median(row.ours_r) or nil
  row.torch = {}
  for _, t in ipairs(live) do
    if not row.torch_err[t.label] and #row.torch_r[t.label] == opts.rounds then
      row.torch[t.label] = median(row.torch_r[t.label])
    end
  end
  row.best, row.best_torch = fastest(row.torch)
  rows[#rows + 1] = row
end

-- the table: a column per torch, headed by its version (without a local tag such as +cu132);
-- * marks the faster torch of each row
local head = { ("%-12s %-56s %9s"):format("model", "configuration", "fsdp ms") }
local width, short = {}, {}
for _, t in ipairs(torches) do
  short[t.label] = t.version and t.version:gsub("%+.*$", "") or t.label
  local h = "torch " .. short[t.label] .. " ms"
  width[t.label] = math.max(#h, 10)
  head[#head + 1] = (" %" .. width[t.label] .. "s"):format(h)
end
head[#head + 1] = ("%12s %12s %7s  %s"):format("fsdp/faster", "round range", "target",
  "loss fsdp/" .. short.A .. "/" .. short.B)
print(table.concat(head))
local failed, slow = 0, 0
for _, r in ipairs(rows) do
  local ratio = (r.ours and r.best) and r.ours / r.best or nil
  local target = target_of(r.name)
  if not r.ours then failed = failed + 1 end
  if ratio and ratio > target then slow = slow + 1 end
  local ours = r.ours and ("%.2f"):format(r.ours) or "FAILED"
  local line = { ("%-12s %-56s %9s"):format(r.name, models.describe[r.name] or "", ours) }
  local losses = { r.ours_loss and ("%.3f"):format(r.ours_loss) or "-" }
  for _, t in ipairs(torches) do
    local v = r.torch[t.label]
    local cell = v and ("%.2f%s"):format(v, r.best_torch == t and #live > 1 and "*" or " ")
      or (t.version and (r.ours and "FAILED " or "- ") or "- ")
    line[#line + 1] = (" %" .. width[t.label] .. "s"):format(cell)
    losses[#losses + 1] = r.torch_loss[t.label] and ("%.3f"):format(r.torch_loss[t.label]) or "-"
  end
  local range = "-"
  if ratio and #r.ratio_r > 0 then
    range = ("%.2f-%.2f"):format(math.min(unpack(r.ratio_r)), math.max(unpack(r.ratio_r)))
  end
  line[#line + 1] = ("%12s %12s %7s  %s"):format(ratio and ("%.2f%s"):format(ratio, ratio <= target and "  " or " !") or "-",
    range, ("<=%.2f"):format(target), table.concat(losses, "/"))
  print(table.concat(line))
end
for _, r in ipairs(rows) do
  if r.err then print(("  %s (fsdp) failed: %s"):format(r.name, tostring(r.err))) end
  for _, t in ipairs(live) do
    local e = r.torch_err[t.label]
    if e then print(("  %s (torch %s) failed: %s"):format(r.name, t.version, e:sub(-600))) end
  end
end
if #live > 0 then
  local special = {}
  for _, name in ipairs(models.order) do
    if models.target[name] then special[#special + 1] = ("%s <= %.2f"):format(name, models.target[name]) end
  end
  print(("target fsdp/(faster torch) <= %.2f (%s): %d of %d model(s) slower than that (marked !)%s")
    :format(opts.target, table.concat(special, ", "), slow, #rows, #live > 1 and "; * the faster torch" or ""))
  for _, t in ipairs(live) do -- which OpenMP wait setting each torch ran under (the faster in round 1)
    local per = {}
    for _, r in ipairs(rows) do
      if r.wait[t.label] then per[#per + 1] = r.name .. " " .. r.wait[t.label].name end
    end
    if #per > 0 then print(("torch %s OpenMP waits (faster of default/passive): %s"):format(short[t.label], table.concat(per, ", "))) end
  end
else
  print("note: no PyTorch (the torch lines above say why); only our times are shown")
end

-- The GEMM floor: each model's Linear GEMMs alone through fsdp's GEMM call, split perfectly over the
-- threads (bench/gemm_floor.lua). No step on this library is faster, so floor/torch is the lowest
-- ours/torch can go; the rest of our step is what sits above the floor.
local floor_ok, gemm_floor = pcall(require, "gemm_floor")
if floor_ok then
  print(("\nGEMM floor: the step's Linear GEMMs alone, fsdp's %s sgemm call on one thread each, divided by %d threads;")
    :format(gemm_floor.library, opts.threads))
  print("  their rate per thread as a fraction of the FMA peak above (the roofline of these GEMMs on this BLAS)")
  for _, r in ipairs(rows) do
    local ms, gflop = gemm_floor.floor_ms(r.name, opts.threads)
    if ms then
      local rate = gflop / (ms * opts.threads) * 1e3
      print(("  %-12s floor %8.2f ms   fsdp above floor %7.2f ms   floor/torch %s   GEMMs %6.1f GFLOP/s = %3.0f%% of peak")
        :format(r.name, ms, r.ours and r.ours - ms or 0 / 0, r.best and ("%.2f"):format(ms / r.best) or "-", rate,
          100 * rate / peak))
      -- per layer: each distinct GEMM shape (C (M, N) = op(A) (M, K) op(B) (K, N), T: transposed)
      for _, g in ipairs(gemm_floor.per_gemm(r.name) or {}) do
        print(("      %s%s %5d x %5d x %5d  x%-2d %6.1f GFLOP/s = %3.0f%%"):format(g[1] and "T" or "N", g[2] and "T" or "N",
          g[3], g[4], g[5], g[6], g[7], 100 * g[7] / peak))
      end
    end
  end
end

-- The convolutions the same way: each conv layer's forward, input grad and weight grad alone
-- through our ops on one thread (bench/conv_floor.lua, in a process of its own: see there why)
local luajit = arg and arg[-1] or "luajit"
local names, steps = {}, {}
for _, r in ipairs(rows) do
  names[#names + 1] = r.name
  if r.ours then steps[#steps + 1] = ("%s=%.3f"):format(r.name, r.ours) end
end
io.stdout:flush()
os.execute(("OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 %s %s --models %s --threads %d --peak %.3f --steps %s"):format(
  shell_quote(luajit), shell_quote(root .. "/bench/conv_floor.lua"), shell_quote(table.concat(names, ",")), opts.threads,
  peak, shell_quote(table.concat(steps, ","))))

-- engineer B's GEMM micro-benchmark, when present
local sgemm = root .. "/bench/linear_sgemm.lua"
local f = io.open(sgemm, "r")
if f then
  f:close()
  print("\n== bench/linear_sgemm.lua")
  io.stdout:flush()
  os.execute(shell_quote(luajit) .. " " .. shell_quote(sgemm))
end

if failed > 0 then os.exit(1) end
