-- The normalization layers (nn.BatchNorm1d/2d, nn.SyncBatchNorm, nn.GroupNorm, nn.RMSNorm) against
-- PyTorch's values (tests/golden/gen_norm.py -> tests/golden/norm.safetensors): outputs, gradients
-- and the running statistics after several training steps; train/eval, state_dict names, the
-- conversion to SyncBatchNorm, bfloat16 inputs and bad arguments. The op-level cases (forward
-- against plain-Lua references, backward against finite differences, every backend) are in
-- tests/ops/op_cases.lua; SyncBatchNorm over several ranks is in tests/scripts/fsdp_matrix.lua.
local fsdp = require "fsdp"
local H = require "helpers"
local nn, F = fsdp.nn, fsdp.nn.functional

local G = fsdp.load("tests/golden/norm.safetensors")
local ATOL, RTOL = 2e-5, 1e-4 -- float32 rounding of sums over 100 values (measured max ~3e-6)

local function close(got, name, what) H.assert_close(got:tolist(), G[name]:tolist(), ATOL, RTOL, what or name) end
local function leaf(name)
  local t = G[name]:clone()
  t.requires_grad = true
  return t
end
local function set(p, name) fsdp.no_grad(function() p:copy_(G[name]) end) end
-- loss = sum(y * r): the gradient of y is r
local function backward(y, r) (y * r):sum():backward() end

describe("BatchNorm against PyTorch", function()
  it("BatchNorm2d: three training steps (outputs, gradients, running stats), then eval", function()
    local bn = nn.BatchNorm2d(3)
    set(bn.weight, "bn2d.weight")
    set(bn.bias, "bn2d.bias")
    for k = 1, 3 do
      local x = leaf("bn2d.x." .. k)
      bn.weight.grad, bn.bias.grad = nil, nil
      local y = bn(x)
      close(y, "bn2d.y." .. k)
      backward(y, G["bn2d.r." .. k])
      close(x.grad, "bn2d.dx." .. k)
      close(bn.weight.grad, "bn2d.dw." .. k)
      close(bn.bias.grad, "bn2d.db." .. k)
    end
    close(bn.running_mean, "bn2d.running_mean")
    close(bn.running_var, "bn2d.running_var")
    assert.equal("int64", bn.num_batches_tracked.dtype)
    assert.equal(3, bn.num_batches_tracked:item())
    bn:eval()
    local x = leaf("bn2d.x.eval")
    local y = bn(x)
    close(y, "bn2d.y.eval")
    backward(y, G["bn2d.r.eval"])
    close(x.grad, "bn2d.dx.eval")
    close(bn.running_mean, "bn2d.running_mean", "eval leaves running_mean")
    assert.equal(3, bn.num_batches_tracked:item())
  end)

  it("BatchNorm1d (N, C) with momentum = false: the cumulative average", function()
    local bn = nn.BatchNorm1d(4, { momentum = false })
    assert.is_nil(bn.momentum)
    for k = 1, 3 do close(bn(G["bn1d.x." .. k]), "bn1d.y." .. k) end
    close(bn.running_mean, "bn1d.running_mean")
    close(bn.running_var, "bn1d.running_var")
    assert.equal(3, bn.num_batches_tracked:item())
  end)

  it("BatchNorm1d (N, C, L), momentum 0.3, affine = false", function()
    local bn = nn.BatchNorm1d(3, { momentum = 0.3, affine = false })
    assert.is_nil(bn.weight)
    for k = 1, 3 do close(bn(G["bn1d3.x." .. k]), "bn1d3.y." .. k) end
    close(bn.running_mean, "bn1d3.running_mean")
    close(bn.running_var, "bn1d3.running_var")
  end)

  it("F.batch_norm takes PyTorch's positional order and updates the running stats in place", function()
    local rm, rv = fsdp.zeros(3), fsdp.ones(3)
    local x = G["bn2d.x.1"]
    local y = F.batch_norm(x, rm, rv, G["bn2d.weight"], G["bn2d.bias"], true, 0.1, 1e-5)
    close(y, "bn2d.y.1")
    local m = x:transpose(1, 2):reshape({ 3, -1 }):mean(2)
    H.assert_close(rm:tolist(), (m * 0.1):tolist(), 1e-6, 1e-5, "running_mean after one step")
    -- eval: the running statistics, not the batch's
    local ye = F.batch_norm(x, fsdp.zeros(3), fsdp.ones(3), nil, nil, false)
    H.assert_close(ye:tolist(), (x / math.sqrt(1 + 1e-5)):tolist(), 1e-6, 1e-5, "eval with mean 0, var 1")
  end)
end)

