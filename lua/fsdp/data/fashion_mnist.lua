-- fsdp.data.fashion_mnist: finds and loads Fashion-MNIST (Zalando, 28x28 grey images, 10 classes).
--
--   local fm = require "fsdp.data.fashion_mnist"
--   local x, y = fm.load("train", {dir = nil, limit = nil, normalize = true})
--       -- x float32 (N, 1, 28, 28), y int64 (N) with classes 0..9
--   for xb, yb in fm.batches(x, y, 128, {shuffle = true}) do ... end
--
-- Where the files are looked for, first hit wins:
--   opts.dir, then $FSDP_DATA_DIR, then $FASHION_MNIST_DIR, then the Debian package's
--   /usr/share/datasets/fashion-mnist (`apt-get install dataset-fashion-mnist`), then
--   ./data/fashion-mnist. In a directory, NAME.gz is preferred over a plain NAME.
local idx = require "fsdp.data.idx"
local fsdp = require "fsdp"

local M = {}

M.DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
M.MEAN, M.STD = 0.2860, 0.3530 -- of the training images, after scaling to [0, 1]
M.NUM_CLASSES = 10
M.classes = { "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
  "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot" }
M.files = {
  train = { images = "train-images-idx3-ubyte", labels = "train-labels-idx1-ubyte", size = 60000 },
  test  = { images = "t10k-images-idx3-ubyte",  labels = "t10k-labels-idx1-ubyte",  size = 10000 },
}
M.files.t10k = M.files.test

local function exists(path)
  if fsdp._not_regular_file(path) then return false end
  local f = io.open(path, "rb")
  if f then f:close() return true end
  return false
end

-- the path of one file of the data set in dir: NAME.gz, else NAME, else NAME.gz (for the error)
local function file_in(dir, name)
  local gz = dir .. "/" .. name .. ".gz"
  if exists(gz) then return gz end
  if exists(dir .. "/" .. name) then return dir .. "/" .. name end
  return gz
end

-- The directory to read from. An explicit dir is used as given (errors then name its files);
-- otherwise the first candidate that holds the data set (its t10k labels), else the Debian default.
function M.find_dir(dir)
  if dir then return (fsdp._path(dir, "fashion_mnist.find_dir", "dir"):gsub("/+$", "")) end
  local cands = { os.getenv("FSDP_DATA_DIR"), os.getenv("FASHION_MNIST_DIR"), M.DEFAULT_DIR, "data/fashion-mnist" }
  for i = 1, 4 do
    local d = cands[i]
    if d and d ~= "" and exists(file_in(d, M.files.test.labels)) then return (d:gsub("/+$", "")) end
  end
  return M.DEFAULT_DIR
end

-- paths of the images and labels files of a split ("train" or "test")
function M.paths(split, dir)
  if dir ~= nil then fsdp._path(dir, "fashion_mnist.paths", "dir") end
  local f = M.files[split or "train"]
  if not f then error(("fashion_mnist: unknown split %q (use \"train\" or \"test\")"):format(tostring(split)), 2) end
  dir = M.find_dir(dir)
  return file_in(dir, f.images), file_in(dir, f.labels)
end

-- Loads a split. opts: dir (data directory), limit (first N samples), normalize (true: with the
-- data set's mean/std; a table {mean=, std=}; default false: pixels in [0, 1]).
-- Returns images float32 (N, 1, 28, 28) and labels int64 (N).
function M.load(split, opts)
  opts = opts or {}
  if opts.dir ~= nil then fsdp._path(opts.dir, "fashion_mnist.load", "opts.dir") end
  local ipath, lpath = M.paths(split, opts.dir)
  local mean, std
  if opts.normalize == true then mean, std = M.MEAN, M.STD
  elseif type(opts.normalize) == "table" then mean, std = opts.normalize.mean, opts.normalize.std end
  local labels = idx.read_labels(lpath, { limit = opts.limit, num_classes = M.NUM_CLASSES })
  local images = idx.read_images(ipath, { limit = opts.limit, mean = mean, std = std })
  local s = images:shape()
  if s[3] ~= 28 or s[4] ~= 28 then
    error(("fashion_mnist: %s holds %dx%d images, expected 28x28"):format(ipath, s[3], s[4]), 2)
  end
  if s[1] ~= labels:numel() then
    error(("fashion_mnist: %s has %d images but %s has %d labels"):format(ipath, s[1], lpath, labels:numel()), 2)
  end
  return images, labels
end

-- Mini-batches over (x, y) along the first dim: `for xb, yb, i in fm.batches(x, y, B, opts)`.
-- opts.shuffle: a new random order each call (fsdp.randperm, so fsdp.manual_seed fixes it);
-- opts.drop_last: skip a final short batch. Unshuffled batches are views (no copy).
function M.batches(x, y, batch_size, opts)
  opts = opts or {}
  local n = x:size(1)
  assert(y:size(1) == n, "fashion_mnist.batches: x and y differ in their first dim")
  assert(batch_size >= 1, "fashion_mnist.batches: batch_size must be >= 1")
  local perm = opts.shuffle and fsdp.randperm(n) or nil
  local nb = opts.drop_last and math.floor(n / batch_size) or math.ceil(n / batch_size)
  local b = 0
  return function()
    if b >= nb then return nil end
    local start = b * batch_size + 1
    local len = math.min(batch_size, n - start + 1)
    b = b + 1
    if perm then
      local ix = perm:narrow(1, start, len)
      return x:index_select(1, ix), y:index_select(1, ix), b
    end
    return x:narrow(1, start, len), y:narrow(1, start, len), b
  end
end

return M
