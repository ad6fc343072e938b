-- The GPT of examples/gpt.lua (nanoGPT's, PyTorch's state_dict names), as a module of its own so
-- that bench/big_model.lua trains the same model at a billion parameters:
--   local GPT = dofile("examples/gpt_model.lua")
--   local model = GPT(vocab, context, d, heads, layers[, untied])
-- token + position embedding, L pre-norm blocks (LayerNorm, causal self-attention through
-- F.scaled_dot_product_attention, LayerNorm, GELU MLP 4x), a final LayerNorm and the LM head, tied
-- to the token embedding unless untied. Initialisation: N(0, 0.02) for Linear and Embedding
-- weights, N(0, 0.02 / sqrt(2 L)) for the two residual projections of each block, zero biases --
-- in place, so a model built inside fsdp.meta records it and materialises the same values.
local fsdp = require "fsdp"
local nn, F = fsdp.nn, fsdp.nn.functional

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

return GPT
