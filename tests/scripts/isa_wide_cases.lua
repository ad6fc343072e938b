-- Child of tests/backends/isa_levels.lua (portable_spec.lua, tools/isa_emu.sh): runs the cases
-- below under the ISA level its FSDP_CPU_ISA installs and writes their outputs and gradients to
-- OUT, in isa_levels.lua's dump format, for the comparison across levels.
--   FSDP_CPU_ISA=avx512f luajit tests/scripts/isa_wide_cases.lua OUT
-- The op-case table's shapes are small (a finite-difference check per element) and mostly shorter
-- than one AVX-512 vector, so under that table alone a copy's vector loops may run only their
-- scalar tails. These shapes reach the vector bodies and their tails (1037 = 64 * 16 + 13), and
-- attention's hand-written tiles (src/backend/cpu/linalg.c, gemm_tiles_one): rows in tiles of 8
-- with AVX-512, 6 with AVX2, 4 in portable C; 16-wide panels, two at once (8x32) where a tile
-- needs both whole, so 37 queries leave a partial tile, Dv = 48 a single panel beside a pair, and
-- the causal limits cut tiles at the diagonal. Also the norms' kernels (norm.c) and the
-- optimizers' (optim.c), several steps each. Inputs come from Lua's random stream, seeded per
-- case, so every level sees the same values.
local out = assert(arg[1], "usage: luajit tests/scripts/isa_wide_cases.lua OUT")
package.path = "lua/?.lua;lua/?/init.lua;tests/?.lua;" .. package.path
local fsdp = require "fsdp"
local levels = require "backends.isa_levels"
local F = fsdp.nn.functional

-- a float32 tensor of `shape`, uniform in [lo, hi), from the random stream
local function rand(shape, lo, hi)
  lo, hi = lo or -1, hi or 1
  local n = 1
  for _, d in ipairs(shape) do n = n * d end
  local v = {}
  for i = 1, n do v[i] = lo + (hi - lo) * math.random() end
  return fsdp.tensor(v):view(shape)
end
local function leaf(shape, lo, hi) return rand(shape, lo, hi):requires_grad_() end

-- outputs and the gradients of sum(out1 * r), r drawn, with respect to the leaves
local function with_grads(outs, leaves)
  local r = rand(outs[1]:shape())
  ;(outs[1] * r):sum():backward()
  local grads = {}
  for i, l in ipairs(leaves) do grads[i] = l.grad end
  return outs, grads
end

