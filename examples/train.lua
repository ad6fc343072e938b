-- Train a conv net on Fashion-MNIST with FSDP: pretrain, checkpoint every epoch, resume, then a
-- linear evaluation of the frozen trunk.
--
--   bin/fsdprun -n 2 examples/train.lua                    the default run (`make demo`)
--   bin/fsdprun -n 2 examples/train.lua --resume checkpoints --epochs 6   continue a run
--   bin/fsdprun -n 2 examples/train.lua --linear-eval     only the linear evaluation of ./checkpoints
--   luajit examples/train.lua --help                       every flag
--
-- The model (PyTorch names in checkpoints):
--   trunk  two FSDP-wrapped blocks Conv3x3-ReLU-MaxPool2 (1 -> C1 -> C2 channels, 28 -> 14 -> 7),
--          themselves inside a wrapped unit "trunk" that owns no parameters
--   head   a wrapped unit: Flatten -> Linear(C2*7*7, 10)
--   root   the model itself, wrapped (owns no parameters)
-- Pretraining: Adam, cross entropy, fsdp.data's DistributedSampler (PyTorch's): one permutation of
-- the training set per epoch from seed + epoch -- the same on every rank --, rank r taking every
-- N-th index from position r + 1 (drop_last: the tail that does not divide evenly is dropped), and a
-- DataLoader of B/N per rank (the last short batch dropped), so the N ranks' batches k together are
-- the global batch k a single process would see; fsdp.progress draws the live line.
-- Every epoch: test accuracy on the test set (split across ranks, counts all-reduced), one JSONL
-- metrics line, a sharded checkpoint (fsdp.save_sharded); at the end a consolidated
-- CKPT/model.safetensors (full tensors, PyTorch names) and a PNG plot (gnuplot).
-- Linear evaluation: the same model loaded from the pretrained weights, the trunk frozen (its
-- nested units included), the head re-initialised and trained alone.
-- Expected user errors (missing data, corrupt files, a checkpoint of another model, bad flags)
-- end with one message on stderr and exit status 1 (2 for bad flags).
local script_dir = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
-- fsdprun sets LUA_PATH for its tree; a plain `luajit examples/train.lua` in a checkout uses ../lua
if not package.searchpath("fsdp", package.path) then
  local root = script_dir .. "/.."
  package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
  package.cpath = root .. "/?.so;" .. package.cpath
end

local ffi = require "ffi"
local fsdp = require "fsdp"
local nn, optim = fsdp.nn, fsdp.optim
local F = nn.functional

-- ---- flags ---------------------------------------------------------------------------------------
local p = fsdp.argparse.ArgumentParser { prog = "train.lua",
  usage = "fsdprun -n N examples/train.lua [flags]      (or plain luajit: one rank)",
  description = "Pretrains a conv net on Fashion-MNIST with FSDP, checkpoints every epoch, then trains a new\n"
    .. "linear head on the frozen trunk and reports both test accuracies." }
p:add_argument("--epochs", { type = "int", default = 8, min = 0, metavar = "N", help = "pretraining epochs (default 8)" })
p:add_argument("--batch-size", { type = "int", default = 128, min = 1, metavar = "B",
  help = "global batch size, split evenly over the ranks (default 128)" })
p:add_argument("--lr", { type = "float", default = 1e-3, help = "Adam learning rate for pretraining (default 0.001)" })
p:add_argument("--lr-decay", { type = "float", default = 0.7, min = 0, metavar = "G",
  help = "the learning rate of epoch e is LR * G^(e-1) (default 0.7)" })
p:add_argument("--data", { metavar = "DIR", help = "directory with the four *-ubyte(.gz) files (default: $FSDP_DATA_DIR,\n"
  .. "/usr/share/datasets/fashion-mnist from `apt-get install dataset-fashion-mnist`)" })
p:add_argument("--ckpt", { metavar = "DIR", help = "checkpoint directory (default ./checkpoints, or the --resume DIR)" })
p:add_argument("--resume", { metavar = "DIR", help = "continue pretraining from the sharded checkpoint in DIR" })
p:add_argument("--linear-eval", { action = "store_true", help = "only the linear evaluation, from the checkpoint in --ckpt / --resume DIR" })
p:add_argument("--skip-linear-eval", { action = "store_true", help = "pretraining only" })
p:add_argument("--linear-epochs", { type = "int", default = 2, min = 0, metavar = "N", help = "epochs of linear evaluation (default 2)" })
p:add_argument("--linear-lr", { type = "float", default = 1e-3, metavar = "LR",
  help = "Adam learning rate of the linear evaluation (default 0.001)" })
