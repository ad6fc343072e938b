-- Our side of the single-GPU benchmark (issue 15 item 8; bench/torch_gpt2.py is PyTorch's, and
-- tools/gpu_check.sh runs both): a GPT-2 124M-shaped model (12 blocks, d 768, 12 heads, T 1024,
-- vocab 50304, the LM head tied to the token embedding, no head bias) trained with AdamW, printing
-- one JSON line: tokens/s, MFU as (6 N + 6 L d T) FLOPs per token against the GPU's bf16 peak, and
-- the device's peak bytes per category.
--   luajit bench/gpu_gpt.lua [--mode fsdp|bf16|fp32] [--config gpt2|1b] [--batch 8] [--steps 10]
--                            [--device cuda] [--offload] [--tiny] [--peak-tflops 989]
-- --config 1b: 24 blocks, d 2048, 16 heads (1.3 B parameters), issue 16's larger configuration.
-- --offload (with --mode fsdp): CPU offload, the shards, gradient pieces and AdamW's step on the
-- CPU (FSDP2's CPUOffloadPolicy; bench/torch_gpt2.py --offload).
-- --mode fsdp (default): every block and the root an FSDP unit with mixed precision (float32
-- master weights, bfloat16 compute, float32 reduce), one rank: PyTorch's FSDP2 with
-- MixedPrecisionPolicy, and close to its autocast eager run. bf16: the model itself in bfloat16.
-- --tiny (2 blocks, d 64, T 64, vocab 512) checks the script on a CPU: --device cpu --tiny, or on
-- the test double of a GPU: luajit tests/scripts/on_testdev.lua bench/gpu_gpt.lua --tiny.
local root = (arg and arg[0] or ""):match("^(.*)/bench/[^/]*$") or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. root .. "/bench/?.lua;" .. package.path
package.cpath = root .. "/?.so;" .. package.cpath
local fsdp = require "fsdp"
local models = require "models"
local U = require "util"
local nn, F = fsdp.nn, fsdp.nn.functional

local opts = { mode = "fsdp", config = "gpt2", batch = 8, steps = 10, device = "cuda", ["peak-tflops"] = 989 }
U.parse_args("bench/gpu_gpt.lua", opts, "[--mode fsdp|bf16|fp32] [--config gpt2|1b] [--batch B] [--steps S] "
  .. "[--device cuda|cpu] [--offload] [--tiny] [--peak-tflops T]",
  { ["--tiny"] = function(o) o.tiny = true end, ["--offload"] = function(o) o.offload = true end })
if opts.offload and opts.mode ~= "fsdp" then error("gpu_gpt.lua: --offload needs --mode fsdp", 0) end
opts.peak = opts["peak-tflops"]
if opts.device == "cuda" then
  local there = false
  for _, d in ipairs(fsdp.backends()) do there = there or d == "cuda" end
  if not there then error("gpu_gpt.lua: CUDA is not available here: " .. fsdp.cuda.why_not(), 0) end
end

local configs = { gpt2 = { L = 12, d = 768, h = 12, T = 1024, V = 50304, name = "gpt2-124M" },
  ["1b"] = { L = 24, d = 2048, h = 16, T = 1024, V = 50304, name = "gpt-1.3B" } }
local c = opts.tiny and { L = 2, d = 64, h = 4, T = 64, V = 512, name = "tiny" } or configs[opts.config]
if not c then error(("gpu_gpt.lua: unknown --config %s (gpt2, 1b)"):format(tostring(opts.config)), 0) end
fsdp.manual_seed(0)
local model = models.Transformer(c.V, c.d, c.h, c.L, c.T)
model.head = nn.Linear(c.d, c.V, { bias = false })
model.head.weight = model.tok.weight -- tied, as GPT-2 (one parameter, two modules of the root unit)
fsdp.no_grad(function() -- GPT-2's initialisation (bench/torch_gpt2.py does the same)
  for _, m in ipairs(model:modules()) do
    if m.weight and (m.in_features or m.num_embeddings) then nn.init.normal_(m.weight, 0, 0.02) end
    if m.bias and m.in_features then m.bias:zero_() end
  end
end)
local n_params = 0
for _, p in ipairs(model:parameters()) do n_params = n_params + p:numel() end
n_params = n_params - c.T * c.d -- without the position embedding, as the MFU formula counts

if opts.mode == "bf16" then
  model:to { device = opts.device, dtype = "bfloat16" }
else
  model:to(opts.device)
end
if opts.mode == "fsdp" then
  local mp = { mixed_precision = { param = "bf16", reduce = "fp32" }, offload = opts.offload }
  for _, b in ipairs(model.blocks:children()) do fsdp.wrap(b, mp) end
  model = fsdp.wrap(model, mp)
end
local opt = fsdp.optim.AdamW(model:parameters(), { lr = 3e-4, weight_decay = 0.1 })
local B, T, V = opts.batch, c.T, c.V
local x = fsdp.randint(0, V, { B, T }):to(opts.device)
local y = fsdp.randint(0, V, { B, T }):to(opts.device)
local function sync() if opts.device == "cuda" then fsdp.cuda.synchronize() end end
local function step()
  opt:zero_grad()
  local logits = model(x)
  local loss = F.cross_entropy(logits:view(B * T, V):to("float32"), y:view(B * T))
  loss:backward()
  opt:step()
  return loss
end

for _ = 1, 3 do step() end
sync()
fsdp.reset_peak_memory_stats()
local t0 = U.seconds()
local loss
for _ = 1, opts.steps do loss = step() end
sync()
local dt = (U.seconds() - t0) / opts.steps
local tok_s = B * T / dt
local tflops = tok_s * (6 * n_params + 6 * c.L * c.d * T) / 1e12
local mem = fsdp.memory_stats(opts.device)
local peak = 0
for _, v in pairs(mem) do peak = peak + v.peak end
print(("{\"model\": \"%s\", \"mode\": \"%s%s\", \"device\": \"%s\", \"batch\": %d, \"T\": %d, \"ms_per_step\": %.2f, "
  .. "\"tokens_per_s\": %d, \"model_tflops\": %.1f, \"mfu_vs_peak\": %.3f, \"params\": %d, \"loss\": %.3f, "
  .. "\"peak_bytes_summed\": %d, \"peak_params\": %d, \"peak_grads\": %d, \"peak_optimizer\": %d, "
  .. "\"peak_activations\": %d, \"gpu\": \"%s\"}")
  :format(c.name, opts.mode, opts.offload and "+offload" or "", opts.device, B, T, dt * 1e3, math.floor(tok_s), tflops,
    tflops / opts.peak, n_params, loss:item(), peak, mem.params.peak, mem.grads.peak, mem.optimizer.peak,
    mem.activations.peak, opts.device == "cuda" and fsdp.cuda.get_device_name() or "-"))
