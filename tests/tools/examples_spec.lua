-- The main job in CI: examples/train.lua on a small subset of Fashion-MNIST with 2 ranks --
-- pretraining, a checkpoint per epoch, resume (the resumed epoch's losses bit-identical to the
-- uninterrupted run's), linear evaluation of the frozen trunk -- its error messages for bad input,
-- and the two report examples (examples/all_wrapped.lua, examples/frozen_trunk.lua).
-- Needs the data set (`apt-get install dataset-fashion-mnist`, which .ci/run installs): without it
-- this spec fails and says so.
local fsdp = require "fsdp"
local fm = require "fsdp.data.fashion_mnist"
local H = require "helpers"

local fsdprun = H.fsdprun
local train = H.root .. "/examples/train.lua"

local function sh_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- runs a shell command; returns stdout, stderr, exit status
local function run(cmd)
  local tmp = os.tmpname()
  local p = io.popen(("(%s) 2>%s; echo \"__rc=$?\""):format(cmd, sh_quote(tmp)))
  local out = p:read("*a")
  p:close()
  local f = io.open(tmp, "r")
  local err = f and f:read("*a") or ""
  if f then f:close() end
  os.remove(tmp)
  local rc = tonumber(out:match("__rc=(%d+)%s*$"))
  return H.untag((out:gsub("__rc=%d+%s*$", ""))), H.untag(err), rc
end

local function train_cmd(n, args)
  return ("FSDP_STDOUT_TTY=0 %s -n %d %s %s"):format(sh_quote(fsdprun), n, sh_quote(train), args)
end

-- the metrics lines of a JSONL file: {phase=, epoch=, loss_str= (the exact text), loss=, test_acc=, loss_checksum=}
local function read_metrics(path)
  local f = assert(io.open(path, "r"), "no metrics file " .. path)
  local out = {}
  for l in f:lines() do
    out[#out + 1] = { phase = l:match('"phase":"([^"]*)"'), epoch = tonumber(l:match('"epoch":(%d+)')),
      loss_str = l:match('"loss":([-%d%.eE+]+)'), loss = tonumber(l:match('"loss":([-%d%.eE+]+)')),
      test_acc = tonumber(l:match('"test_acc":([-%d%.eE+]+)')), checksum = l:match('"loss_checksum":"(%x+)"'),
      samples_per_s = tonumber(l:match('"samples_per_s":([-%d%.eE+]+)')), line = l }
  end
  f:close()
  return out
end

local tmp = H.mkdtemp("fsdp_examples")
local data_dir = fm.find_dir(nil)
local have_data = io.open(data_dir .. "/" .. fm.files.test.labels .. ".gz", "rb") or io.open(data_dir .. "/" .. fm.files.test.labels, "rb")
if have_data then have_data:close() end
-- a small but real subset: 20 global batches of 128, 500 test images
local SMALL = "--limit 2560 --test-limit 500"

describe("examples/train.lua", function()
  it("has the Fashion-MNIST data set", function()
    assert(have_data, ("Fashion-MNIST not found (looked in %s): install it with `apt-get install dataset-fashion-mnist` " ..
      "(.ci/run does) or set FSDP_DATA_DIR; the examples spec cannot run without it"):format(data_dir))
  end)

  local A, B = tmp .. "/A", tmp .. "/B"
  local outA, outB1, outB2

  it("pretrains 2 epochs on 2 ranks with checkpoints, a consolidated file and metrics", function()
    assert(have_data, "Fashion-MNIST is not installed (see the first test)")
    local out, err, rc = run(train_cmd(2, SMALL .. " --epochs 2 --skip-linear-eval --ckpt " .. sh_quote(A)))
    outA = out
    assert.are.equal(0, rc, "train.lua failed:\n" .. out .. err)
    -- plain lines (no carriage returns) when stdout is not a terminal
    assert.is_nil(out:find("\r", 1, true), "carriage returns in non-TTY output")
    local m = read_metrics(A .. "/metrics.jsonl")
    assert.are.equal(2, #m, "metrics lines:\n" .. table.concat((function() local t = {} for i, x in ipairs(m) do t[i] = x.line end return t end)(), "\n"))
    for e = 1, 2 do
      assert.are.equal("pretrain", m[e].phase)
      assert.are.equal(e, m[e].epoch)
      assert.is_true(m[e].samples_per_s > 0)
      assert.is_truthy(m[e].checksum)
    end
    -- it learns: loss falls from ln(10) = 2.30, accuracy far above chance on 500 test images
    assert.is_true(m[1].loss < 2.2 and m[2].loss < m[1].loss, "losses " .. m[1].loss .. ", " .. m[2].loss)
    assert.is_true(m[2].test_acc > 0.6, "test accuracy " .. m[2].test_acc)
    assert.is_truthy(out:find("pretrain test accuracy: " .. ("%.4f"):format(m[2].test_acc) .. ", linear%-eval test accuracy: skipped"), out)
    -- sharded checkpoint of epoch 2, and the consolidated file with the full tensors (PyTorch names)
    local latest = assert(io.open(A .. "/latest")):read("*a")
    assert.is_truthy(latest:find("world_size 2"), latest)
    local sd = fsdp.load(A .. "/model.safetensors")
    assert.are.same({ 32, 1, 3, 3 }, sd["trunk.0.0.weight"]:shape())
    assert.are.same({ 64, 32, 3, 3 }, sd["trunk.1.0.weight"]:shape())
    assert.are.same({ 10, 3136 }, sd["head.1.weight"]:shape())
    assert.are.same({ 10 }, sd["head.1.bias"]:shape())
    -- the plot of loss and accuracy per epoch (gnuplot from Debian; .ci/run installs it)
    if os.execute("command -v gnuplot >/dev/null 2>&1") == 0 then
      local png = assert(io.open(A .. "/metrics.png", "rb"), "no plot " .. A .. "/metrics.png")
      local bytes = png:read("*a")
      png:close()
      assert.are.equal("\137PNG", bytes:sub(1, 4))
      assert.is_true(#bytes > 5000, "plot of " .. #bytes .. " bytes")
    end
  end)

  it("resumes from an epoch-1 checkpoint with bit-identical losses, then evaluates the frozen trunk", function()
    assert(outA, "the uninterrupted run failed (see above)")
    local out, err, rc = run(train_cmd(2, SMALL .. " --epochs 1 --skip-linear-eval --ckpt " .. sh_quote(B)))
    outB1 = out
    assert.are.equal(0, rc, "epoch 1 run failed:\n" .. out .. err)
    out, err, rc = run(train_cmd(2, SMALL .. " --epochs 2 --linear-epochs 1 --resume " .. sh_quote(B)))
    outB2 = out
    assert.are.equal(0, rc, "resumed run failed:\n" .. out .. err)
    assert.is_truthy(out:find("resumed from .- after epoch 1"), out)
    local a, b = read_metrics(A .. "/metrics.jsonl"), read_metrics(B .. "/metrics.jsonl")
    assert.are.equal(3, #b, "pretrain 1, pretrain 2 (resumed), linear 1")
    -- the same run: epoch 1 alike, and the resumed epoch 2 equal to the uninterrupted one, bit for bit
    for e = 1, 2 do
      assert.are.equal("pretrain", b[e].phase)
      assert.are.equal(a[e].checksum, b[e].checksum, ("epoch %d: per-step loss checksums differ"):format(e))
      assert.are.equal(a[e].loss_str, b[e].loss_str, ("epoch %d: mean loss differs"):format(e))
      assert.are.equal(a[e].test_acc, b[e].test_acc, ("epoch %d: test accuracy differs"):format(e))
    end
    -- the printed lines agree too (the checksum printed by rank 0)
    local ck = a[2].checksum
    assert.is_truthy(outA:find("pretrain 2/2 .- loss checksum " .. ck), outA)
    assert.is_truthy(out:find("pretrain 2/2 .- loss checksum " .. ck), out)
    -- linear evaluation: new head on the frozen trunk learns
    assert.are.equal("linear", b[3].phase)
    assert.is_true(b[3].test_acc > 0.5, "linear-eval test accuracy " .. b[3].test_acc)
    local pre, lin = out:match("pretrain test accuracy: (0%.%d%d%d%d), linear%-eval test accuracy: (0%.%d%d%d%d)")
    assert.is_truthy(pre, "no summary line in:\n" .. out)
    assert.are.equal(("%.4f"):format(a[2].test_acc), pre)
    assert.are.equal(("%.4f"):format(b[3].test_acc), lin)
    -- the linear evaluation left the pretrained trunk alone: the checkpoint's consolidated file is A's
    local sa, sb = fsdp.load(A .. "/model.safetensors"), fsdp.load(B .. "/model.safetensors")
    for k, t in pairs(sa) do
      assert.are.equal(0, (t - sb[k]):abs():max():item(), k)
    end
  end)

  it("resuming a finished run trains nothing and leaves its files as they are", function()
    assert(outB2, "the resumed run failed (see above)")
    local function bytes(path) local f = assert(io.open(path, "rb")); local d = f:read("*a"); f:close(); return d end
    local before = bytes(B .. "/metrics.jsonl")
    local out, err, rc = run(train_cmd(2, SMALL .. " --epochs 2 --linear-epochs 1 --resume " .. sh_quote(B)))
    assert.are.equal(0, rc, "resuming the finished run failed:\n" .. out .. err)
    assert.is_truthy(out:find("nothing to train: the checkpoint in .- is at epoch 2, %-%-epochs is 2"), out)
    assert.are.equal(before, bytes(B .. "/metrics.jsonl"))
    assert.is_falsy(out:find("linear evaluation:", 1, true), out)
  end)

  it("--linear-eval alone reruns the linear evaluation from the checkpoint", function()
    assert(outB2, "the resumed run failed (see above)")
    local out, err, rc = run(train_cmd(2, SMALL .. " --linear-eval --linear-epochs 1 --ckpt " .. sh_quote(B)))
    assert.are.equal(0, rc, out .. err)
    local b = read_metrics(B .. "/metrics.jsonl")
    assert.are.equal(3, #b, "the linear line is replaced, not appended")
    local pre, lin = out:match("pretrain test accuracy: (0%.%d%d%d%d), linear%-eval test accuracy: (0%.%d%d%d%d)")
    assert.are.equal(("%.4f"):format(b[2].test_acc), pre)       -- the loaded model, evaluated again
    assert.are.equal(("%.4f"):format(b[3].test_acc), lin)
    assert.is_truthy(outB2:find("linear 1/1 .- loss checksum " .. b[3].checksum), "same linear run as before")
  end)

  it("ends bad input with one clear message and exit status 1, no traceback", function()
    assert(have_data, "Fashion-MNIST is not installed (see the first test)")
    local function expect_error(cmd, pattern)
      local out, err, rc = run(cmd)
      assert.are.equal(1, rc, cmd .. "\n" .. out .. err)
      assert.is_truthy(err:find(pattern), ("expected %q in stderr:\n%s"):format(pattern, err))
      assert.is_nil(err:find("traceback"), err)
      assert.is_nil(err:find("%.lua:%d+:"), "a Lua error position in:\n" .. err)
    end
    -- a missing data directory
    expect_error(train_cmd(1, "--data " .. sh_quote(tmp .. "/nowhere")), "data directory .-nowhere does not exist")
    -- a truncated IDX file (the test images cut short)
    local bad = tmp .. "/truncated"
    os.execute(("mkdir -p %s && cd %s && for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-labels-idx1-ubyte; do " ..
      "ln -s %s/$f.gz .; done && head -c 300000 %s/t10k-images-idx3-ubyte.gz > t10k-images-idx3-ubyte.gz")
      :format(sh_quote(bad), sh_quote(bad), sh_quote(data_dir), sh_quote(data_dir)))
    expect_error(train_cmd(1, "--limit 256 --data " .. sh_quote(bad) .. " --ckpt " .. sh_quote(tmp .. "/C")),
      "loading the test set: idx: .-t10k%-images%-idx3%-ubyte%.gz: truncated")
    -- a checkpoint of another model, at 2 ranks (one message, from rank 0)
    local other = tmp .. "/other"
    local script = tmp .. "/other.lua"
    local f = assert(io.open(script, "w"))
    f:write([[
      local fsdp = require "fsdp"
      local m = fsdp.wrap(fsdp.nn.Sequential(fsdp.nn.Linear(4, 3)))
      fsdp.save_sharded(arg[1], m, fsdp.optim.Adam(m:parameters()), { epoch = 1 })
    ]])
    f:close()
    local _, err0, rc0 = run(("%s -n 1 %s %s"):format(sh_quote(fsdprun), sh_quote(script), sh_quote(other)))
    assert.are.equal(0, rc0, err0)
    local cmd = train_cmd(2, SMALL .. " --resume " .. sh_quote(other))
    expect_error(cmd, "cannot resume from .-other: fsdp.load_sharded: the checkpoint .- does not match the model %(missing keys: head.1.bias")
    local _, err = run(cmd)
    local _, count = err:gsub("does not match the model", "")
    assert.are.equal(1, count, "the message once, not once per rank:\n" .. err)
    -- no checkpoint at all
    expect_error(train_cmd(1, SMALL .. " --resume " .. sh_quote(tmp .. "/nothing")), "cannot resume from .-nothing")
    -- a bad flag is a usage error (status 2)
    local _, e2, rc2 = run(train_cmd(1, "--epochs two"))
    assert.are.equal(2, rc2)
    assert.is_truthy(e2:find("--epochs expects an integer, got 'two'", 1, true), e2)
    local _, e3, rc3 = run(train_cmd(1, "--device tpu"))
    assert.are.equal(2, rc3)
    assert.is_truthy(e3:find("--device expects cpu or cuda, got 'tpu'", 1, true), e3)
  end)

  -- --device cuda: on a GPU where there is one, else on the test double of one (backend/testdev,
  -- installed by tests/scripts/on_testdev.lua before the script runs), which must give the CPU's
  -- losses bit for bit; at 2 ranks the collectives go through the host
  it("--device cuda trains on the device, 1 and 2 ranks, the same runs as on the CPU", function()
    assert(have_data, "Fashion-MNIST is not installed (see the first test)")
    local args = "--epochs 1 --limit 512 --test-limit 256 --linear-epochs 1 --batch-size 64 --channels 4,8 --eval-batch 128"
    local real = fsdp.cuda.is_available()
    local function go(n, device, dir)
      local script = sh_quote(H.root .. "/examples/train.lua")
      if device == "cuda" and not real then script = sh_quote(H.root .. "/tests/scripts/on_testdev.lua") .. " " .. script end
      local out, err, rc = run(("cd %s && FSDP_STDOUT_TTY=0 FSDP_TESTDEV_MIB=64 %s -n %d %s --device %s %s --ckpt %s")
        :format(sh_quote(tmp), sh_quote(H.fsdprun), n, script, device, args, sh_quote(dir)))
      assert.are.equal(0, rc, out .. err)
      return read_metrics(dir .. "/metrics.jsonl")
    end
    for _, n in ipairs { 1, 2 } do
      local cpu, dev = go(n, "cpu", ("%s/dev-cpu-%d"):format(tmp, n)), go(n, "cuda", ("%s/dev-cuda-%d"):format(tmp, n))
      assert.are.equal(2, #dev)
      for i = 1, 2 do
        if real then
          assert.is_true(math.abs(cpu[i].loss - dev[i].loss) < 1e-3 * cpu[i].loss, cpu[i].line .. "\n" .. dev[i].line)
        else
          assert.are.equal(cpu[i].checksum, dev[i].checksum, n .. " ranks:\n" .. cpu[i].line .. "\n" .. dev[i].line)
          assert.are.equal(cpu[i].test_acc, dev[i].test_acc)
        end
      end
    end
  end)
end)

describe("the report examples", function()
  for _, ex in ipairs { "all_wrapped", "frozen_trunk" } do
    it(ex .. ".lua: FSDP on 2 ranks equals the single-process run", function()
      local out, err, rc = run(("%s -n 2 %s/examples/%s.lua"):format(sh_quote(fsdprun), sh_quote(H.root), ex))
      assert.are.equal(0, rc, out .. err)
      assert.is_truthy(out:find("\nOK: FSDP on 2 ranks equals single%-process training"), out)
      -- the per-step table: FSDP loss beside the single-process loss, within float32 rounding
      local n = 0
      for a, b in out:gmatch("\n%d+%s+(%d+%.%d+)%s+(%d+%.%d+)") do
        n = n + 1
        assert.is_true(math.abs(tonumber(a) - tonumber(b)) <= 1e-5, out)
      end
      assert.is_true(n >= 5, "per-step loss lines:\n" .. out)
    end)
  end
end)

describe("examples/transformer.lua (PyTorch's FSDP tutorial with a transformer encoder)", function()
  -- the lines both runs print: "step N  loss X", "Train Epoch: E <tab>Loss: X", "Test set: Average
  -- loss: X, Accuracy: A/B (...)", as {kind, number, value}
  local function lines(out)
    local r = {}
    for line in out:gmatch("[^\n]+") do
      local s, l = line:match("step (%d+)  loss (%d+%.%d+)")
      local e, tl = line:match("Train Epoch: (%d+) \tLoss: (%d+%.%d+)")
      local vl, acc = line:match("Test set: Average loss: (%d+%.%d+), Accuracy: (%d+)/")
      if s then r[#r + 1] = { "step", s, tonumber(l) } end
      if e then r[#r + 1] = { "epoch", e, tonumber(tl) } end
      if vl then r[#r + 1] = { "test", tonumber(acc), tonumber(vl) } end
    end
    return r
  end
  it("FSDP on 2 ranks prints the single-process run's losses", function()
    local script = sh_quote(H.root .. "/examples/transformer.lua")
    local one, err1, rc1 = run("luajit " .. script)
    assert.are.equal(0, rc1, one .. err1)
    local two, err2, rc2 = run(("%s -n 2 %s"):format(sh_quote(fsdprun), script))
    assert.are.equal(0, rc2, two .. err2)
    local a, b = lines(one), lines(H.untag(two))
    assert.is_true(#a >= 10, "the single-process run printed:\n" .. one)
    assert.are.equal(#a, #b, one .. "\n" .. two)
    for i = 1, #a do
      assert.are.same({ a[i][1], a[i][2] }, { b[i][1], b[i][2] }, one .. "\n" .. two)
      -- losses printed with 6 (test: 4) decimals, float32 sums in another order
      assert.is_true(math.abs(a[i][3] - b[i][3]) <= 2e-6 + 1e-5 * a[i][3], one .. "\n" .. two)
    end
    assert.is_truthy(two:find("FSDP, 2 ranks", 1, true), two)
  end)
end)

-- leave no temp files behind (the directory holds checkpoints and links only)
teardown(function() os.execute("rm -rf " .. sh_quote(tmp)) end)