p:add_argument("--seed", { type = "int", default = 0, min = 0, metavar = "S", help = "initialisation and data order (default 0)" })
p:add_argument("--limit", { type = "int", min = 1, metavar = "N", help = "use only the first N training images (CI)" })
p:add_argument("--test-limit", { type = "int", min = 1, metavar = "N", help = "evaluate on the first N test images only" })
p:add_argument("--metrics", { metavar = "FILE", help = "JSONL metrics, one object per epoch (default CKPT/metrics.jsonl)" })
p:add_argument("--plot", { metavar = "FILE.png", help = "loss/accuracy plot (default CKPT/metrics.png; needs gnuplot)" })
p:add_argument("--channels", { default = "32,64", metavar = "C1,C2", help = "conv channels of the two trunk blocks (default 32,64)" })
p:add_argument("--eval-batch", { type = "int", default = 500, min = 1, metavar = "B", help = "batch size of evaluation (default 500)" })
p:add_argument("--summary", { action = "store_true", help = "print the FSDP plan (fsdp.summary: units, bytes per rank, what a step\n"
  .. "sends) after the first pretraining epoch, optimizer state included" })
p:add_argument("--device", { choices = { "cpu", "cuda" }, default = "cpu", metavar = "D",
  help = "cpu (default) or cuda: model, data and training on the GPU (with several\n"
    .. "ranks their collectives run on NCCL where every rank has a GPU of its\n"
    .. "own, else through the host over MPI: FSDP_DEVICE_COMM)" })
local cfg = p:parse_args(arg)
for _, k in ipairs { "lr", "linear_lr" } do
  if cfg[k] <= 0 then p:error(("--%s must be positive, got %s"):format(k:gsub("_", "-"), cfg[k])) end
end
if cfg.linear_eval and cfg.skip_linear_eval then p:error("--linear-eval and --skip-linear-eval exclude each other") end
local C1, C2 = cfg.channels:match("^(%d+),(%d+)$")
C1, C2 = tonumber(C1), tonumber(C2)
if not C1 or C1 < 1 or C2 < 1 then p:error(("--channels expects C1,C2 like 32,64, got '%s'"):format(cfg.channels)) end
cfg.ckpt = (cfg.ckpt or cfg.resume or "./checkpoints"):gsub("/+$", "")
cfg.metrics = cfg.metrics or (cfg.ckpt .. "/metrics.jsonl")
cfg.plot = cfg.plot or (cfg.ckpt .. "/metrics.png")

-- ---- errors: expected ones are a message (fsdp.exit), anything else a traceback --------------------
local fail = fsdp.exit
-- runs fn; an error from it is a message prefixed with `what`
local function expect(what, fn, ...)
  local res = { pcall(fn, ...) }
  if not res[1] then fail("%s: %s", what, tostring(res[2])) end
  return unpack(res, 2, table.maxn(res))
end

local now = fsdp.perf_counter

-- os.execute's success across Lua 5.1 (status 0) and 5.2-style (true) builds
local function os_ok(a) return a == 0 or a == true end

local function file_exists(path)
  local f = io.open(path, "rb")
  if f then f:close() return true end
  return false
end

