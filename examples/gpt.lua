-- A character-level GPT trained with FSDP on the text of Debian's `fortunes` package, then sampled.
-- examples/gpt_torch.py is the same job written with PyTorch FSDP2 (bench/README.md compares them).
--
--   bin/fsdprun -n 2 examples/gpt.lua                       the default run (`make demo-gpt`)
--   bin/fsdprun -n 2 examples/gpt.lua --stop-at 300        train the first 300 steps of the run only
--   bin/fsdprun -n 2 examples/gpt.lua --resume gpt_ckpt     continue it, exactly as if never stopped
--   bin/fsdprun examples/gpt.lua --help                     every flag
--
-- Model: examples/gpt_model.lua (nanoGPT's, PyTorch's state_dict names), the LM head tied to the
-- token embedding unless --untied. Built inside fsdp.meta: no rank ever holds the whole model, each
-- materialises its pieces as it wraps (--eager builds it whole first; the values are the same).
-- Every block and the root are FSDP units.
-- Data: the files of FILES below, concatenated in that (sorted) order, one token per byte (the
-- vocabulary is the bytes that occur); the first 90% trains, the last 10% validates.
-- Batches: random crops of the token stream. The crop offsets of step s come from a small
-- Park-Miller generator seeded by (--seed, s) -- exact in doubles, so gpt_torch.py draws the very
-- same crops -- identical on every rank: each step draws the whole global batch and rank r takes its
-- r-th slice of every micro-batch, so N ranks train on exactly what one process would, and a resumed
-- run draws what the uninterrupted one did. Validation: --eval-iters fixed batches of the validation
-- text (the same crops at every evaluation), split over the ranks, losses averaged.
-- Training: AdamW with two parameter groups (weight decay for p:dim() >= 2, none for the rest),
-- linear warmup then cosine decay to lr/10 (SequentialLR of LinearLR and CosineAnnealingLR),
-- gradient accumulation (--accum), clipping of the global norm, --bf16 mixed precision (bf16
-- compute, float32 master weights and reduction). A sharded checkpoint after every evaluation holds
-- model, optimizer and scheduler; --resume continues the run exactly.
local fsdp = require "fsdp"
local nn, optim, F = fsdp.nn, fsdp.optim, fsdp.nn.functional

local p = fsdp.argparse.ArgumentParser { formatter_class = fsdp.argparse.ArgumentDefaultsHelpFormatter,
  description = "Trains a character-level GPT on the fortunes corpus with FSDP, prints the validation loss every\n"
    .. "--eval-every steps, checkpoints, and ends with a sample of generated text." }
local function a(name, t, v, help, min) p:add_argument(name, { type = t, default = v, help = help, min = min }) end
a("--steps", "int", 2000, "optimizer steps", 1)
a("--batch-size", "int", 16, "crops per micro-batch, global, split over the ranks", 1)
a("--accum", "int", 2, "micro-batches per optimizer step (gradient accumulation)", 1)
a("--block", "int", 128, "context length", 1)
a("--layers", "int", 4, "transformer blocks", 1)
a("--heads", "int", 6, "attention heads", 1)
a("--dim", "int", 192, "embedding width", 1)
p:add_argument("--untied", { action = "store_true", help = "an LM head weight of its own, untied from wte" })
a("--lr", "float", 2e-3, "peak AdamW learning rate, cosine decay to LR/10", 0)
a("--warmup", "int", 100, "linear warmup steps", 0)
a("--weight-decay", "float", 0.1, "AdamW weight decay of the matrices", 0)
a("--clip", "float", 1.0, "clip the global gradient norm to C (0: off)", 0)
a("--eval-every", "int", 100, "steps between validation evaluations and checkpoints", 1)
a("--eval-iters", "int", 8, "validation batches of B crops per evaluation", 1)
p:add_argument("--bf16", { action = "store_true", help = "mixed precision: bf16 compute, fp32 masters and reduction" })
p:add_argument("--eager", { action = "store_true", help = "build the whole model on every rank before wrapping\n"
  .. "(default: on meta, each rank materialising its pieces only; the same values)" })
