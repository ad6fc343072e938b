-- Activation checkpointing: what it saves and what it costs, on the bench's language models
-- (bench/models.lua's Transformer) with every block checkpointed (nn.Checkpoint) against none.
--
--   luajit bench/checkpoint_memory.lua [--models transformer,gpt] [--layers 2,8] [--steps 6] [--threads 2]
--
-- One training step = zero_grad, forward, cross-entropy, backward, AdamW step. Activation bytes: the
-- peak of fsdp.memory_stats().activations over one step (a collection before it, so only that step's
-- tensors count), the largest over the timed steps. Step time: the median of the timed steps after
-- one untimed step; the two variants take turns step by step, so machine noise hits both alike.
-- With every block checkpointed, a block's activations live only from its rerun in backward to the
-- end of its backward, and between steps of forward only its input does; what stays is outside the
-- blocks (embeddings, the final norm, the logits and their gradient).
local root = (arg and arg[0] or ""):match("^(.*)/bench/[^/]*$") or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. root .. "/bench/?.lua;" .. package.path
package.cpath = root .. "/?.so;" .. package.cpath
local fsdp = require "fsdp"
local nn, F, optim = fsdp.nn, fsdp.nn.functional, fsdp.optim
local models = require "models"
local U = require "util"

local opts = { models = "transformer,gpt", layers = "2,8", steps = 6, threads = 2 }
U.parse_args("bench/checkpoint_memory.lua", opts, "[--models transformer,gpt] [--layers 2,8] [--steps S] [--threads N]")
fsdp.set_num_threads(tonumber(opts.threads))

local configs = {
  transformer = { vocab = 1000, d = 256, heads = 4, T = 128, B = 16 },
  gpt = { vocab = 512, d = 384, heads = 6, T = 256, B = 8 },
}

local function build(c, layers, ckpt)
  fsdp.manual_seed(0)
  local model = models.Transformer(c.vocab, c.d, c.heads, layers, c.T)
  if ckpt then for _, b in ipairs(model.blocks:children()) do nn.Checkpoint(b) end end
  local opt = optim.AdamW(model:parameters(), { lr = 3e-4, weight_decay = 0.01 })
  fsdp.manual_seed(1)
  local x, y = fsdp.randint(0, c.vocab, { c.B, c.T }), fsdp.randint(0, c.vocab, { c.B * c.T })
  return function()
    collectgarbage()
    fsdp.reset_peak_memory_stats()
    local t0 = U.now_ms(1)
    opt:zero_grad()
    local loss = F.cross_entropy(model(x):view(c.B * c.T, c.vocab), y)
    loss:backward()
    opt:step()
    local ms = U.now_ms(1) - t0
    return ms, fsdp.memory_stats().activations.peak, loss:item()
  end
end

local median = U.median
local MB = 1024 * 1024

print(("activation checkpointing, every block: %d thread(s), %d timed steps each (median), CPU: %s")
  :format(opts.threads, opts.steps, U.cpu_model()))
print(("%-12s %6s %14s %14s %8s %12s %12s %8s  %s"):format("model", "blocks", "act MiB plain", "act MiB ckpt",
  "ratio", "ms plain", "ms ckpt", "cost", "loss plain/ckpt"))
for name in opts.models:gmatch("[^,]+") do
  local c = assert(configs[name], "unknown model " .. name)
  for layers in opts.layers:gmatch("%d+") do
    layers = tonumber(layers)
    local plain, ckpt = build(c, layers, false), build(c, layers, true)
    plain(); ckpt()  -- untimed: first-call costs
    local tp, tc, mp, mc, lp, lc = {}, {}, 0, 0
    for i = 1, opts.steps do
      local ms, act, l = plain()
      tp[i], mp, lp = ms, math.max(mp, act), l
      ms, act, l = ckpt()
      tc[i], mc, lc = ms, math.max(mc, act), l
    end
    local a, b = median(tp), median(tc)
    print(("%-12s %6d %14.2f %14.2f %7.2fx %12.2f %12.2f %7.2fx  %.4f/%.4f"):format(name, layers, mp / MB, mc / MB,
      mp / mc, a, b, b / a, lp, lc))
  end
end
