-- Hostile paths and files (issue 39, items 6, 9, 10 and 11): a path with a NUL byte, a
-- safetensors file whose __fsdp__ tree and tensors disagree, a sharded checkpoint whose layout
-- metadata lies, damaged files and values JSON cannot hold. Each is a Lua error naming the public
-- function, the file or argument and what is wrong -- never another file, dropped tensors, wrong
-- numbers, a raw Lua error or a crash -- and the process keeps working after it.
-- Sharded checkpoints of 2 ranks are written here, in one process: a genuine 1-rank checkpoint's
-- metadata, cut into two rank files (tests/fsdp/checkpoint_spec.lua runs the real multi-rank saves).
local ffi = require "ffi"
local fsdp = require "fsdp"
local H = require "helpers"
local json = require "fsdp.json"
local CK = require "fsdp.checkpoint"
local idx = require "fsdp.data.idx"
local fm = require "fsdp.data.fashion_mnist"
local nn = fsdp.nn

local base = H.mkdtemp("fsdp_hostile")
local exists, write_file = H.exists, H.write_file
-- the process still works: a save and a load round trip
local function still_works()
  local p = base .. "/ok.safetensors"
  fsdp.save(p, { x = fsdp.tensor { 1, 2 } })
  assert.same({ 1, 2 }, fsdp.load(p).x:tolist())
end

