-- Four runners over the op-case table (tests/ops/op_cases.lua):
--   1. forward: each case's outputs (shape, dtype, values) against the naive Lua reference of
--      tests/ops/op_refs.lua, and against the case's hand-computed values where it has them; a
--      bfloat16 or float16 output must be the reference rounded once (H.assert_rounded_once);
--   2. backward: the gradient of sum(out * r), r random, with respect to every float32 input,
--      against central finite differences (inputs rebuilt from perturbed Lua values);
--   3. backends: every device in fsdp.backends() against the CPU, outputs and gradients; the CPU
--      against itself must be bit-exact (a determinism check), another backend within float
--      tolerance. A new backend is tested by appearing in fsdp.backends();
--   4. low precision: the gradients of a case's bfloat16/float16 inputs against the float32
--      gradients of the same case on float32 copies of the same values: rounded once.
-- Only the public API is used: inputs are made with fsdp.tensor(values):view(shape), read back
-- with tolist().
local fsdp = require "fsdp"
local H = require "helpers"
local R = require "ops.op_refs"
local op_table = require "ops.op_cases"

local cases = op_table.cases

-- forward tolerances {atol, rtol} by output dtype, unless the case gives its own
local forward_tol = {
  float32 = { 1e-5, 1e-5 },
  float16 = { 1e-3, 1e-3 },
  bfloat16 = { 1e-2, 1e-2 },
  int64 = { 0, 0 },
  bool = { 0, 0 },
}
-- another backend against the CPU: outputs within the forward tolerance, gradients within this
local backend_grad_tol = { 1e-4, 1e-4 }
-- finite differences: step, tolerance, and how many elements of a large input are perturbed
local fd_eps = 1e-2
local fd_tol = { 2e-2, 2e-2 }
local fd_max_elements = 64

-- ---- inputs -------------------------------------------------------------------------------------
-- The Lua values of each input, drawn from a random stream seeded by the case's position, so
-- every runner sees the same inputs for a case.
local function draw(spec)
  local n = R.numel(spec.base)
  local v = {}
  if spec.gen == "values" then
    for i = 1, n do
      v[i] = spec.values[i]
    end
  elseif spec.gen == "iota" then
    for i = 1, n do
      v[i] = spec.start + i - 1
    end
  elseif spec.gen == "uniform" then
    for i = 1, n do
      local u = math.random()
      if spec.away then
        -- |value| in [away, hi], either sign
        local mag = spec.away + (spec.hi - spec.away) * u
        if math.random() < 0.5 then
          mag = -mag
        end
        v[i] = mag
      else
        v[i] = spec.lo + (spec.hi - spec.lo) * u
      end
    end
  elseif spec.gen == "distinct" then
    -- a random permutation of -1, -1 + 2/n, ...
    for i = 1, n do
      v[i] = -1 + 2 * (i - 1) / n
    end
    for i = n, 2, -1 do
      local j = math.random(i)
      v[i], v[j] = v[j], v[i]
    end
  elseif spec.gen == "ints" then
    for i = 1, n do
      v[i] = math.random(spec.lo, spec.hi - 1)
    end
    for k, x in pairs(spec.set or {}) do
      v[k] = x
    end
  else
    error("ops_spec: unknown generator " .. tostring(spec.gen))
  end
  return v
end

local function draw_all(case, index)
  math.randomseed(index)
  local vals = {}
  for i, spec in ipairs(case.inputs) do
    if not spec.none then
      vals[i] = draw(spec)
    end
  end
  return vals
end

-- the stored (contiguous) tensor of an input, built from its Lua values
local function stored(spec, values)
  return fsdp.tensor(values, spec.dtype):view(spec.base)
end

-- what the op sees: the stored tensor, or the spec's view of it
local function viewed(spec, t)
  if spec.view then
    return spec.view(t)
  end
  return t
end

