-- PyTorch's FSDP tutorial (pytorch.org/tutorials/intermediate/FSDP_tutorial.html) with its model made a
-- transformer, ported line by line: a Fashion-MNIST image read as 28 rows of 28 pixels, each row a
-- token -> nn.TransformerEncoder (the encoder layers wrapped by class, PyTorch's
-- transformer_auto_wrap_policy) -> the mean over tokens -> 10 classes.
--
--   luajit examples/transformer.lua                 one process: the reference (nn.utils clipping)
--   bin/fsdprun -n 2 examples/transformer.lua       FSDP on 2 ranks (fsdp.clip_grad_norm)
--   flags: --epochs N (2), --batch-size B (64, the global batch), --limit N (4096 training images),
--          --lr LR (1e-3), --seed S (1)
--
-- Both print the same lines: the loss every 8 steps, then per epoch the tutorial's "Train Epoch" and
-- "Test set" lines, in float32 rounding of each other (tests/tools/examples_spec.lua compares them).
-- Dropout is 0: a rank draws the dropout masks of its own slice, one process those of the whole
-- batch, so with dropout the two runs would differ by design. Needs `dataset-fashion-mnist`.
local root = (arg and arg[0] or ""):match("^(.*)/examples/[^/]*$") or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
package.cpath = root .. "/?.so;" .. package.cpath

local fsdp = require "fsdp"
local fm = require "fsdp.data.fashion_mnist"
local nn, optim, data = fsdp.nn, fsdp.optim, fsdp.data
local F = nn.functional

local parser = fsdp.argparse.ArgumentParser { prog = "transformer.lua",
  description = "PyTorch's FSDP tutorial with a transformer encoder, on Fashion-MNIST" }
parser:add_argument("--epochs", { type = "int", default = 2, help = "epochs to train" })
parser:add_argument("--batch-size", { type = "int", default = 64, help = "the global batch (split over the ranks)" })
parser:add_argument("--limit", { type = "int", default = 4096, help = "training images (the first N)" })
parser:add_argument("--lr", { type = "float", default = 1e-3, help = "Adam's learning rate" })
parser:add_argument("--seed", { type = "int", default = 1, help = "random seed" })
local args = parser:parse_args(arg)

-- class Net(nn.Module): rows of the image as tokens, a transformer encoder, a linear head
local D_MODEL, NHEAD, LAYERS = 32, 4, 2
local Net = nn.Module:extend("Net")
function Net:__init()
  self.embed = nn.Linear(28, D_MODEL)
  self.pos = nn.Parameter(fsdp.randn(1, 28, D_MODEL) * 0.02)
  local layer = nn.TransformerEncoderLayer(D_MODEL, NHEAD, { dim_feedforward = 64, dropout = 0, batch_first = true })
  self.encoder = nn.TransformerEncoder(layer, LAYERS, { norm = nn.LayerNorm(D_MODEL) })
  self.fc = nn.Linear(D_MODEL, 10)
end
function Net:forward(x)
  local h = self.embed(x:view(x:size(1), 28, 28)) + self.pos  -- (B, 28 tokens, D_MODEL)
  h = self.encoder(h)
  return F.log_softmax(self.fc(h:mean(2)), -1)
end

-- def train(args, model, rank, world_size, train_loader, optimizer, epoch, sampler=None)
local function train(model, rank, world_size, train_loader, optimizer, epoch, sampler)
  model:train()
  local ddp_loss = fsdp.zeros(2)
  sampler:set_epoch(epoch)
  local batch_idx = 0
  for xb, yb in train_loader() do
    batch_idx = batch_idx + 1
    optimizer:zero_grad()
    local output = model(xb)
    local loss = F.nll_loss(output, yb)
    loss:backward()
    if world_size > 1 then
      fsdp.clip_grad_norm(model, 1.0)                      -- FSDP's model.clip_grad_norm_(1.0)
    else
      nn.utils.clip_grad_norm_(model:parameters(), 1.0)    -- torch.nn.utils.clip_grad_norm_
    end
    optimizer:step()
    local step_loss = fsdp.tensor({ loss:item() })
    if world_size > 1 then fsdp.all_reduce(step_loss, "avg") end  -- the global batch's mean loss
    if rank == 0 and batch_idx % 8 == 0 then print(("step %d  loss %.6f"):format(batch_idx, step_loss:item())) end
    ddp_loss = ddp_loss + fsdp.tensor({ loss:item() * xb:size(1), xb:size(1) })
  end
  if world_size > 1 then fsdp.all_reduce(ddp_loss, "sum") end
  local t = ddp_loss:tolist()
  if rank == 0 then print(("Train Epoch: %d \tLoss: %.6f"):format(epoch, t[1] / t[2])) end
end

-- def test(model, rank, world_size, test_loader)
local function test(model, rank, world_size, test_loader)
  model:eval()
  local ddp_loss = fsdp.zeros(3)  -- summed loss, correct, count
  fsdp.no_grad(function()
    for xb, yb in test_loader() do
      local output = model(xb)
      local pred = output:argmax(2)
      local correct = pred:eq(yb):sum():item()
      ddp_loss = ddp_loss + fsdp.tensor({ F.nll_loss(output, yb):item() * xb:size(1), correct, xb:size(1) })
    end
  end)
  if world_size > 1 then fsdp.all_reduce(ddp_loss, "sum") end
  local t = ddp_loss:tolist()
  if rank == 0 then
    print(("Test set: Average loss: %.4f, Accuracy: %d/%d (%.2f%%)"):format(t[1] / t[3], t[2], t[3], 100 * t[2] / t[3]))
  end
end

-- def fsdp_main(rank, world_size, args)
fsdp.init()
local rank, world_size = fsdp.rank(), fsdp.world_size()
if args.batch_size % world_size ~= 0 then
  fsdp.exit("--batch-size %d must be a multiple of the %d ranks", args.batch_size, world_size)
end
local x, y = fm.load("train", { limit = args.limit, normalize = true })
local xt, yt = fm.load("test", { limit = 1000, normalize = true })
local dataset1, dataset2 = data.TensorDataset(x, y), data.TensorDataset(xt, yt)
local sampler1 = data.DistributedSampler(dataset1, { rank = rank, num_replicas = world_size, shuffle = true, seed = args.seed })
local sampler2 = data.DistributedSampler(dataset2, { rank = rank, num_replicas = world_size })
local train_kwargs = { batch_size = args.batch_size / world_size, sampler = sampler1, num_workers = 2, pin_memory = true }
local test_kwargs = { batch_size = 250, sampler = sampler2, num_workers = 2, pin_memory = true }
local train_loader = data.DataLoader(dataset1, train_kwargs)
local test_loader = data.DataLoader(dataset2, test_kwargs)

fsdp.manual_seed(args.seed)
local model = Net()
if world_size > 1 then
  -- FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}))
  model = fsdp.auto_wrap(model, { module_classes = { nn.TransformerEncoderLayer } })
end
local optimizer = optim.Adam(model:parameters(), { lr = args.lr })
local scheduler = optim.lr_scheduler.StepLR(optimizer, { step_size = 1, gamma = 0.7 })
local t0 = fsdp.perf_counter()
for epoch = 1, args.epochs do
  train(model, rank, world_size, train_loader, optimizer, epoch, sampler1)
  test(model, rank, world_size, test_loader)
  scheduler:step()
end
if rank == 0 then
  print(("%s, %d rank%s: %.1fs"):format(world_size > 1 and "FSDP" or "one process", world_size,
    world_size > 1 and "s" or "", fsdp.perf_counter() - t0))
end
