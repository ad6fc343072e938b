-- A character-level GPT trained with FSDP on the text of Debian's `fortunes` package, then sampled.
--
--   bin/fsdprun -n 2 examples/gpt.lua                       the default run (`make demo-gpt`)
--   bin/fsdprun -n 2 examples/gpt.lua --stop-at 300        train the first 300 steps of the run only
--   bin/fsdprun -n 2 examples/gpt.lua --resume gpt_ckpt     continue it, exactly as if never stopped
--   luajit examples/gpt.lua --help                          every flag
--
-- Model (nanoGPT's, PyTorch's state_dict names): token + position embedding, L pre-norm blocks
-- (LayerNorm, causal self-attention through F.scaled_dot_product_attention, LayerNorm, GELU MLP 4x),
-- a final LayerNorm and the LM head, tied to the token embedding unless --untied. Initialisation:
-- N(0, 0.02) for Linear and Embedding weights, N(0, 0.02 / sqrt(2 L)) for the two residual
-- projections of each block, zero biases. Every block and the root are FSDP units.
-- Data: the files of FILES below, concatenated in that (sorted) order, one token per byte (the
-- vocabulary is the bytes that occur); the first 90% trains, the last 10% validates.
-- Batches: random crops of the token stream. The crop offsets of step s come from a small
-- Park-Miller generator seeded by (--seed, s) -- exact in doubles, so examples/gpt_torch.py draws
-- the very same crops -- identical on every rank: each step draws the whole global batch and rank r
-- takes its r-th slice of every micro-batch, so N ranks train on exactly what one process would, and
-- a resumed run draws what the uninterrupted one did. Validation: --eval-iters fixed batches of the
-- validation text (the same crops at every evaluation), split over the ranks, losses averaged.
-- Training: AdamW with two parameter groups (weight decay for p:dim() >= 2, none for the rest),
-- linear warmup then cosine decay to lr/10 (SequentialLR of LinearLR and CosineAnnealingLR),
-- gradient accumulation (--accum), clipping of the global norm, --bf16 mixed precision (bf16
-- compute, float32 master weights and reduction). A sharded checkpoint after every evaluation holds
-- model, optimizer and scheduler; --resume continues the run exactly.
local script_dir = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
if not package.searchpath("fsdp", package.path) then
  local root = script_dir .. "/.."
  package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
  package.cpath = root .. "/?.so;" .. package.cpath
end
local ffi = require "ffi"
local fsdp = require "fsdp"
local nn, optim, F = fsdp.nn, fsdp.optim, fsdp.nn.functional
pcall(ffi.cdef, "void _exit(int);")
require "fsdp.progress" -- declares clock_gettime (one declaration per process) with its timespec
local function now()
  local t = ffi.new("fsdp_progress_timespec")
  ffi.C.clock_gettime(1, t)
  return tonumber(t.tv_sec) + tonumber(t.tv_nsec) * 1e-9
end

-- ---- flags ---------------------------------------------------------------------------------------
local p = fsdp.argparse.ArgumentParser { prog = "gpt.lua",
  usage = "fsdprun -n N examples/gpt.lua [flags]      (or plain luajit: one rank)",
  description = "Trains a character-level GPT on the fortunes corpus with FSDP, prints the validation loss every\n"
    .. "--eval-every steps, checkpoints, and ends with a sample of generated text." }
local function int(name, default, help, metavar)
  p:add_argument(name, { type = "int", default = default, min = 1, metavar = metavar, help = help })
end
int("--steps", 2000, "optimizer steps (default 2000)", "N")
int("--batch-size", 16, "crops per micro-batch, global, split over the ranks (default 16)", "B")
int("--accum", 2, "micro-batches per optimizer step (gradient accumulation, default 2)", "K")
int("--block", 128, "context length (default 128)", "T")
int("--layers", 4, "transformer blocks (default 4)", "L")
int("--heads", 6, "attention heads (default 6)", "H")
int("--dim", 192, "embedding width (default 192)", "D")
p:add_argument("--untied", { action = "store_true", help = "a separate LM head weight (default: tied to the token embedding)" })
p:add_argument("--lr", { type = "float", default = 2e-3, min = 0, help = "peak AdamW learning rate (default 0.002), cosine decay to LR/10" })
p:add_argument("--warmup", { type = "int", default = 100, min = 0, metavar = "W", help = "linear warmup steps (default 100)" })
p:add_argument("--weight-decay", { type = "float", default = 0.1, min = 0, metavar = "WD",
  help = "AdamW weight decay of the matrices (default 0.1)" })
