-- Train an MLP (784-256-10) on Fashion-MNIST with fsdp.nn and fsdp.optim, single process.
--
--   luajit examples/mlp.lua [--epochs N] [--batch-size B] [--lr LR] [--optim adam|sgd]
--                           [--hidden H] [--data DIR] [--limit N] [--seed S]
--
-- Needs the data set: `apt-get install dataset-fashion-mnist` (or --data DIR holding the four
-- *-ubyte(.gz) files). Prints one line per epoch: mean training loss, test accuracy, timing (with a
-- live fsdp.progress line while the epoch runs on a terminal; fsdp.data.DataLoader batches).
-- Reaches ~85% test accuracy after one epoch with the defaults.
local root = (arg and arg[0] or ""):match("^(.*)/examples/[^/]*$") or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
package.cpath = root .. "/?.so;" .. package.cpath

local fsdp = require "fsdp"
local fm = require "fsdp.data.fashion_mnist"
local nn, optim = fsdp.nn, fsdp.optim
local F = nn.functional

-- ---- arguments ------------------------------------------------------------------------------------
local cfg = { epochs = 2, ["batch-size"] = 128, lr = nil, optim = "adam", hidden = 256, data = nil,
  limit = nil, seed = 0 }
local usage = "usage: luajit examples/mlp.lua [--epochs N] [--batch-size B] [--lr LR] [--optim adam|sgd] " ..
  "[--hidden H] [--data DIR] [--limit N] [--seed S]"
local numeric = { epochs = true, ["batch-size"] = true, lr = true, hidden = true, limit = true, seed = true }
local i = 1
while i <= #arg do
  local key = arg[i]:match("^%-%-([%w%-]+)$")
  if arg[i] == "-h" or arg[i] == "--help" then print(usage) os.exit(0) end
  local known = key and (cfg[key] ~= nil or key == "lr" or key == "data" or key == "limit")
  if not known or arg[i + 1] == nil then io.stderr:write(usage, "\n") os.exit(2) end
  local v = arg[i + 1]
  if numeric[key] then
    v = tonumber(v)
    if not v then io.stderr:write(("--%s expects a number, got %s\n"):format(key, arg[i + 1])) os.exit(2) end
  end
  cfg[key] = v
  i = i + 2
end
cfg.lr = cfg.lr or (cfg.optim == "sgd" and 0.05 or 1e-3)

local now = fsdp.perf_counter

-- ---- data -----------------------------------------------------------------------------------------
local t0 = now()
local ok, err = pcall(function()
  cfg.xtrain, cfg.ytrain = fm.load("train", { dir = cfg.data, limit = cfg.limit, normalize = true })
  cfg.xtest, cfg.ytest = fm.load("test", { dir = cfg.data, limit = cfg.limit, normalize = true })
end)
if not ok then io.stderr:write("mlp.lua: ", tostring(err), "\n") os.exit(1) end
local xtrain, ytrain, xtest, ytest = cfg.xtrain, cfg.ytrain, cfg.xtest, cfg.ytest
-- a new order every epoch (from the seed), batches taken by index_select of the rows
local train_loader = fsdp.data.DataLoader(fsdp.data.TensorDataset(xtrain, ytrain),
  { batch_size = cfg["batch-size"], shuffle = true, seed = cfg.seed })
local test_loader = fsdp.data.DataLoader(fsdp.data.TensorDataset(xtest, ytest), { batch_size = 1000 })
print(("Fashion-MNIST: %d train / %d test images from %s (%.2fs)"):format(xtrain:size(1), xtest:size(1),
  fm.find_dir(cfg.data), now() - t0))

-- ---- model and optimizer ------------------------------------------------------------------------------
fsdp.manual_seed(cfg.seed)
local model = nn.Sequential(
  nn.Flatten(),                      -- (B, 1, 28, 28) -> (B, 784)
  nn.Linear(784, cfg.hidden),
  nn.ReLU(),
  nn.Linear(cfg.hidden, 10))         -- logits (B, 10)
local opt
if cfg.optim == "sgd" then
  opt = optim.SGD(model:parameters(), { lr = cfg.lr, momentum = 0.9 })
elseif cfg.optim == "adam" then
  opt = optim.Adam(model:parameters(), { lr = cfg.lr })
else
  io.stderr:write("--optim must be adam or sgd\n") os.exit(2)
end
local nparams = 0
for _, p in ipairs(model:parameters()) do nparams = nparams + p:numel() end
print(("MLP 784-%d-10 (%d parameters), %s lr %g, batch %d, OMP_NUM_THREADS=%s"):format(cfg.hidden, nparams,
  cfg.optim, cfg.lr, cfg["batch-size"], os.getenv("OMP_NUM_THREADS") or "unset"))

-- ---- evaluation ------------------------------------------------------------------------------------------
local function accuracy(loader, n)
  return fsdp.no_grad(function()
    local correct = 0
    for xb, yb in loader() do
      local pred = model(xb):argmax(2)                -- (B) int64
      correct = correct + pred:eq(yb):sum():item()
    end
    return correct / n
  end)
end

-- ---- training --------------------------------------------------------------------------------------------
for epoch = 1, cfg.epochs do
  model:train()
  local te = now()
  local total, steps = 0, 0
  local bar = fsdp.progress(#train_loader, { desc = ("epoch %d"):format(epoch), unit = "step" })
  for xb, yb in train_loader() do
    local loss = F.cross_entropy(model(xb), yb)
    opt:zero_grad()
    loss:backward()
    opt:step()
    total, steps = total + loss:item(), steps + 1
    bar:update(1, { loss = total / steps })
  end
  local train_s = now() - te
  model:eval()
  local ta = now()
  local acc = accuracy(test_loader, xtest:size(1))
  bar:close(("epoch %d  train loss %.4f  test acc %.2f%%  time %.2fs (train %.2fs = %.2f ms/step, eval %.2fs)")
    :format(epoch, total / steps, 100 * acc, now() - te, train_s, 1e3 * train_s / steps, now() - ta))
end
