-- Activation checkpointing under FSDP, at any world size: the same model trained twice in one job,
-- without checkpointing and with it, from the same weights, data and RNG seeds, must give the same
-- losses and the same gradients (bit for bit: the rerun repeats the same ops on the same values,
-- dropout included), with every unit idle after each step. Layouts (arg[1]):
--   unit      each block an FSDP unit with {checkpoint = true} (units around checkpointed forwards)
--   around    nn.Checkpoint around the trunk, whose blocks are FSDP units (a region around units)
--   inside    each block a unit whose forward checkpoints part of itself with fsdp.checkpoint
-- Prints "act_ckpt <layout> OK rank R steps S act_peak A B" (activation peaks without and with).
local fsdp = require "fsdp"
local nn, F = fsdp.nn, fsdp.nn.functional
fsdp.init()
local rank, N = fsdp.rank(), fsdp.world_size()
local layout = arg[1] or "unit"

local D, H, T, Bsz, STEPS = 64, 256, 32, 8, 3

local Block = nn.Module:extend("Block")
function Block:__init(inner_ckpt)
  self.norm = nn.LayerNorm(D)
  self.up = nn.Linear(D, H)
  self.drop = nn.Dropout(0.25)
  self.down = nn.Linear(H, D)
  self.inner_ckpt = inner_ckpt
end
function Block:mlp(x) return self.down(self.drop(F.gelu(self.up(x)))) end
function Block:forward(x)
  local h = self.norm(x)
  if self.inner_ckpt then return x + fsdp.checkpoint(self.mlp, self, h) end
  return x + self:mlp(h)
end

local Net = nn.Module:extend("Net")
function Net:__init(inner_ckpt)
  self.emb = nn.Embedding(20, D)
  self.trunk = nn.Sequential(Block(inner_ckpt), Block(inner_ckpt), Block(inner_ckpt))
  self.head = nn.Linear(D, 20)
end
function Net:forward(tok) return self.head(self.trunk(self.emb(tok))) end

local function build(ckpt)
  fsdp.manual_seed(11)
  local m = Net(ckpt and layout == "inside")
  for _, b in ipairs(m.trunk:children()) do fsdp.wrap(b, { checkpoint = ckpt and layout == "unit" }) end
  if ckpt and layout == "around" then nn.Checkpoint(m.trunk) end
  fsdp.wrap(m)
  return m, fsdp.optim.AdamW(m:parameters(), { lr = 1e-2 })
end

local function fail(msg) error(("rank %d %s: %s"):format(rank, layout, msg), 0) end
local plain, plain_opt = build(false)
local ckpt, ckpt_opt = build(true)
fsdp.manual_seed(100 + rank)
local tok = fsdp.randint(0, 20, { Bsz, T })
local tgt = fsdp.randint(0, 20, { Bsz * T })

local function step(m, opt, s)
  fsdp.manual_seed(1000 * s + rank)  -- dropout's draws: the same for both models
  collectgarbage()  -- (the peak counts this step's activations, not what earlier steps left)
  fsdp.reset_peak_memory_stats()
  opt:zero_grad()
  local loss = F.cross_entropy(m(tok):view(-1, 20), tgt)
  loss:backward()
  local peak = fsdp.memory_stats().activations.peak
  local g = {}
  for name, p in m:named_parameters() do g[name] = p.grad and p.grad:clone() end
  opt:step()
  if not fsdp.all_idle() then fail("a unit is not idle after step " .. s) end
  return loss:item(), g, peak
end

local peaks = { 0, 0 }
for s = 1, STEPS do
  local la, ga, pa = step(plain, plain_opt, s)
  local lb, gb, pb = step(ckpt, ckpt_opt, s)
  peaks[1], peaks[2] = math.max(peaks[1], pa), math.max(peaks[2], pb)
  if la ~= lb then fail(("step %d: loss %.9g without checkpointing, %.9g with"):format(s, la, lb)) end
  for name, g in pairs(ga) do
    local h = gb[name]
    if not h then fail(("step %d: %s has no gradient with checkpointing"):format(s, name)) end
    local d = (g - h):abs():max():item()
    if d ~= 0 then fail(("step %d: the gradient of %s differs by %.3g with checkpointing"):format(s, name, d)) end
  end
end
print(("act_ckpt %s OK rank %d steps %d act_peak %d %d"):format(layout, rank, STEPS, peaks[1], peaks[2]))
