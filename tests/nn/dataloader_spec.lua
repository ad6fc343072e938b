-- fsdp.data: DistributedSampler against a plain-Lua reference of PyTorch's index algorithm (itself
-- checked on PyTorch's own lists, tests/golden/distributed_sampler.json from
-- tests/golden/gen_distributed_sampler.py), the structure of its partitions, the DataLoader's
-- batching, collation, shuffling and resumption, and a 2-rank run (tests/scripts/dataloader_ranks.lua).
local fsdp = require "fsdp"
local json = require "fsdp.json"
local H = require "helpers"
local data = fsdp.data

-- torch.utils.data.DistributedSampler.__iter__, written as PyTorch writes it: `order` (a list of
-- the epoch's indices) -> the list of every rank's indices
local function ref_partition(order, n, N, drop_last)
  local num = (drop_last and n % N ~= 0) and math.ceil((n - N) / N) or math.ceil(n / N)
  local total = num * N
  local idx = {}
  for i, v in ipairs(order) do idx[i] = v end
  if not drop_last then
    local pad = total - #idx
    if pad <= #idx then
      for i = 1, pad do idx[#idx + 1] = order[i] end
    else  -- indices += (indices * ceil(padding_size / len(indices)))[:padding_size]
      local rep = {}
      for _ = 1, math.ceil(pad / #order) do for _, v in ipairs(order) do rep[#rep + 1] = v end end
      for i = 1, pad do idx[#idx + 1] = rep[i] end
    end
  else
    for i = #idx, total + 1, -1 do idx[i] = nil end
  end
  assert(#idx == total)
  local out = {}
  for r = 0, N - 1 do
    out[r + 1] = {}
    for i = r + 1, total, N do table.insert(out[r + 1], idx[i]) end  -- indices[rank:total:replicas]
  end
  return out
end

local function minus1(list)
  local o = {}
  for i, v in ipairs(list) do o[i] = v - 1 end
  return o
end

local golden = json.decode(H.read_file(H.root .. "/tests/golden/distributed_sampler.json"), "golden")

describe("DistributedSampler", function()
  it("the plain-Lua reference reproduces PyTorch's lists", function()
    assert.is_true(#golden.cases > 100)
    for _, c in ipairs(golden.cases) do
      local got = ref_partition(c.order, c.n, c.num_replicas, c.drop_last)
      assert.are.same(c.ranks, got, json.encode(c, "case"))
    end
  end)

  it("gives PyTorch's lists unshuffled, and the reference applied to fsdp's permutation shuffled", function()
    for _, c in ipairs(golden.cases) do
      local order = {}
      if c.shuffle then order = minus1(data.randperm(c.n, c.seed + c.epoch))
      else for i = 1, c.n do order[i] = i - 1 end end
      local want = ref_partition(order, c.n, c.num_replicas, c.drop_last)
      if not c.shuffle then assert.are.same(c.ranks, want) end
      for r = 0, c.num_replicas - 1 do
        local s = data.DistributedSampler(c.n, { num_replicas = c.num_replicas, rank = r, shuffle = c.shuffle,
          seed = c.seed, drop_last = c.drop_last })
        s:set_epoch(c.epoch)
        local got = minus1(s:indices())
        assert.are.same(want[r + 1], got, ("n %d replicas %d rank %d drop_last %s shuffle %s")
          :format(c.n, c.num_replicas, r, tostring(c.drop_last), tostring(c.shuffle)))
        assert.are.equal(#want[r + 1], s:len())
      end
    end
  end)

  it("partitions: the same count on every rank, distinct samples, all of them, padding by repetition", function()
    for _, n in ipairs { 1, 6, 7, 11, 64, 100 } do
      for _, N in ipairs { 1, 2, 3, 4, 7 } do
        for _, drop_last in ipairs { false, true } do
          local lists, count = {}, {}
          for r = 0, N - 1 do
            local s = data.DistributedSampler(n, { num_replicas = N, rank = r, seed = 5, drop_last = drop_last })
            s:set_epoch(3)
            lists[r + 1] = s:indices()
            assert.are.equal(#lists[1], #lists[r + 1], "equal counts")
          end
          local per = #lists[1]
          if drop_last then assert.are.equal(math.floor(n / N), per) else assert.are.equal(math.ceil(n / N), per) end
          for _, l in ipairs(lists) do for _, i in ipairs(l) do count[i] = (count[i] or 0) + 1 end end
          local distinct, extra = 0, 0
          for i, k in pairs(count) do
            assert.is_true(i >= 1 and i <= n, "index in 1..n")
            distinct = distinct + 1
            extra = extra + k - 1
          end
          if drop_last then
            assert.are.equal(per * N, distinct, "drop_last: no sample twice")
            assert.are.equal(0, extra)
          else
            assert.are.equal(n, distinct, "every sample seen")
            assert.are.equal(per * N - n, extra, "exactly the padding repeats")
            -- the padding is the beginning of the epoch's order again
            local order = data.randperm(n, 5 + 3)
            for j = 1, per * N - n do
              local pos = n + j                                    -- position in the padded order
              local r, k = (pos - 1) % N, math.floor((pos - 1) / N) + 1
              assert.are.equal(order[(j - 1) % n + 1], lists[r + 1][k])
            end
          end
        end
      end
    end
  end)

  it("reshuffles per epoch from seed + epoch, the same order for the same seed and epoch", function()
    local function idx(seed, epoch, rank)
      local s = data.DistributedSampler(50, { num_replicas = 2, rank = rank or 0, seed = seed })
      s:set_epoch(epoch)
      return s:indices()
    end
    assert.are.same(idx(0, 1), idx(0, 1))
    assert.are_not.same(idx(0, 1), idx(0, 2))
    assert.are_not.same(idx(0, 1), idx(7, 1))
    assert.are.same(idx(1, 1), idx(0, 2), "seed + epoch, as PyTorch seeds its generator")
    -- without shuffle: 1, 1 + N, ... whatever the epoch
    local s = data.DistributedSampler(7, { num_replicas = 3, rank = 1, shuffle = false })
    s:set_epoch(4)
    assert.are.same({ 2, 5, 1 }, s:indices())
  end)

  it("draws its permutation without disturbing the global RNG stream", function()
    fsdp.manual_seed(11)
    local a = fsdp.rand(5):tolist()
    fsdp.manual_seed(11)
    data.randperm(100, 3)
    local s = data.DistributedSampler(30, { num_replicas = 2, rank = 0 })
    s:indices()
    assert.are.same(a, fsdp.rand(5):tolist())
    -- and it is fsdp.randperm's permutation after fsdp.manual_seed(seed)
    fsdp.manual_seed(42)
    local p = fsdp.randperm(20):tolist()
    for i = 1, 20 do p[i] = p[i] + 1 end
    assert.are.same(p, data.randperm(20, 42))
  end)

  it("resumes an epoch from its state_dict", function()
    local s = data.DistributedSampler(40, { num_replicas = 2, rank = 1, seed = 9 })
    s:set_epoch(2)
    local full = s:indices()
    local it, seen = s:iter(), {}
    for _ = 1, 7 do seen[#seen + 1] = it() end
    local sd = s:state_dict()
    assert.are.same({ epoch = 2, pos = 7 }, sd)
    local t = data.DistributedSampler(40, { num_replicas = 2, rank = 1, seed = 9 })
    t:load_state_dict(sd)
    t:set_epoch(2)  -- the epoch of the checkpoint: the position stays
    for i in t:iter() do seen[#seen + 1] = i end
    assert.are.same(full, seen)
    -- another epoch starts from its beginning
    local u = data.DistributedSampler(40, { num_replicas = 2, rank = 1, seed = 9 })
    u:load_state_dict(sd)
    u:set_epoch(3)
    local n = 0
    for _ in u:iter() do n = n + 1 end
    assert.are.equal(20, n)
  end)

  it("rejects bad arguments", function()
    H.assert_error(function() data.DistributedSampler(10, { num_replicas = 2, rank = 2 }) end, "DistributedSampler", "invalid rank 2", "[0, 1]")
    H.assert_error(function() data.DistributedSampler(10, { num_replicas = 0 }) end, "num_replicas", ">= 1")
    H.assert_error(function() data.DistributedSampler(10, { seed = -1 }) end, "seed")
    H.assert_error(function() data.DistributedSampler(10, { shufle = true }) end, "unknown option shufle")
    H.assert_error(function() data.DistributedSampler("x") end, "DistributedSampler", "dataset")
    local s = data.DistributedSampler(10, { num_replicas = 1, rank = 0 })
    H.assert_error(function() s:load_state_dict({ epoch = 1 }) end, "load_state_dict", "pos")
    H.assert_error(function() s:set_epoch(1.5) end, "set_epoch", "integer")
  end)
end)

describe("DataLoader", function()
  local x = fsdp.arange(0, 30, 1, "float32"):reshape({ 10, 3 })
  local y = fsdp.arange(10)
  local ds = data.TensorDataset(x, y)

  -- the rows of y a loader yields, batch by batch
  local function ys(loader)
    local out = {}
    for _, yb in loader() do out[#out + 1] = yb:tolist() end
    return out
  end

  it("batches a TensorDataset in order, #loader batches, drop_last", function()
    local L = data.DataLoader(ds, { batch_size = 4 })
    assert.are.equal(3, #L)
    assert.are.equal(3, L:len())
    local n = 0
    for xb, yb in L() do
      n = n + 1
      assert.are.same(n < 3 and { 4, 3 } or { 2, 3 }, xb:shape())
      local flat = xb:tolist()  -- (row-major, flat)
      for j, v in ipairs(yb:tolist()) do
        assert.are.same({ 3 * v, 3 * v + 1, 3 * v + 2 }, { flat[3 * j - 2], flat[3 * j - 1], flat[3 * j] })
      end
    end
    assert.are.equal(3, n)
    assert.are.same({ { 0, 1, 2, 3 }, { 4, 5, 6, 7 }, { 8, 9 } }, ys(L))
    local D = data.DataLoader(ds, { batch_size = 4, drop_last = true })
    assert.are.equal(2, #D)
    assert.are.same({ { 0, 1, 2, 3 }, { 4, 5, 6, 7 } }, ys(D))
    assert.are.equal(10, #data.DataLoader(ds))
    -- loader:iter() is loader()
    local k = 0
    for _ in L:iter() do k = k + 1 end
    assert.are.equal(3, k)
  end)

  it("the fast path (index_select of rows) equals collating samples one by one", function()
    local function slow(samples) return data.default_collate(samples) end
    local a = data.DataLoader(ds, { batch_size = 3, shuffle = true, seed = 4 })
    local b = data.DataLoader(ds, { batch_size = 3, shuffle = true, seed = 4, collate_fn = slow })
    local ia, ib = a(), b()
    for _ = 1, 4 do
      local xa, ya = ia()
      local xb, yb = ib()
      assert.are.same(xb:tolist(), xa:tolist())
      assert.are.same(yb:tolist(), ya:tolist())
      assert.are.equal("int64", ya.dtype)
    end
    assert.is_nil(ia())
    assert.is_nil(ib())
  end)

  -- PyTorch's batches are new tensors; unshuffled TensorDataset batches were views of the data
  -- set's rows, so xb:mul_(2) doubled the data set and the next epoch trained on doubled rows
  it("gives batches that are new tensors: changing one in place leaves the data set alone", function()
    local xs = fsdp.arange(0, 12, 1, "float32"):reshape({ 6, 2 })
    local d = data.TensorDataset(xs, fsdp.arange(6))
    for _, shuffle in ipairs { false, true } do
      local L = data.DataLoader(d, { batch_size = 4, shuffle = shuffle })
      for epoch = 1, 2 do
        local sum = 0
        for xb, yb in L() do
          sum = sum + xb:sum():item()
          xb:mul_(2)
          yb:fill_(0)
          xb[1] = -1
        end
        assert.equal(66, sum, ("shuffle %s, epoch %d"):format(tostring(shuffle), epoch))
      end
    end
    assert.same(fsdp.arange(0, 12, 1, "float32"):tolist(), xs:tolist())
  end)

  it("shuffles from the seed: reproducible, a permutation, a new order each pass", function()
    local a = data.DataLoader(ds, { batch_size = 4, shuffle = true, seed = 1 })
    local b = data.DataLoader(ds, { batch_size = 4, shuffle = true, seed = 1 })
    local e1 = ys(a)
    assert.are.same(e1, ys(b))
    local all = {}
    for _, l in ipairs(e1) do for _, v in ipairs(l) do all[#all + 1] = v end end
    table.sort(all)
    assert.are.same({ 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 }, all)
    assert.are_not.same({ { 0, 1, 2, 3 }, { 4, 5, 6, 7 }, { 8, 9 } }, e1)
    local e2 = ys(a)
    assert.are_not.same(e1, e2, "the next pass is the next epoch")
    local d = data.DataLoader(ds, { batch_size = 4, shuffle = true, seed = 1, drop_last = true })
    local d1 = ys(d)
    assert.are.equal(2, #d1)
    assert.are_not.same(d1, ys(d), "with drop_last too")
    -- set_epoch picks the epoch: epoch 0 again is the first pass
    a:set_epoch(0)
    assert.are.same(e1, ys(a))
    -- without a seed, fsdp.manual_seed fixes the order
    fsdp.manual_seed(3)
    local c = ys(data.DataLoader(ds, { batch_size = 4, shuffle = true }))
    fsdp.manual_seed(3)
    assert.are.same(c, ys(data.DataLoader(ds, { batch_size = 4, shuffle = true })))
  end)

  it("takes a DistributedSampler; set_epoch reaches it", function()
    local s = data.DistributedSampler(ds, { num_replicas = 2, rank = 1, seed = 2 })
    local L = data.DataLoader(ds, { batch_size = 2, sampler = s })
    assert.are.equal(3, #L)
    L:set_epoch(5)
    assert.are.equal(5, s.epoch)
    local got = {}
    for _, l in ipairs(ys(L)) do for _, v in ipairs(l) do got[#got + 1] = v + 1 end end
    assert.are.same(s:indices(), got)
  end)

  it("collates lists of samples, tables, numbers and strings", function()
    local list = { { 1, 2.5, "a" }, { 3, 4.5, "b" }, { 5, 6.5, "c" } }
    local L = data.DataLoader(list, { batch_size = 2 })
    local i, f, s = L()()
    assert.are.equal("int64", i.dtype)
    assert.are.same({ 1, 3 }, i:tolist())
    assert.are.equal("float32", f.dtype)
    assert.are.same({ 2.5, 4.5 }, f:tolist())
    assert.are.same({ "a", "b" }, s)
    local Squares = data.Dataset:extend("Squares")
    function Squares:__init(n) self.n = n end
    function Squares:len() return self.n end
    function Squares:get(k) return { x = fsdp.full({ 2 }, k), k = k } end
    local D = data.DataLoader(Squares(5), { batch_size = 2 })
    assert.are.equal(3, #D)
    local n = 0
    for b in D() do
      n = n + 1
      assert.are.same(n < 3 and { 2, 2 } or { 1, 2 }, b.x:shape())
      local flat, firsts = b.x:tolist(), {}
      for j = 1, #flat, 2 do firsts[#firsts + 1] = flat[j] end
      assert.are.same(b.k:tolist(), firsts)
    end
    assert.are.equal(3, n)
    -- a dataset of single tensors yields the stacked tensor
    local T = data.DataLoader({ fsdp.ones(2, 2), fsdp.zeros(2, 2) }, { batch_size = 2 })
    assert.are.same({ 2, 2, 2 }, T()():shape())
    -- a custom collate_fn gets the list of samples
    local C = data.DataLoader(list, { batch_size = 3, collate_fn = function(s) return #s end })
    assert.are.equal(3, C()())
  end)

  it("resumes mid-epoch from its state_dict (through fsdp.save/load) with exactly the remaining batches", function()
    local function make()
      local s = data.DistributedSampler(ds, { num_replicas = 2, rank = 0, seed = 8 })
      return data.DataLoader(ds, { batch_size = 2, sampler = s })
    end
    local whole = make()
    whole:set_epoch(1)
    local want = ys(whole)
    local a = make()
    a:set_epoch(1)
    local it, got = a(), {}
    local _, yb = it()
    got[1] = yb:tolist()
    local path = os.tmpname()
    fsdp.save(path, { loader = a:state_dict(), epoch = 1 })
    local ck = fsdp.load(path)
    os.remove(path)
    assert.are.same({ sampler = { epoch = 1, pos = 2 } }, ck.loader)
    local b = make()
    b:load_state_dict(ck.loader)
    b:set_epoch(ck.epoch)
    for _, l in ipairs(ys(b)) do got[#got + 1] = l end
    assert.are.same(want, got)
    -- the next pass of the resumed loader is a whole epoch again
    b:set_epoch(1)
    assert.are.same(want, ys(b))
  end)

  it("rejects bad arguments", function()
    H.assert_error(function() data.DataLoader(ds, { batch_size = 0 }) end, "DataLoader", "batch_size", ">= 1")
    H.assert_error(function() data.DataLoader(ds, { batchsize = 2 }) end, "DataLoader", "unknown option batchsize")
    H.assert_error(function() data.DataLoader(ds, { shuffle = true, sampler = data.SequentialSampler(ds) }) end, "mutually exclusive")
    H.assert_error(function() data.DataLoader(ds, { sampler = {} }) end, "sampler must be")
    H.assert_error(function() data.DataLoader(42) end, "DataLoader", "dataset")
    H.assert_error(function() data.TensorDataset(x, fsdp.arange(9)) end, "TensorDataset", "10 rows", "argument 2 has 9")
    H.assert_error(function() data.TensorDataset(x, 3) end, "TensorDataset", "argument 2 must be a tensor")
    H.assert_error(function() ds:get(11) end, "TensorDataset", "index 11", "1..10")
    H.assert_error(function() data.Dataset():get(1) end, "Dataset", "get(i)")
    -- num_workers counts no batch (tests/nn/dataloader_workers_spec.lua runs the workers)
    assert.are.equal(10, #data.DataLoader(ds, { num_workers = 2 }))
  end)
end)

describe("DataLoader on 2 ranks", function()
  it("each rank its own samples, the same number of batches, reshuffled per epoch", function()
    if not H.has_mpi() then pending("no MPI here") return end
    local dir = H.mkdtemp("fsdp_dl")
    local rc, out = H.sh(("%s -n 2 %sdataloader_ranks.lua %s"):format(H.fsdprun, H.scripts, dir), "FSDP_STDOUT_TTY=0")
    assert.are.equal(0, rc, out)
    local per = {}
    for r = 0, 1 do
      per[r] = json.decode(H.read_file(("%s/rank%d.json"):format(dir, r)), "rank file")
    end
    os.execute("rm -rf '" .. dir .. "'")
    for e = 1, 2 do
      local a, b = per[0].epochs[e], per[1].epochs[e]
      assert.are.equal(#a, #b, "the same number of batches")
      local seen, n = {}, 0
      for _, batches in ipairs { a, b } do
        for _, batch in ipairs(batches) do
          for _, i in ipairs(batch) do
            assert.is_nil(seen[i], "sample " .. i .. " twice")
            seen[i], n = true, n + 1
          end
        end
      end
      assert.are.equal(100, n, "drop_last: 2 x 50 samples of 101")
    end
    assert.are_not.same(per[0].epochs[1], per[0].epochs[2], "epoch 2 reshuffled")
    -- the progress line comes from rank 0 only
    assert.is_truthy(out:find("[rank 0] batches", 1, true), out)
    assert.is_nil(out:find("[rank 1] batches", 1, true), out)
  end)
end)
