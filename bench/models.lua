-- The benchmark models, ours: identical to bench/torch_models.py (sizes, layer order, optimizer
-- settings). Each case returns the model, its optimizer and a function computing the loss of one
-- fixed random batch, so a training step is `opt:zero_grad(); loss_fn():backward(); opt:step()`.
local fsdp = require "fsdp"
local nn, optim = fsdp.nn, fsdp.optim
local F = nn.functional

local M = {}

M.order = { "mlp", "conv", "transformer", "small", "resnet", "gpt" }
M.describe = {
  mlp = "MLP 784-1024-1024-10, batch 256, SGD momentum",
  conv = "ConvNet 1-32-64 3x3 on 28x28, batch 64, Adam",
  transformer = "Transformer d256 h4 L2 T128 V1000, batch 16, AdamW",
  small = "24 x (Linear 32-32, LayerNorm, ReLU), batch 16, SGD",
  resnet = "ResNet 64-128-256 on 3x56x56, no BN, batch 8, SGD mom.",
  gpt = "GPT d384 h6 L2 T256 V512, batch 8, AdamW",
}
-- the step-time target ours / (faster torch), per model (bench/run.lua's default otherwise)
M.target = { conv = 0.70, resnet = 0.70 }
-- timed steps per round where the default would take too long (bench/run.lua --iters overrides)
M.iters = { resnet = 5, gpt = 5 }

function M.mlp()
  return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
    nn.Linear(1024, 10))
end

