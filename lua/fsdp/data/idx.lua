-- fsdp.data.idx: reader for the IDX format of (Fashion-)MNIST, gzipped or plain.
--
--   local idx = require "fsdp.data.idx"
--   local images = idx.read_images(path, {limit = 1000, mean = 0.2860, std = 0.3530}) -- f32 (N,1,H,W)
--   local labels = idx.read_labels(path, {limit = 1000})                            -- i64 (N)
--   local hdr, bytes, n = idx.read(path, {limit = 1000})  -- raw: header, uint8_t* data, item count
--
-- IDX: a big-endian header -- magic 0x00 0x00 <type> <ndim> (type 0x08 = unsigned byte), then
-- ndim uint32 sizes -- followed by the items in row-major order. Images have magic 0x00000803
-- (N, rows, cols), labels 0x00000801 (N). Files are read through zlib (gzopen reads plain files
-- too), so no decompressed copy ever lands on disk. The bytes land in one uint8 buffer and are
-- converted straight into the storage of a tensor made by fsdp_empty: no Lua tables, and no
-- float staging buffer for fsdp_from_blob to copy (188 MB for the training images).
local ffi = require "ffi"
local fsdp = require "fsdp"

-- pcall: another module may have declared zlib already
pcall(ffi.cdef, [[
typedef struct gzFile_s* gzFile;
gzFile gzopen(const char* path, const char* mode);
int gzread(gzFile file, void* buf, unsigned int len);
int gzclose(gzFile file);
const char* gzerror(gzFile file, int* errnum);
int gzbuffer(gzFile file, unsigned int size);
int gzwrite(gzFile file, const void* buf, unsigned int len);
]])

local M = {}
M.IMAGES_MAGIC = 0x00000803
M.LABELS_MAGIC = 0x00000801
M.INSTALL_HINT = "install the data set with `apt-get install dataset-fashion-mnist`"

local z
local function zlib()
  if z then return z end
  for _, name in ipairs { "z", "libz.so.1" } do
    local ok, lib = pcall(ffi.load, name)
    if ok then z = lib; return z end
  end
  error("idx: cannot load zlib (libz.so.1); install it with `apt-get install zlib1g`", 3)
end
M.zlib = zlib

-- open for reading, or raise an error naming the path (and how to get the data set)
local function open(path)
  local kind = fsdp._not_regular_file(path)
  if kind then error(("idx: %s is %s, not a data file"):format(path, kind), 0) end
  local f = io.open(path, "rb")
  if not f then
    error(("idx: file %s not found; %s (or pass another data directory)"):format(path, M.INSTALL_HINT), 0)
  end
  f:close()
  local lib = zlib()
  local gz = lib.gzopen(path, "rb")
  if gz == nil then error(("idx: cannot open %s with zlib"):format(path), 3) end
  lib.gzbuffer(gz, 256 * 1024)
  return gz
end

-- reads exactly n bytes into buf; returns the count actually read (short at end of file)
local function read_full(gz, path, buf, n)
  local lib = z
  local got = 0
  while got < n do
    local want = math.min(n - got, 0x40000000)
    local r = lib.gzread(gz, ffi.cast("uint8_t*", buf) + got, want)
    if r < 0 then
      local errnum = ffi.new("int[1]")
      local msg = ffi.string(lib.gzerror(gz, errnum))
      lib.gzclose(gz)
      error(("idx: %s is corrupt (zlib: %s)"):format(path, msg), 0)
    end
    if r == 0 then break end
    got = got + r
  end
  return got
end

local function be32(p, i)
  return p[i] * 16777216 + p[i + 1] * 65536 + p[i + 2] * 256 + p[i + 3]
end

