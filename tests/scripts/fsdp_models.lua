-- Model builders for the FSDP test matrix (tests/scripts/fsdp_matrix.lua).
--
--   local models = dofile "tests/scripts/fsdp_models.lua"
--   local spec = models.nested     -- {build = fn() -> module, batch = fn(seed) -> x, y, loss = fn(out, y) -> loss}
--
-- Every builder is deterministic: it seeds the RNG itself, so two calls give identical
-- parameters (one copy stays unwrapped as the reference, the other is wrapped). Sizes are tiny
-- and deliberately odd (7, 13, 11, 3 ...) so that chunks are padded at world size 2 and 4 and
-- some pieces are empty (a bias of 3 elements at world size 4: chunk 1, rank 3 holds nothing).
-- batch(seed) gives the GLOBAL batch (GLOBAL_B rows, divisible by 1, 2 and 4); each rank
-- trains on its own slice of it.
local fsdp = require "fsdp"
local nn, F = fsdp.nn, fsdp.nn.functional

local M = {}
M.GLOBAL_B = 8

-- (1) four nested Linears, PyTorch's NestedWrappedModule style:
--     Sequential(Linear, ReLU, Sequential(Linear, ReLU, Linear), ReLU, Linear)
--     names: 0.weight 0.bias 2.0.weight 2.0.bias 2.2.weight 2.2.bias 4.weight 4.bias
M.nested = {
  build = function()
    fsdp.manual_seed(11)
    return nn.Sequential(
      nn.Linear(7, 13), nn.ReLU(),
      nn.Sequential(nn.Linear(13, 11), nn.ReLU(), nn.Linear(11, 11)),
      nn.ReLU(),
      nn.Linear(11, 3))
  end,
  batch = function(seed)
    fsdp.manual_seed(1000 + seed)
    return fsdp.randn{M.GLOBAL_B, 7}, fsdp.randint(0, 3, {M.GLOBAL_B})
  end,
  loss = function(out, y) return F.cross_entropy(out, y) end,
}

-- (2) the conv model of the second report: model.trunk = Sequential(Block(1, 8), Block(8, 8)),
--     model.head = Sequential(AdaptiveAvgPool2d(1), Flatten(), Linear(8, 10))
local Block = nn.Module:extend("Block")
function Block:__init(cin, cout)
  self.conv = nn.Conv2d(cin, cout, 3, { padding = 1 })
  self.act = nn.ReLU()
end
function Block:forward(x) return self.act(self.conv(x)) end

local ConvNet = nn.Module:extend("ConvNet")
function ConvNet:__init()
  self.trunk = nn.Sequential(Block(1, 8), Block(8, 8))
  self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
end
function ConvNet:forward(x) return self.head(self.trunk(x)) end

M.conv = {
  build = function()
    fsdp.manual_seed(12)
    return ConvNet()
  end,
  batch = function(seed)
    fsdp.manual_seed(2000 + seed)
    return fsdp.randn{M.GLOBAL_B, 1, 5, 5}, fsdp.randint(0, 10, {M.GLOBAL_B})
  end,
  loss = function(out, y) return F.cross_entropy(out, y) end,
}

-- (3) a 2-block causal transformer: embeddings, pre-norm blocks (attention through
--     F.scaled_dot_product_attention with is_causal, GELU MLP, layer norms), final norm, head
local VOCAB, T, D, NH = 11, 6, 8, 2
-- the golden runs' GPT (tests/golden/models.lua), at these sizes
local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/scripts"
local golden = dofile(here .. "/../golden/models.lua")
local function Transformer()
  return golden.GPT { vocab = VOCAB, block_size = T, d = D, n_head = NH, n_layer = 2 }
end

M.transformer = {
  build = function()
    fsdp.manual_seed(13)
    return Transformer()
  end,
  batch = function(seed)
    fsdp.manual_seed(3000 + seed)
    return fsdp.randint(0, VOCAB, {M.GLOBAL_B, T}), fsdp.randint(0, VOCAB, {M.GLOBAL_B, T})
  end,
  loss = function(out, y) return F.cross_entropy(out:reshape(-1, VOCAB), y:reshape(-1)) end,
}