-- flat JSON objects of numbers and strings, keys in the given order
local function json_line(keys, obj)
  local parts = {}
  for _, k in ipairs(keys) do
    local v = obj[k]
    if v ~= nil then
      local s
      if type(v) == "number" then
        s = (v == math.floor(v) and math.abs(v) < 2 ^ 53) and ("%d"):format(v) or ("%.17g"):format(v)
      else
        s = ('"%s"'):format(tostring(v):gsub('[%c"\\]', function(c) return ("\\u%04x"):format(c:byte()) end))
      end
      parts[#parts + 1] = ('"%s":%s'):format(k, s)
    end
  end
  return "{" .. table.concat(parts, ",") .. "}"
end
local metric_keys = { "phase", "epoch", "loss", "test_acc", "samples_per_s", "seconds", "eval_seconds",
  "steps", "world_size", "global_batch", "loss_checksum" }

-- FNV-1a over the bytes of the float32 losses of one epoch: equal checksums = bit-identical losses
local f32 = ffi.new("float[1]")
local u8 = ffi.cast("uint8_t*", f32)
local function fnv_init() return 2166136261 end
local function fnv_add(h, x)
  f32[0] = x
  for i = 0, 3 do h = bit.tobit(bit.bxor(h, u8[i]) * 16777619 % 4294967296) end
  return h
end

local hms = require("fsdp.progress").hms

-- ---- the model --------------------------------------------------------------------------------------
local function block(cin, cout)  -- (B, cin, H, W) -> (B, cout, H/2, W/2)
  return nn.Sequential(nn.Conv2d(cin, cout, 3, { padding = 1 }), nn.ReLU(), nn.MaxPool2d(2))
end

local Net = nn.Module:extend("FashionNet")
function Net:__init(c1, c2)
  self.trunk = nn.Sequential(block(1, c1), block(c1, c2))        -- (B, 1, 28, 28) -> (B, c2, 7, 7)
  self.head = nn.Sequential(nn.Flatten(), nn.Linear(c2 * 7 * 7, 10)) -- logits (B, 10)
end
function Net:forward(x) return self.head(self.trunk(x)) end

local function new_head() return nn.Sequential(nn.Flatten(), nn.Linear(C2 * 7 * 7, 10)) end

-- every block, the trunk (which then owns no parameters), the head and the root are FSDP units
local function wrap_model(m)
  for _, b in m.trunk:named_children() do fsdp.wrap(b) end
  fsdp.wrap(m.trunk)
  fsdp.wrap(m.head)
  return fsdp.wrap(m)
end

local function count_params(m)
  local n = 0
  for _, p in m:named_parameters() do n = n + p:numel() end
  return n
end

-- ---- setup ---------------------------------------------------------------------------------------------
local function main()
  fsdp.init()
  local R, N = fsdp.rank(), fsdp.world_size()
  local B = cfg.batch_size
  if B % N ~= 0 then fail("--batch-size %d must be a multiple of the number of ranks (%d)", B, N) end
  local device = cfg.device
  if device == "cuda" then
    local there = false
    for _, d in ipairs(fsdp.backends()) do there = there or d == "cuda" end
    if not there then fail("--device cuda: CUDA is not available here: %s", fsdp.cuda.why_not()) end
  end
  local b = B / N

  -- rank 0 talks (fsdp.progress draws live lines where stdout is a terminal)
  local say = R == 0 and function(fmt, ...) io.write(fmt:format(...), "\n") io.flush() end or function() end

  -- data (every rank holds the arrays; each trains on its slices)
  local fm = require "fsdp.data.fashion_mnist"
  local t0 = now()
  local data_dir = fm.find_dir(cfg.data)
  if cfg.data and not os_ok(os.execute(("test -d '%s'"):format(cfg.data:gsub("'", "'\\''")))) then
    fail("data directory %s does not exist (pass --data DIR holding the Fashion-MNIST *-ubyte(.gz) files, or `apt-get install dataset-fashion-mnist`)", cfg.data)
  end
  local xtrain, ytrain = expect("loading the training set", fm.load, "train", { dir = cfg.data, limit = cfg.limit, normalize = true })
  local xtest, ytest = expect("loading the test set", fm.load, "test", { dir = cfg.data, limit = cfg.test_limit, normalize = true })
  xtrain, ytrain, xtest, ytest = xtrain:to(device), ytrain:to(device), xtest:to(device), ytest:to(device)
  local ntrain, ntest = xtrain:size(1), xtest:size(1)

  -- ---- the training batches: this rank's share of each epoch (permutation from seed + epoch) ---------
  local train_set = fsdp.data.TensorDataset(xtrain, ytrain)
  local function train_loader(seed)
    local sampler = fsdp.data.DistributedSampler(train_set, { seed = seed, drop_last = true })
    return fsdp.data.DataLoader(train_set, { batch_size = b, sampler = sampler, drop_last = true })
  end
  local steps = #train_loader(cfg.seed)
  if steps < 1 then fail("%d training images are fewer than one global batch of %d", ntrain, B) end
  say("Fashion-MNIST from %s: %d train / %d test images (%.1fs); %d ranks, global batch %d (%d per rank), %d steps per epoch",
    data_dir, ntrain, ntest, now() - t0, N, B, b, steps)

  -- ---- evaluation: the test set split over ranks, counts all-reduced ----------------------------------
  -- every rank runs the same number of forwards (the collectives of the units must match): a rank
  -- whose slice has run out evaluates one sample and does not count it
  local function evaluate(model)
    local lo = math.floor(ntest * R / N)
    local hi = math.floor(ntest * (R + 1) / N)
    local eb = cfg.eval_batch
    local nb = math.ceil(math.ceil(ntest / N) / eb)
    model:eval()
    local correct = fsdp.no_grad(function()
      local c = 0
      for k = 0, nb - 1 do
        local s = lo + k * eb
        local len = math.min(eb, hi - s)
        local xb, yb = xtest:narrow(1, math.min(s, ntest - 1) + 1, math.max(len, 1)), nil
        local pred = model(xb):argmax(2)
        if len > 0 then
          yb = ytest:narrow(1, s + 1, len)
          c = c + pred:eq(yb):sum():item()
        end
      end
      return c
    end)
    model:train()
    local t = fsdp.tensor({ correct })
    if N > 1 then fsdp.all_reduce(t, "sum") end
    return t:item() / ntest
  end

  -- ---- metrics ---------------------------------------------------------------------------------------
  local function metrics_write(lines, mode)
    if R ~= 0 then return end
    local dir = cfg.metrics:match("^(.*)/[^/]*$")
    if dir then os.execute(("mkdir -p '%s'"):format(dir:gsub("'", "'\\''"))) end
    local f, err = io.open(cfg.metrics, mode)
    if not f then fail("cannot write the metrics file: %s", err) end
    for _, l in ipairs(lines) do f:write(l, "\n") end
    f:close()
  end
  local function metrics_read()
    local f = io.open(cfg.metrics, "r")
    if not f then return {} end
    local out = {}
    for l in f:lines() do
      if l:match("^%s*{") then
        out[#out + 1] = { line = l, phase = l:match('"phase":"([^"]*)"'), epoch = tonumber(l:match('"epoch":(%d+)')),
          loss = tonumber(l:match('"loss":([-%d%.eE+]+)')), test_acc = tonumber(l:match('"test_acc":([-%d%.eE+]+)')) }
      end
    end
    f:close()
    return out
  end

  -- ---- one epoch of training -----------------------------------------------------------------------
  -- returns {loss = mean over steps of the rank-averaged loss, checksum, seconds, samples_per_s}
  local function train_epoch(model, opt, phase, epoch, nepochs, loader)
    local label = ("%s %d/%d"):format(phase, epoch, nepochs)
    local sum, h = 0, fnv_init()
    local te = now()
    local bar = fsdp.progress(steps * B, { desc = label, unit = "samples" })
    model:train()
    loader:set_epoch(epoch)
    local s = 0
    for xb, yb in loader() do
      s = s + 1
      local loss = F.cross_entropy(model(xb), yb)
      opt:zero_grad()
      loss:backward()
      opt:step()
      local l = loss:item()
      if l ~= l then fail("%s: the loss became NaN at step %d (lower --lr)", label, s) end
      sum, h = sum + l, fnv_add(h, l)
      bar:update(B, { loss = sum / s })
    end
    local seconds = now() - te
    local t = fsdp.tensor({ sum })
    if N > 1 then fsdp.all_reduce(t, "sum") end
    return { loss = t:item() / N / steps, checksum = ("%08x"):format(h % 4294967296), seconds = seconds,
      samples_per_s = steps * B / seconds, bar = bar }
  end

  local function finish_epoch(model, phase, epoch, nepochs, r)
    local ta = now()
    local acc = evaluate(model)
    local eval_s = now() - ta
    local rec = { phase = phase, epoch = epoch, loss = r.loss, test_acc = acc, samples_per_s = r.samples_per_s,
      seconds = r.seconds, eval_seconds = eval_s, steps = steps, world_size = N, global_batch = B,
      loss_checksum = r.checksum }
    local final = ("%s %d/%d  loss %.4f  test acc %.4f  %.0f samples/s  %s (+%.1fs eval)  loss checksum %s")
      :format(phase, epoch, nepochs, r.loss, acc, r.samples_per_s, hms(r.seconds), eval_s, r.checksum)
    r.bar:close(final)  -- the final line replaces the live one
    metrics_write({ json_line(metric_keys, rec) }, "a")
    return acc
  end

  -- ---- pretraining -------------------------------------------------------------------------------------
  local pretrain_acc, linear_acc
  if not cfg.linear_eval then
    fsdp.manual_seed(cfg.seed)
    local model = wrap_model(Net(C1, C2):to(device))
    local opt = optim.Adam(model:parameters(), { lr = cfg.lr })
    local start = 1
    if cfg.resume then
      local extra = expect(("cannot resume from %s"):format(cfg.resume), fsdp.load_sharded, cfg.resume, model, opt)
      if type(extra) ~= "table" or extra.phase ~= "pretrain" or type(extra.epoch) ~= "number" then
        fail("cannot resume from %s: it is not a checkpoint of examples/train.lua's pretraining", cfg.resume)
      end
      if extra.global_batch ~= B or extra.seed ~= cfg.seed or extra.lr ~= cfg.lr or extra.lr_decay ~= cfg.lr_decay then
        fail("cannot resume from %s: it was trained with --batch-size %s --seed %s --lr %s --lr-decay %s; pass the same values to continue it",
          cfg.resume, tostring(extra.global_batch), tostring(extra.seed), tostring(extra.lr), tostring(extra.lr_decay))
      end
      start = extra.epoch + 1
      if start > cfg.epochs then  -- a finished run: its checkpoint, metrics, plot and model stay as they are
        say("nothing to train: the checkpoint in %s is at epoch %d, --epochs is %d; its files stay as they are "
          .. "(--epochs N continues it, --linear-eval reruns the linear evaluation)", cfg.resume, extra.epoch, cfg.epochs)
        fsdp.barrier()
        return
      end
      -- the metrics file keeps the epochs up to the checkpoint
      local keep = {}
      for _, m in ipairs(metrics_read()) do
        if m.phase == "pretrain" and m.epoch and m.epoch <= extra.epoch then keep[#keep + 1] = m.line end
      end
      metrics_write(keep, "w")
      say("resumed from %s after epoch %d (pretrain test accuracy then: %s)", cfg.resume, extra.epoch,
        extra.test_acc and ("%.4f"):format(extra.test_acc) or "?")
      pretrain_acc = extra.test_acc
    else
      metrics_write({}, "w")
    end
    say("FashionNet: trunk 2 x Conv3x3-ReLU-MaxPool (1-%d-%d), head Linear(%d, 10): %d parameters in %d FSDP units; Adam lr %g x %g per epoch",
      C1, C2, C2 * 49, count_params(model), #require("fsdp.wrap").units(model), cfg.lr, cfg.lr_decay)
    local loader = train_loader(cfg.seed)
    for epoch = start, cfg.epochs do
      -- the schedule depends on the epoch alone, so a resumed run follows it too
      for _, g in ipairs(opt.param_groups) do g.lr = cfg.lr * cfg.lr_decay ^ (epoch - 1) end
      local r = train_epoch(model, opt, "pretrain", epoch, cfg.epochs, loader)
      -- (before the evaluation: the plan of the training steps just run, optimizer state included)
      if cfg.summary and epoch == start then fsdp.summary(model, { optimizer = opt }) end
      pretrain_acc = finish_epoch(model, "pretrain", epoch, cfg.epochs, r)
      expect("saving the checkpoint", fsdp.save_sharded, cfg.ckpt, model, opt,
        { phase = "pretrain", epoch = epoch, seed = cfg.seed, global_batch = B, test_acc = pretrain_acc,
          loss = r.loss, channels = cfg.channels, lr = cfg.lr, lr_decay = cfg.lr_decay })
      if not fsdp.all_idle() then error("a unit is not idle after the epoch (an FSDP bug)") end
    end
    -- one consolidated file with the full tensors (PyTorch names), written by rank 0
    if R == 0 then
      local info = expect("consolidating the checkpoint", require("fsdp.checkpoint").consolidate, cfg.ckpt, cfg.ckpt .. "/model.safetensors")
      say("checkpoint: %s (sharded, %d ranks), consolidated %s (%d tensors, %.1f MB)", info.source, info.world_size,
        info.path, #info.names, info.bytes / 1e6)
    end
    fsdp.barrier()
  end

  -- ---- linear evaluation -------------------------------------------------------------------------------
  if not cfg.skip_linear_eval then
    local src = cfg.resume or cfg.ckpt
    fsdp.manual_seed(cfg.seed)
    local model = Net(C1, C2)
    local full = src .. "/model.safetensors"
    if file_exists(full) then
      local sd = expect(("cannot read the pretrained weights %s"):format(full), fsdp.load, full)
      expect(("the pretrained weights %s do not fit the model"):format(full), model.load_state_dict, model, sd)
    else  -- no consolidated file yet (e.g. an interrupted run): the sharded checkpoint, read whole
      expect(("cannot load the pretrained weights from %s"):format(src), fsdp.load_sharded, src, model)
    end
    model:to(device)
    if not pretrain_acc then pretrain_acc = evaluate(model) end
    -- freeze the trunk, new head, wrap exactly as in pretraining (the trunk's nested units included)
    for _, p in model.trunk:named_parameters() do p.requires_grad = false end
    fsdp.manual_seed(cfg.seed + 1)
    model.head = new_head():to(device)
    wrap_model(model)
    local trainable = {}
    for _, p in ipairs(model:parameters()) do if p.requires_grad then trainable[#trainable + 1] = p end end
    local opt = optim.Adam(trainable, { lr = cfg.linear_lr })
    say("linear evaluation: trunk of %s frozen, new head Linear(%d, 10), Adam lr %g, %d epochs",
      src, C2 * 49, cfg.linear_lr, cfg.linear_epochs)
    if cfg.linear_eval then
      local keep = {}
      for _, m in ipairs(metrics_read()) do if m.phase ~= "linear" then keep[#keep + 1] = m.line end end
      metrics_write(keep, "w")
    end
    linear_acc = evaluate(model)
    say("linear 0/%d  test acc %.4f (untrained head)", cfg.linear_epochs, linear_acc)
    local loader = train_loader(cfg.seed + 1000)
    for epoch = 1, cfg.linear_epochs do
      local r = train_epoch(model, opt, "linear", epoch, cfg.linear_epochs, loader)
      linear_acc = finish_epoch(model, "linear", epoch, cfg.linear_epochs, r)
    end
  end

  -- ---- plot and summary -----------------------------------------------------------------------------------
  if R == 0 then
    local gp = script_dir .. "/plot.gp"
    if not os_ok(os.execute("command -v gnuplot >/dev/null 2>&1")) then
      say("gnuplot not found (apt-get install gnuplot-nox): skipping the plot %s", cfg.plot)
    elseif not file_exists(gp) then
      say("%s not found: skipping the plot", gp)
    else
      -- gnuplot reads a table: one block per phase (x on one epoch time line, epoch, loss, accuracy)
      local tsv = cfg.plot:gsub("%.png$", "") .. ".tsv"
      local f = assert(io.open(tsv, "w"))
      local ms, npre, nlin = metrics_read(), 0, 0
      for _, m in ipairs(ms) do
        if m.phase == "pretrain" then npre = math.max(npre, m.epoch) else nlin = math.max(nlin, m.epoch) end
      end
      for i, phase in ipairs { "pretrain", "linear" } do
        f:write(("# %s: x epoch loss test_acc\n"):format(phase))
        local any = false
        for _, m in ipairs(ms) do
          if m.phase == phase then
            f:write(("%d\t%d\t%.6f\t%.6f\n"):format(m.epoch + (i == 2 and npre or 0), m.epoch, m.loss, m.test_acc))
            any = true
          end
        end
        if not any then f:write("NaN\tNaN\tNaN\tNaN\n") end
        if i == 1 then f:write("\n\n") end
      end
      f:close()
      local q = function(s) return "'" .. s:gsub("'", "'\\''") .. "'" end
      local vars = ("data='%s'; out='%s'; npre=%d; nlin=%d; ntest=%d"):format(tsv, cfg.plot, npre, nlin, ntest)
      local cmd = ("gnuplot -e %s %s 2>&1"):format(q(vars), q(gp))
      os.remove(cfg.plot)
      local p = io.popen(cmd)
      local out = p:read("*a")
      p:close()
      if file_exists(cfg.plot) and not out:find("rror") then say("plot: %s", cfg.plot)
      else say("gnuplot failed, no plot: %s", out) end
    end
    local function fmt(a) return a and ("%.4f"):format(a) or "skipped" end
    say("pretrain test accuracy: %s, linear-eval test accuracy: %s", fmt(pretrain_acc), fmt(linear_acc))
  end
  fsdp.barrier()
end

main()