local cases = {}
local function case(name, fn) cases[#cases + 1] = { name = name, fn = fn } end

-- element-wise, reductions, softmax: vector bodies and tails
local n = 1037
for _, op in ipairs { "exp", "tanh", "sigmoid", "relu", "gelu", "sqrt", "log", "abs" } do
  case(op .. " " .. n, function()
    local positive = op == "sqrt" or op == "log"
    local x = leaf({ n }, positive and 0.1 or -4, 4)
    return with_grads({ x[op](x) }, { x })
  end)
end
case("add, mul, div 3x1037 by 1037", function()
  local a, b = leaf { 3, n }, leaf({ n }, 0.5, 2)
  return with_grads({ (a + b) * a / b }, { a, b })
end)
case("sum, mean, max over 1037", function()
  local x = leaf { 5, n }
  return with_grads({ x:sum(2) + x:mean(2) + x:max(2) }, { x })
end)
case("softmax, log_softmax 7x1037", function()
  local x = leaf({ 7, n }, -6, 6)
  return with_grads({ x:softmax(2) + x:log_softmax(2) }, { x })
end)
case("gelu tanh 1037", function()
  local x = leaf({ n }, -4, 4)
  return with_grads({ F.gelu(x, "tanh") }, { x })
end)

-- GEMMs and convolutions (oneDNN's kernels of each level, our Winograd and packed 4x24 kernel)
case("linear 37x100 -> 53", function()
  local x, w, b = leaf { 37, 100 }, leaf { 53, 100 }, leaf { 53 }
  return with_grads({ F.linear(x, w, b) }, { x, w, b })
end)
case("bmm 3x29x64 @ 3x64x47", function()
  local a, b = leaf { 3, 29, 64 }, leaf { 3, 64, 47 }
  return with_grads({ a:bmm(b) }, { a, b })
end)
case("conv2d 3x3 32 -> 32, 2x32x10x10", function()
  local x, w, b = leaf { 2, 32, 10, 10 }, leaf({ 32, 32, 3, 3 }, -0.2, 0.2), leaf { 32 }
  return with_grads({ F.conv2d(x, w, b, { padding = 1 }) }, { x, w, b })
end)
case("conv2d 5x5 stride 2, 3 -> 20, 2x3x17x17", function()
  local x, w, b = leaf { 2, 3, 17, 17 }, leaf({ 20, 3, 5, 5 }, -0.3, 0.3), leaf { 20 }
  return with_grads({ F.conv2d(x, w, b, { stride = 2, padding = 2 }) }, { x, w, b })
end)

-- attention: the 8x16 and 8x32 tiles, partial tiles, the causal limits, an additive mask
local function sdpa(name, qs, ks, vs, opts, mask_shape)
  case("scaled_dot_product_attention " .. name, function()
    local q, k, v = leaf(qs), leaf(ks), leaf(vs)
    local o = { is_causal = opts.is_causal, scale = opts.scale }
    if mask_shape then o.attn_mask = rand(mask_shape, -2, 2) end
    return with_grads({ F.scaled_dot_product_attention(q, k, v, o) }, { q, k, v })
  end)
end
sdpa("2x2x40x32", { 2, 2, 40, 32 }, { 2, 2, 40, 32 }, { 2, 2, 40, 32 }, {})
sdpa("2x2x40x32 causal", { 2, 2, 40, 32 }, { 2, 2, 40, 32 }, { 2, 2, 40, 32 }, { is_causal = true })
sdpa("1x2x64x64 causal", { 1, 2, 64, 64 }, { 1, 2, 64, 64 }, { 1, 2, 64, 64 }, { is_causal = true })
sdpa("1x3x37x48, 37 queries, Dv 48", { 1, 3, 37, 48 }, { 1, 3, 37, 48 }, { 1, 3, 37, 48 }, { is_causal = true })
sdpa("1x2x24 queries x 70 keys, mask", { 1, 2, 24, 16 }, { 1, 2, 70, 16 }, { 1, 2, 70, 40 }, { scale = 0.3 }, { 24, 70 })

-- the norms: rows of 100 and 1037, groups, batch statistics
case("layer_norm 9x1037", function()
  local x, w, b = leaf { 9, n }, leaf { n }, leaf { n }
  return with_grads({ F.layer_norm(x, { n }, w, b, 1e-5) }, { x, w, b })
end)
case("rms_norm 33x100", function()
  local x, w = leaf { 33, 100 }, leaf { 100 }
  return with_grads({ F.rms_norm(x, { 100 }, w, 1e-6) }, { x, w })
end)
case("group_norm 3x32x9x9, 8 groups", function()
  local x, w, b = leaf { 3, 32, 9, 9 }, leaf { 32 }, leaf { 32 }
  return with_grads({ F.group_norm(x, 8, w, b, 1e-5) }, { x, w, b })
end)
case("batch_norm training 4x19x9x9", function()
  local x, w, b = leaf { 4, 19, 9, 9 }, leaf { 19 }, leaf { 19 }
  local rm, rv = rand({ 19 }, -0.5, 0.5), rand({ 19 }, 0.5, 1.5)
  local outs, grads = with_grads({ F.batch_norm(x, rm, rv, w, b, { training = true, eps = 1e-5 }) }, { x, w, b })
  outs[2], outs[3] = rm, rv  -- the running statistics, updated in place
  return outs, grads
end)

-- the optimizers: five steps on 1037 + 40 parameters, each step's gradient from the parameters
local function optimizer(name, make)
  case("optim " .. name, function()
    local ps = { leaf({ n }, -2, 2), leaf({ 4, 10 }, -2, 2) }
    local opt = make(ps)
    for _ = 1, 5 do
      opt:zero_grad()
      local loss = (ps[1] * ps[1] * rand { n }):sum() + (ps[2]:tanh() * rand { 4, 10 }):sum()
      loss:backward()
      opt:step()
    end
    return { ps[1]:detach(), ps[2]:detach() }, {}
  end)
end
local optim = fsdp.optim
optimizer("SGD", function(ps) return optim.SGD(ps, { lr = 0.05 }) end)
optimizer("SGD momentum, nesterov, weight decay", function(ps)
  return optim.SGD(ps, { lr = 0.05, momentum = 0.9, nesterov = true, weight_decay = 0.01 })
end)
optimizer("SGD momentum, dampening, maximize", function(ps)
  return optim.SGD(ps, { lr = 0.05, momentum = 0.8, dampening = 0.3, maximize = true })
end)
optimizer("Adam", function(ps) return optim.Adam(ps, { lr = 0.01 }) end)
optimizer("Adam weight decay, amsgrad", function(ps) return optim.Adam(ps, { lr = 0.01, weight_decay = 0.1, amsgrad = true }) end)
optimizer("AdamW", function(ps) return optim.AdamW(ps, { lr = 0.01, weight_decay = 0.1 }) end)

local f = assert(io.open(out, "w"))
for index, c in ipairs(cases) do
  math.randomseed(index)
  local outs, grads = c.fn()
  f:write(levels.case_line(index, c.name, outs, grads))
end
f:close()
print(("isa_wide_cases: %d cases under %s"):format(#cases, require("ffi").string(fsdp.C.fsdp_cpu_isa())))