a("--seed", "int", 0, "initialisation, crops and sampling", 0)
a("--data", "str", "/usr/share/games/fortunes", "the fortunes directory")
a("--limit", "int", nil, "use only the first N bytes of the corpus (CI)", 1)
a("--ckpt", "str", nil, "checkpoint directory (default ./gpt_ckpt, or the --resume DIR)")
a("--resume", "str", nil, "continue the run saved in DIR (pass the same training flags)")
a("--stop-at", "int", nil, "stop after step S (checkpointed there when S is a multiple of --eval-every);\n"
  .. "--resume then goes on as if the run had never stopped", 1)
a("--sample-len", "int", 400, "characters to generate at the end (0: none)", 0)
a("--temperature", "float", 0.8, "sampling temperature")
a("--top-k", "int", 10, "sample among the K most likely characters", 1)
a("--prompt", "str", "\n", "the text generation starts from")
local cfg = p:parse_args(arg)
if cfg.dim % cfg.heads ~= 0 then p:error(("--dim %d is not a multiple of --heads %d"):format(cfg.dim, cfg.heads)) end
if cfg.temperature <= 0 then p:error("--temperature must be positive") end
cfg.ckpt = (cfg.ckpt or cfg.resume or "./gpt_ckpt"):gsub("/+$", "")

local FILES = { "art", "ascii-art", "computers", "cookie", "debian", "definitions", "disclaimer", "drugs",
  "education", "ethnic", "food", "fortunes", "goedel", "humorists", "kids", "knghtbrd", "law", "linux",
  "linuxcookie", "literature", "love", "magic", "medicine", "men-women", "miscellaneous", "news", "paradoxum",
  "people", "perl", "pets", "platitudes", "politics", "pratchett", "riddles", "science", "songs-poems", "sports",
  "startrek", "tao", "translate-me", "wisdom", "work", "zippy" }