-- many small layers: the step time is mostly per-op overhead (Lua's, or Python's for torch)
function M.small()
  local layers = {}
  for _ = 1, 24 do
    layers[#layers + 1] = nn.Linear(32, 32)
    layers[#layers + 1] = nn.LayerNorm(32)
    layers[#layers + 1] = nn.ReLU()
  end
  layers[#layers + 1] = nn.Linear(32, 10)
  return nn.Sequential(unpack(layers))
end

function M.convnet()
  return nn.Sequential(nn.Conv2d(1, 32, 3, { padding = 1 }), nn.ReLU(),
    nn.Conv2d(32, 64, 3, { padding = 1 }), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
end

-- ---- a small ResNet: the convolution shapes people train (3->64 stem, 64/128/256 channels at
-- 56/28/14, stride-2 3x3 and 1x1 shortcut convolutions), without BatchNorm (fsdp has none yet) --
-- a basic block: 3x3 conv (stride s), ReLU, 3x3 conv, plus the input -- through a 1x1 stride-s
-- conv when the shape changes -- then ReLU
local BasicBlock = nn.Module:extend("BasicBlock")
function BasicBlock:__init(cin, cout, stride)
  self.conv1 = nn.Conv2d(cin, cout, 3, { stride = stride, padding = 1 })
  self.relu = nn.ReLU()
  self.conv2 = nn.Conv2d(cout, cout, 3, { padding = 1 })
  if stride ~= 1 or cin ~= cout then self.shortcut = nn.Conv2d(cin, cout, 1, { stride = stride }) end
end
function BasicBlock:forward(x)
  local h = self.conv2(self.relu(self.conv1(x)))
  return self.relu(h + (self.shortcut and self.shortcut(x) or x))
end

-- (B, 3, 56, 56) -> stem 64 @ 56 -> 64 @ 56 -> 128 @ 28 -> 128 @ 28 -> 256 @ 14 -> 256 @ 14 -> 10
function M.resnet()
  return nn.Sequential(nn.Conv2d(3, 64, 3, { padding = 1 }), nn.ReLU(),
    BasicBlock(64, 64, 1), BasicBlock(64, 128, 2), BasicBlock(128, 128, 1),
    BasicBlock(128, 256, 2), BasicBlock(256, 256, 1),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10))
end

-- ---- a small GPT: pre-norm blocks, causal self-attention, GELU MLP 4x ------------------------------
local Attention = nn.Module:extend("Attention")
function Attention:__init(d, heads)
  self.heads = heads
  self.qkv = nn.Linear(d, 3 * d)
  self.proj = nn.Linear(d, d)
end
function Attention:forward(x) -- (B, T, d)
  local s = x:shape()
  local B, T, d, H = s[1], s[2], s[3], self.heads
  local qkv = self.qkv(x) -- (B, T, 3d)
  local function head(i) -- (B, H, T, hd)
    return qkv:narrow(3, i * d + 1, d):reshape(B, T, H, d / H):transpose(2, 3)
  end
  local y = F.scaled_dot_product_attention(head(0), head(1), head(2), { causal = true })
  return self.proj(y:transpose(2, 3):reshape(B, T, d))
end

local Block = nn.Module:extend("Block")
function Block:__init(d, heads)
  self.ln1 = nn.LayerNorm(d)
  self.attn = Attention(d, heads)
  self.ln2 = nn.LayerNorm(d)
  self.fc = nn.Linear(d, 4 * d)
  self.act = nn.GELU()
  self.out = nn.Linear(4 * d, d)
end
function Block:forward(x)
  x = x + self.attn(self.ln1(x))
  return x + self.out(self.act(self.fc(self.ln2(x))))
end

local Transformer = nn.Module:extend("Transformer")
function Transformer:__init(vocab, d, heads, layers, seq)
  self.tok = nn.Embedding(vocab, d)
  self.pos = nn.Embedding(seq, d)
  local blocks = {}
  for i = 1, layers do blocks[i] = Block(d, heads) end
  self.blocks = nn.Sequential(unpack(blocks))
  self.ln = nn.LayerNorm(d)
  self.head = nn.Linear(d, vocab)
end
function Transformer:forward(idx) -- (B, T) int64
  local T = idx:size(2)
  local x = self.tok(idx) + self.pos(fsdp.arange(T):to(idx.device))
  return self.head(self.ln(self.blocks(x))) -- (B, T, vocab)
end
M.Transformer = Transformer

-- the two language models: one builder, two sizes (vocab, width, heads, blocks, sequence, batch)
local lm = {
  transformer = { vocab = 1000, d = 256, heads = 4, layers = 2, T = 128, B = 16 },
  gpt = { vocab = 512, d = 384, heads = 6, layers = 2, T = 256, B = 8 },
}

-- ---- the step's linear-layer GEMMs (bench/gemm_floor.lua) --------------------------------------------
-- rows: the rows of each Linear's input in one step (the batch, or batch x sequence); the MLP's
-- first Linear reads the data batch, which needs no gradient, so it has no input-grad GEMM.
local rows = { mlp = 256, conv = nil, transformer = lm.transformer.B * lm.transformer.T, gpt = lm.gpt.B * lm.gpt.T }
local data_linear = { mlp = 1 }

-- The GEMMs of one training step's Linear layers, as { ta, tb, M, N, K } (C (M, N) = op(A) op(B),
-- inner size K), in module order: forward y = x w^T, input grad gx = gy w, weight grad gw = gy^T x.
-- Attention's products and everything else are left out. nil for a model without Linear GEMMs worth
-- counting (conv: its convolutions are not Linears).
function M.linear_gemms(name, model)
  local R = rows[name]
  if not R then return nil end
  local list, k = {}, 0
  for _, m in ipairs(model:modules()) do
    if m.in_features and m.out_features and m.weight then
      k = k + 1
      local i, o = m.in_features, m.out_features
      list[#list + 1] = { false, true, R, o, i }    -- y (R, o) = x (R, i) w^T
      if data_linear[name] ~= k then
        list[#list + 1] = { false, false, R, i, o } -- gx (R, i) = gy (R, o) w (o, i)
      end
      list[#list + 1] = { true, false, o, i, R }    -- gw (o, i) = gy^T (o, R) x (R, i)
    end
  end
  return list
end

-- ---- cases ---------------------------------------------------------------------------------------------
function M.case(name)
  fsdp.manual_seed(0)
  local model, opt, loss_fn
  if name == "mlp" then
    model = M.mlp()
    opt = optim.SGD(model:parameters(), { lr = 0.01, momentum = 0.9 })
    local x, y = fsdp.randn(256, 784), fsdp.randint(0, 10, { 256 })
    loss_fn = function() return F.cross_entropy(model(x), y) end
  elseif name == "conv" then
    model = M.convnet()
    opt = optim.Adam(model:parameters(), { lr = 1e-3 })
    local x, y = fsdp.randn(64, 1, 28, 28), fsdp.randint(0, 10, { 64 })
    loss_fn = function() return F.cross_entropy(model(x), y) end
  elseif name == "resnet" then
    model = M.resnet()
    opt = optim.SGD(model:parameters(), { lr = 0.01, momentum = 0.9 })
    local x, y = fsdp.randn(8, 3, 56, 56), fsdp.randint(0, 10, { 8 })
    loss_fn = function() return F.cross_entropy(model(x), y) end
  elseif lm[name] then
    local c = lm[name]
    local vocab, B, T = c.vocab, c.B, c.T
    model = Transformer(vocab, c.d, c.heads, c.layers, T)
    opt = optim.AdamW(model:parameters(), { lr = 3e-4, weight_decay = 0.01 })
    local x, y = fsdp.randint(0, vocab, { B, T }), fsdp.randint(0, vocab, { B, T })
    loss_fn = function() return F.cross_entropy(model(x):view(B * T, vocab), y:view(B * T)) end
  elseif name == "small" then
    model = M.small()
    opt = optim.SGD(model:parameters(), { lr = 0.01, momentum = 0.9 })
    local x, y = fsdp.randn(16, 32), fsdp.randint(0, 10, { 16 })
    loss_fn = function() return F.cross_entropy(model(x), y) end
  else
    error(("bench/models.lua: unknown model %q (%s)"):format(tostring(name), table.concat(M.order, ", ")), 2)
  end
  return model, opt, loss_fn
end

return M
