-- The three golden models of tests/golden/gen.py, written with fsdp.nn.
-- Parameter names are identical to PyTorch's state_dict keys, so
--   model:load_state_dict(fsdp.load("tests/golden/mlp_init.safetensors"))
-- loads the weights PyTorch started from.
--
--   local models = dofile "tests/golden/models.lua"   (or require "golden.models" with tests/ on the path)
--   models.mlp(), models.convnet(), models.gpt{vocab = 50, block_size = 16, d = 32, n_head = 4, n_layer = 2}
local fsdp = require "fsdp"
local nn, F = fsdp.nn, fsdp.nn.functional

local M = {}

-- (a) MLP: 64 -> 32 -> 32 -> 10
function M.mlp()
  return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
end

-- (b) conv net on (N, 1, 12, 12)
function M.convnet()
  return nn.Sequential(
    nn.Conv2d(1, 4, 3, { padding = 1 }), nn.ReLU(),
    nn.Conv2d(4, 8, 3, { stride = 2, padding = 1 }), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
end

-- (c) a small causal transformer LM (GPT-2 layout, pre-norm blocks)
local Attention = nn.Module:extend("Attention")
function Attention:__init(d, n_head)
  self.n_head = n_head
  self.qkv = nn.Linear(d, 3 * d)
  self.proj = nn.Linear(d, d)
end
function Attention:forward(x)                     -- (B, T, C)
  local B, T, C = x:size(1), x:size(2), x:size(3)
  local nh = self.n_head
  local hd = C / nh
  local qkv = self.qkv(x)                         -- (B, T, 3C)
  local function heads(i)                         -- i-th third -> (B, nh, T, hd)
    return qkv:narrow(3, i * C + 1, C):reshape(B, T, nh, hd):transpose(2, 3)
  end
  local y = F.scaled_dot_product_attention(heads(0), heads(1), heads(2), { is_causal = true })
  y = y:transpose(2, 3):reshape(B, T, C)          -- (B, T, C)
  return self.proj(y)
end

local MLP = nn.Module:extend("MLP")
function MLP:__init(d)
  self.fc = nn.Linear(d, 4 * d)
  self.act = nn.GELU()
  self.proj = nn.Linear(4 * d, d)
end
function MLP:forward(x) return self.proj(self.act(self.fc(x))) end

local Block = nn.Module:extend("Block")
function Block:__init(d, n_head)
  self.ln1 = nn.LayerNorm(d)
  self.attn = Attention(d, n_head)
  self.ln2 = nn.LayerNorm(d)
  self.mlp = MLP(d)
end
function Block:forward(x)
  x = x + self.attn(self.ln1(x))
  return x + self.mlp(self.ln2(x))
end

local GPT = nn.Module:extend("GPT")
function GPT:__init(cfg)
  cfg = cfg or {}
  local vocab, block_size, d = cfg.vocab or 50, cfg.block_size or 16, cfg.d or 32
  local n_head, n_layer = cfg.n_head or 4, cfg.n_layer or 2
  self.wte = nn.Embedding(vocab, d)
  self.wpe = nn.Embedding(block_size, d)
  local blocks = {}
  for i = 1, n_layer do blocks[i] = Block(d, n_head) end
  self.blocks = nn.Sequential(unpack(blocks))
  self.ln_f = nn.LayerNorm(d)
  self.head = nn.Linear(d, vocab)
end
function GPT:forward(idx)                         -- (B, T) int64
  local T = idx:size(2)
  local pos = fsdp.arange(T):to(idx.device)       -- (T,) int64: 0 .. T-1, where idx is
  local x = self.wte(idx) + self.wpe(pos)         -- (B, T, C)
  x = self.blocks(x)
  return self.head(self.ln_f(x))                  -- (B, T, vocab)
end
M.GPT = GPT

function M.gpt(cfg) return GPT(cfg) end

-- next-token loss: logits (B, T, V), targets (B, T)
function M.lm_loss(logits, y)
  local V = logits:size(3)
  return F.cross_entropy(logits:reshape(-1, V), y:reshape(-1))
end

return M
