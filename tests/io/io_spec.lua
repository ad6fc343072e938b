-- fsdp.save / fsdp.load (safetensors): Python-written fixtures, byte-identical output, round trips
-- of every dtype and layout, hostile files and atomic saves.
-- Fixtures: tests/data/*.safetensors, written by tests/data/make_fixtures.py.
local ffi = require "ffi"
local fsdp = require "fsdp"
local H = require "helpers"

local DATA = H.root .. "/tests/data/"

local tmpdir = os.tmpname()
os.remove(tmpdir)
os.execute("mkdir -p '" .. tmpdir .. "'")
local function tmp(name) return tmpdir .. "/" .. name end

local write_file = H.write_file
-- little-endian u64 from a Lua number (exact up to 2^53) or from 8 raw bytes
local function u64(n)
  local b = {}
  for i = 1, 8 do b[i] = string.char(n % 256); n = math.floor(n / 256) end
  return table.concat(b)
end
-- a safetensors file from a header string and n data bytes (zeros unless given)
local function st_file(header, data)
  if type(data) == "number" then data = ("\0"):rep(data) end
  return u64(#header) .. header .. (data or "")
end
local function list_dir(dir)
  local p = io.popen("ls -a '" .. dir .. "'")
  local out = p:read("*a")
  p:close()
  return out
end
local function bits16(t)
  local p = ffi.cast("uint16_t*", t:data_ptr())
  local r = {}
  for i = 0, t:numel() - 1 do r[#r + 1] = p[i] end
  return r
end
local function i64s(t)
  local p = ffi.cast("int64_t*", t:data_ptr())
  local r = {}
  for i = 0, t:numel() - 1 do r[#r + 1] = p[i] end
  return r
end
local function raw_bytes(t)  -- contiguous tensors only
  local es = ({ float32 = 4, int64 = 8, bfloat16 = 2, float16 = 2 })[t.dtype]
  return ffi.string(t:data_ptr(), t:numel() * es)
end

-- the tensors of tests/data/mixed.safetensors, built here (values exactly representable)
local function mixed_tensors()
  local ids = fsdp.zeros({ 5 }, { dtype = "int64" })
  local p = ffi.cast("int64_t*", ids:data_ptr())
  p[0], p[1], p[2] = 0, -1, 2 ^ 40 + 3
  p[3] = ffi.new("int64_t", 1) * 2 ^ 31 * 2 ^ 31 + 1   -- 2^62 + 1 (not a double)
  p[4] = -ffi.new("int64_t", 2 ^ 62) * 2                -- INT64_MIN
  return {
    weight = fsdp.tensor({ { 0.5, -1.25, 2.0 }, { 3.75, -0.125, 100.0 } }),
    scalar = fsdp.tensor(3.5),
    empty = fsdp.zeros({ 0, 4 }),
    step = fsdp.tensor(7, "int64"),
    ids = ids,
    bhalf = fsdp.tensor({ 1.0, -2.5, 0.15625, 2 ^ 100 }, "bfloat16"),
    half = fsdp.tensor({ { 1.0, -0.5 }, { 65504, 2 ^ -24 } }, "float16"),
  }
end
local MIXED_META = { note = "caf\195\169 \"q\"\n\t/" }

describe("fsdp.load of files written by Python's safetensors", function()
  it("reads every dtype, a 0-dim and an empty tensor, with exact values and bits", function()
    local t, meta = fsdp.load(DATA .. "mixed.safetensors")
    local n = 0
    for _ in pairs(t) do n = n + 1 end
    assert.are.equal(7, n)
    assert.are.same({ note = "caf\195\169 \"q\"\n\t/" }, meta)

    assert.are.equal("float32", t.weight.dtype)
    assert.are.same({ 2, 3 }, t.weight:shape())
    assert.are.same({ { 0.5, -1.25, 2.0 }, { 3.75, -0.125, 100.0 } }, t.weight:totable())
    assert.are.same({}, t.scalar:shape())
    assert.are.equal(3.5, t.scalar:item())
    assert.are.same({ 0, 4 }, t.empty:shape())
    assert.are.equal(0, t.empty:numel())

    assert.are.equal("int64", t.step.dtype)
    assert.are.equal(7, t.step:item())
    assert.are.equal("int64", t.ids.dtype)
    local ids = i64s(t.ids)
    assert.are.equal(0LL, ids[1]); assert.are.equal(-1LL, ids[2]); assert.are.equal(1099511627779LL, ids[3])
    assert.are.equal(4611686018427387905LL, ids[4])
    assert.are.equal(-9223372036854775807LL - 1, ids[5])

    assert.are.equal("bfloat16", t.bhalf.dtype)
    assert.are.same({ 0x3F80, 0xC020, 0x3E20, 0x7180 }, bits16(t.bhalf))
    assert.are.same({ 1.0, -2.5, 0.15625, 2 ^ 100 }, t.bhalf:tolist())
    assert.are.equal("float16", t.half.dtype)
    assert.are.same({ 2, 2 }, t.half:shape())
    assert.are.same({ 0x3C00, 0xB800, 0x7BFF, 0x0001 }, bits16(t.half))
    assert.are.same({ 1.0, -0.5, 65504, 2 ^ -24 }, t.half:tolist())

    for _, x in pairs(t) do
      assert.is_true(x:is_contiguous())
      assert.is_false(x.requires_grad)
    end
  end)

  it("returns an empty metadata table when the file has none", function()
    local t, meta = fsdp.load(DATA .. "plain.safetensors")
    assert.are.same({}, meta)
    assert.are.same({ { 1, 2 }, { 3, 4 } }, t["a.weight"]:totable())
    assert.are.same({ -1, 0.25 }, t["a.bias"]:tolist())
  end)

  it("refuses a dtype fsdp does not have, naming the file, the tensor and the dtype", function()
    local p = DATA .. "unsupported.safetensors"
    H.assert_error(function() fsdp.load(p) end, p, "tensor 'bad'", "F64")
  end)
end)

describe("fsdp.save", function()
  it("writes the same bytes as Python's safetensors for the same tensors and metadata", function()
    local p = tmp("mixed.safetensors")
    fsdp.save(p, mixed_tensors(), MIXED_META)
    local ours, theirs = H.read_file(p), H.read_file(DATA .. "mixed.safetensors")
    assert.are.equal(#theirs, #ours)
    assert.is_true(ours == theirs, "files differ")

    local q = tmp("plain.safetensors")
    fsdp.save(q, { ["a.weight"] = fsdp.tensor({ { 1, 2 }, { 3, 4 } }), ["a.bias"] = fsdp.tensor({ -1, 0.25 }) })
    assert.is_true(H.read_file(q) == H.read_file(DATA .. "plain.safetensors"), "files differ")
  end)

  it("orders entries by name within a dtype and pads the header to a multiple of 8", function()
    local p = tmp("order.safetensors")
    local sd = {}
    for _, name in ipairs { "1.bias", "0.weight", "10.weight", "0.bias", "1.weight" } do sd[name] = fsdp.ones(2) end
    fsdp.save(p, sd)
    local s = H.read_file(p)
    local hlen = s:byte(1) + 256 * s:byte(2)
    assert.are.equal(0, hlen % 8)
    local header = s:sub(9, 8 + hlen)
    local last = 0
    for _, name in ipairs { "0.bias", "0.weight", "1.bias", "1.weight", "10.weight" } do
      local at = header:find('"' .. name .. '"', 1, true)
      assert.is_truthy(at)
      assert.is_true(at > last, name .. " out of order")
      last = at
    end
    assert.is_truthy(header:find('"0.bias":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}', 1, true))
    assert.are.equal(8 + hlen + 5 * 8, #s)
  end)

  it("round-trips every dtype bit for bit", function()
    fsdp.manual_seed(3)
    local src = {
      f = fsdp.randn(3, 5),
      i = fsdp.randint(-1000000, 1000000, { 4, 2 }),
      b = fsdp.tensor({ { 0.5, -3, 1e30 }, { -1e-20, 7, 0 } }, "bfloat16"),
      h = fsdp.tensor({ 0.1, -2.5, 1000, 6e-8, -65504 }, "float16"),
      s = fsdp.tensor(-4.25),
      e = fsdp.zeros({ 2, 0, 3 }),
    }
    local p = tmp("rt.safetensors")
    fsdp.save(p, src)
    local back, meta = fsdp.load(p)
    assert.are.same({}, meta)
    for name, t in pairs(src) do
      local b = back[name]
      assert.is_truthy(b, name)
      assert.are.equal(t.dtype, b.dtype)
      assert.are.same(t:shape(), b:shape())
      assert.is_true(raw_bytes(t) == raw_bytes(b), name .. ": bytes differ")
      assert.are.same(t:tolist(), b:tolist())
    end
    -- independent copies: changing the loaded tensor leaves the source alone and vice versa
    back.f:fill_(0)
    assert.are_not.equal(0, src.f:sum():item())
  end)

  it("writes strided views as their logical (row-major) contents", function()
    local a = fsdp.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })
    local at = a:t()
    local col = a:narrow(2, 2, 1)
    assert.is_false(at:is_contiguous())
    local p = tmp("views.safetensors")
    fsdp.save(p, { at = at, col = col })
    local back = fsdp.load(p)
    assert.are.same({ { 1, 4 }, { 2, 5 }, { 3, 6 } }, back.at:totable())
    assert.are.same({ { 2 }, { 5 } }, back.col:totable())
    assert.is_true(back.at:is_contiguous())
  end)

  it("round-trips metadata with quotes, escapes, control characters and UTF-8", function()
    local meta = {
      plain = "v", quote = 'say "hi"', back = "C:\\dir\\", ctl = "a\1b\31c\127", nl = "x\ny\r\tz\b\f",
      utf = "\206\187 \240\159\152\128", [""] = "empty key", ["k\"ey"] = "",
    }
    local p = tmp("meta.safetensors")
    fsdp.save(p, { x = fsdp.ones(1) }, meta)
    local _, back = fsdp.load(p)
    assert.are.same(meta, back)
    fsdp.save(p, { x = fsdp.ones(1) }, {})
    local _, empty = fsdp.load(p)
    assert.are.same({}, empty)
    assert.is_truthy(H.read_file(p):find('"__metadata__":{}', 1, true))
  end)

  it("saves an empty table as a valid file", function()
    local p = tmp("none.safetensors")
    fsdp.save(p, {})
    assert.are.equal(u64(8) .. "{}      ", H.read_file(p))
    local t, meta = fsdp.load(p)
    assert.are.same({}, t)
    assert.are.same({}, meta)
  end)
end)

describe("hostile or broken files", function()
  local good = '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}'
  local cases = {
    { "truncated data", st_file(good, 12), "past the end" },
    { "truncated header", st_file(good, 16):sub(1, 40), "header length 108 is past the end" },
    { "header length 2^62", "\0\0\0\0\0\0\0\64" .. good, "header length 4611686018427387904 exceeds the 100 MB limit" },
    { "tiny file", "abc", "too small" },
    { "bad JSON", st_file('{"a":{"dtype":"F32",,}}', 0), "bad header at byte 20" },
    { "not an object", st_file("[1]", 0), "does not start with '{'" },
    { "a float", st_file('{"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}}', 8), "only integers" },
    { "overlapping offsets", st_file('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}', 12), "overlap" },
    { "offsets past the end", st_file('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}', 10), "past the end" },
    { "a gap", st_file('{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', 8), "gap" },
    { "unknown dtype", st_file('{"w":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}}', 8), "tensor 'w' has dtype I32" },
    { "byte count mismatch", st_file('{"w":{"dtype":"F16","shape":[2,3],"data_offsets":[0,8]}}', 8), "needs 12 bytes" },
    { "negative dim", st_file('{"w":{"dtype":"F32","shape":[-1,2],"data_offsets":[0,8]}}', 8), "negative size" },
    { "absurd dims", st_file('{"w":{"dtype":"F32","shape":[9223372036854775807,2],"data_offsets":[0,8]}}', 8), "absurd shape" },
    { "duplicated name", st_file('{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', 8), "'w' appears twice" },
    { "missing key", st_file('{"w":{"dtype":"F32","data_offsets":[0,8]}}', 8), "no 'shape'" },
    { "non-string metadata", st_file('{"__metadata__":{"epoch":3}}', 0), "must be a string" },
  }
  for _, c in ipairs(cases) do
    it("gives a Lua error naming the file for " .. c[1] .. ", then keeps working", function()
      local p = tmp("hostile.safetensors")
      write_file(p, c[2])
      H.assert_error(function() fsdp.load(p) end, p, c[3])
      -- the process keeps working: a good file loads and ops run
      local t = fsdp.load(DATA .. "plain.safetensors")
      assert.are.same({ -1, 0.25 }, t["a.bias"]:tolist())
      assert.are.same({ 0, 1.25 }, (t["a.bias"] + 1):tolist())
    end)
  end

  it("names a missing file", function()
    local p = tmp("does-not-exist.safetensors")
    H.assert_error(function() fsdp.load(p) end, p, "No such file")
  end)

  it("survives random corruption of a valid file", function()
    local src = H.read_file(DATA .. "mixed.safetensors")
    local p = tmp("fuzz.safetensors")
    math.randomseed(7)
    local loaded, failed = 0, 0
    for _ = 1, 300 do
      local b = { src:byte(1, -1) }
      for _ = 1, math.random(1, 3) do b[math.random(1, #b)] = math.random(0, 255) end
      local n = math.random(1, 10) == 1 and math.random(1, #b) or #b
      write_file(p, string.char(unpack(b, 1, n)))
      local ok, err = pcall(fsdp.load, p)
      if ok then loaded = loaded + 1 else
        failed = failed + 1
        assert.is_truthy(tostring(err):find(p, 1, true), tostring(err))
      end
    end
    assert.is_true(failed > 0 and loaded > 0)
  end)
end)

describe("failed saves", function()
  it("leave an existing file intact and no temporary files behind", function()
    local p = tmp("keep.safetensors")
    local x = fsdp.tensor({ 1, 2, 3 })
    fsdp.save(p, { x = x }, { v = "1" })
    local before = H.read_file(p)

    H.assert_error(function() fsdp.save(p, { [""] = x }) end, p, "empty name")
    H.assert_error(function() fsdp.save(p, { __metadata__ = x }) end, p, "reserved")
    H.assert_error(function() fsdp.save(p, { ["\255bad"] = x }) end, p, "UTF-8")
    H.assert_error(function() fsdp.save(p, { x = x, y = print }) end, "fsdp.save", '["y"]', "is a function")
    H.assert_error(function() fsdp.save(p, { [true] = x }) end, "fsdp.save", "boolean key")
    H.assert_error(function() fsdp.save(p, { x = x, e = 1 }, { v = 1 }) end, "fsdp.save", "metadata", '"v"')
    H.assert_error(function() fsdp.save(p, { x = x }, { v = 1 }) end, "fsdp.save", "metadata", '"v"')
    H.assert_error(function() fsdp.save(p, { x = x }, "v=1") end, "fsdp.save", "metadata")
    H.assert_error(function() fsdp.save(p, { x = x }, { ["a\0b"] = "c" }) end, p, "NUL")
    H.assert_error(function() fsdp.save(p, { x = x }, { k = "\255" }) end, p, "metadata is not valid UTF-8")
    H.assert_error(function() fsdp.save(p, "x") end, "fsdp.save", "table")
    H.assert_error(function() fsdp.save(nil, { x = x }) end, "fsdp.save", "path")
    H.assert_error(function() fsdp.load(42) end, "fsdp.load", "path")
    local missing = tmpdir .. "/no/such/dir/ckpt.safetensors"
    H.assert_error(function() fsdp.save(missing, { x = x }) end, missing, "No such file")
    -- the rename fails (a directory is in the way): the written temporary file is removed
    local d = tmp("adir")
    os.execute("mkdir -p '" .. d .. "/sub'")
    H.assert_error(function() fsdp.save(d, { x = x }) end, d, "cannot rename")

    assert.is_true(H.read_file(p) == before, "the old file changed")
    assert.is_falsy(list_dir(tmpdir):find(".tmp.", 1, true))
    local back, meta = fsdp.load(p)
    assert.are.same({ 1, 2, 3 }, back.x:tolist())
    assert.are.same({ v = "1" }, meta)
    -- and a good save replaces it
    fsdp.save(p, { y = fsdp.tensor({ 5 }) })
    back = fsdp.load(p)
    assert.is_nil(back.x)
    assert.are.same({ 5 }, back.y:tolist())
  end)
end)

describe("fsdp.save / fsdp.load of nested tables and non-tensor values", function()
  local C = fsdp.C
  local json = require "fsdp.json"
  it("round-trips numbers, strings, booleans, lists and nested tables beside tensors", function()
    local p = tmp("nested.safetensors")
    local w, b = fsdp.tensor({ { 1, 2 }, { 3, 4 } }), fsdp.tensor({ 5, 6 }, "int64")
    local ck = {
      model = { ["0.weight"] = w, ["0.bias"] = b },
      epoch = 3, lr = 1e-3, third = 1 / 3, big = 2 ^ 60, neg = -7, name = "run \"7\"\n", done = false, ok = true,
      history = { 2.5, 1.25, 0.625 }, cfg = { layers = { 32, 64 }, opts = { nesterov = true } },
      tensors = { w, b }, empty = {},
    }
    fsdp.save(p, ck, { note = "kept" })
    local back, meta = fsdp.load(p)
    assert.are.same({ note = "kept" }, meta, "the reserved key is not returned")
    assert.are.same(w:tolist(), back.model["0.weight"]:tolist())
    assert.are.same(b:tolist(), back.model["0.bias"]:tolist())
    assert.are.equal("int64", back.model["0.bias"].dtype)
    assert.are.same(w:tolist(), back.tensors[1]:tolist())
    assert.are.same(b:tolist(), back.tensors[2]:tolist())
    for _, k in ipairs { "epoch", "lr", "third", "big", "neg", "name", "done", "ok" } do
      assert.are.equal(ck[k], back[k], k)
    end
    assert.are.same(ck.history, back.history)
    assert.are.same(ck.cfg, back.cfg)
    assert.are.same({}, back.empty)
    -- a list of tensors at the top, as torch.save([t1, t2])
    local q = tmp("list.safetensors")
    fsdp.save(q, { w, b })
    local list = fsdp.load(q)
    assert.are.equal(2, #list)
    assert.are.same(b:tolist(), list[2]:tolist())
    -- the tensors are stored under their paths, which any safetensors reader sees
    local flat = {}
    local f = C.fsdp_st_open(p)
    for i = 0, C.fsdp_st_count(f) - 1 do flat[#flat + 1] = ffi.string(C.fsdp_st_name(f, i)) end
    local raw = ffi.string(C.fsdp_st_metadata(f))
    C.fsdp_st_close(f)
    table.sort(flat)
    assert.are.same({ "model.0.bias", "model.0.weight", "tensors.1", "tensors.2" }, flat)
    local m = json.decode(raw, "metadata")
    assert.are.equal("string", type(m.__fsdp__), "string -> string metadata, as safetensors requires")
    assert.are.equal("kept", m.note)
  end)

  it("round-trips torch.save's usual checkpoint: model, optimizer state (0-based keys), epoch", function()
    local p = tmp("train_ckpt.safetensors")
    local nn = fsdp.nn
    fsdp.manual_seed(1)
    local m = nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 1))
    local opt = fsdp.optim.AdamW(m:parameters(), { lr = 1e-2 })
    local x = fsdp.randn(4, 3)
    local function step(o)
      o:zero_grad()
      m(x):sum():backward()
      o:step()
    end
    step(opt)
    fsdp.save(p, { model = m:state_dict(), optimizer = opt:state_dict(), epoch = 1 })
    step(opt)
    local want = m:state_dict()
    local ck = fsdp.load(p)
    assert.are.equal(1, ck.epoch)
    m:load_state_dict(ck.model)
    local opt2 = fsdp.optim.AdamW(m:parameters(), { lr = 1e-2 })
    opt2:load_state_dict(ck.optimizer)
    step(opt2)
    for k, t in pairs(want) do assert.are.same(t:tolist(), m:state_dict()[k]:tolist(), k) end
    -- sparse and 0-based integer keys beside string keys, and nested lists
    local q = tmp("int_keys.safetensors")
    local v = { [0] = "zero", [5] = { 1, 2 }, [-3] = true, name = "n", l = { { 1 }, { 2, { 3 } } } }
    fsdp.save(q, { v = v, t = fsdp.tensor({ 1 }) })
    assert.are.same(v, fsdp.load(q).v)
    H.assert_error(function() fsdp.save(q, { t = fsdp.tensor({ 1 }), [1.5] = 2 }) end, "fsdp.save", "number key 1.5")
  end)

  it("writes a flat table of tensors as before, without the reserved key", function()
    local p, q = tmp("flat1.safetensors"), tmp("flat2.safetensors")
    local t = { a = fsdp.tensor({ 1, 2 }), ["b.c"] = fsdp.tensor({ 3 }) }
    fsdp.save(p, t, { k = "v" })
    local back, meta = fsdp.load(p)
    assert.are.same({ k = "v" }, meta)
    assert.are.same({ 3 }, back["b.c"]:tolist(), "a flat name with a dot stays flat")
    -- the same bytes as the nested spelling would not give: a flat file has no __fsdp__ entry
    assert.is_nil(H.read_file(p):find("__fsdp__", 1, true))
    fsdp.save(q, { a = t.a, b = { c = t["b.c"] } })
    assert.is_truthy(H.read_file(q):find("__fsdp__", 1, true))
    local nested = fsdp.load(q)
    assert.are.same({ 3 }, nested.b.c:tolist())
  end)

  it("refuses what it cannot store, naming the place", function()
    local p = tmp("bad_nested.safetensors")
    local x = fsdp.tensor({ 1 })
    H.assert_error(function() fsdp.save(p, { x = x, cfg = { f = print } }) end, "fsdp.save", '["cfg"]["f"]', "function")
    H.assert_error(function() fsdp.save(p, { a = { b = x }, ["a.b"] = x }) end, "fsdp.save", 'two tensors would be stored as "a.b"')
    H.assert_error(function() fsdp.save(p, { x = x, n = 0 / 0 }) end, "fsdp.save", "non-finite")
    local loop = {}
    loop.self = loop
    H.assert_error(function() fsdp.save(p, { x = x, loop = loop }) end, "fsdp.save", "contains itself")
    H.assert_error(function() fsdp.save(p, { x = x, e = 1 }, { __fsdp__ = "x" }) end, "fsdp.save", "reserved")
    H.assert_error(function() fsdp.save(p, { x = x, t = { __tensor__ = "x" } }) end, "fsdp.save", "reserved")
    H.assert_error(function() fsdp.save(p, x) end, "fsdp.save", "got a tensor")
    -- a file whose tree names a tensor it does not hold
    local forged = tmp("forged.safetensors")
    C.fsdp_st_save(forged, 0, ffi.new("const char*[1]"), ffi.new("fsdp_tensor*[1]"), '{"__fsdp__":"{\\"w\\":{\\"__tensor__\\":\\"w\\"}}"}')
    H.assert_error(function() fsdp.load(forged) end, "fsdp.load", forged, 'the tensor "w" is missing')
  end)
end)

teardown(function() os.execute("rm -rf '" .. tmpdir .. "'") end)