-- the op's outputs as a list
local function call(case, args)
  return { case.def.call(case.p, unpack(args, 1, #case.inputs)) }
end

-- an input whose gradient is checked: float32, not marked const
local function perturbable(spec)
  return not spec.none and spec.dtype == "float32" and not spec.const
end

-- a bfloat16 or float16 output is the exact value rounded once, after a float32 computation whose
-- own error is within the case's tol (a float32 tolerance), or this; gradients likewise (runner 4)
local low_precision = { bfloat16 = true, float16 = true }
local fsdp_float = { float32 = true, bfloat16 = true, float16 = true }
local f32_slack = { 1e-5, 1e-5 }
local low_grad_slack = { 1e-5, 1e-5 }

local function has_low_precision_input(case)
  for _, spec in ipairs(case.inputs) do
    if not spec.none and low_precision[spec.dtype] then
      return true
    end
  end
  return false
end

-- finite differences for the cases on float32 inputs alone (runner 4 takes the others)
local function differentiable(case)
  if case.nograd or case.def.nograd or has_low_precision_input(case) then
    return false
  end
  for _, spec in ipairs(case.inputs) do
    if perturbable(spec) then
      return true
    end
  end
  return false
end

-- uniform [-1, 1] weights for the scalar loss sum(out * r), from the case's random stream
local function draw_weights(n)
  local w = {}
  for i = 1, n do
    w[i] = 2 * math.random() - 1
  end
  return w
end

local function weights_tensor(values, shape)
  return fsdp.tensor(values):view(shape)
end

-- A case marked known_failure (a library bug, described in the table) must still fail; once it
-- passes, the stale mark is reported as a failure.
local function name_of(case)
  if case.known_failure then
    return case.name .. " [known failure: " .. case.known_failure .. "]"
  end
  return case.name
end

local function expecting(case, fn)
  if not case.known_failure then
    return fn
  end
  return function()
    local ok = pcall(fn)
    if ok then
      error(case.name .. ": marked as a known failure but passes now; remove the mark", 0)
    end
  end
end

-- ---- 1. forward against the references ----------------------------------------------------------
local function tol_of(case, dtype)
  return case.tol or forward_tol[dtype]
end

local function check_output(case, k, got, ref)
  local what = ("%s: output %d"):format(case.name, k)
  assert(fsdp.is_tensor(got), what .. " is not a tensor")
  assert.same(ref.shape, got:shape(), what .. " shape")
  assert.equal(ref.dtype, got.dtype, what .. " dtype")
  if low_precision[got.dtype] then
    local tol = case.tol or f32_slack
    H.assert_rounded_once(got:tolist(), ref.data, got.dtype, tol[1], tol[2], what .. " against the reference")
    return
  end
  local tol = tol_of(case, got.dtype)
  H.assert_close(got:tolist(), ref.data, tol[1], tol[2], what .. " against the reference")
end

-- The reference gets the op's inputs as tolist() reads them back (a strided view in logical
-- row-major order); the cases of transpose, narrow and expand check that reading themselves.
local function run_forward(case, index)
  local vals = draw_all(case, index)
  local args = {}
  local arrays = {}
  for i, spec in ipairs(case.inputs) do
    if not spec.none then
      local t = viewed(spec, stored(spec, vals[i]))
      args[i] = t
      arrays[i] = R.array(t:shape(), t:tolist(), t.dtype)
    end
  end
  local outs = call(case, args)
  local refs = { case.def.ref(case.p, unpack(arrays, 1, #case.inputs)) }
  assert.equal(#refs, #outs, case.name .. ": number of outputs")
  for k = 1, #outs do
    check_output(case, k, outs[k], refs[k])
  end
  -- hand-computed values, where the case has them
  local tol = tol_of(case, outs[1].dtype)
  if case.want ~= nil then
    H.assert_close(outs[1]:tolist(), H.flat(case.want), tol[1], tol[2], case.name .. ": hand-computed values")
  end
  if case.want2 ~= nil then
    H.assert_close(outs[2]:tolist(), H.flat(case.want2), 0, 0, case.name .. ": hand-computed second output")
  end
end

describe("op cases: forward against naive references", function()
  for index, case in ipairs(cases) do
    it(name_of(case), expecting(case, function() run_forward(case, index) end))
  end
end)

-- ---- 2. backward against finite differences -----------------------------------------------------
-- the elements of an n-element input that are perturbed: all of a small one, an even spread of
-- fd_max_elements (first and last included) of a large one
local function fd_positions(n)
  local list = {}
  if n <= fd_max_elements then
    for j = 1, n do
      list[j] = j
    end
    return list
  end
  for k = 1, fd_max_elements do
    list[k] = 1 + math.floor((k - 1) * (n - 1) / (fd_max_elements - 1))
  end
  return list
end

local function run_backward(case, index)
  local vals = draw_all(case, index)
  -- analytic: the stored tensors of perturbable inputs are the leaves
  local leaves = {}
  local args = {}
  for i, spec in ipairs(case.inputs) do
    if not spec.none then
      local t = stored(spec, vals[i])
      if perturbable(spec) then
        t.requires_grad = true
        leaves[i] = t
      end
      args[i] = viewed(spec, t)
    end
  end
  local out = call(case, args)[1]
  assert.equal("float32", out.dtype, case.name .. ": gradient check needs a float32 output")
  assert.is_true(out.requires_grad, case.name .. ": output does not require grad")
  local r = weights_tensor(draw_weights(out:numel()), out:shape())
  local loss = (out * r):sum()
  loss:backward()
  -- numeric: the loss with one input rebuilt from perturbed values, the others as they are
  local eps = case.fd_eps or fd_eps
  local tol = case.fd_tol or fd_tol
  local function loss_with(i, values)
    local a = {}
    for k = 1, #case.inputs do
      a[k] = args[k]
    end
    a[i] = viewed(case.inputs[i], stored(case.inputs[i], values))
    return fsdp.no_grad(function() return (call(case, a)[1] * r):sum():item() end)
  end
  for i, leaf in pairs(leaves) do
    assert(leaf.grad, ("%s: input %d got no gradient"):format(case.name, i))
    assert.same(leaf:shape(), leaf.grad:shape(), ("%s: gradient shape of input %d"):format(case.name, i))
    local analytic = leaf.grad:tolist()
    local v = vals[i]
    for _, j in ipairs(fd_positions(#v)) do
      local orig = v[j]
      v[j] = orig + eps
      local plus = loss_with(i, v)
      v[j] = orig - eps
      local minus = loss_with(i, v)
      v[j] = orig
      local numeric = (plus - minus) / (2 * eps)
      local a = analytic[j]
      if not (math.abs(a - numeric) <= tol[1] + tol[2] * math.abs(numeric)) then
        error(("%s: input %d element %d: analytic %.6g vs numeric %.6g"):format(case.name, i, j, a, numeric), 0)
      end
    end
  end
end

describe("op cases: backward against finite differences", function()
  for index, case in ipairs(cases) do
    if differentiable(case) then
      it(name_of(case), expecting(case, function() run_backward(case, index) end))
    end
  end
end)

-- ---- 3. every backend against the CPU -----------------------------------------------------------
-- Runs a case with its inputs on `device` (copied there with clone():to(device), so even the CPU
-- run works on new tensors) and brings back the outputs and, for differentiable cases, the
-- gradients of sum(out * r) for the given weights.
local function run_on(case, vals, device, weights)
  local leaves = {}
  local args = {}
  local grad = differentiable(case)
  for i, spec in ipairs(case.inputs) do
    if not spec.none then
      local t = stored(spec, vals[i]):clone():to(device)
      if grad and perturbable(spec) then
        t.requires_grad = true
        leaves[i] = t
      end
      args[i] = viewed(spec, t)
    end
  end
  local outs = call(case, args)
  local result = { outs = {}, grads = {} }
  for k, o in ipairs(outs) do
    result.outs[k] = o:to("cpu")
  end
  if grad then
    local r = weights_tensor(weights, outs[1]:shape()):clone():to(outs[1].device)  -- (x:cpu() leaves the device)
    ;(outs[1] * r):sum():backward()
    for i, leaf in pairs(leaves) do
      result.grads[i] = leaf.grad:to("cpu")
    end
  end
  return result
end

-- FSDP_OP_REPORT=FILE (tools/gpu_check.sh): each backend comparison's largest errors, one line per
-- case, tab-separated: backend, case, output dtype, then max |got - want| and max |got - want| /
-- max(|want|, 1e-30) over the outputs, the same two over the gradients
local report = os.getenv("FSDP_OP_REPORT")
local function max_errors(pairs_)
  local abs, rel = 0, 0
  for _, p in ipairs(pairs_) do
    local g, w = p[1]:tolist(), p[2]:tolist()
    for i = 1, #w do
      local d = 0  -- equal values (infinities too) and NaN against NaN are no error
      if g[i] ~= w[i] and (g[i] == g[i] or w[i] == w[i]) then d = math.abs(g[i] - w[i]) end
      if d ~= d then d = math.huge end
      abs = math.max(abs, d)
      rel = math.max(rel, d / math.max(math.abs(w[i]), 1e-30))
    end
  end
  return abs, rel
end
local function report_case(case, device, want, got)
  if not report or device == "cpu" then return end
  local outs, grads = {}, {}
  for k, w in ipairs(want.outs) do if got.outs[k] then outs[#outs + 1] = { got.outs[k], w } end end
  for i, w in pairs(want.grads) do if got.grads[i] then grads[#grads + 1] = { got.grads[i], w } end end
  local oa, orl = max_errors(outs)
  local ga, grl = max_errors(grads)
  local f = io.open(report, "a")
  if f then
    f:write(("%s\t%s\t%s\t%.3g\t%.3g\t%.3g\t%.3g\n"):format(device, name_of(case),
      want.outs[1] and want.outs[1].dtype or "-", oa, orl, ga, grl))
    f:close()
  end
end

-- Two backends each round a float32 result once to a bfloat16 or float16 output; float32 sums in
-- another order can land on the other side of a rounding boundary, so their outputs may be one
-- unit in the last place of that dtype apart (found when the CUDA kernels first ran, on the CUDA
-- executor: a bfloat16 convolution one bf16 ulp off the CPU's)
local low_ulp = { bfloat16 = 2 ^ -7, float16 = 2 ^ -10 }
local function rounded_apart(tol, dtype)
  if not low_ulp[dtype] then
    return tol
  end
  return { tol[1], tol[2] + low_ulp[dtype] }
end

-- FSDP_OP_DUMP=FILE (tests/backends/isa_levels.lua, for portable_spec.lua and tools/isa_emu.sh): the
-- CPU's run of each case -- outputs and gradients, their dtypes and every value -- appended to FILE
-- in isa_levels.lua's format, so runs under different FSDP_CPU_ISA levels can be compared
local dump = os.getenv("FSDP_OP_DUMP")
local function dump_case(index, case, result)
  local f = assert(io.open(dump, "a"))
  f:write(require("backends.isa_levels").case_line(index, name_of(case), result.outs, result.grads))
  f:close()
end

local function run_backend(case, index, device)
  local vals = draw_all(case, index)
  -- the weights need the output size: one plain CPU forward first
  local args = {}
  for i, spec in ipairs(case.inputs) do
    if not spec.none then
      args[i] = viewed(spec, stored(spec, vals[i]))
    end
  end
  local n = call(case, args)[1]:numel()
  local weights = draw_weights(n)
  local want = run_on(case, vals, "cpu", weights)
  local got = run_on(case, vals, device, weights)
  report_case(case, device, want, got)
  if dump and device == "cpu" then dump_case(index, case, want) end
  local exact = device == "cpu"
  assert.equal(#want.outs, #got.outs, case.name .. ": number of outputs")
  for k, w in ipairs(want.outs) do
    local g = got.outs[k]
    local what = ("%s on %s: output %d"):format(case.name, device, k)
    assert.same(w:shape(), g:shape(), what .. " shape")
    assert.equal(w.dtype, g.dtype, what .. " dtype")
    local tol = rounded_apart(tol_of(case, w.dtype), w.dtype)
    if exact then
      tol = { 0, 0 }
    end
    H.assert_close(g:tolist(), w:tolist(), tol[1], tol[2], what)
  end
  for i, w in pairs(want.grads) do
    local what = ("%s on %s: gradient of input %d"):format(case.name, device, i)
    assert(got.grads[i], what .. " is missing")
    local tol = rounded_apart(backend_grad_tol, w.dtype)
    if exact then
      tol = { 0, 0 }
    end
    H.assert_close(got.grads[i]:tolist(), w:tolist(), tol[1], tol[2], what)
  end
end

-- Without a GPU the "cuda" device is the test double of one (backend/testdev/testdev.c): the CPU's
-- kernels on memory the host cannot touch, so every case proves that its op reaches device memory
-- only through the device table (a host read of a device tensor faults), as on a GPU.
if not fsdp.cuda.is_available() then fsdp._testdev_install() end

describe("op cases: every backend against the CPU", function()
  for _, device in ipairs(fsdp.backends()) do
    for index, case in ipairs(cases) do
      it(device .. ": " .. name_of(case), expecting(case, function() run_backend(case, index, device) end))
    end
  end
end)

-- ---- 4. low-precision gradients against float32 ------------------------------------------------
-- The case runs twice with the same upstream gradient r (drawn, then rounded to the output's
-- dtype): as declared, and with each bfloat16/float16 input replaced by a float32 tensor holding
-- the same values. Forward and backward compute in float32 either way, so each low-precision
-- input's gradient must have the input's dtype and be the float32 gradient rounded once; a
-- float32 input of a mixed case gets the float32 gradient (within float32 tolerance).
-- An input the op sees expanded (`broadcast`) gets the sum of the gradients of the expanded view,
-- itself a bfloat16 tensor whose gradient was rounded before that sum (PyTorch does the same): the
-- float32 run rounds that view's gradient too (a hook), so the sums compare rounded once as well.
local function grad_input(spec)
  return not spec.none and fsdp_float[spec.dtype] and not spec.const
end

local function low_differentiable(case)
  if case.nograd or case.def.nograd or not has_low_precision_input(case) then
    return false
  end
  for _, spec in ipairs(case.inputs) do
    if grad_input(spec) then
      return true
    end
  end
  return false
end

local function check_low_grad(spec, got, want, what)
  if low_precision[spec.dtype] then
    H.assert_rounded_once(got, want, spec.dtype, low_grad_slack[1], low_grad_slack[2], what)
  else
    H.assert_close(got, want, forward_tol.float32[1], forward_tol.float32[2], what)
  end
end

local function run_low_grad(case, index)
  local vals = draw_all(case, index)
  local leaves, twins, args, args32 = {}, {}, {}, {}
  for i, spec in ipairs(case.inputs) do
    if not spec.none then
      local t = stored(spec, vals[i])
      local t32 = t
      if low_precision[spec.dtype] then
        t32 = fsdp.tensor(t:tolist(), "float32"):view(spec.base)
      end
      if grad_input(spec) then
        t.requires_grad = true
        t32.requires_grad = true
        leaves[i], twins[i] = t, t32
      end
      args[i], args32[i] = viewed(spec, t), viewed(spec, t32)
      if spec.broadcast and low_precision[spec.dtype] and grad_input(spec) then
        args32[i]:register_hook(function(g) return g:to(spec.dtype):float() end)
      end
    end
  end
  local out = call(case, args)[1]
  local out32 = call(case, args32)[1]
  assert.is_true(out.requires_grad, case.name .. ": output does not require grad")
  local r = fsdp.tensor(draw_weights(out:numel()), out.dtype):view(out:shape())
  ;(out * r):sum():backward()
  ;(out32 * r:float()):sum():backward()
  for i, leaf in pairs(leaves) do
    local what = ("%s: gradient of input %d"):format(case.name, i)
    assert(leaf.grad, what .. " is missing")
    assert.equal(leaf.dtype, leaf.grad.dtype, what .. " dtype")
    assert.same(leaf:shape(), leaf.grad:shape(), what .. " shape")
    check_low_grad(case.inputs[i], leaf.grad:tolist(), twins[i].grad:tolist(), what .. " against float32")
  end
end

describe("op cases: low-precision gradients against float32", function()
  for index, case in ipairs(cases) do
    if low_differentiable(case) then
      it(name_of(case), expecting(case, function() run_low_grad(case, index) end))
    end
  end
end)

-- ---- the table itself ---------------------------------------------------------------------------
describe("op cases: the table", function()
  it("has a case for every registered op", function()
    local seen = {}
    for _, case in ipairs(cases) do
      seen[case.op] = true
    end
    local missing = {}
    for name in pairs(op_table.ops) do
      if not seen[name] then
        missing[#missing + 1] = name
      end
    end
    table.sort(missing)
    assert.same({}, missing)
  end)

  it("registers every function of fsdp.nn.functional", function()
    local missing = {}
    for name, fn in pairs(fsdp.nn.functional) do
      if type(fn) == "function" and name:sub(1, 1) ~= "_" then
        if not op_table.ops[name] and not op_table.ops["F." .. name] then
          missing[#missing + 1] = name
        end
      end
    end
    table.sort(missing)
    assert.same({}, missing)
  end)
end)