describe("GroupNorm and RMSNorm against PyTorch", function()
  it("GroupNorm(3, 6): output and gradients", function()
    local gn = nn.GroupNorm(3, 6)
    set(gn.weight, "gn.weight")
    set(gn.bias, "gn.bias")
    local x = leaf("gn.x")
    local y = gn(x)
    close(y, "gn.y")
    backward(y, G["gn.r"])
    close(x.grad, "gn.dx")
    close(gn.weight.grad, "gn.dw")
    close(gn.bias.grad, "gn.db")
  end)

  it("RMSNorm(5): output and gradients with eps = finfo(float32).eps, and an explicit eps", function()
    local r = nn.RMSNorm(5)
    assert.is_nil(r.eps)
    set(r.weight, "rms.weight")
    local x = leaf("rms.x")
    local y = r(x)
    close(y, "rms.y")
    backward(y, G["rms.r"])
    close(x.grad, "rms.dx")
    close(r.weight.grad, "rms.dw")
    close(F.rms_norm(G["rms.x"], 5, G["rms.weight"], 0.1), "rms.y_eps")
    close(r(G["rms.x_small"]), "rms.y_small", "the default eps (finfo(float32).eps) on small values")
    close(nn.RMSNorm(5, { eps = 0.1 }):forward(G["rms.x"]) * G["rms.weight"], "rms.y_eps", "RMSNorm eps option")
  end)
end)

describe("BatchNorm state and modes", function()
  local function net()
    fsdp.manual_seed(1)
    return nn.Sequential(nn.Conv2d(2, 3, 3, { padding = 1 }), nn.BatchNorm2d(3), nn.ReLU())
  end

  it("registers PyTorch's state_dict keys, int64 num_batches_tracked, and round-trips them", function()
    local m = net()
    local sd = m:state_dict()
    assert.same({ "0.bias", "0.weight", "1.bias", "1.num_batches_tracked", "1.running_mean", "1.running_var", "1.weight" },
      H.sorted_keys(sd))
    assert.equal("int64", sd["1.num_batches_tracked"].dtype)
    local names = {}
    for name in m:named_parameters() do names[#names + 1] = name end
    assert.same({ "0.weight", "0.bias", "1.weight", "1.bias" }, names)
    m(fsdp.randn { 4, 2, 5, 5 })
    local m2 = net()
    m2:load_state_dict(m:state_dict())
    assert.same(m["1"].running_mean:tolist(), m2["1"].running_mean:tolist())
    assert.same(m["1"].running_var:tolist(), m2["1"].running_var:tolist())
    assert.equal(1, m2["1"].num_batches_tracked:item())
    -- a loaded count carries on (the layer's remembered count is dropped when the buffer is written)
    m2(fsdp.randn { 4, 2, 5, 5 })
    assert.equal(2, m2["1"].num_batches_tracked:item())
    local sd = m2:state_dict()
    sd["1.num_batches_tracked"] = fsdp.tensor(9, "int64")
    m2:load_state_dict(sd)
    m2(fsdp.randn { 4, 2, 5, 5 })
    assert.equal(10, m2["1"].num_batches_tracked:item())
  end)

  it("a saved state_dict loads into PyTorch's model with strict keys (and the same running stats)", function()
    if os.execute("/usr/bin/python3 -c 'import torch' 2>/dev/null") ~= 0 then
      pending("/usr/bin/python3 with torch is not installed")
      return
    end
    local m = net()
    m(fsdp.randn { 4, 2, 5, 5 })
    local dir = H.mkdtemp("norm_sd")
    fsdp.save(dir .. "/bn.safetensors", m:state_dict())
    local py = ([[
import sys; sys.path.insert(0, "%s/tests/golden")
from gen import load_safetensors
import torch.nn as nn
sd, _ = load_safetensors("%s/bn.safetensors")
m = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU())
m.load_state_dict(sd, strict=True)
print("OK", int(m[1].num_batches_tracked), float(m[1].running_var[0]))
]]):format(H.root, dir)
    local f = assert(io.open(dir .. "/check.py", "w"))
    f:write(py)
    f:close()
    local _, out = H.sh("/usr/bin/python3 " .. dir .. "/check.py")
    os.execute("rm -rf '" .. dir .. "'")
    local n, v = out:match("OK (%d+) ([%d%.e%-]+)")
    assert(n, "PyTorch did not load the state_dict:\n" .. out)
    assert.equal(1, tonumber(n))
    H.assert_close({ tonumber(v) }, { m["1"].running_var:tolist()[1] }, 1e-6, 1e-6, "running_var[1] in PyTorch")
  end)

  it("model:train()/eval() switch between batch and running statistics", function()
    local m = net()
    local x = fsdp.randn { 4, 2, 5, 5 }
    m(x)
    local rm = m["1"].running_mean:tolist()
    m:eval()
    assert.is_false(m["1"].training)
    local y1, y2 = m(x), m(x)
    assert.same(y1:tolist(), y2:tolist())
    assert.same(rm, m["1"].running_mean:tolist(), "eval does not move running_mean")
    m:train()
    local y3 = m(x)
    assert.is_true(H.max_abs_diff(y3:tolist(), y1:tolist()) > 1e-3, "training uses the batch statistics")
    assert.equal(2, m["1"].num_batches_tracked:item())
  end)

  it("track_running_stats = false: no buffers, batch statistics in eval too", function()
    local bn = nn.BatchNorm1d(4, { track_running_stats = false })
    local keys = H.sorted_keys(bn:state_dict())
    assert.same({ "bias", "weight" }, keys)
    local x = G["bn1d.x.1"]
    local yt = bn(x)
    bn:eval()
    assert.same(yt:tolist(), bn(x):tolist())
  end)

  it("bfloat16 inputs with float32 parameters, as LayerNorm", function()
    local x = G["bn2d.x.1"]
    local xb = x:to("bfloat16")
    local cases = {
      { nn.BatchNorm2d(3), 4e-2 },
      { nn.GroupNorm(3, 3), 4e-2 },
      { nn.RMSNorm({ 5 }, { eps = 1e-6 }), 4e-2 },
    }
    for _, c in ipairs(cases) do
      local m, tol = c[1], c[2]
      local yb = m(xb)
      assert.equal("bfloat16", yb.dtype, m.__name)
      local y = m(xb:float())
      H.assert_close(yb:float():tolist(), y:tolist(), tol, 1e-2, m.__name .. " bf16 against float32")
    end
    local xl = xb:clone()
    xl.requires_grad = true
    local bn = nn.BatchNorm2d(3)
    bn(xl):sum():backward()
    assert.equal("bfloat16", xl.grad.dtype)
    assert.equal("float32", bn.weight.grad.dtype)
  end)
end)

describe("SyncBatchNorm", function()
  it("convert_sync_batchnorm replaces nested BatchNorms, keeping parameters, buffers and mode", function()
    fsdp.manual_seed(2)
    local inner = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3, { momentum = 0.2 }))
    local m = nn.Sequential(inner, nn.BatchNorm1d(4), nn.GroupNorm(1, 3))
    local w, rm = inner["1"].weight, inner["1"].running_mean
    m["1"]:eval()
    local s = nn.SyncBatchNorm.convert_sync_batchnorm(m)
    assert.equal(m, s)
    assert.equal("SyncBatchNorm", inner["1"].__name)
    assert.equal("SyncBatchNorm", m["1"].__name)
    assert.equal("GroupNorm", m["2"].__name)
    assert.equal(w, inner["1"].weight)
    assert.equal(rm, inner["1"].running_mean)
    assert.equal(0.2, inner["1"].momentum)
    assert.is_false(m["1"].training)
    local single = nn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(3))
    assert.equal("SyncBatchNorm", single.__name)
  end)

  it("with one rank equals BatchNorm (outputs, gradients, running stats)", function()
    local bn, sbn = nn.BatchNorm2d(3), nn.SyncBatchNorm(3)
    set(bn.weight, "bn2d.weight"); set(bn.bias, "bn2d.bias")
    set(sbn.weight, "bn2d.weight"); set(sbn.bias, "bn2d.bias")
    for k = 1, 2 do
      local x1, x2 = leaf("bn2d.x." .. k), leaf("bn2d.x." .. k)
      local y1, y2 = bn(x1), sbn(x2)
      assert.same(y1:tolist(), y2:tolist())
      backward(y1, G["bn2d.r." .. k]); backward(y2, G["bn2d.r." .. k])
      assert.same(x1.grad:tolist(), x2.grad:tolist())
    end
    assert.same(bn.running_var:tolist(), sbn.running_var:tolist())
    assert.same(bn.weight.grad:tolist(), sbn.weight.grad:tolist())
  end)