p:add_argument("--clip", { type = "float", default = 1.0, min = 0, metavar = "C",
  help = "clip the global gradient norm to C (default 1.0; 0: off)" })
int("--eval-every", 100, "steps between validation evaluations and checkpoints (default 100)", "E")
int("--eval-iters", 8, "validation batches of B crops per evaluation (default 8)", "I")
p:add_argument("--bf16", { action = "store_true", help = "mixed precision: bf16 compute, float32 master weights and reduction" })
p:add_argument("--seed", { type = "int", default = 0, min = 0, metavar = "S", help = "initialisation, crops and sampling (default 0)" })
p:add_argument("--data", { default = "/usr/share/games/fortunes", metavar = "DIR",
  help = "the fortunes directory (default /usr/share/games/fortunes)" })
int("--limit", nil, "use only the first N bytes of the corpus (CI)", "N")
p:add_argument("--ckpt", { metavar = "DIR", help = "checkpoint directory (default ./gpt_ckpt, or the --resume DIR)" })
p:add_argument("--resume", { metavar = "DIR", help = "continue the run saved in DIR (pass the same training flags)" })
int("--stop-at", nil, "stop after step S (checkpointed there when S is a multiple of --eval-every);\n"
  .. "--resume then goes on as if the run had never stopped", "S")
p:add_argument("--sample-len", { type = "int", default = 400, min = 0, metavar = "N",
  help = "characters to generate at the end (default 400; 0: none)" })
p:add_argument("--temperature", { type = "float", default = 0.8, metavar = "X", help = "sampling temperature (default 0.8)" })
int("--top-k", 10, "sample among the K most likely characters (default 10)", "K")
p:add_argument("--prompt", { default = "\n", metavar = "TEXT", help = "the text generation starts from (default a newline)" })
local cfg = p:parse_args(arg)
if cfg.dim % cfg.heads ~= 0 then p:error(("--dim %d is not a multiple of --heads %d"):format(cfg.dim, cfg.heads)) end
if cfg.temperature <= 0 then p:error("--temperature must be positive") end
cfg.ckpt = (cfg.ckpt or cfg.resume or "./gpt_ckpt"):gsub("/+$", "")

local function fail(fmt, ...) error({ msg = fmt:format(...) }, 0) end

-- ---- the corpus --------------------------------------------------------------------------------------
local FILES = { "art", "ascii-art", "computers", "cookie", "debian", "definitions", "disclaimer", "drugs",
  "education", "ethnic", "food", "fortunes", "goedel", "humorists", "kids", "knghtbrd", "law", "linux",
  "linuxcookie", "literature", "love", "magic", "medicine", "men-women", "miscellaneous", "news", "paradoxum",
  "people", "perl", "pets", "platitudes", "politics", "pratchett", "riddles", "science", "songs-poems", "sports",
  "startrek", "tao", "translate-me", "wisdom", "work", "zippy" }

local function load_corpus(dir, limit)
  local parts = {}
  for _, name in ipairs(FILES) do
    local f = io.open(dir .. "/" .. name, "rb")
    if not f then fail("the corpus file %s/%s is missing: install it with `apt-get install fortunes` (or pass --data DIR)", dir, name) end
    parts[#parts + 1] = f:read("*a")
    f:close()
  end
  local text = table.concat(parts)
  if limit then text = text:sub(1, limit) end
  return text
end

-- ---- the model ------------------------------------------------------------------------------------------
local Attention = nn.Module:extend("CausalSelfAttention")
function Attention:__init(d, heads)
  self.heads = heads
  self.c_attn = nn.Linear(d, 3 * d)
  self.c_proj = nn.Linear(d, d)
end
function Attention:forward(x) -- (B, T, d)
  local B, T, d = x:size(1), x:size(2), x:size(3)
  local H = self.heads
  local qkv = self.c_attn(x)
  local function head(i) return qkv:narrow(3, i * d + 1, d):reshape(B, T, H, d / H):transpose(2, 3) end
  local y = F.scaled_dot_product_attention(head(0), head(1), head(2), { causal = true })
  return self.c_proj(y:transpose(2, 3):reshape(B, T, d))
end

local MLP = nn.Module:extend("MLP")
function MLP:__init(d) self.c_fc, self.gelu, self.c_proj = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d) end
function MLP:forward(x) return self.c_proj(self.gelu(self.c_fc(x))) end

