-- Data loading: the IDX reader (gzipped and plain), the Fashion-MNIST loader and its batches,
-- the errors for missing / corrupt / truncated files, and the real data set when installed.
local ffi = require "ffi"
local fsdp = require "fsdp"
local H = require "helpers"
local idx = require "fsdp.data.idx"
local fm = require "fsdp.data.fashion_mnist"

local tmp
local function path(name) return tmp .. "/" .. name end


-- a synthetic Fashion-MNIST directory: n images whose pixel (i, r, c) is (7i + 3r + c) % 256
local function pixel(i, r, c) return (7 * i + 3 * r + c) % 256 end
local function make_dataset(dir, n, labels, opts)
  opts = opts or {}
  os.execute("mkdir -p '" .. dir .. "'")
  local px = {}
  for i = 0, n - 1 do for r = 0, 27 do for c = 0, 27 do px[#px + 1] = pixel(i, r, c) end end end
  local ext = opts.plain and "" or ".gz"
  idx.write(dir .. "/train-images-idx3-ubyte" .. ext, idx.IMAGES_MAGIC, { n, 28, 28 }, px)
  idx.write(dir .. "/train-labels-idx1-ubyte" .. ext, idx.LABELS_MAGIC, { #labels }, labels)
  idx.write(dir .. "/t10k-images-idx3-ubyte" .. ext, idx.IMAGES_MAGIC, { n, 28, 28 }, px)
  idx.write(dir .. "/t10k-labels-idx1-ubyte" .. ext, idx.LABELS_MAGIC, { #labels }, labels)
end

-- the process keeps working after an error: a fresh read gives the right values
local function still_works()
  local p = path("ok-labels.gz")
  idx.write(p, idx.LABELS_MAGIC, { 3 }, { 4, 0, 9 })
  assert.same({ 4, 0, 9 }, idx.read_labels(p):tolist())
  local x = fsdp.tensor({ 1, 2, 3 })
  H.assert_close(x + x, { 2, 4, 6 })
end

describe("idx reader", function()
  setup(function()
    tmp = os.tmpname()
    os.remove(tmp)
    assert(os.execute("mkdir -p '" .. tmp .. "'"))
  end)
  teardown(function() os.execute("rm -rf '" .. tmp .. "'") end)

  -- 3 images of 2x3 pixels
  local pix = { 0, 255, 51, 102, 1, 254,   10, 20, 30, 40, 50, 60,   255, 255, 0, 0, 128, 127 }

  for _, ext in ipairs { ".gz", "" } do
    it("reads images as float32 (N, 1, H, W) in [0, 1] (" .. (ext == "" and "plain" or "gzip") .. ")", function()
      local p = path("img" .. ext)
      idx.write(p, idx.IMAGES_MAGIC, { 3, 2, 3 }, pix)
      if ext == ".gz" then  -- really gzipped: starts with the gzip magic
        local s = H.read_file(p)
        assert.equal("\31\139", s:sub(1, 2))
      end
      local x = idx.read_images(p)
      assert.equal("float32", x.dtype)
      assert.same({ 3, 1, 2, 3 }, x:shape())
      local want = {}
      for i, v in ipairs(pix) do want[i] = v / 255 end
      H.assert_close(x, want, 1e-7, 1e-6)
    end)
  end

  it("normalizes with mean and std", function()
    local p = path("img.gz")
    idx.write(p, idx.IMAGES_MAGIC, { 3, 2, 3 }, pix)
    local x = idx.read_images(p, { mean = 0.5, std = 0.25 })
    local want = {}
    for i, v in ipairs(pix) do want[i] = (v / 255 - 0.5) / 0.25 end
    H.assert_close(x, want, 1e-6, 1e-6)
    assert.equal(-2, x:tolist()[1])
    assert.near(2, x:tolist()[2], 1e-6)
  end)

  it("reads labels as int64 (N) with 0-based values", function()
    local p = path("lab.gz")
    idx.write(p, idx.LABELS_MAGIC, { 5 }, { 0, 9, 3, 3, 7 })
    local y = idx.read_labels(p)
    assert.equal("int64", y.dtype)
    assert.same({ 5 }, y:shape())
    assert.same({ 0, 9, 3, 3, 7 }, y:tolist())
  end)

  it("limits the number of samples", function()
    local p = path("img.gz")
    idx.write(p, idx.IMAGES_MAGIC, { 3, 2, 3 }, pix)
    local x = idx.read_images(p, { limit = 2 })
    assert.same({ 2, 1, 2, 3 }, x:shape())
    H.assert_close(x:tolist()[7], 10 / 255, 1e-7)
    assert.same({ 3, 1, 2, 3 }, idx.read_images(p, { limit = 100 }):shape())
    local l = path("lab.gz")
    idx.write(l, idx.LABELS_MAGIC, { 5 }, { 0, 9, 3, 3, 7 })
    assert.same({ 0, 9 }, idx.read_labels(l, { limit = 2 }):tolist())
    assert.same({ 0 }, idx.read_labels(l, { limit = 0 }):shape())
    H.assert_error(function() idx.read_labels(l, { limit = -1 }) end, l, "limit must be a non-negative number")
  end)

  it("returns the raw header and bytes", function()
    local p = path("img.gz")
    idx.write(p, idx.IMAGES_MAGIC, { 3, 2, 3 }, pix)
    local hdr, bytes, n = idx.read(p)
    assert.equal(0x803, hdr.magic)
    assert.same({ 3, 2, 3 }, hdr.dims)
    assert.equal(6, hdr.item_size)
    assert.equal(3, n)
    assert.equal(255, bytes[1])
    assert.equal(127, bytes[17])
  end)

  it("says how to install the data set when a file is missing", function()
    local p = path("no-such-file.gz")
    H.assert_error(function() idx.read_images(p) end, p, "not found", "apt-get install dataset-fashion-mnist")
    still_works()
  end)

  it("rejects a bad magic number, naming the file", function()
    local p = path("bad-magic.gz")
    idx.write(p, 0x0802, { 3 }, { 1, 2, 3 })        -- not unsigned-byte data
    H.assert_error(function() idx.read_labels(p) end, p, "bad magic number 0x00000802")
    local q = path("text.gz")
    idx.write_bytes(q, "hello world, this is not IDX")
    H.assert_error(function() idx.read(q) end, q, "bad magic")
    still_works()
  end)

  it("rejects images read as labels and labels read as images", function()
    local p = path("img.gz")
    idx.write(p, idx.IMAGES_MAGIC, { 3, 2, 3 }, pix)
    H.assert_error(function() idx.read_labels(p) end, p, "0x00000803", "expected 0x00000801")
    local l = path("lab.gz")
    idx.write(l, idx.LABELS_MAGIC, { 3 }, { 1, 2, 3 })
    H.assert_error(function() idx.read_images(l) end, l, "0x00000801", "expected 0x00000803")
    still_works()
  end)

  it("rejects truncated data and headers, naming the file", function()
    local p = path("short.gz")
    idx.write(p, idx.IMAGES_MAGIC, { 3, 2, 3 }, { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 }) -- 11 of 18 bytes
    H.assert_error(function() idx.read_images(p) end, p, "truncated", "3 items of 2x3 bytes", "1 complete items", "11 of 18 bytes")
    -- a limit that stays inside the data reads fine
    assert.same({ 1, 1, 2, 3 }, idx.read_images(p, { limit = 1 }):shape())
    local h = path("short-header")
    idx.write_bytes(h, "\0\0\8\3\0\0\0\3\0\0")   -- dims cut off
    H.assert_error(function() idx.read(h) end, h, "truncated header")
    local e = path("empty.gz")
    idx.write_bytes(e, "")
    H.assert_error(function() idx.read(e) end, e, "truncated header")
    still_works()
  end)

  it("rejects data beyond what the header announces", function()
    local p = path("long.gz")
    idx.write(p, idx.LABELS_MAGIC, { 3 }, { 1, 2, 3, 4 })
    H.assert_error(function() idx.read_labels(p) end, p, "wrong size", "3 items")
    still_works()
  end)

  it("rejects a corrupt gzip stream, naming the file", function()
    local good = path("good.gz")
    local px = {}
    for i = 1, 4 * 28 * 28 do px[i] = (i * 37) % 256 end
    idx.write(good, idx.IMAGES_MAGIC, { 4, 28, 28 }, px)
    local s = H.read_file(good)
    -- cut the compressed stream in half: zlib reports it or the data comes up short
    local cut = path("cut.gz")
    idx.write_bytes(cut .. ".raw", s:sub(1, math.floor(#s / 2)))
    os.rename(cut .. ".raw", cut)
    H.assert_error(function() idx.read_images(cut) end, cut)
    local err = select(2, pcall(idx.read_images, cut))
    assert.truthy(err:find("corrupt") or err:find("truncated"), err)
    -- flip bytes in the middle of the deflate data
    local bad = path("flipped.gz")
    local mid = math.floor(#s / 2)
    local f = assert(io.open(bad, "wb"))
    f:write(s:sub(1, mid - 1), ("\255"):rep(8), s:sub(mid + 8))
    f:close()
    local ok, err2 = pcall(idx.read_images, bad)
    if ok then  -- a flip zlib cannot detect must at least not pass the CRC check silently
      error("corrupt gzip file read without error")
    end
    assert.truthy(err2:find(bad, 1, true), err2)
    still_works()
  end)
end)

describe("fashion_mnist loader", function()
  setup(function()
    tmp = os.tmpname()
    os.remove(tmp)
    assert(os.execute("mkdir -p '" .. tmp .. "'"))
  end)
  teardown(function() os.execute("rm -rf '" .. tmp .. "'") end)

  it("loads a split from a data dir override", function()
    local dir = path("fm")
    make_dataset(dir, 5, { 3, 1, 4, 1, 5 })
    local x, y = fm.load("train", { dir = dir })
    assert.same({ 5, 1, 28, 28 }, x:shape())
    assert.equal("float32", x.dtype)
    assert.same({ 3, 1, 4, 1, 5 }, y:tolist())
    assert.equal("int64", y.dtype)
    local v = x:tolist()
    for _, ix in ipairs { { 0, 0, 0 }, { 2, 5, 17 }, { 4, 27, 27 }, { 3, 13, 0 } } do
      local i, r, c = ix[1], ix[2], ix[3]
      assert.near(pixel(i, r, c) / 255, v[i * 784 + r * 28 + c + 1], 1e-7)
    end
    local xt, yt = fm.load("test", { dir = dir .. "/", limit = 2 })
    assert.same({ 2, 1, 28, 28 }, xt:shape())
    assert.same({ 3, 1 }, yt:tolist())
  end)

  it("reads plain (not gzipped) files too", function()
    local dir = path("fm-plain")
    make_dataset(dir, 2, { 9, 0 }, { plain = true })
    local x, y = fm.load("test", { dir = dir })
    assert.same({ 2, 1, 28, 28 }, x:shape())
    assert.same({ 9, 0 }, y:tolist())
    assert.near(pixel(1, 1, 1) / 255, x:tolist()[784 + 28 + 2], 1e-7)
  end)

  it("normalizes with the data set's mean/std or given ones", function()
    local dir = path("fm")
    make_dataset(dir, 2, { 0, 1 })
    local x = fm.load("train", { dir = dir, normalize = true })
    local v = x:tolist()
    assert.near((pixel(1, 2, 3) / 255 - fm.MEAN) / fm.STD, v[784 + 2 * 28 + 3 + 1], 1e-5)
    local x2 = fm.load("train", { dir = dir, normalize = { mean = 0.5, std = 0.5 } })
    assert.near(pixel(0, 0, 5) / 255 * 2 - 1, x2:tolist()[6], 1e-6)
  end)

  it("finds the directory through FSDP_DATA_DIR-style candidates", function()
    local dir = path("fm")
    make_dataset(dir, 1, { 7 })
    assert.equal(dir, fm.find_dir(dir .. "//"))
    local ip, lp = fm.paths("test", dir)
    assert.equal(dir .. "/t10k-images-idx3-ubyte.gz", ip)
    assert.equal(dir .. "/t10k-labels-idx1-ubyte.gz", lp)
    H.assert_error(function() fm.paths("validation", dir) end, "unknown split", "validation")
  end)

  it("names the missing path and the package to install", function()
    local dir = path("nowhere")
    local err = H.assert_error(function() fm.load("train", { dir = dir }) end,
      dir .. "/train-labels-idx1-ubyte.gz", "apt-get install dataset-fashion-mnist")
    assert.truthy(err:find("not found", 1, true))
    still_works()
  end)

  it("rejects mismatched counts, wrong image sizes and out-of-range labels", function()
    local dir = path("fm-bad")
    make_dataset(dir, 3, { 1, 2 })
    H.assert_error(function() fm.load("train", { dir = dir }) end, "3 images", "2 labels", dir)
    idx.write(dir .. "/t10k-images-idx3-ubyte.gz", idx.IMAGES_MAGIC, { 2, 4, 4 }, ("\1"):rep(32))
    idx.write(dir .. "/t10k-labels-idx1-ubyte.gz", idx.LABELS_MAGIC, { 2 }, { 0, 1 })
    H.assert_error(function() fm.load("test", { dir = dir }) end, "4x4", "expected 28x28")
    idx.write(dir .. "/t10k-labels-idx1-ubyte.gz", idx.LABELS_MAGIC, { 2 }, { 0, 12 })
    H.assert_error(function() fm.load("test", { dir = dir }) end, "label 12", "10 classes")
    still_works()
  end)

  it("iterates over batches in order, and shuffled", function()
    local dir = path("fm")
    make_dataset(dir, 5, { 0, 1, 2, 3, 4 })
    local x, y = fm.load("train", { dir = dir })
    local sizes, seen = {}, {}
    for xb, yb, i in fm.batches(x, y, 2) do
      sizes[i] = yb:numel()
      assert.same({ yb:numel(), 1, 28, 28 }, xb:shape())
      for _, v in ipairs(yb:tolist()) do seen[#seen + 1] = v end
      -- the first pixel of each sample identifies it: pixel(i, 0, 0) = 7 i
      local xv = xb:tolist()
      for k, lab in ipairs(yb:tolist()) do assert.near(7 * lab / 255, xv[(k - 1) * 784 + 1], 1e-7) end
    end
    assert.same({ 2, 2, 1 }, sizes)
    assert.same({ 0, 1, 2, 3, 4 }, seen)
    local n = 0
    for _ in fm.batches(x, y, 2, { drop_last = true }) do n = n + 1 end
    assert.equal(2, n)

    fsdp.manual_seed(1)
    local order = {}
    for xb, yb in fm.batches(x, y, 2, { shuffle = true }) do
      local xv = xb:tolist()
      for k, lab in ipairs(yb:tolist()) do
        assert.near(7 * lab / 255, xv[(k - 1) * 784 + 1], 1e-7) -- images stay with their labels
        order[#order + 1] = lab
      end
    end
    local sorted = { unpack(order) }
    table.sort(sorted)
    assert.same({ 0, 1, 2, 3, 4 }, sorted)
  end)
end)

local real = fm.DEFAULT_DIR
local have_real = io.open(real .. "/t10k-labels-idx1-ubyte.gz", "rb")
if have_real then have_real:close() end

describe("the installed Fashion-MNIST", function()
  if not have_real then
    pending("not installed (apt-get install dataset-fashion-mnist)")
    return
  end

  local function class_counts(y)
    local counts = {}
    for _, v in ipairs(y:tolist()) do
      assert(v >= 0 and v <= 9 and v == math.floor(v), "label out of range: " .. v)
      counts[v + 1] = (counts[v + 1] or 0) + 1
    end
    return counts
  end

  it("has 10000 test samples, 1000 per class, pixels in [0, 1]", function()
    local x, y = fm.load("test")
    assert.same({ 10000, 1, 28, 28 }, x:shape())
    assert.same({ 10000 }, y:shape())
    local c = class_counts(y)
    for k = 1, 10 do assert.equal(1000, c[k]) end
    local p = ffi.cast("float*", x:data_ptr())
    local lo, hi, sum = 1, 0, 0
    for i = 0, x:numel() - 1 do
      local v = p[i]
      if v < lo then lo = v end
      if v > hi then hi = v end
      sum = sum + v
    end
    assert.equal(0, lo)
    assert.equal(1, hi)
    assert.near(0.2868, sum / x:numel(), 2e-3)
  end)

  it("has 60000 training samples, 6000 per class, with the documented mean/std", function()
    local x, y = fm.load("train")
    assert.same({ 60000, 1, 28, 28 }, x:shape())
    local c = class_counts(y)
    for k = 1, 10 do assert.equal(6000, c[k]) end
    local p = ffi.cast("float*", x:data_ptr())
    local n, s, s2 = x:numel(), 0, 0
    for i = 0, n - 1 do local v = p[i]; s = s + v; s2 = s2 + v * v end
    local mean = s / n
    assert.near(fm.MEAN, mean, 1e-3)
    assert.near(fm.STD, math.sqrt(s2 / n - mean * mean), 1e-3)
  end)

  it("honours the limit", function()
    local x, y = fm.load("train", { limit = 100 })
    assert.same({ 100, 1, 28, 28 }, x:shape())
    assert.same({ 100 }, y:shape())
    local first = fm.load("train", { limit = 1000 })
    H.assert_close(x, first:narrow(1, 1, 100), 0, 0)
  end)
end)
