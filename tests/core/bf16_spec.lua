-- bfloat16 compute beyond the op-case table (which checks every op's forward and gradients on
-- bfloat16 inputs): the engine's dtype rule for gradients, mixed-dtype errors, in-place updates,
-- random fills and optimizer steps on bfloat16 tensors. Each result is compared with the same
-- computation in float32 on the same (bfloat16) values, rounded once.
local fsdp = require "fsdp"
local H = require "helpers"
local R = require "ops.op_refs"
local F, optim = fsdp.nn.functional, fsdp.optim

local function bf16(values) return fsdp.tensor(values, "bfloat16") end
local function rounded(list)
  local r = {}
  for i, v in ipairs(list) do r[i] = R.to_dtype(v, "bfloat16") end
  return r
end
-- n values in [-2, 2] from a fixed stream, exactly representable in bfloat16
local function values(n, salt)
  local v = {}
  for i = 1, n do v[i] = R.to_dtype(2 * math.sin(i * 1.3 + (salt or 0)), "bfloat16") end
  return v
end

describe("bfloat16: gradients have their tensor's dtype", function()
  it("a bfloat16 leaf gets a bfloat16 gradient, the float32 sum of its contributions rounded", function()
    local a, b = values(6, 1), values(6, 2)
    local x = bf16(values(6, 3))
    x.requires_grad = true
    -- two uses of x: its gradient is a + b (each contribution exact in bfloat16), rounded once
    local y = (x * bf16(a) + x * bf16(b)):sum()
    assert.equal("bfloat16", y.dtype)
    y:backward()
    assert.equal("bfloat16", x.grad.dtype)
    local want = {}
    for i = 1, 6 do want[i] = a[i] + b[i] end
    H.assert_close(x.grad:tolist(), rounded(want), 0, 0, "x.grad")
  end)

  it("a float32 leaf used through a bfloat16 cast gets a float32 gradient", function()
    local x = fsdp.tensor(values(4, 4))
    x.requires_grad = true
    local y = (x:bfloat16() * 3):sum()
    y:backward()
    assert.equal("float32", x.grad.dtype)
    H.assert_close(x.grad:tolist(), { 3, 3, 3, 3 }, 0, 0)
  end)

  it("hooks of a bfloat16 non-leaf see bfloat16 gradients, and an explicit gradient is cast", function()
    local x = bf16(values(3, 5))
    x.requires_grad = true
    local h = x * 2
    local seen
    h:register_hook(function(g) seen = g.dtype end)
    h:backward(fsdp.tensor({ 0.1, 0.2, 0.3 }))  -- a float32 gradient for a bfloat16 output
    assert.equal("bfloat16", seen)
    assert.equal("bfloat16", x.grad.dtype)
    H.assert_close(x.grad:tolist(), rounded { 0.2, 0.4, 0.6 }, 0, 0)
  end)
end)

describe("bfloat16: mixed dtypes", function()
  it("promotes elementwise ops to float32, and a 0-dim float32 tensor keeps bfloat16", function()
    assert.equal("float32", (bf16 { 1, 2 } + fsdp.tensor { 1, 2 }).dtype)
    assert.equal("bfloat16", (bf16 { 1, 2 } * fsdp.tensor(3)).dtype)
    assert.equal("bfloat16", (bf16 { 1, 2 } + 0.5).dtype)
  end)

  it("refuses float32 with bfloat16 where PyTorch does, naming both dtypes", function()
    local x, w = fsdp.randn(2, 4), fsdp.randn(3, 4):bfloat16()
    H.assert_error(function() return F.linear(x, w) end, "linear", "float32", "bfloat16", "(2, 4)", "(3, 4)")
    H.assert_error(function() return x:matmul(w:t()) end, "matmul", "float32", "bfloat16")
    local img, k = fsdp.randn(1, 2, 5, 5), fsdp.randn(3, 2, 3, 3):bfloat16()
    H.assert_error(function() return F.conv2d(img, k) end, "conv2d", "float32", "bfloat16")
    local q = fsdp.randn(1, 2, 3, 4)
    H.assert_error(function() return F.scaled_dot_product_attention(q, q:bfloat16(), q) end,
      "scaled_dot_product_attention", "float32", "bfloat16")
    H.assert_error(function() return F.layer_norm(x:bfloat16(), { 4 }, fsdp.ones(4):half()) end, "layer_norm",
      "float16", "bfloat16")
  end)

  it("still refuses integer tensors in float ops", function()
    H.assert_error(function() return fsdp.tensor({ 1, 2 }, "int64"):exp() end, "exp", "int64", "float")
  end)
end)