local Block = nn.Module:extend("Block")
function Block:__init(d, heads)
  self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d), MLP(d)
end
function Block:forward(x)
  x = x + self.attn(self.ln_1(x))
  return x + self.mlp(self.ln_2(x))
end

local GPT = nn.Module:extend("GPT")
function GPT:__init(vocab, block, d, heads, layers, untied)
  self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
  self.h = nn.ModuleList()
  for _ = 1, layers do self.h:append(Block(d, heads)) end
  self.ln_f = nn.LayerNorm(d)
  self.lm_head = nn.Linear(d, vocab, { bias = false })
  if not untied then self.lm_head.weight = self.wte.weight end
  fsdp.no_grad(function()
    for _, m in ipairs(self:modules()) do
      if m.in_features or m.num_embeddings then m.weight:normal_(0, 0.02) end
      if m.in_features and m.bias then m.bias:zero_() end
    end
    for _, b in ipairs(self.h:children()) do
      b.attn.c_proj.weight:normal_(0, 0.02 / math.sqrt(2 * layers))
      b.mlp.c_proj.weight:normal_(0, 0.02 / math.sqrt(2 * layers))
    end
  end)
end
function GPT:forward(idx) -- (B, T) int64 -> logits (B, T, vocab)
  local x = self.wte(idx) + self.wpe(fsdp.arange(idx:size(2)))
  for _, b in ipairs(self.h:children()) do x = b(x) end
  return self.lm_head(self.ln_f(x))
end

-- ---- crops: a Park-Miller generator, exact in doubles (examples/gpt_torch.py has the same) -----------
local function crop_offsets(seed, step, count, range)
  local s = (seed * 1000003 + step * 7919 + 12345) % 2147483646 + 1
  local out = {}
  for i = 1, count do
    s = s * 48271 % 2147483647
    out[i] = s % range
  end
  return out
end

