-- DataLoader workers: one training epoch with num_workers = 0 against num_workers = N (default 2),
-- on a dataset whose per-sample transform is CPU-heavy (issue 40, item 3; target: N = 2 at least
-- 1.6x faster on 2 cores).
--
--   luajit bench/loader.lua [--workers 2] [--rounds 5] [--samples 2048] [--batch 16] [--passes 6] [--threads 1]
--
-- Sample i: a 3x40x40 image (a fixed random tensor shifted by i) through an augmentation of
-- tensor ops: a 32x32 crop at an offset from i, a horizontal flip for odd i, brightness and
-- contrast, `passes` 5x5 blurs (conv2d, one channel at a time) and a per-pixel tone curve in plain
-- Lua (LuaJIT-compiled math over the 3072 values), then normalisation. The transform is a function
-- of i alone, so both sides see the same batches and their final losses must be equal. The
-- training step: a small conv net (Conv 3-16 3x3 stride 2, ReLU, Conv 16-32 3x3 stride 2, ReLU,
-- Flatten, Linear 1568-10), cross-entropy, SGD; every epoch starts from the same weights.
-- The main process trains on --threads OpenMP threads (1: the transform and the step share one
-- core without workers); the two sides take turns, round by round, in alternating order, and the
-- table shows each round's epoch time and the medians' ratio.
local ffi = require "ffi"
local root = (arg and arg[0] or ""):match("^(.*)/bench/[^/]*$") or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. root .. "/bench/?.lua;" .. package.path
package.cpath = root .. "/?.so;" .. package.cpath
local fsdp = require "fsdp"
local nn, F, optim, data = fsdp.nn, fsdp.nn.functional, fsdp.optim, fsdp.data
local U = require "util"

local opts = { workers = 2, rounds = 5, samples = 2048, batch = 16, passes = 6, threads = 1 }
U.parse_args("bench/loader.lua", opts, "[--workers N] [--rounds R] [--samples S] [--batch B] [--passes P] [--threads T]")
fsdp.set_num_threads(opts.threads)

-- ---- the dataset --------------------------------------------------------------------------------------
fsdp.manual_seed(0)
local base = fsdp.rand(3, 40, 40)
local blur = fsdp.ones(1, 1, 5, 5) / 25
local mean, std = fsdp.tensor({ 0.5, 0.5, 0.5 }):view(3, 1, 1), fsdp.tensor({ 0.25, 0.25, 0.25 }):view(3, 1, 1)
local flip_idx = fsdp.arange(31, -1, -1)
local curve = ffi.new("float[?]", 3 * 32 * 32)

local Augmented = data.Dataset:extend("Augmented")
function Augmented:len() return opts.samples end
function Augmented:get(i)
  local x = base + (i % 7) * 0.01
  x = x:narrow(2, 1 + i % 9, 32):narrow(3, 1 + (i * 5) % 9, 32)
  if i % 2 == 1 then x = x:index_select(3, flip_idx) end
  x = (x * (0.8 + (i % 5) * 0.1) + (i % 3) * 0.05):contiguous()
  for _ = 1, opts.passes do
    x = F.conv2d(x:view(3, 1, 32, 32), blur, nil, { padding = 2 }):view(3, 32, 32)
  end
  local p = ffi.cast("float*", x:contiguous():data_ptr())
  for k = 0, 3 * 32 * 32 - 1 do  -- a tone curve: a smooth step, then gamma
    local v = p[k]
    v = v * v * (3 - 2 * v)
    curve[k] = math.exp(0.8 * math.log(math.max(v, 1e-6)))
  end
  local y = fsdp.empty(3, 32, 32)
  ffi.copy(y:data_ptr(), curve, 3 * 32 * 32 * 4)
  return { (y - mean) / std, i % 10 }
end

-- ---- one epoch ----------------------------------------------------------------------------------------
local function model()
  fsdp.manual_seed(1)
  return nn.Sequential(nn.Conv2d(3, 16, 3, { stride = 2 }), nn.ReLU(), nn.Conv2d(16, 32, 3, { stride = 2 }), nn.ReLU(),
    nn.Flatten(), nn.Linear(32 * 7 * 7, 10))
end
local ds = Augmented()
local loaders = {
  [0] = data.DataLoader(ds, { batch_size = opts.batch, shuffle = true, seed = 0 }),
  [opts.workers] = data.DataLoader(ds, { batch_size = opts.batch, shuffle = true, seed = 0, num_workers = opts.workers }),
}
-- seconds for one epoch, and the last batch's loss
local function epoch(nw)
  local m = model()
  local opt = optim.SGD(m:parameters(), { lr = 0.05 })
  local loader = loaders[nw]
  loader:set_epoch(0)
  local loss
  local t0 = U.seconds()
  for x, y in loader() do
    loss = F.cross_entropy(m(x), y)
    opt:zero_grad()
    loss:backward()
    opt:step()
  end
  return U.seconds() - t0, loss:item()
end
-- the parts without workers: the transform alone, the steps alone (on the batches made once)
local function parts()
  local batches = {}
  local t0 = U.seconds()
  for x, y in loaders[0]() do batches[#batches + 1] = { x, y } end
  local load = U.seconds() - t0
  local m = model()
  local opt = optim.SGD(m:parameters(), { lr = 0.05 })
  t0 = U.seconds()
  for _, b in ipairs(batches) do
    local loss = F.cross_entropy(m(b[1]), b[2])
    opt:zero_grad()
    loss:backward()
    opt:step()
  end
  return load, U.seconds() - t0
end

print(("fsdp DataLoader workers: %d samples, batch %d, %d blur passes, %d training thread(s), %d rounds")
  :format(opts.samples, opts.batch, opts.passes, opts.threads, opts.rounds))
local cpuinfo = io.open("/proc/cpuinfo"):read("*a")
local _, cores = cpuinfo:gsub("\nprocessor%s*:", "")
print(("CPU: %s family %s model %s, %d cores"):format(U.cpu_model(), cpuinfo:match("cpu family%s*:%s*(%d+)") or "?",
  cpuinfo:match("\nmodel%s*:%s*(%d+)") or "?", cores + (cpuinfo:match("^processor") and 1 or 0)))
epoch(0)  -- warmup (the JIT, the allocator's cache)
epoch(opts.workers)
local load, train = parts()
print(("without workers: the transform %.3f s, the steps %.3f s per epoch"):format(load, train))
local times = { [0] = {}, [opts.workers] = {} }
local losses = {}
print(("%-6s %14s %14s %8s"):format("round", "workers=0 s", ("workers=%d s"):format(opts.workers), "ratio"))
for r = 1, opts.rounds do
  local order = r % 2 == 1 and { 0, opts.workers } or { opts.workers, 0 }
  for _, nw in ipairs(order) do
    local t, l = epoch(nw)
    times[nw][r], losses[nw] = t, l
    collectgarbage("collect")
  end
  print(("%-6d %14.3f %14.3f %7.2fx"):format(r, times[0][r], times[opts.workers][r], times[0][r] / times[opts.workers][r]))
end
local m0, mw = U.median(times[0]), U.median(times[opts.workers])
print(("median %14.3f %14.3f %7.2fx  (target >= 1.6x with 2 workers on 2 cores)"):format(m0, mw, m0 / mw))
print(("final loss: workers=0 %.6f, workers=%d %.6f (%s)"):format(losses[0], opts.workers, losses[opts.workers],
  losses[0] == losses[opts.workers] and "equal" or "DIFFERENT"))
if losses[0] ~= losses[opts.workers] then os.exit(1) end