describe("bfloat16: in-place updates and random fills", function()
  it("add_ and mul_ compute in float32 and round each element once", function()
    local a, b = values(8, 6), values(8, 7)
    local t = bf16(a)
    fsdp.no_grad(function() t:add_(bf16(b), 0.3):mul_(1.7) end)
    -- two updates, each rounded once
    local mid = {}
    for i = 1, 8 do mid[i] = R.to_dtype(a[i] + 0.3 * b[i], "bfloat16") * 1.7 end
    H.assert_rounded_once(t:tolist(), mid, "bfloat16", 1e-6, 1e-6, "add_ then mul_")
    assert.equal("bfloat16", t.dtype)
  end)

  it("uniform_ and normal_ draw the float32 stream and round it", function()
    for _, fill in ipairs { "uniform_", "normal_" } do
      local t32, t16 = fsdp.empty(50), fsdp.empty({ 50 }, { dtype = "bfloat16" })
      fsdp.manual_seed(3)
      t32[fill](t32)
      fsdp.manual_seed(3)
      t16[fill](t16)
      H.assert_close(t16:tolist(), rounded(t32:tolist()), 0, 0, fill)
    end
  end)
end)

describe("bfloat16: optimizer steps on bfloat16 parameters", function()
  -- one step on a bfloat16 parameter against the same step in float32 on the same values: the
  -- parameter and each state tensor are the float32 results rounded once, in bfloat16
  local function one_step(make, state_names)
    local p0, g0 = values(12, 8), values(12, 9)
    local p16, p32 = bf16(p0), fsdp.tensor(p0)
    p16.requires_grad, p32.requires_grad = true, true
    p16.grad, p32.grad = bf16(g0), fsdp.tensor(g0)
    local o16, o32 = make { p16 }, make { p32 }
    o16:step()
    o32:step()
    assert.equal("bfloat16", p16.dtype)
    H.assert_rounded_once(p16:tolist(), p32:tolist(), "bfloat16", 1e-7, 1e-6, "parameter")
    for _, name in ipairs(state_names) do
      local s16, s32 = o16:state_of(p16)[name], o32:state_of(p32)[name]
      assert.equal("bfloat16", s16.dtype, name)
      H.assert_rounded_once(s16:tolist(), s32:tolist(), "bfloat16", 1e-7, 1e-6, name)
    end
  end

  it("SGD with momentum and weight decay", function()
    one_step(function(ps) return optim.SGD(ps, { lr = 0.1, momentum = 0.9, weight_decay = 0.01 }) end,
      { "momentum_buffer" })
  end)

  it("Adam and AdamW", function()
    one_step(function(ps) return optim.Adam(ps, { lr = 0.01 }) end, { "exp_avg", "exp_avg_sq" })
    one_step(function(ps) return optim.AdamW(ps, { lr = 0.01, amsgrad = true }) end,
      { "exp_avg", "exp_avg_sq", "max_exp_avg_sq" })
  end)

  it("refuses an int64 parameter", function()
    local p = fsdp.tensor({ 1, 2 }, "int64")
    H.assert_error(function() return optim.SGD({ p }, { lr = 0.1 }) end, "SGD", "float tensor", "int64")
  end)
end)