local function main()
  fsdp.init()
  local R, N = fsdp.rank(), fsdp.world_size()
  local say = R == 0 and function(fmt, ...) io.write(fmt:format(...), "\n") io.flush() end or function() end
  local B, K, T = cfg.batch_size, cfg.accum, cfg.block
  if B % N ~= 0 then fail("--batch-size %d must be a multiple of the number of ranks (%d)", B, N) end
  local b = B / N

  local text = load_corpus(cfg.data, cfg.limit)
  local itos, stoi = {}, {}
  for c = 0, 255 do if text:find(string.char(c), 1, true) then itos[#itos + 1] = c; stoi[c] = #itos - 1 end end
  local V = #itos
  local n = #text
  local ids = ffi.new("int64_t[?]", n)
  for i = 1, n do ids[i - 1] = stoi[text:byte(i)] end
  local ntrain = math.floor(n * 0.9)
  local splits = { train = { lo = 0, len = ntrain }, val = { lo = ntrain, len = n - ntrain } }
  for name, sp in pairs(splits) do
    if sp.len <= T + 1 then fail("the %s split (%d bytes) is shorter than --block %d + 1", name, sp.len, T) end
  end
  -- rank r's slice of crops `offs` (0-based in the split): inputs (b, T) and next-character targets
  local function batch(sp, offs, first)
    local x, y = fsdp.empty({ b, T }, { dtype = "int64" }), fsdp.empty({ b, T }, { dtype = "int64" })
    local px, py = ffi.cast("int64_t*", x:data_ptr()), ffi.cast("int64_t*", y:data_ptr())
    for i = 0, b - 1 do
      local o = sp.lo + offs[first + i]
      ffi.copy(px + i * T, ids + o, T * 8)
      ffi.copy(py + i * T, ids + o + 1, T * 8)
    end
    return x, y
  end
  say("corpus: %d fortunes files from %s, %d bytes, vocabulary %d; train %d / val %d", #FILES, cfg.data, n, V, ntrain, n - ntrain)

  -- ---- model, optimizer, schedule -------------------------------------------------------------------
  fsdp.manual_seed(cfg.seed)
  local model = GPT(V, T, cfg.dim, cfg.heads, cfg.layers, cfg.untied)
  local nparams = model:num_parameters()
  local wrap_opts = cfg.bf16 and { mixed_precision = { param = "bf16", reduce = "fp32" } } or {}
  for _, blk in ipairs(model.h:children()) do fsdp.wrap(blk, wrap_opts) end
  fsdp.wrap(model, wrap_opts)
  local decay, no_decay = {}, {}
  for _, p in ipairs(model:parameters()) do table.insert(p:dim() >= 2 and decay or no_decay, p) end
  local opt = optim.AdamW({ { params = decay, weight_decay = cfg.weight_decay }, { params = no_decay, weight_decay = 0 } },
    { lr = cfg.lr, betas = { 0.9, 0.95 } })
  local S = optim.lr_scheduler
  local warm = math.max(1, math.min(cfg.warmup, cfg.steps - 1))
  local sched = S.SequentialLR(opt, { S.LinearLR(opt, { start_factor = 1 / warm, total_iters = warm }),
    S.CosineAnnealingLR(opt, { T_max = math.max(1, cfg.steps - warm), eta_min = cfg.lr / 10 }) }, { warm })
  say("GPT: %d blocks, d %d, %d heads, context %d, %s head: %d parameters, %d FSDP units, %d ranks%s",
    cfg.layers, cfg.dim, cfg.heads, T, cfg.untied and "untied" or "tied", nparams, cfg.layers + 1, N, cfg.bf16 and ", bf16 compute" or "")
  say("AdamW lr %g (warmup %d, cosine to %g), weight decay %g on %d matrices; %d steps of %d x %d crops of %d characters",
    cfg.lr, warm, cfg.lr / 10, cfg.weight_decay, #decay, cfg.steps, K, B, T)

  local function loss_of(x, y)
    local logits = model(x)
    return F.cross_entropy(logits:reshape(b * T, V):to("float32"), y:reshape(b * T))
  end
  local function mean_over_ranks(v)
    local t = fsdp.tensor({ v })
    if N > 1 then fsdp.all_reduce(t, "avg") end
    return t:item()
  end
  local val_offs = crop_offsets(cfg.seed + 7777, 0, B * cfg.eval_iters, splits.val.len - T)
  local function evaluate()
    model:eval()
    local sum = fsdp.no_grad(function()
      local s = 0
      for it = 0, cfg.eval_iters - 1 do s = s + loss_of(batch(splits.val, val_offs, it * B + R * b + 1)):item() end
      return s
    end)
    model:train()
    return mean_over_ranks(sum / cfg.eval_iters)
  end

  -- what a resumed run must share with the saved one (the model's shapes are checked by load_sharded)
  local resume_keys = { "steps", "batch_size", "accum", "block", "seed", "lr", "warmup", "weight_decay", "clip", "limit" }
  local saved_cfg = {}
  for _, k in ipairs(resume_keys) do saved_cfg[k] = cfg[k] end
  local start, curve = 1, {}
  if cfg.resume then
    local ok, extra = pcall(fsdp.load_sharded, cfg.resume, model, opt)
    if not ok then fail("cannot resume from %s: %s", cfg.resume, tostring(extra)) end
    if type(extra) ~= "table" or extra.job ~= "gpt" then fail("cannot resume from %s: not a checkpoint of examples/gpt.lua", cfg.resume) end
    for _, k in ipairs(resume_keys) do
      if extra.cfg[k] ~= cfg[k] then fail("cannot resume from %s: it was trained with --%s %s, not %s", cfg.resume, (k:gsub("_", "-")), tostring(extra.cfg[k]), tostring(cfg[k])) end
    end
    sched:load_state_dict(extra.sched)
    start, curve = extra.step + 1, extra.curve
    say("resumed from %s after step %d", cfg.resume, extra.step)
  end
  for _, c in ipairs(curve) do say("step %5d  train loss %.6f  val loss %.6f  lr %.3e", c[1], c[2], c[3], c[4]) end

  -- ---- training -------------------------------------------------------------------------------------------
  local t0, tsum, tcount = now(), 0, 0
  local bar
  local last = math.min(cfg.steps, cfg.stop_at or cfg.steps)
  for step = start, last do
    if not bar then -- one live line per evaluation interval (on a terminal), closed by the evaluation's line
      local count = math.min(cfg.eval_every - (step - 1) % cfg.eval_every, last - step + 1)
      bar = fsdp.progress(count, { desc = ("steps %d-%d"):format(step, step + count - 1), unit = "step", every = 1 })
    end
    local offs = crop_offsets(cfg.seed, step, K * B, splits.train.len - T)
    local lsum = 0
    for k = 0, K - 1 do
      local loss = loss_of(batch(splits.train, offs, k * B + R * b + 1)) / K
      loss:backward()
      lsum = lsum + loss:item()
    end
    if cfg.clip > 0 then fsdp.clip_grad_norm(model, cfg.clip) end
    local lr = opt.param_groups[1].lr
    opt:step()
    opt:zero_grad()
    sched:step()
    local l = mean_over_ranks(lsum)
    if l ~= l then fail("the loss became NaN at step %d (lower --lr)", step) end
    tsum, tcount = tsum + l, tcount + 1
    bar:update(1, { loss = l })
    if step % cfg.eval_every == 0 or step == cfg.steps then
      local c = { step, tsum / tcount, evaluate(), lr }
      tsum, tcount = 0, 0
      curve[#curve + 1] = c
      bar:close(("step %5d  train loss %.6f  val loss %.6f  lr %.3e"):format(c[1], c[2], c[3], c[4]))
      bar = nil
      fsdp.save_sharded(cfg.ckpt, model, opt, { job = "gpt", step = step, curve = curve, sched = sched:state_dict(),
        cfg = saved_cfg })
    end
  end
  if bar then bar:close() end
  if start <= last then
    say("trained steps %d-%d in %.1f s (%.3f s per step); checkpoint %s", start, last, now() - t0, (now() - t0) / (last - start + 1), cfg.ckpt)
  end

  -- ---- sampling: every rank runs the same forwards (the units gather) and draws the same characters --
  if cfg.sample_len > 0 then
    fsdp.manual_seed(cfg.seed)
    model:eval()
    local ctx = {}
    for i = 1, #cfg.prompt do
      local id = stoi[cfg.prompt:byte(i)]
      if not id then fail("--prompt: the character %q is not in the corpus", cfg.prompt:sub(i, i)) end
      ctx[#ctx + 1] = id
    end
    if #ctx == 0 then fail("--prompt must not be empty") end
    local out, kk = {}, math.min(cfg.top_k, V)
    fsdp.no_grad(function()
      for _ = 1, cfg.sample_len do
        local lo = math.max(1, #ctx - T + 1)
        local window = {}
        for i = lo, #ctx do window[#window + 1] = ctx[i] end
        local logits = model(fsdp.tensor({ window }, "int64")):to("float32")
        local last = logits:narrow(2, #window, 1):reshape(V) / cfg.temperature
        local vals, inds = last:topk(kk, { dim = -1 })
        local j = fsdp.multinomial(F.softmax(vals, -1), 1):item()
        local id = inds:narrow(1, j + 1, 1):item()
        ctx[#ctx + 1] = id
        out[#out + 1] = string.char(itos[id + 1])
      end
    end)
    say("sample (temperature %g, top-k %d, %d characters):\n%s%s\n-- end of sample --", cfg.temperature, kk,
      cfg.sample_len, cfg.prompt, table.concat(out))
  end
  fsdp.barrier()
end

local ok, err = xpcall(main, function(e)
  if type(e) == "table" and e.msg then return e end
  return debug.traceback(tostring(e), 2)
end)
if not ok then
  local r = fsdp.comm.is_initialized() and fsdp.world_size() > 1 and (" (rank %d)"):format(fsdp.rank()) or ""
  io.stderr:write("gpt.lua", r, ": ", type(err) == "table" and err.msg or tostring(err), "\n")
  io.stderr:flush()
  io.stdout:flush()
  if r ~= "" then ffi.C._exit(1) end -- no orderly MPI finalize: the other ranks may never arrive
  os.exit(1)
end
