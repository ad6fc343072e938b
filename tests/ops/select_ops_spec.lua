-- Selection, sorting, sampling and shape ops beyond what the op-case table (tests/ops/op_cases.lua)
-- expresses: sort/topk/gather/scatter_add against PyTorch on inputs full of ties
-- (tests/golden/gen_select_ops.py), NaN order, where topk's gradient goes; multinomial's
-- distribution (chi-square bounds over many draws, with and without replacement), its determinism
-- per seed, on the device double and across 2 ranks (bin/fsdprun, tests/scripts/multinomial_ranks.lua);
-- split/chunk/stack/tile/repeat forms; and the error messages, in the user's 1-based dims.
local fsdp = require "fsdp"
local json = require "fsdp.json"
local H = require "helpers"

local golden = json.decode(H.read_file(H.root .. "/tests/golden/select_ops.json"), "select_ops.json")

local function from(a) return fsdp.tensor(a.data):view(a.shape) end
local function ints(a) return fsdp.tensor(a.data, "int64"):view(a.shape) end

describe("sort, topk, gather, scatter_add against PyTorch", function()
  for k, c in ipairs(golden) do
    local name = ("%d: %s dim=%d%s%s%s"):format(k, c.op, c.dim, c.k and (" k=" .. c.k) or "",
      c.largest == false and " smallest" or (c.descending and " descending" or ""), c.ties and " ties" or "")
    it(name, function()
      local x = from(c.x)
      if c.op == "sort" then
        local v, i = x:sort({ dim = c.dim, descending = c.descending })
        assert.same(c.values, v:tolist())
        assert.same(c.indices, i:tolist()) -- stable: ties keep their order, as torch.sort(stable=True)
        assert.same(c.indices, x:argsort(c.dim, c.descending):tolist())
      elseif c.op == "topk" then
        local v, i = x:topk(c.k, { dim = c.dim, largest = c.largest })
        assert.same(c.values, v:tolist())
        if c.ties then -- PyTorch's tie order is its partial sort's; ours is index order (a stable sort's)
          assert.same(c.values, x:gather(c.dim, i):tolist())
          local s = x:sort({ dim = c.dim, descending = c.largest })
          assert.same(s:narrow(c.dim, 1, c.k):tolist(), v:tolist())
          local si = select(2, x:sort({ dim = c.dim, descending = c.largest }))
          assert.same(si:narrow(c.dim, 1, c.k):contiguous():tolist(), i:tolist())
        else
          assert.same(c.indices, i:tolist())
        end
      elseif c.op == "gather" then
        assert.same(c.values, x:gather(c.dim, ints(c.index)):tolist())
      else
        H.assert_close(x:scatter_add(c.dim, ints(c.index), from(c.src)):tolist(), c.values, 1e-6, 1e-6, name)
      end
    end)
  end
end)

describe("sort and topk", function()
  local nan = 0 / 0
  local function is_nan(v) return v ~= v end

  it("put NaN after every number, and first when descending or taking the largest", function()
    local x = fsdp.tensor { 2, nan, -1, 3 }
    local v, i = x:sort()
    assert.same({ 2, 0, 3 }, { i:tolist()[1], i:tolist()[2], i:tolist()[3] })
    assert.same({ -1, 2, 3 }, { v:tolist()[1], v:tolist()[2], v:tolist()[3] })
    assert.is_true(is_nan(v:tolist()[4]))
    assert.equal(1, i:tolist()[4])
    v, i = x:sort(1, true)
    assert.is_true(is_nan(v:tolist()[1]))
    assert.same({ 1, 3, 0, 2 }, i:tolist())
    v, i = x:topk(2)
    assert.same({ 1, 3 }, i:tolist())
    v, i = x:topk(2, 1, false)
    assert.same({ -1, 2 }, v:tolist())
    assert.same({ 2, 0 }, i:tolist())
  end)

  it("send topk's gradient to the chosen positions only, and sort's to every position", function()
    local x = H.leaf { { 1, 5, 3, 4 }, { 9, 0, 2, 8 } }
    local v = x:topk(2)
    local loss = (v * fsdp.tensor { { 1, 2 }, { 3, 4 } }):sum()
    loss:backward()
    assert.same({ 0, 1, 0, 2, 3, 0, 0, 4 }, x.grad:tolist())
    local y = H.leaf { 3, 1, 2 }
    local s = y:sort({ descending = true })
    loss = (s * fsdp.tensor { 10, 20, 30 }):sum()
    loss:backward()
    assert.same({ 10, 30, 20 }, y.grad:tolist())
    assert.equal("GatherBackward", s.grad_fn)
  end)

  it("keep a bfloat16 input's dtype and accept positional and keyword forms alike", function()
    local x = fsdp.tensor({ { 0.5, -1, 2 }, { 3, 0, 1 } }, "bfloat16")
    local v, i = x:topk(1, -1)
    assert.equal("bfloat16", v.dtype)
    assert.equal("int64", i.dtype)
    assert.same({ 2, 3 }, v:tolist())
    local a, b = x:sort(1, true)
    local c, d = x:sort { dim = 1, descending = true }
    assert.same(a:tolist(), c:tolist())
    assert.same(b:tolist(), d:tolist())
    assert.same({ 3, 0, 2, 0.5, -1, 1 }, a:tolist())
  end)

  it("handle 0-dim and empty tensors", function()
    local v, i = fsdp.tensor(5):sort()
    assert.same({}, v:shape())
    assert.equal(5, v:item())
    assert.equal(0, i:item())
    v, i = fsdp.zeros { 3, 0 }:topk(0)
    assert.same({ 3, 0 }, v:shape())
    assert.same({ 3, 0 }, i:shape())
  end)
end)

describe("gather and scatter_add", function()
  it("are each other's backward", function()
    local x = H.leaf { { 1, 2, 3 }, { 4, 5, 6 } }
    local idx = fsdp.tensor({ { 2, 2 }, { 0, 1 } }, "int64")
    local g = x:gather(2, idx)
    assert.same({ 3, 3, 4, 5 }, g:tolist())
    local loss = (g * fsdp.tensor { { 1, 2 }, { 3, 4 } }):sum()
    loss:backward()
    assert.same({ 0, 0, 3, 3, 4, 0 }, x.grad:tolist()) -- a repeated index adds up
    local base, src = H.leaf { 0, 0, 0 }, H.leaf { 1, 2, 3, 4 }
    local out = base:scatter_add(1, fsdp.tensor({ 2, 0, 2 }, "int64"), src)
    assert.same({ 2, 0, 4 }, out:tolist())
    loss = (out * fsdp.tensor { 10, 20, 30 }):sum()
    loss:backward()
    assert.same({ 10, 20, 30 }, base.grad:tolist())
    assert.same({ 30, 10, 30, 0 }, src.grad:tolist()) -- src beyond the index gets no gradient
  end)
end)

describe("multinomial", function()
  local probs = { 1, 2, 3, 4, 0 } -- unnormalized, one impossible category
  local total = 10

  -- Pearson's chi-square of counts against expected probabilities (over the categories with p > 0)
  local function chi2(counts, expect, n)
    local s = 0
    for k, p in pairs(expect) do
      local e = n * p
      s = s + ((counts[k] or 0) - e) ^ 2 / e
    end
    return s
  end

  it("draws each category in proportion to its weight (with replacement)", function()
    fsdp.manual_seed(11)
    local n = 20000
    local s = fsdp.multinomial(fsdp.tensor(probs), n, { replacement = true })
    assert.same({ n }, s:shape())
    assert.equal("int64", s.dtype)
    local counts = {}
    for _, v in ipairs(s:tolist()) do counts[v] = (counts[v] or 0) + 1 end
    assert.is_nil(counts[4], "category 4 has weight 0")
    local expect = {}
    for k = 1, 4 do expect[k - 1] = probs[k] / total end
    -- 4 degrees of freedom: P(chi2 > 18.47) = 0.001 for a correct sampler
    local x2 = chi2(counts, expect, n)
    assert.is_true(x2 < 18.47, ("chi-square %.2f over 4 degrees of freedom"):format(x2))
  end)

  it("draws without replacement as successive draws from what is left", function()
    fsdp.manual_seed(12)
    local rows = 6000
    local p = fsdp.tensor(probs):view(1, 5):expand(rows, 5)
    local s = p:multinomial(2)
    assert.same({ rows, 2 }, s:shape())
    local flat = s:tolist()
    local counts, expect = {}, {}
    for r = 0, rows - 1 do
      local a, b = flat[2 * r + 1], flat[2 * r + 2]
      assert.are_not.equal(a, b)
      assert.is_true(a ~= 4 and b ~= 4)
      local key = a * 5 + b
      counts[key] = (counts[key] or 0) + 1
    end
    for a = 0, 3 do
      for b = 0, 3 do
        if a ~= b then
          local pa = probs[a + 1] / total
          expect[a * 5 + b] = pa * (probs[b + 1] / total) / (1 - pa)
        end
      end
    end
    -- 12 ordered pairs, 11 degrees of freedom: P(chi2 > 31.26) = 0.001
    local x2 = chi2(counts, expect, rows)
    assert.is_true(x2 < 31.26, ("chi-square %.2f over 11 degrees of freedom"):format(x2))
    -- as many samples as non-zero categories: a permutation of them
    local all = fsdp.multinomial(fsdp.tensor { 0, 1, 1, 1 }, 3):tolist()
    table.sort(all)
    assert.same({ 1, 2, 3 }, all)
  end)

  it("gives the same samples for the same seed, other samples for another seed, on every device", function()
    local p = fsdp.tensor { { 1, 2, 3, 4, 0 }, { 0.5, 0, 0, 0, 0.5 } }
    local function draw(seed, t)
      fsdp.manual_seed(seed)
      local a = t:multinomial(50, { replacement = true })
      local b = t:multinomial(2)
      return a:to("cpu"):tolist(), b:to("cpu"):tolist()
    end
    local a1, b1 = draw(5, p)
    local a2, b2 = draw(5, p)
    assert.same(a1, a2)
    assert.same(b1, b2)
    local a3 = draw(6, p)
    assert.are_not.same(a1, a3)
    if not fsdp.cuda.is_available() then fsdp._testdev_install() end
    local pd = p:to("cuda")
    local a4, b4 = draw(5, pd)
    assert.same(a1, a4)
    assert.same(b1, b4)
    fsdp.manual_seed(5)
    assert.equal("cuda", pd:multinomial(1).device)
  end)

  it("draws the same samples on 2 ranks", function()
    if not H.has_mpi() then pending("no mpirun or libfsdp_mpi.so") return end
    local rc, out = H.sh(("%s -n 2 %smultinomial_ranks.lua"):format(H.fsdprun, H.scripts), nil, 120)
    assert.equal(0, rc, out)
    local text = H.untag(out)
    local r0 = text:match("multinomial rank 0/2: ([%d ]+)")
    local r1 = text:match("multinomial rank 1/2: ([%d ]+)")
    assert.truthy(r0, out)
    assert.equal(r0, r1)
    -- and the same as one process with the same seed (every run draws the same)
    local rc1, out1 = H.lua("dofile(" .. ("%q"):format(H.scripts .. "multinomial_ranks.lua") .. ")")
    assert.equal(0, rc1, out1)
    assert.equal(r0, out1:match("multinomial rank 0/1: ([%d ]+)"))
  end)

  it("refuses invalid probabilities and sample counts, naming them", function()
    local m = fsdp.multinomial
    H.assert_error(function() m(fsdp.tensor { 1, -1 }, 1) end, "multinomial", "value -1", "row 1",
      "category 1", "non-negative")
    H.assert_error(function() m(fsdp.tensor { 1, 0 / 0 }, 1) end, "multinomial", "nan", "finite")
    H.assert_error(function() m(fsdp.tensor { { 1, 1 }, { 0, 0 } }, 1) end, "row 2", "sums to zero")
    H.assert_error(function() m(fsdp.tensor { 1, 1 }, 3) end, "cannot draw 3 samples without replacement",
      "2 categories")
    H.assert_error(function() m(fsdp.tensor { 1, 0, 1 }, 3) end, "only 2 non-zero categories")
    H.assert_error(function() m(fsdp.tensor { 1, 1 }, 0) end, "num_samples must be at least 1")
    H.assert_error(function() m(fsdp.zeros { 2, 2, 2 }, 1) end, "1-D or 2-D", "(2, 2, 2)")
    H.assert_error(function() m(fsdp.tensor({ 1, 2 }, "int64"), 1) end, "multinomial", "float")
    H.assert_error(function() m(fsdp.tensor { 1, 1 }, 1, { replacement = 1 }) end, "replacement", "a boolean")
    H.assert_error(function() m({ 1, 1 }, 1) end, "multinomial", "probs")
    assert.same({ 7 }, m(fsdp.tensor { 1, 1 }, 7, { replacement = true }):shape()) -- more draws than categories
  end)
end)

describe("split, chunk, stack, tile and repeat", function()
  it("split into views that share storage and chunk like torch.chunk", function()
    local x = fsdp.arange(0, 10, 1, "float32")
    local parts = x:split(4)
    assert.equal(3, #parts)
    assert.same({ 8, 9 }, parts[3]:tolist())
    parts[1]:fill_(-1)
    assert.equal(-1, x:tolist()[1])
    assert.equal(4, #x:chunk(4)) -- 3, 3, 3, 1
    assert.equal(3, #fsdp.zeros(6):chunk(4)) -- 2, 2, 2: fewer pieces, as PyTorch
    local sizes = {}
    for k, p in ipairs(fsdp.zeros { 2, 9 }:split({ 2, 3, 4 }, -1)) do sizes[k] = p:size(2) end
    assert.same({ 2, 3, 4 }, sizes)
  end)

  it("stack along a new dim, at the end with -1", function()
    local a, b = fsdp.tensor { 1, 2 }, fsdp.tensor { 3, 4 }
    assert.same({ { 1, 2 }, { 3, 4 } }, fsdp.stack { a, b }:totable())
    assert.same({ { 1, 3 }, { 2, 4 } }, fsdp.stack({ a, b }, -1):totable())
    assert.same({ 2, 2 }, fsdp.stack({ a, b }, 2):shape())
  end)

  it("tile and repeat: `repeat` is a Lua keyword, so x:repeat(...) does not parse", function()
    assert.is_nil(load("local x; return x:repeat(2, 3)"))
    local x = fsdp.tensor { { 1, 2 } }
    assert.same({ { 1, 2, 1, 2 }, { 1, 2, 1, 2 } }, x:tile(2, 2):totable())
    assert.same({ { 1, 2, 1, 2 }, { 1, 2, 1, 2 } }, x["repeat"](x, { 2, 2 }):totable())
    assert.same({ 1, 4 }, x:tile { 2 }:shape()) -- torch.tile: fewer counts repeat the last dims
    assert.same({ 3, 1, 4 }, x["repeat"](x, 3, 1, 2):shape())
  end)

  it("squeeze every size-1 dim or the listed ones; unsqueeze and expand take PyTorch's forms", function()
    local x = fsdp.zeros { 1, 3, 1, 2 }
    assert.same({ 3, 2 }, x:squeeze():shape())
    assert.same({ 3, 1, 2 }, x:squeeze(1):shape())
    assert.same({ 3, 2 }, x:squeeze { 1, -2 }:shape())
    assert.same({ 1, 3, 1, 2 }, x:squeeze(2):shape()) -- not size 1: unchanged
    assert.same({ 1, 3, 1, 2 }, x:squeeze {}:shape())
    assert.same({}, fsdp.tensor(5):squeeze():shape())
    assert.same({ 1, 3, 1, 2, 1 }, x:unsqueeze(-1):shape())
    assert.same({ 1, 1, 3, 1, 2 }, x:unsqueeze(1):shape())
    local c = fsdp.zeros { 3, 1 }
    assert.same({ 2, 3, 4 }, c:expand(2, -1, 4):shape())
    assert.same({ 2, 3, 4 }, c:expand { 2, -1, 4 }:shape())
  end)
end)

describe("errors name the op, the argument and 1-based dims", function()
  local x = fsdp.zeros { 2, 3 }
  local idx = fsdp.tensor({ { 0, 1 } }, "int64")
  it("for dims", function()
    H.assert_error(function() x:topk(1, 3) end, "topk: dimension 3 out of range for a tensor with 2 dims", "1..2")
    H.assert_error(function() x:sort(-3) end, "sort: dimension -3 out of range")
    H.assert_error(function() x:gather(0, idx) end, "gather: dimension must be a non-zero integer")
    H.assert_error(function() x:squeeze(3) end, "squeeze: dimension 3 out of range")
    H.assert_error(function() x:unsqueeze(4) end, "unsqueeze: dimension 4 out of range for a tensor with 2 dims", "1..3")
    H.assert_error(function() x:split(1, 3) end, "split: dimension 3")
    H.assert_error(function() fsdp.stack({ x, x }, 4) end, "stack: dimension 4 out of range for a tensor with 2 dims")
    H.assert_error(function() x:expand(3, 3) end, "expand", "existing size 2 at dim 1")
    H.assert_error(function() fsdp.zeros { 2, 1 }:expand(2, 4, 3) end, "expand", "existing size 2 at dim 2")
  end)
  it("for values and shapes", function()
    H.assert_error(function() x:topk(4) end, "topk: k = 4 is out of range for dim 2 of size 3")
    H.assert_error(function() x:topk(1.5) end, "topk", "k", "an integer")
    H.assert_error(function() x:sort { descending = "yes" } end, "sort", "descending", "a boolean")
    H.assert_error(function() x:gather(2, fsdp.tensor({ { 0, 3 } }, "int64")) end,
      "gather: index 3 (at position 2", "out of range for dim 2 of size 3", "0-based")
    H.assert_error(function() x:gather(2, fsdp.tensor({ 0, 1 }, "int64")) end, "gather", "as many dims")
    H.assert_error(function() x:gather(2, fsdp.tensor { { 0, 1 } }) end, "gather: index must be an int64 tensor")
    H.assert_error(function() x:gather(2, fsdp.zeros({ 3, 1 }, "int64")) end, "larger than the input", "at dim 1")
    H.assert_error(function() x:scatter_add(2, idx, fsdp.zeros { 1, 1 }) end, "scatter_add",
      "larger than src of shape (1, 1) at dim 2")
    H.assert_error(function() x:scatter_add(2, idx, fsdp.zeros({ 1, 2 }, "bfloat16")) end, "scatter_add",
      "src (bfloat16) must have the input's dtype (float32)")
    H.assert_error(function() x:split { 1, 2 } end, "split: split_size_or_sections {1, 2} sum to 3, but dim 1 has size 2")
    H.assert_error(function() x:chunk(0) end, "chunk", "chunks", "an integer >= 1")
    H.assert_error(function() fsdp.stack { x, fsdp.zeros { 3, 2 } } end, "stack: tensors[2] has shape {3, 2}",
      "tensors[1] has {2, 3}")
    H.assert_error(function() x["repeat"](x, 2) end, "repeat: repeats gives 1 counts for a tensor with 2 dims", "x:tile")
    H.assert_error(function() x:tile(2, -1) end, "tile", "repeats[2]", "an integer >= 0")
  end)
end)
