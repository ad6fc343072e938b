-- Sharded checkpoints (lua/fsdp/checkpoint.lua) and bin/fsdp-consolidate.
-- Multi-rank runs (tests/scripts/ckpt_train.lua, model in tests/scripts/ckpt_model.lua): train at
-- 2 ranks, save, keep training; resume at 2 ranks (bit for bit), 4 ranks and 1 rank (float32
-- tolerance); a kill -9 between the rank files and `latest`. In this process (1 rank): the
-- consolidated file, error cases (another model, another optimizer, no `latest`, a truncated rank
-- file) that leave the model unchanged, and a simulated crash.
local fsdp = require "fsdp"
local H = require "helpers"

local root, scripts, sh = H.root, H.scripts, H.sh
package.path = scripts .. "?.lua;" .. package.path
local K = require "ckpt_model"
local CK = require "fsdp.checkpoint"

local mpi = H.has_mpi()

local base = os.tmpname()
os.remove(base)
assert(os.execute(("mkdir -p %q"):format(base .. "/out")) == 0)
local DIR, OUT = base .. "/ckpt", base .. "/out"

-- runs every multi-rank phase once, the first time a test needs them
local runs
local function run_all()
  if runs then return runs end
  runs = { log = {} }
  local function go(n, args)
    local rc, out = sh(("%s/bin/fsdprun -n %d %sckpt_train.lua %s"):format(root, n, scripts, args))
    runs.log[#runs.log + 1] = ("-n %d %s -> %s\n%s"):format(n, args, tostring(rc), out)
    return rc, out
  end
  assert(go(2, ("first %s %s"):format(DIR, OUT)) == 0, runs.log[#runs.log])
  runs.first = dofile(OUT .. "/first.lua")
  for _, n in ipairs { 2, 4, 1 } do
    assert(go(n, ("resume %s %s n%d"):format(DIR, OUT, n)) == 0, runs.log[#runs.log])
    runs[n] = dofile(("%s/resume_n%d.lua"):format(OUT, n))
  end
  runs.crash_rc, runs.crash_out = go(2, ("crash %s %s"):format(base .. "/crash", OUT))
  return runs
end

local function state_of(m)
  local sd = {}
  for k, t in pairs(m:state_dict()) do sd[k] = t:clone() end
  return sd
end


describe("fsdp.save_sharded / fsdp.load_sharded across ranks", function()
  if not mpi then
    pending("needs mpirun and libfsdp_mpi.so")
    return
  end

  it("saves one file per rank and an atomic `latest`", function()
    local r = run_all()
    assert.equal(1, r.first.gen)
    assert.equal("ckpt-1\nworld_size 2\n", H.read_file(DIR .. "/latest"))
    for rank = 0, 1 do
      local t, meta = fsdp.load(("%s/ckpt-1/rank-%d-of-2.safetensors"):format(DIR, rank))
      assert.equal("2", meta.world_size)
      assert.equal(tostring(rank), meta.rank)
      -- "3.bias" lives in a NO_SHARD unit: replicated; "2.0.bias" (12 elements) is cut in two pieces of 6
      assert.same({ 5 }, t["model.3.bias"]:shape())
      assert.same({ 6 }, t["model.2.0.bias"]:shape())
      assert.same({ 64 }, t["model.0.weight"]:shape())
      assert.is_nil(t["optim.0.bias.exp_avg"])  -- frozen: no optimizer state
      assert.same({ 64 }, t["optim.0.weight.exp_avg_sq"]:shape())
    end
  end)

  it("the uninterrupted 2-rank run equals an unwrapped single-process run on the global batch", function()
    local f = run_all().first
    assert.is_true(f.idle)
    H.assert_close(f.before, { f.ref[1], f.ref[2], f.ref[3] }, 1e-5, 1e-5, "losses before save")
    H.assert_close(f.after, { f.ref[4], f.ref[5], f.ref[6] }, 1e-5, 1e-5, "losses after save")
    assert.is_true(f.ref_diff < 1e-5, "final parameters differ from the reference by " .. f.ref_diff)
  end)

  it("resuming at 2 ranks continues bit for bit (parameters, AdamW state, step counts, RNG, extra)", function()
    local r = run_all()
    local x = r[2]
    assert.is_true(x.before_diff > 0.1)  -- the fresh model really was different
    assert.equal(0, x.load_diff)
    assert.same(r.first.after, x.losses)
    assert.equal(0, x.final_diff)
    assert.same({ step = 3, note = "after 3 steps", lr = 0.02 }, x.extra)
    assert.is_true(x.idle)
  end)

  for _, n in ipairs { 4, 1 } do
    it(("loads the 2-rank checkpoint at %d rank(s) and trains on"):format(n), function()
      local r = run_all()
      local x = r[n]
      assert.equal(n, x.world)
      assert.is_true(x.before_diff > 0.1)
      assert.equal(0, x.load_diff)  -- gathered parameters are exactly those saved
      H.assert_close(x.losses, r.first.after, 1e-5, 1e-5, ("losses at %d ranks"):format(n))
      assert.is_true(x.final_diff < 1e-5, "final parameters differ by " .. x.final_diff)
      assert.same({ step = 3, note = "after 3 steps", lr = 0.02 }, x.extra)
      assert.is_true(x.idle)
    end)
  end

  -- hybrid sharding (4 ranks, shard groups of 2: each piece on two ranks) and full sharding read
  -- each other's checkpoints: saved under one, loaded under the other, training goes on the same
  for _, c in ipairs { { "hybrid:2", "" }, { "", "hybrid:2" } } do
    local saved, loaded = c[1] ~= "" and "hybrid" or "full", c[2] ~= "" and "hybrid" or "full"
    it(("saves under %s sharding and loads under %s sharding (4 ranks)"):format(saved, loaded), function()
      local d, o = ("%s/x_%s_%s"):format(base, saved, loaded), ("%s/o_%s_%s"):format(base, saved, loaded)
      assert(os.execute(("mkdir -p %q"):format(o)) == 0)
      local function go(env, args)
        local rc, out = sh(("%s/bin/fsdprun -n 4 %sckpt_train.lua %s"):format(root, scripts, args),
          env ~= "" and ("FSDP_CKPT_SHARDING=" .. env) or nil)
        assert.equal(0, rc, out)
      end
      go(c[1], ("first %s %s"):format(d, o))
      local first = dofile(o .. "/first.lua")
      -- the run itself equals one process on the global batch
      H.assert_close(first.before, { first.ref[1], first.ref[2], first.ref[3] }, 1e-5, 1e-5, "losses before save")
      assert.is_true(first.ref_diff < 1e-5, "final parameters differ from the reference by " .. first.ref_diff)
      go(c[2], ("resume %s %s x"):format(d, o))
      local x = dofile(o .. "/resume_x.lua")
      assert.equal(0, x.load_diff)  -- the gathered parameters are exactly those saved
      H.assert_close(x.losses, first.after, 1e-5, 1e-5, "losses after loading")
      assert.is_true(x.final_diff < 1e-5, "final parameters differ by " .. x.final_diff)
      assert.is_true(x.idle)
    end)
  end

  it("bin/fsdp-consolidate writes the full parameters under PyTorch names", function()
    run_all()
    local out = OUT .. "/consolidated.safetensors"
    local rc, log = sh(("%s/bin/fsdp-consolidate %s %s"):format(root, DIR, out))
    assert.equal(0, rc, log)
    assert.truthy(log:find("6 tensors", 1, true), log)
    assert.truthy(log:find("2.0.weight", 1, true), log)
    local got, meta = fsdp.load(out)
    local want = fsdp.load(OUT .. "/sd_at_save.safetensors")
    assert.equal(0, K.sd_diff(got, want))
    for k, t in pairs(want) do assert.same(t:shape(), got[k]:shape(), k) end
    assert.equal("2", meta.world_size)
    -- with the optimizer: full AdamW moments, and they equal what the shards hold
    rc, log = sh(("%s/bin/fsdp-consolidate %s %s --with-optimizer"):format(root, DIR, out))
    assert.equal(0, rc, log)
    got = fsdp.load(out)
    assert.same({ 16, 8 }, got["optim.0.weight.exp_avg"]:shape())
    local p0 = fsdp.load(DIR .. "/ckpt-1/rank-0-of-2.safetensors")
    local p1 = fsdp.load(DIR .. "/ckpt-1/rank-1-of-2.safetensors")
    local full = fsdp.cat({ p0["optim.2.0.weight.exp_avg_sq"], p1["optim.2.0.weight.exp_avg_sq"] }, 1)
    assert.equal(0, H.max_abs_diff(got["optim.2.0.weight.exp_avg_sq"]:reshape(-1), full))
    assert.is_nil(got["optim.0.bias.exp_avg"])
    -- errors: no checkpoint, usage
    rc, log = sh(("%s/bin/fsdp-consolidate %s %s"):format(root, base .. "/nothing", out))
    assert.equal(1, rc)
    assert.truthy(log:find(base .. "/nothing/latest", 1, true), log)
    rc = sh(("%s/bin/fsdp-consolidate %s"):format(root, DIR))
    assert.equal(2, rc)
  end)

  it("the consolidated file loads with Python's safetensors", function()
    run_all()
    if os.execute("python3 -c 'import safetensors.numpy' >/dev/null 2>&1") ~= 0 then
      pending("python3 with safetensors is not installed")
      return
    end
    local out = OUT .. "/consolidated_py.safetensors"
    assert.equal(0, (sh(("%s/bin/fsdp-consolidate %s %s"):format(root, DIR, out))))
    local rc, log = sh(("python3 -c \"from safetensors.numpy import load_file\nfor k, v in sorted(load_file('%s').items()): "
      .. "print('T', k, 'x'.join(map(str, v.shape)), v.dtype, repr(float(v.astype('float64').sum())))\""):format(out))
    assert.equal(0, rc, log)
    local want = fsdp.load(OUT .. "/sd_at_save.safetensors")
    local n = 0
    for k, shape, dtype, sum in log:gmatch("T (%S+) (%S+) (%S+) (%S+)") do
      n = n + 1
      assert.truthy(want[k], k)
      assert.equal(table.concat(want[k]:shape(), "x"), shape)
      assert.equal("float32", dtype)
      local s = 0
      for _, v in ipairs(want[k]:reshape(-1):tolist()) do s = s + v end
      assert.is_true(math.abs(s - tonumber(sum)) < 1e-9, k)
    end
    assert.equal(6, n, log)
  end)

  it("a kill -9 after the rank files but before `latest` leaves the previous checkpoint", function()
    local r = run_all()
    assert.equal(137, r.crash_rc, r.crash_out)
    local cdir = base .. "/crash"
    assert.equal("ckpt-1\nworld_size 2\n", H.read_file(cdir .. "/latest"))
    assert.truthy(io.open(cdir .. "/ckpt-2/rank-1-of-2.safetensors"))  -- the new files were written
    local m = K.wrap(K.build(5))
    local o = K.optimizer(m)
    local extra = fsdp.load_sharded(cdir, m, o)
    assert.same({ step = 1 }, extra)
    assert.equal(0, K.sd_diff(state_of(m), fsdp.load(OUT .. "/sd_gen1.safetensors")))
    -- the next save reuses generation 2 (clearing the leftovers) and removes generation 1
    assert.equal(2, fsdp.save_sharded(cdir, m, o, { step = 9 }))
    assert.equal("ckpt-2\nworld_size 1\n", H.read_file(cdir .. "/latest"))
    assert.is_nil(io.open(cdir .. "/ckpt-1/rank-0-of-2.safetensors"))
    assert.is_nil(io.open(cdir .. "/ckpt-2/rank-1-of-2.safetensors"))
    assert.same({ step = 9 }, fsdp.load_sharded(cdir, m, o))
  end)
end)

describe("sharded checkpoints in one process", function()
  local dir = base .. "/single"

  -- a 1-rank wrapped model with a saved checkpoint and a step of AdamW state
  local function trained(seed)
    local m = K.wrap(K.build(seed))
    local o = K.optimizer(m)
    K.step(m, o, 0, 1)
    return m, o
  end

  it("round-trips at 1 rank, optimizer state included", function()
    local m, o = trained(0)
    local gen = fsdp.save_sharded(dir, m, o, { epoch = 2 })
    local sd = state_of(m)
    local st = fsdp.get_rng_state()
    local l1 = K.step(m, o, 0, 1)
    local m2 = K.wrap(K.build(3))
    local o2 = K.optimizer(m2)
    assert.same({ epoch = 2 }, fsdp.load_sharded(dir, m2, o2))
    assert.equal(0, K.sd_diff(state_of(m2), sd))
    assert.equal(1, o2:state_of(m2["2"]["0"].weight).step)
    assert.same(st, fsdp.get_rng_state())
    assert.equal(l1, K.step(m2, o2, 0, 1))
    assert.equal(gen + 1, fsdp.save_sharded(dir, m2, o2))
    assert.is_nil(io.open(("%s/ckpt-%d/rank-0-of-1.safetensors"):format(dir, gen)))
  end)

  -- weight tying: one parameter under two names (core.tok.weight = core.head.weight); the sharded
  -- checkpoint stores it once, the consolidated file holds both names, as PyTorch's state_dict
  it("keeps every name of a tied parameter through fsdp-consolidate, and loads back strictly", function()
    local models = dofile(H.scripts .. "fsdp_models.lua")
    local m = models.tied.build()
    fsdp.wrap(m.core.tok); fsdp.wrap(m.core.head); fsdp.wrap(m)
    local o = fsdp.optim.AdamW(m:parameters(), { lr = 1e-2 })
    local x, y = models.tied.batch(1)
    o:zero_grad(); models.tied.loss(m(x), y):backward(); o:step()
    local tdir = base .. "/tied"
    fsdp.save_sharded(tdir, m, o)
    local out = base .. "/tied.safetensors"
    require("fsdp.checkpoint").consolidate(tdir, out)
    local sd = fsdp.load(out)
    assert.truthy(sd["core.tok.weight"] and sd["core.head.weight"])
    assert.same(sd["core.tok.weight"]:tolist(), sd["core.head.weight"]:tolist())
    local want = m:state_dict()
    assert.same(want["core.head.weight"]:tolist(), sd["core.head.weight"]:tolist())
    local plain = models.tied.build()
    local res = plain:load_state_dict(sd, true)
    assert.same({}, res.missing_keys)
    assert.same({}, res.unexpected_keys)
    assert.equal(plain.core.tok.weight, plain.core.head.weight)  -- still one parameter
    assert.same(want["core.tok.weight"]:tolist(), plain.core.head.weight:tolist())
    os.execute("rm -rf '" .. tdir .. "' '" .. out .. "'")
  end)

  it("refuses another model's checkpoint, naming the directory and the keys, and changes nothing", function()
    local m = K.wrap(K.build(1, true))
    local o = K.optimizer(m)
    local before = state_of(m)
    local ok, err = pcall(fsdp.load_sharded, dir, m, o)
    assert.is_false(ok)
    assert.truthy(err:find(dir .. "/ckpt-", 1, true), err)
    assert.truthy(err:find('"2.0.weight": checkpoint (12, 16), model (10, 16)', 1, true), err)
    assert.truthy(err:find('"3.weight": checkpoint (5, 12), model (5, 10)', 1, true), err)
    assert.equal(0, K.sd_diff(state_of(m), before))
    -- missing / unexpected keys: a model with one layer less
    local small = fsdp.wrap(fsdp.nn.Sequential(fsdp.nn.Linear(8, 16)))
    ok, err = pcall(fsdp.load_sharded, dir, small)
    assert.is_false(ok)
    assert.truthy(err:find("unexpected keys: 2.0.bias, 2.0.weight, 3.bias, 3.weight", 1, true), err)
  end)

  it("refuses another optimizer and changes nothing", function()
    local m = K.wrap(K.build(1))
    local before = state_of(m)
    local sgd = fsdp.optim.SGD(m:parameters(), { lr = 0.1 })
    local ok, err = pcall(fsdp.load_sharded, dir, m, sgd)
    assert.is_false(ok)
    assert.truthy(err:find("holds AdamW state, the optimizer is SGD", 1, true), err)
    local one_group = fsdp.optim.AdamW(m:parameters())
    ok, err = pcall(fsdp.load_sharded, dir, m, one_group)
    assert.is_false(ok)
    assert.truthy(err:find("2 parameter groups, the optimizer 1", 1, true), err)
    assert.equal(0, K.sd_diff(state_of(m), before))
    assert.is_nil(next(sgd.state))
  end)

  it("a missing `latest` or a truncated rank file is an error naming the file", function()
    local m = K.wrap(K.build(1))
    local before = state_of(m)
    local ok, err = pcall(fsdp.load_sharded, base .. "/empty", m)
    assert.is_false(ok)
    assert.truthy(err:find(base .. "/empty/latest", 1, true), err)
    if mpi then
      run_all()
      local copy = base .. "/trunc"
      assert(os.execute(("cp -r %q %q"):format(DIR, copy)) == 0)
      local file = copy .. "/ckpt-1/rank-1-of-2.safetensors"
      local data = H.read_file(file)
      local f = assert(io.open(file, "wb"))
      f:write(data:sub(1, #data - 100))
      f:close()
      ok, err = pcall(fsdp.load_sharded, copy, m)
      assert.is_false(ok)
      assert.truthy(err:find(file, 1, true), err)
      os.remove(copy .. "/ckpt-1/rank-1-of-2.safetensors")
      ok, err = pcall(fsdp.load_sharded, copy, m)
      assert.is_false(ok)
      assert.truthy(err:find(file, 1, true), err)
    end
    assert.equal(0, K.sd_diff(state_of(m), before))
  end)

  it("a save that fails before `latest` leaves the previous generation loadable", function()
    local m, o = trained(2)
    local d = base .. "/atomic"
    fsdp.save_sharded(d, m, o, { n = 1 })
    local sd = state_of(m)
    K.step(m, o, 0, 1)
    CK._crash_at = "before_latest"
    local ok, err = pcall(fsdp.save_sharded, d, m, o, { n = 2 })
    CK._crash_at = nil
    assert.is_false(ok)
    assert.truthy(err:find("simulated crash", 1, true), err)
    assert.truthy(io.open(d .. "/ckpt-2/rank-0-of-1.safetensors"))
    assert.same({ n = 1 }, fsdp.load_sharded(d, m, o))
    assert.equal(0, K.sd_diff(state_of(m), sd))
  end)

  it("checks its arguments", function()
    local m = K.wrap(K.build(1))
    assert.has_error(function() fsdp.save_sharded(nil, m) end, "fsdp.save_sharded: dir must be a string, got nil")
    local ok, err = pcall(fsdp.save_sharded, base .. "/args", m, nil, { f = function() end })
    assert.is_false(ok)
    assert.truthy(err:find("cannot store a function", 1, true), err)
    ok, err = pcall(fsdp.load_sharded, dir, "model")
    assert.is_false(ok)
    assert.truthy(err:find("expected an nn.Module", 1, true), err)
  end)
end)

teardown(function() os.execute(("rm -rf %q"):format(base)) end)