local function load_corpus(dir, limit)
  local parts = {}
  for _, name in ipairs(FILES) do
    local f = io.open(dir .. "/" .. name, "rb")
    if not f then
      fsdp.exit("the corpus file %s/%s is missing: install it with `apt-get install fortunes` (or pass --data DIR)",
        dir, name)
    end
    parts[#parts + 1] = f:read("*a")
    f:close()
  end
  return table.concat(parts):sub(1, limit)
end

-- the model (nanoGPT's; bench/big_model.lua trains a 1-billion-parameter one of it)
local GPT = dofile(((arg and arg[0] or ""):match("^(.*)/[^/]*$") or ".") .. "/gpt_model.lua")

local function crop_offsets(seed, step, count, range) -- a Park-Miller generator, exact (gpt_torch.py has the same)
  local s = (seed * 1000003 + step * 7919 + 12345) % 2147483646 + 1
  local out = {}
  for i = 1, count do
    s = s * 48271 % 2147483647
    out[i] = s % range
  end
  return out
end

fsdp.init()
local R, N = fsdp.rank(), fsdp.world_size()
local function say(...) if R == 0 then print(string.format(...)) io.flush() end end
local B, K, T = cfg.batch_size, cfg.accum, cfg.block
if B % N ~= 0 then fsdp.exit("--batch-size %d must be a multiple of the number of ranks (%d)", B, N) end
local b = B / N

local text = load_corpus(cfg.data, cfg.limit)
local itos, stoi, list = {}, {}, {}
for c = 0, 255 do if text:find(string.char(c), 1, true) then itos[#itos + 1] = c; stoi[c] = #itos - 1 end end
for i = 1, #text do list[i] = stoi[text:byte(i)] end
local V, n = #itos, #text
local ids = fsdp.tensor(list, "int64")
local ntrain = math.floor(n * 0.9)
local splits = { train = ids:narrow(1, 1, ntrain), val = ids:narrow(1, ntrain + 1, n - ntrain) }
for name, sp in pairs(splits) do
  if sp:numel() <= T + 1 then
    fsdp.exit("the %s split (%d bytes) is shorter than --block %d + 1", name, sp:numel(), T)
  end
end
local function batch(data, offs, first) -- crops offs[first .. first + b - 1]: inputs (b, T), next-character targets
  local x, y = {}, {}
  for i = 1, b do x[i], y[i] = data:narrow(1, offs[first + i] + 1, T), data:narrow(1, offs[first + i] + 2, T) end
  return fsdp.stack(x), fsdp.stack(y)
end
say("corpus: %d fortunes files from %s, %d bytes, vocabulary %d; train %d / val %d", #FILES, cfg.data, n, V, ntrain,
  n - ntrain)

-- built on meta (no parameter storage: shapes and the recorded initialisation), then each wrap
-- materialises this rank's pieces only -- the values the eager build (--eager) gives, bit for bit
fsdp.manual_seed(cfg.seed)
local build = function() return GPT(V, T, cfg.dim, cfg.heads, cfg.layers, cfg.untied) end
local model = cfg.eager and build() or fsdp.meta(build)
local nparams = model:num_parameters()
local mp = cfg.bf16 and { param = "bf16", reduce = "fp32" } or nil
for _, blk in ipairs(model.h:children()) do fsdp.wrap(blk, { mixed_precision = mp }) end
fsdp.wrap(model, { mixed_precision = mp })
local decay, no_decay = {}, {}
for _, q in ipairs(model:parameters()) do table.insert(q:dim() >= 2 and decay or no_decay, q) end
local opt = optim.AdamW({ { params = decay, weight_decay = cfg.weight_decay },
  { params = no_decay, weight_decay = 0 } }, { lr = cfg.lr, betas = { 0.9, 0.95 } })
local S = optim.lr_scheduler
local warm = math.max(1, math.min(cfg.warmup, cfg.steps - 1))
local sched = S.SequentialLR(opt, { S.LinearLR(opt, { start_factor = 1 / warm, total_iters = warm }),
  S.CosineAnnealingLR(opt, { T_max = math.max(1, cfg.steps - warm), eta_min = cfg.lr / 10 }) }, { warm })
say("GPT: %d blocks, d %d, %d heads, context %d, %s head: %d parameters, %d FSDP units, %d ranks%s", cfg.layers,
  cfg.dim, cfg.heads, T, cfg.untied and "untied" or "tied", nparams, cfg.layers + 1, N,
  cfg.bf16 and ", bf16 compute" or "")
say("AdamW lr %g (warmup %d, cosine to %g), weight decay %g on %d matrices; %d steps of %d x %d crops of %d characters",
  cfg.lr, warm, cfg.lr / 10, cfg.weight_decay, #decay, cfg.steps, K, B, T)

local function loss_of(x, y) return F.cross_entropy(model(x):reshape(b * T, V):to("float32"), y:reshape(b * T)) end
local function mean_over_ranks(v) return fsdp.all_reduce(fsdp.tensor({ v }), "avg"):item() end
local val_offs = crop_offsets(cfg.seed + 7777, 0, B * cfg.eval_iters, splits.val:numel() - T)
local function evaluate()
  model:eval()
  local s = 0
  fsdp.no_grad(function()
    for it = 0, cfg.eval_iters - 1 do s = s + loss_of(batch(splits.val, val_offs, it * B + R * b)):item() end
  end)
  model:train()
  return mean_over_ranks(s / cfg.eval_iters)
end

-- what a resumed run must share with the saved one (load_sharded checks the model's shapes)
local resume_keys = { "steps", "batch_size", "accum", "block", "seed", "lr", "warmup", "weight_decay", "clip", "limit" }
local start, curve = 1, {}
if cfg.resume then
  local ok, extra = pcall(fsdp.load_sharded, cfg.resume, model, opt)
  if not ok then fsdp.exit("cannot resume from %s: %s", cfg.resume, tostring(extra)) end
  if type(extra) ~= "table" or extra.job ~= "gpt" then
    fsdp.exit("cannot resume from %s: not a checkpoint of examples/gpt.lua", cfg.resume)
  end
  for _, k in ipairs(resume_keys) do
    if extra.cfg[k] ~= cfg[k] then
      fsdp.exit("cannot resume from %s: it was trained with --%s %s, not %s", cfg.resume, (k:gsub("_", "-")),
        tostring(extra.cfg[k]), tostring(cfg[k]))
    end
  end
  sched:load_state_dict(extra.sched)
  start, curve = extra.step + 1, extra.curve
  say("resumed from %s after step %d", cfg.resume, extra.step)
end
local line = "step %5d  train loss %.6f  val loss %.6f  lr %.3e"
for _, c in ipairs(curve) do say(line, unpack(c)) end

local t0, tsum, tcount = fsdp.perf_counter(), 0, 0
local bar
local last = math.min(cfg.steps, cfg.stop_at or cfg.steps)
for step = start, last do
  if not bar then -- one live line per evaluation interval (on a terminal), closed by the evaluation's line
    local count = math.min(cfg.eval_every - (step - 1) % cfg.eval_every, last - step + 1)
    -- (in a log, not a terminal: plain lines at every 10% of the run's first interval, so the run
    -- is not silent until its first evaluation; later intervals print only their evaluation line)
    local every = step == start and 0.1 or 1
    bar = fsdp.progress(count, { desc = ("steps %d-%d"):format(step, step + count - 1), unit = "step", every = every })
  end
  local offs = crop_offsets(cfg.seed, step, K * B, splits.train:numel() - T)
  local lsum = 0
  for k = 0, K - 1 do
    local loss = loss_of(batch(splits.train, offs, k * B + R * b)) / K
    loss:backward()
    lsum = lsum + loss:item()
  end
  if cfg.clip > 0 then fsdp.clip_grad_norm(model, cfg.clip) end
  local lr = opt.param_groups[1].lr
  opt:step()
  opt:zero_grad()
  sched:step()
  local loss = mean_over_ranks(lsum)
  if loss ~= loss then fsdp.exit("the loss became NaN at step %d (lower --lr)", step) end
  tsum, tcount = tsum + loss, tcount + 1
  bar:update(1, { loss = loss })
  if step % cfg.eval_every == 0 or step == cfg.steps then
    local c = { step, tsum / tcount, evaluate(), lr }
    tsum, tcount = 0, 0
    curve[#curve + 1] = c
    bar:close(line:format(unpack(c)))
    bar = nil
    local saved_cfg = {}
    for _, k in ipairs(resume_keys) do saved_cfg[k] = cfg[k] end
    fsdp.save_sharded(cfg.ckpt, model, opt, { job = "gpt", step = step, curve = curve, sched = sched:state_dict(),
      cfg = saved_cfg })
  end
end
if bar then bar:close() end
if start <= last then
  local dt = fsdp.perf_counter() - t0
  say("trained steps %d-%d in %.1f s (%.3f s per step); checkpoint %s", start, last, dt, dt / (last - start + 1),
    cfg.ckpt)
end

-- sampling: every rank runs the same forwards (the units gather) and draws the same characters
if cfg.sample_len > 0 then
  fsdp.manual_seed(cfg.seed)
  model:eval()
  local ctx, out, kk = {}, {}, math.min(cfg.top_k, V)
  for i = 1, #cfg.prompt do
    ctx[i] = stoi[cfg.prompt:byte(i)]
      or fsdp.exit("--prompt: the character %q is not in the corpus", cfg.prompt:sub(i, i))
  end
  if #ctx == 0 then fsdp.exit("--prompt must not be empty") end
  fsdp.no_grad(function()
    for _ = 1, cfg.sample_len do
      local window = fsdp.tensor({ { unpack(ctx, math.max(1, #ctx - T + 1)) } }, "int64")
      local vals, inds = (model(window):to("float32")[{ 1, -1 }] / cfg.temperature):topk(kk)
      ctx[#ctx + 1] = inds[fsdp.multinomial(F.softmax(vals, -1), 1):item() + 1]:item()
      out[#out + 1] = string.char(itos[ctx[#ctx] + 1])
    end
  end)
  say("sample (temperature %g, top-k %d, %d characters):\n%s%s\n-- end of sample --", cfg.temperature, kk,
    cfg.sample_len, cfg.prompt, table.concat(out))
end
fsdp.barrier()