-- Reads the header and items of an IDX file.
--   opts.limit: read at most this many items (the first dim)
--   opts.magic: the expected magic number (error otherwise)
-- Returns hdr = {magic=, dims={...}, count=, item_size=}, the buffer, and the item count read.
function M.read(path, opts)
  fsdp._path(path, "idx.read", "path")
  opts = opts or {}
  local gz = open(path)
  local head = ffi.new("uint8_t[4]")
  local function fail(fmt, ...)
    z.gzclose(gz)
    error(("idx: %s: " .. fmt):format(path, ...), 0)
  end
  if read_full(gz, path, head, 4) < 4 then fail("truncated header (file shorter than 4 bytes)") end
  local magic = be32(head, 0)
  if head[0] ~= 0 or head[1] ~= 0 or head[2] ~= 0x08 or head[3] < 1 or head[3] > 4 then
    fail("bad magic number 0x%08x (expected an unsigned-byte IDX file such as 0x%08x images or 0x%08x labels)",
      magic, M.IMAGES_MAGIC, M.LABELS_MAGIC)
  end
  if opts.magic and magic ~= opts.magic then
    fail("bad magic number 0x%08x (expected 0x%08x)", magic, opts.magic)
  end
  local ndim = head[3]
  local dbuf = ffi.new("uint8_t[16]")
  if read_full(gz, path, dbuf, 4 * ndim) < 4 * ndim then fail("truncated header (missing dimension sizes)") end
  local dims, item_size = {}, 1
  for i = 1, ndim do
    dims[i] = be32(dbuf, 4 * (i - 1))
    if i > 1 then item_size = item_size * dims[i] end
  end
  if item_size == 0 or item_size > 2 ^ 31 then fail("implausible item size %s", table.concat(dims, "x")) end
  local count = dims[1]
  if opts.limit then
    if type(opts.limit) ~= "number" or opts.limit < 0 then fail("limit must be a non-negative number, got %s", tostring(opts.limit)) end
    count = math.min(count, opts.limit)
  end
  local hdr = { magic = magic, dims = dims, count = dims[1], item_size = item_size }
  local nbytes = count * item_size
  local buf = ffi.new("uint8_t[?]", math.max(nbytes, 1))
  local got = read_full(gz, path, buf, nbytes)
  if got < nbytes then
    local shape = {}
    for k = 2, ndim do shape[#shape + 1] = dims[k] end
    fail("truncated data: the header announces %d items of %s bytes, but the file ends after %d complete items (%d of %d bytes)",
      dims[1], #shape > 0 and table.concat(shape, "x") or "1", math.floor(got / item_size), got, nbytes)
  end
  if count == dims[1] then  -- whole file read: nothing may follow
    local extra = ffi.new("uint8_t[1]")
    if read_full(gz, path, extra, 1) > 0 then
      fail("wrong size: more data after the %d items the header (%s) announces", dims[1], table.concat(dims, "x"))
    end
  end
  z.gzclose(gz)
  return hdr, buf, count
end

-- a new contiguous tensor of the data-set memory category (not counted as activations)
local function new_tensor(shape, dtype)
  local n, arr = fsdp._shape("idx", shape)
  local t = fsdp._wrap(fsdp.C.fsdp_empty(n, arr, dtype, 0))
  fsdp.C.fsdp_tensor_set_mem_category(t.p, 5) -- FSDP_MEM_OTHER
  return t
end

-- Images: float32 (N, 1, rows, cols), pixel / 255, then (x - mean) / std when opts.mean/std are given.
function M.read_images(path, opts)
  fsdp._path(path, "idx.read_images", "path")
  opts = opts or {}
  local mean, std = opts.mean or 0, opts.std or 1
  if std == 0 then error("idx.read_images: std must be non-zero", 2) end
  local hdr, bytes, n = M.read(path, { limit = opts.limit, magic = M.IMAGES_MAGIC })
  local rows, cols = hdr.dims[2], hdr.dims[3]
  local t = new_tensor({ n, 1, rows, cols }, 0)
  local out = ffi.cast("float*", t:data_ptr())
  local scale, shift = 1 / (255 * std), -mean / std
  for i = 0, n * rows * cols - 1 do out[i] = bytes[i] * scale + shift end
  return t
end

-- Labels: int64 (N) with the class values as stored (0-based). opts.num_classes checks the range.
function M.read_labels(path, opts)
  fsdp._path(path, "idx.read_labels", "path")
  opts = opts or {}
  local _, bytes, n = M.read(path, { limit = opts.limit, magic = M.LABELS_MAGIC })
  local t = new_tensor({ n }, 1)
  local out = ffi.cast("int64_t*", t:data_ptr())
  local k = opts.num_classes
  for i = 0, n - 1 do
    local v = bytes[i]
    if k and v >= k then
      error(("idx: %s: label %d at index %d is out of range for %d classes"):format(path, v, i, k), 2)
    end
    out[i] = v
  end
  return t
end

-- Writes an IDX file (uint8 items) -- plain, or gzipped when the path ends in .gz. For tests and
-- for making small data sets. dims = {N, ...}; data = flat Lua table of 0..255 values or a string.
function M.write(path, magic, dims, data)
  fsdp._path(path, "idx.write", "path")
  local parts = { string.char(0, 0, math.floor(magic / 256) % 256, magic % 256) }
  for _, d in ipairs(dims) do
    parts[#parts + 1] = string.char(math.floor(d / 16777216) % 256, math.floor(d / 65536) % 256,
      math.floor(d / 256) % 256, d % 256)
  end
  if type(data) == "table" then
    local chunk = {}
    for i = 1, #data do chunk[i] = string.char(data[i]) end
    data = table.concat(chunk)
  end
  parts[#parts + 1] = data or ""
  return M.write_bytes(path, table.concat(parts))
end

-- Writes raw bytes, gzipped when the path ends in .gz.
function M.write_bytes(path, s)
  fsdp._path(path, "idx.write_bytes", "path")
  if path:match("%.gz$") then
    local lib = zlib()
    local gz = lib.gzopen(path, "wb")
    if gz == nil then error(("idx: cannot create %s"):format(path), 2) end
    local w = #s > 0 and lib.gzwrite(gz, s, #s) or 0
    lib.gzclose(gz)
    if w ~= #s then error(("idx: short write to %s"):format(path), 2) end
  else
    local f = assert(io.open(path, "wb"))
    f:write(s)
    f:close()
  end
end

return M