describe("bfloat16: GEMMs on two bfloat16 operands", function()
  local ffi = require "ffi"
  local flags = H.read_file("/proc/cpuinfo")
  local forced = os.getenv("FSDP_BF16_GEMM") or os.getenv("ONEDNN_MAX_CPU_ISA") or os.getenv("FSDP_CPU_ISA")

  it("run through oneDNN's bf16 GEMM where the CPU has bf16 instructions, else on float32 copies", function()
    local name = ffi.string(fsdp.C.fsdp_cpu_bf16_gemm_backend())
    if forced then
      return pending("FSDP_BF16_GEMM, ONEDNN_MAX_CPU_ISA or FSDP_CPU_ISA is set: " .. name)
    end
    if flags:find(" avx512_bf16") or flags:find(" amx_bf16") then
      assert.truthy(name:find("^onednn bf16 %(native"), name)
    elseif not flags:find(" avx512f") then
      assert.truthy(name:find("^upcast to float32"), name)
    end
  end)

  -- the float32 path, forced, must pass every bfloat16 op case the native path passes (the op
  -- cases check each result is the float32 computation rounded once)
  it("give the same results on float32 copies (FSDP_BF16_GEMM=upcast runs the bfloat16 op cases)", function()
    -- a shell command in the checkout with the float32 path forced: exit status and output
    local function upcast(cmd)
      local p = io.popen(("cd '%s' && FSDP_BF16_GEMM=upcast OMP_NUM_THREADS=1 timeout 300 %s 2>&1; echo __rc=$?")
        :format(H.root, cmd))
      local out = p:read("*a")
      p:close()
      return tonumber(out:match("__rc=(%d+)%s*$")), out
    end
    local rc, out = upcast([[luajit -e 'package.cpath = "./?.so;" .. package.cpath
      package.path = "./lua/?.lua;./lua/?/init.lua;" .. package.path
      print(require("ffi").string(require("fsdp").C.fsdp_cpu_bf16_gemm_backend()))']])
    assert.equal(0, rc, out)
    assert.truthy(out:find("upcast to float32 (FSDP_BF16_GEMM)", 1, true), out)
    rc, out = upcast([[luajit "$(command -v busted)" --filter='%sbf16' tests/ops/ops_spec.lua]])
    assert.equal(0, rc, out:sub(-3000))
    local ok, failed = out:match("(%d+) successes / (%d+) failures")
    assert.truthy(ok and tonumber(ok) > 1000 and failed == "0", out:sub(-3000))
  end)
end)

describe("bfloat16: a model trains in bfloat16 (Module:to)", function()
  local nn = fsdp.nn
  -- the same MLP from the same seed and data, trained in float32 and, converted with
  -- Module:to("bfloat16"), in bfloat16: the per-step losses
  local function train(dtype, make_opt, steps)
    fsdp.manual_seed(1)
    local m = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 10))
    m:to(dtype)
    fsdp.manual_seed(2)
    local x = fsdp.randn(128, 16)
    local y = x:matmul(fsdp.randn(16, 10)):argmax(2)  -- a teacher's labels: learnable
    x = x:to(dtype)
    local opt = make_opt(m:parameters())
    local losses = {}
    for s = 1, steps do
      local out = m(x)
      assert.equal(dtype, out.dtype)
      local loss = F.cross_entropy(out, y)
      opt:zero_grad()
      loss:backward()
      opt:step()
      losses[s] = loss:item()
    end
    for _, p in ipairs(m:parameters()) do assert.equal(dtype, p.dtype) end
    return losses
  end

  -- measured: max |difference| 0.0062 over 40 steps (losses 2.61 -> 0.0016); the bound leaves 3x
  it("with SGD: its losses follow float32 within 0.02 + 2% and fall 50-fold", function()
    local sgd = function(ps) return optim.SGD(ps, { lr = 0.2, momentum = 0.9 }) end
    local l32, l16 = train("float32", sgd, 40), train("bfloat16", sgd, 40)
    local differs = false
    for s = 1, #l32 do
      assert(math.abs(l16[s] - l32[s]) <= 0.02 + 0.02 * l32[s],
        ("step %d: bfloat16 loss %.5f, float32 loss %.5f"):format(s, l16[s], l32[s]))
      differs = differs or l16[s] ~= l32[s]
    end
    assert.is_true(differs, "the bfloat16 run gave exactly the float32 losses")
    assert(l16[#l16] < l16[1] / 50, ("bfloat16 loss fell from %.4f to %.4f only"):format(l16[1], l16[#l16]))
  end)

  -- Adam's small updates fall below half a bfloat16 ulp of the weights and are lost (why FSDP keeps
  -- float32 master shards): measured 0.39 against 0.34 after 40 steps, so a looser bound
  it("with AdamW: its losses fall 5-fold and stay within 0.1 + 20% of float32", function()
    local adamw = function(ps) return optim.AdamW(ps, { lr = 3e-3 }) end
    local l32, l16 = train("float32", adamw, 40), train("bfloat16", adamw, 40)
    for s = 1, #l32 do
      assert(math.abs(l16[s] - l32[s]) <= 0.1 + 0.2 * l32[s],
        ("step %d: bfloat16 loss %.5f, float32 loss %.5f"):format(s, l16[s], l32[s]))
    end
    assert(l16[#l16] < l16[1] / 5, ("bfloat16 loss fell from %.4f to %.4f only"):format(l16[1], l16[#l16]))
  end)
end)

describe("bfloat16: FSDP mixed precision computes in bfloat16", function()
  local nn = fsdp.nn
  -- one unit at world size 1 ("self"): gathered parameters are bfloat16 tensors in forward and
  -- backward, the master shards, gradients and state_dict float32 (the FSDP matrix compares
  -- training at 1, 2 and 4 ranks with float32 training within bfloat16 tolerance)
  it("gathers bfloat16 parameters for forward and backward; shards, gradients and state_dict stay float32", function()
    fsdp.manual_seed(4)
    local model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 3))
    local exact = {}
    for name, p in model:named_parameters() do exact[name] = p:tolist() end
    fsdp.wrap(model, { mixed_precision = { param = "bf16" } })
    local seen = {}
    model:get(4):register_forward_hook(function(m, inputs, out)
      seen.input, seen.weight, seen.out = inputs[1].dtype, m.weight.dtype, out.dtype
    end)
    local g_dtype
    local x = fsdp.randn(5, 4)  -- a float32 input: the unit casts it
    x.requires_grad = true
    local out = model(x)
    assert.same({ input = "bfloat16", weight = "bfloat16", out = "bfloat16" }, seen)
    assert.equal("bfloat16", out.dtype)
    -- a hook on a parameter while the unit is gathered for backward sees its bfloat16 gradient
    local w = model:get(1).weight
    w:register_hook(function(g) g_dtype = g.dtype end)
    F.cross_entropy(out, fsdp.tensor({ 0, 1, 2, 0, 1 }, "int64")):backward()
    assert.equal("bfloat16", g_dtype)
    assert.equal("float32", x.grad.dtype)  -- the cast's gradient goes back in the input's dtype
    for name, p in model:named_parameters() do
      assert.equal("float32", p.dtype, name)
      assert.equal("float32", p.grad.dtype, name)
    end
    -- state_dict gathers the float32 masters: the exact initial values, not their bf16 rounding
    for name, t in pairs(model:state_dict()) do
      assert.equal("float32", t.dtype, name)
      H.assert_close(t:contiguous():tolist(), exact[name], 0, 0, name)
    end
    assert.is_true(fsdp.all_idle())
  end)

  it("refuses a model already converted to bfloat16, pointing at mixed_precision", function()
    local m = nn.Sequential(nn.Linear(2, 3)):to("bfloat16")
    H.assert_error(function() fsdp.wrap(m) end, "fsdp.wrap", "'0.weight' is bfloat16", "mixed_precision")
    local w = nn.Sequential(nn.Linear(2, 3))
    fsdp.wrap(w)
    H.assert_error(function() w:to("bfloat16") end, "FSDP unit", "before fsdp.wrap", "mixed_precision")
  end)
end)