end)

describe("normalization bad arguments", function()
  it("name the layer or op, the argument and the shapes", function()
    H.assert_error(function() nn.BatchNorm2d(3)(fsdp.randn { 2, 3, 4 }) end, "BatchNorm2d", "expected 4D input", "3D")
    H.assert_error(function() nn.BatchNorm1d(3)(fsdp.randn { 2, 3, 4, 4 }) end, "BatchNorm1d", "2D or 3D")
    H.assert_error(function() nn.BatchNorm2d(4)(fsdp.randn { 2, 3, 4, 4 }) end, "batch_norm", "weight", "(4)", "3 channels")
    H.assert_error(function() nn.BatchNorm1d(3)(fsdp.randn { 1, 3 }) end, "more than 1 value per channel")
    H.assert_error(function() F.batch_norm(fsdp.randn { 2, 3 }, nil, nil) end, "eval mode", "running_mean")
    H.assert_error(function() F.batch_norm(fsdp.randn { 4 }, nil, nil, nil, nil, true) end, "batch_norm", "(4)")
    H.assert_error(function() nn.BatchNorm1d(0) end, "BatchNorm1d", "num_features")
    H.assert_error(function() nn.GroupNorm(4, 6) end, "GroupNorm", "divisible")
    H.assert_error(function() F.group_norm(fsdp.randn { 2, 6 }, 4) end, "group_norm", "num_groups 4", "6 channels")
    H.assert_error(function() F.rms_norm(fsdp.randn { 2, 6 }, 5) end, "rms_norm", "(2, 6)", "(5)")
    H.assert_error(function() F.rms_norm(fsdp.randn { 2, 6 }, 6, fsdp.randn { 5 }) end, "rms_norm", "weight", "(5)")
    H.assert_error(function() nn.BatchNorm1d(3, { momentum = "x" }) end, "momentum")
    -- the process keeps working
    assert.equal(2, nn.BatchNorm1d(3)(fsdp.randn { 2, 3 }):shape()[1])
  end)
end)