describe("a path with a NUL byte (item 6)", function()
  local bad = base .. "/a\0b"
  -- fn(path) must fail naming `name` and the argument; one that writes must create nothing at the
  -- path cut at the NUL ("a"; a reader finds a file there, which it must not read)
  local function refused(name, arg, fn, reads)
    local err = H.assert_error(fn, name .. ": " .. arg, "contains a NUL byte (\\0 at byte " .. (#base + 3) .. ")")
    assert.truthy(err:find(base .. "/a\\0b", 1, true), err)
    if not reads then assert.is_false(exists(base .. "/a"), name .. " created the file cut at the NUL") end
  end
  local x = fsdp.tensor { 1, 2, 3 }

  it("is refused by fsdp.save and fsdp.load", function()
    refused("fsdp.save", "path", function() fsdp.save(bad .. ".safetensors", { x = x }) end)
    fsdp.save(base .. "/a", { x = x })  -- the file the cut path names exists: load must not read it
    refused("fsdp.load", "path", function() fsdp.load(bad) end, true)
    os.remove(base .. "/a")
    still_works()
  end)

  it("is refused by the sharded checkpoint functions", function()
    local m = nn.Linear(2, 2)
    refused("fsdp.save_sharded", "dir", function() fsdp.save_sharded(bad, m) end)
    refused("fsdp.load_sharded", "dir", function() fsdp.load_sharded(bad, m) end)
    refused("fsdp.read_sharded", "dir", function() CK.read(bad) end)
    local dir = base .. "/nulckpt"
    fsdp.save_sharded(dir, m)
    refused("fsdp-consolidate", "out", function() CK.consolidate(dir, bad) end)
    refused("fsdp-consolidate", "dir", function() CK.consolidate(bad, base .. "/out.safetensors") end)
  end)

  it("is refused by the data readers and writers and by the trace", function()
    refused("idx.write", "path", function() idx.write(bad, idx.LABELS_MAGIC, { 1 }, { 1 }) end)
    refused("idx.write_bytes", "path", function() idx.write_bytes(bad .. ".gz", "abc") end)
    idx.write(base .. "/a", idx.LABELS_MAGIC, { 1 }, { 1 })
    refused("idx.read", "path", function() idx.read(bad) end, true)
    refused("idx.read_labels", "path", function() idx.read_labels(bad) end, true)
    refused("idx.read_images", "path", function() idx.read_images(bad) end, true)
    os.remove(base .. "/a")
    refused("fashion_mnist.load", "opts.dir", function() fm.load("test", { dir = bad }) end)
    refused("fashion_mnist.paths", "dir", function() fm.paths("test", bad) end)
    refused("fashion_mnist.find_dir", "dir", function() fm.find_dir(bad) end)
    refused("fsdp.trace.start", "path", function() fsdp.trace.start(bad) end)
    assert.is_false(fsdp.trace.enabled())
    still_works()
  end)
end)

describe("fsdp.load of a file whose __fsdp__ tree and tensors disagree (item 9)", function()
  -- a file with the tensors `names` (each a 2-element tensor) and the __fsdp__ tree `tree`
  local function forged(names, tree)
    local p = base .. "/tree.safetensors"
    local n = #names
    local cnames, ctensors, keep = ffi.new("const char*[?]", n), ffi.new("fsdp_tensor*[?]", n), {}
    for i, name in ipairs(names) do
      keep[i] = fsdp.tensor { i, i }
      cnames[i - 1], ctensors[i - 1] = name, keep[i].p
    end
    local meta = json.encode({ __fsdp__ = json.encode(tree, "tree") }, "meta")
    assert.equal(0, fsdp.C.fsdp_st_save(p, n, cnames, ctensors, meta))
    return p
  end

  it("returns every tensor of the file: one the tree does not place comes back under its own name", function()
    local p = forged({ "model.w", "added" }, { model = { w = { __tensor__ = "model.w" } }, epoch = 3 })
    for _, opts in ipairs { {}, { lazy = false } } do
      local ck = fsdp.load(p, opts)
      assert.equal(3, ck.epoch)
      assert.same({ 1, 1 }, ck.model.w:tolist())
      assert.truthy(ck.added, "the tensor the tree does not name was dropped")
      assert.same({ 2, 2 }, ck.added:tolist())
    end
  end)

  it("is an error naming the tensor when its name is taken at the top of the tree", function()
    local p = forged({ "model.w", "epoch" }, { model = { w = { __tensor__ = "model.w" } }, epoch = 3 })
    H.assert_error(function() fsdp.load(p) end, "fsdp.load", p, 'tensor "epoch"')
  end)

  it("is an error naming a tensor the tree names and the file lacks, or a malformed entry", function()
    local p = forged({ "w" }, { a = { __tensor__ = "w" }, b = { __tensor__ = "gone" } })
    H.assert_error(function() fsdp.load(p) end, "fsdp.load", p, 'tensor "gone" is missing')
    p = forged({ "w" }, { a = { __tensor__ = 5 }, w = { __tensor__ = "w" } })
    H.assert_error(function() fsdp.load(p) end, "fsdp.load", p, "__tensor__ entry holds a number")
    p = forged({ "w" }, { a = { __int_keys__ = { x = 1 } }, w = { __tensor__ = "w" } })
    H.assert_error(function() fsdp.load(p) end, "fsdp.load", p, 'integer key "x"')
    still_works()
  end)
end)

describe("fsdp.load_sharded of a checkpoint whose layout lies (item 10)", function()
  local function linear()  -- weight (3, 4): 12 elements; bias (3)
    fsdp.manual_seed(0)
    return nn.Linear(4, 3)
  end
  local src = linear()
  local flat = { weight = src.weight:detach():reshape(-1), bias = src.bias:detach() }
  local GOOD = { weight = { { 0, 6 }, { 6, 6 } }, bias = { { 0, 3 }, { 0, 3 } } }  -- bias replicated

  -- writes a 2-rank checkpoint of `src` into a new directory: rank r holds pieces[name][r + 1] =
  -- {start, length} of each parameter; edit(r, tensors, meta, layout) may then damage rank r's file
  local n = 0
  local function craft(pieces, edit)
    n = n + 1
    local dir = ("%s/ck%d"):format(base, n)
    fsdp.save_sharded(dir .. "/one", src)
    local _, template = fsdp.load(dir .. "/one/ckpt-1/rank-0-of-1.safetensors")
    assert(os.execute(("mkdir -p %q"):format(dir .. "/ckpt-1")) == 0)
    for r = 0, 1 do
      local tensors, meta, layout = {}, {}, json.decode(template.layout, "layout")
      for k, v in pairs(template) do meta[k] = v end
      for name, l in pairs(layout) do
        l.start, l.length = pieces[name][r + 1][1], pieces[name][r + 1][2]
        local from = math.max(l.start, 0)  -- (a piece past the end: made-up values)
        tensors["model." .. name] = from + l.length > l.numel and fsdp.full({ l.length }, 7)
          or flat[name]:narrow(1, from + 1, l.length):clone()
      end
      meta.world_size, meta.rank, meta.layout = "2", tostring(r), nil
      if edit then edit(r, tensors, meta, layout) end
      meta.layout = meta.layout or json.encode(layout, "layout")
      fsdp.save(("%s/ckpt-1/rank-%d-of-2.safetensors"):format(dir, r), tensors, meta)
    end
    write_file(dir .. "/latest", "ckpt-1\nworld_size 2\n")
    return dir
  end
  local function file(dir, r) return ("%s/ckpt-1/rank-%d-of-2.safetensors"):format(dir, r) end
  -- loading dir must fail mentioning every fragment and leave the model as it was
  local function refused(dir, ...)
    local m = nn.Linear(4, 3)
    local before = m.weight:detach():clone()
    H.assert_error(function() fsdp.load_sharded(dir, m) end, "fsdp.load_sharded", ...)
    assert.same(before:tolist(), m.weight:detach():tolist())
    return m
  end

  it("a sound 2-rank checkpoint (a replicated bias) loads the same numbers", function()
    local m = nn.Linear(4, 3)
    fsdp.load_sharded(craft(GOOD), m)
    assert.same(src.weight:tolist(), m.weight:tolist())
    assert.same(src.bias:tolist(), m.bias:tolist())
  end)

  it("refuses pieces that overlap, leave a gap, start before 0 or end past the parameter", function()
    local dir = craft({ weight = { { 0, 8 }, { 6, 6 } }, bias = GOOD.bias })
    refused(dir, '"weight"', "overlap", file(dir, 0), file(dir, 1))
    dir = craft({ weight = { { 0, 5 }, { 6, 6 } }, bias = GOOD.bias })
    refused(dir, '"weight"', "elements [5, 6)")
    dir = craft({ weight = { { -2, 6 }, { 4, 8 } }, bias = GOOD.bias })
    refused(dir, file(dir, 0), '"weight"', "start -2")
    dir = craft({ weight = { { 0, 6 }, { 6, 8 } }, bias = GOOD.bias })
    refused(dir, file(dir, 1), '"weight"', "not within its 12 elements")
    dir = craft({ weight = { { 0, 6 }, { 6, 6 } }, bias = { { 0, 3 }, { 0, 2 } } })
    refused(dir, '"bias"', "overlap")
  end)

  it("refuses a layout entry that is not numbers, a shape that is not its numel, and pieces of two dtypes", function()
    local dir = craft(GOOD, function(r, _, _, layout) if r == 1 then layout.weight.length = nil end end)
    refused(dir, file(dir, 1), '"weight"', "length nil")
    dir = craft(GOOD, function(r, _, _, layout) if r == 1 then layout.weight.start = "6" end end)
    refused(dir, file(dir, 1), '"weight" the piece start "6"')
    dir = craft(GOOD, function(r, _, _, layout) if r == 1 then layout.weight.shape = { 3, 5 } end end)
    refused(dir, file(dir, 1), '"weight"', "(3, 5) has 15")
    dir = craft(GOOD, function(r, _, _, layout) if r == 1 then layout.weight.shape, layout.weight.numel = { 4, 3 }, 12 end end)
    refused(dir, file(dir, 1), '"weight" the shape (4, 3)', "(3, 4)")
    dir = craft(GOOD, function(r, t) if r == 1 then t["model.weight"] = t["model.weight"]:to("bfloat16") end end)
    refused(dir, file(dir, 1), '"model.weight" as bfloat16', "as float32")
    dir = craft(GOOD, function(r, t) if r == 1 then t["model.weight"] = t["model.weight"]:narrow(1, 1, 5) end end)
    refused(dir, file(dir, 1), '5 elements of "model.weight"', "says 6")
  end)

  it("refuses rank files that disagree on the tensors they describe or hold tensors they do not describe", function()
    local dir = craft(GOOD, function(r, t, _, layout) if r == 1 then layout.bias, t["model.bias"] = nil, nil end end)
    refused(dir, file(dir, 1), 'lacks "bias" in its layout')
    dir = craft(GOOD, function(r, t) if r == 1 then t["model.stray"] = fsdp.ones { 2 } end end)
    refused(dir, file(dir, 1), '"model.stray"', "does not describe")
  end)

  it("refuses damaged metadata: world size, layout, extra, rng, optimizer state, latest", function()
    local dir = craft(GOOD, function(r, _, meta) if r == 1 then meta.world_size = "3" end end)
    refused(dir, file(dir, 1), "world_size 3")
    dir = craft(GOOD, function(r, _, meta) if r == 0 then meta.layout = '{"weight":' end end)
    refused(dir, file(dir, 0), "layout: malformed JSON")
    dir = craft(GOOD, function(r, _, meta) if r == 0 then meta.extra = "5" end end)
    refused(dir, file(dir, 0), "extra")
    dir = craft(GOOD, function(r, _, meta) if r == 0 then meta.rng = "1,2,3" end end)
    refused(dir, file(dir, 0), "malformed rng state")
    dir = craft(GOOD, function(r, _, meta) if r == 0 then meta.optim = '{"class":"AdamW"}' end end)
    local m = nn.Linear(4, 3)
    H.assert_error(function() fsdp.load_sharded(dir, m, fsdp.optim.AdamW(m:parameters())) end,
      "fsdp.load_sharded", file(dir, 0), "optimizer metadata")
    dir = craft(GOOD)
    write_file(dir .. "/latest", "ckpt-99999999999999999999\nworld_size 2\n")
    refused(dir, dir .. "/latest", "malformed")
    dir = craft(GOOD)
    os.remove(file(dir, 1))
    refused(dir, file(dir, 1), "No such file")
    H.assert_error(function() CK.consolidate(dir, base .. "/c.safetensors") end, "fsdp-consolidate", file(dir, 1))
    still_works()
  end)
end)

describe("values JSON cannot hold, and damaged files (item 11)", function()
  it("save_sharded names where in extra a cycle, a function, a NaN or a mixed table sits", function()
    local m = nn.Linear(2, 2)
    local dir = base .. "/extra"
    local extra = { a = { b = {} } }
    extra.a.b.c = extra.a
    H.assert_error(function() fsdp.save_sharded(dir, m, nil, extra) end, "fsdp.save_sharded: extra has a cycle at extra.a.b.c")
    H.assert_error(function() fsdp.save_sharded(dir, m, nil, { cfg = { f = print } }) end,
      "fsdp.save_sharded", "cannot store a function at extra.cfg.f")
    H.assert_error(function() fsdp.save_sharded(dir, m, nil, { list = { 1, 0 / 0 } }) end,
      "fsdp.save_sharded", "non-finite number", "at extra.list[2]")
    H.assert_error(function() fsdp.save_sharded(dir, m, nil, { t = { 1, 2, x = 3 } }) end,
      "fsdp.save_sharded", "number key 1 in extra.t")
    H.assert_error(function() fsdp.save_sharded(dir, m, nil, { ["odd key"] = { io.stdout } }) end,
      "fsdp.save_sharded", 'cannot store a userdata at extra["odd key"][1]')
    local shared = { 1 }
    fsdp.save_sharded(dir, m, nil, { p = shared, q = shared })  -- a table twice is no cycle
    assert.same({ p = { 1 }, q = { 1 } }, fsdp.load_sharded(dir, m))
  end)

  -- every damaged file is loaded in one child process (a crash fails the test, not busted)
  it("fsdp.load names itself and the file for every damaged safetensors file, lazy values included", function()
    local function u64(v)
      local b = {}
      for i = 1, 8 do b[i] = string.char(v % 256); v = math.floor(v / 256) end
      return table.concat(b)
    end
    local function st(header, nbytes) return u64(#header) .. header .. ("\0"):rep(nbytes) end
    local good = st('{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}', 16)
    local cases = {
      truncated = good:sub(1, #good - 3),
      flipped = good:sub(1, 12) .. "\255" .. good:sub(14),
      brace = good:sub(1, 8) .. "}" .. good:sub(10),
      huge_offsets = st('{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,9223372036854775807]}}', 8),
      huge_shape = st('{"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,16]}}', 16),
      dtype = st('{"w":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}}', 16),
      negative = st('{"w":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}}', 16),
      mismatch = st('{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}', 16),
      header_length = u64(2 ^ 40) .. "{}",
      empty = "",
    }
    local code = { "local ok, err" }
    for name, bytes in pairs(cases) do
      local p = ("%s/bad_%s.safetensors"):format(base, name)
      write_file(p, bytes)
      code[#code + 1] = ("ok, err = pcall(fsdp.load, %q); print(%q, ok and 'LOADED' or err)"):format(p, name)
    end
    -- a file cut short after it was opened: the file-backed tensor's read fails when used
    local p = base .. "/cut.safetensors"
    write_file(p, good)
    code[#code + 1] = ("local t = fsdp.load(%q).w; io.open(%q, 'wb'):close()"):format(p, p)
    code[#code + 1] = "ok, err = pcall(function() return t:sum():item() end); print('cut', ok and 'LOADED' or err)"
    code[#code + 1] = "print(fsdp.tensor({1, 2}):sum():item())"
    local rc, out = H.lua(table.concat(code, "\n"))
    assert.equal(0, rc, out)
    assert.truthy(out:find("\n3\n", 1, true) or out:find("^3\n") or out:find("\n3$"), out)
    for name in pairs(cases) do
      local line = out:match("\n" .. name .. "\t([^\n]*)") or out:match("^" .. name .. "\t([^\n]*)")
      assert.truthy(line, ("no result for %s:\n%s"):format(name, out))
      assert.truthy(line:find("^fsdp%.load: ") and line:find(("%s/bad_%s.safetensors"):format(base, name), 1, true),
        ("%s: %s"):format(name, line))
    end
    local cut = out:match("cut\t([^\n]*)")
    assert.truthy(cut and cut:find(p, 1, true) and cut:find("truncated", 1, true), out)
  end)
end)

teardown(function() os.execute(("rm -rf %q"):format(base)) end)