-- (4) usage models built around the nested one
-- a branch whose output never reaches the loss: model.aux runs every forward, its result is dropped
local Branchy = nn.Module:extend("Branchy")
function Branchy:__init()
  self.body = M.nested.build()
  self.aux = nn.Linear(7, 5)
end
function Branchy:forward(x)
  local _ = self.aux(x)  -- computed with grad enabled, never used
  return self.body(x)
end
M.branchy = {
  build = function() local m = Branchy(); return m end,
  batch = M.nested.batch, loss = M.nested.loss,
}

-- one module called twice in a forward: shared(relu(shared(inp(x))))
local Twice = nn.Module:extend("Twice")
function Twice:__init()
  fsdp.manual_seed(14)
  self.inp = nn.Linear(7, 9)
  self.shared = nn.Linear(9, 9)
  self.out = nn.Linear(9, 3)
end
function Twice:forward(x)
  local h = F.relu(self.inp(x))
  h = F.relu(self.shared(h))
  h = F.relu(self.shared(h))
  return self.out(h)
end
M.twice = {
  build = function() return Twice() end,
  batch = M.nested.batch, loss = M.nested.loss,
}

-- (5) weight tying, as GPT-2's: the output projection IS the token embedding (one parameter held
--     by two modules, core.tok and core.head); names core.tok.weight (= core.head.weight),
--     core.body.{0,2}.{weight,bias}, out.{weight,bias}
local TiedCore = nn.Module:extend("TiedCore")
function TiedCore:__init()
  self.tok = nn.Embedding(VOCAB, D)
  self.body = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh())
  self.head = nn.Linear(D, VOCAB, { bias = false })
  self.head.weight = self.tok.weight
end
function TiedCore:forward(x) return self.head(self.body(self.tok(x))) end
local Tied = nn.Module:extend("Tied")
function Tied:__init()
  self.core = TiedCore()
  self.out = nn.Linear(VOCAB, VOCAB)
end
function Tied:forward(x) return self.out(self.core(x)) end
M.tied = {
  build = function()
    fsdp.manual_seed(15)
    return Tied()
  end,
  batch = M.transformer.batch, loss = M.transformer.loss,
}

-- (6) a conv net with batch norms (issue 19): BatchNorm2d after each conv, BatchNorm1d in the head;
--     names trunk.{0,3}.{weight,bias}, trunk.{1,4}.{weight,bias,running_mean,running_var,
--     num_batches_tracked}, head.{2,5}.*, head.3.* (4 rows per BatchNorm at 2 ranks, 2 at 4)
--     With head_bn = false the head has no BatchNorm1d (bnconv2d): a rank's slice at 4 ranks is 2
--     rows, whose batch statistics make the gradient ill-conditioned (rounding grows ~1e3-fold)
local BNNet = nn.Module:extend("BNNet")
function BNNet:__init(head_bn)
  self.trunk = nn.Sequential(nn.Conv2d(1, 4, 3, { padding = 1 }), nn.BatchNorm2d(4), nn.ReLU(),
    nn.Conv2d(4, 4, 3, { padding = 1 }), nn.BatchNorm2d(4, { momentum = 0.3 }), nn.ReLU())
  if head_bn then  -- (no bias before a batch norm: its gradient is zero up to rounding)
    self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 6, { bias = false }),
      nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 10))
  else
    self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 10))
  end
end
function BNNet:forward(x) return self.head(self.trunk(x)) end
M.bnconv = {
  build = function()
    fsdp.manual_seed(16)
    return BNNet(true)
  end,
  batch = function(seed)
    fsdp.manual_seed(3000 + seed)
    return fsdp.randn{M.GLOBAL_B, 1, 5, 5} * 2 + 0.5, fsdp.randint(0, 10, {M.GLOBAL_B})
  end,
  loss = M.conv.loss,
}

M.bnconv2d = {
  build = function()
    fsdp.manual_seed(16)
    return BNNet(false)
  end,
  batch = M.bnconv.batch, loss = M.bnconv.loss,
}

return M
