-- The transformer modules (nn.MultiheadAttention, nn.TransformerEncoderLayer/DecoderLayer,
-- nn.TransformerEncoder/Decoder, nn.Transformer) against PyTorch's values (tests/golden/gen_transformer.py ->
-- tests/golden/transformer.safetensors): for every case the output, the attention weights where
-- asked for, and the gradients of every float input and every parameter, with the state_dict
-- loaded from PyTorch's under PyTorch's names. Then state_dict both ways, dropout (eval equals
-- dropout 0; training drops with the right scale), deep copies in the stacks, nn.Transformer's init
-- and generate_square_subsequent_mask, and bad input.
-- Under FSDP at 2 and 3 ranks: tests/scripts/fsdp_matrix.lua's nn_encoder case and
-- tests/scripts/transformer_ranks.lua (tests/fsdp/transformer_ranks_spec.lua).
local fsdp = require "fsdp"
local H = require "helpers"
local nn = fsdp.nn

local G = fsdp.load("tests/golden/transformer.safetensors")
-- float32 rounding: sums of a few dozen products, a softmax and a layer norm; the measured maxima
-- are about 1e-6 absolute (print them with TRANSFORMER_ERRORS=1)
local ATOL, RTOL = 2e-5, 1e-4
local E, NH, FF = 8, 2, 16
local TFF = 12  -- (the nn.Transformer cases' dim_feedforward)

-- the entries "<case>.<kind>.<name>" as name -> tensor
local function entries(case, kind)
  local r, prefix = {}, case .. "." .. kind .. "."
  for k, t in pairs(G) do
    if k:sub(1, #prefix) == prefix then r[k:sub(#prefix + 1)] = t end
  end
  return r
end

-- the cases: the module (the generator's settings) and its call on the inputs x (name -> tensor;
-- bool masks already bool)
local CASES = {
  mha_self = { build = function() return nn.MultiheadAttention(E, NH) end,
    call = function(m, x) return m(x.query, x.query, x.query) end },
  mha_cross_bf = { build = function() return nn.MultiheadAttention(E, NH, { batch_first = true }) end,
    call = function(m, x)
      return m(x.query, x.key, x.value, { attn_mask = x.attn_mask, key_padding_mask = x.key_padding_mask,
        average_attn_weights = false })
    end },
  mha_noweights = { build = function() return nn.MultiheadAttention(E, NH) end,
    call = function(m, x)
      local y, w = m(x.query, x.key, x.value, { attn_mask = x.attn_mask, key_padding_mask = x.key_padding_mask,
        need_weights = false })
      assert.is_nil(w)
      return y
    end },
  mha_float3d = { build = function() return nn.MultiheadAttention(E, NH) end,
    call = function(m, x)  -- (PyTorch's positional order: key_padding_mask, need_weights, attn_mask)
      return m(x.query, x.key, x.value, x.key_padding_mask, true, x.attn_mask)
    end },
  mha_kvdim = { build = function() return nn.MultiheadAttention(E, NH, { bias = false, kdim = 6, vdim = 5 }) end,
    call = function(m, x) return m(x.query, x.key, x.value) end },
  mha_causal = { build = function() return nn.MultiheadAttention(E, NH) end,
    call = function(m, x) return m(x.query, x.query, x.query, { is_causal = true }) end },
  mha_biaskv = { build = function() return nn.MultiheadAttention(E, NH, { add_bias_kv = true, add_zero_attn = true }) end,
    call = function(m, x)
      return m(x.query, x.key, x.value, { attn_mask = x.attn_mask, key_padding_mask = x.key_padding_mask })
    end },
  mha_unbatched = { build = function() return nn.MultiheadAttention(E, NH, { batch_first = true }) end,
    call = function(m, x) return m(x.query, x.key, x.value, { average_attn_weights = false }) end },
  enc_post_relu = { build = function() return nn.TransformerEncoderLayer(E, NH, FF, 0) end,
    call = function(m, x) return m(x.src, x.src_mask, x.src_key_padding_mask) end },
  enc_pre_gelu_bf = {
    build = function()
      return nn.TransformerEncoderLayer(E, NH, { dim_feedforward = FF, dropout = 0, activation = "gelu",
        batch_first = true, norm_first = true, layer_norm_eps = 1e-3 })
    end,
    call = function(m, x) return m(x.src, { src_mask = x.src_mask }) end },
  enc_nobias_causal = {
    build = function() return nn.TransformerEncoderLayer(E, NH, { dim_feedforward = FF, dropout = 0, bias = false }) end,
    call = function(m, x) return m(x.src, { is_causal = true }) end },
  dec_post = { build = function() return nn.TransformerDecoderLayer(E, NH, FF, 0) end,
    call = function(m, x)
      return m(x.tgt, x.memory, x.tgt_mask, x.memory_mask, x.tgt_key_padding_mask, x.memory_key_padding_mask)
    end },
  dec_pre_gelu_bf_causal = {
    build = function()
      return nn.TransformerDecoderLayer(E, NH, { dim_feedforward = FF, dropout = 0, activation = "gelu",
        batch_first = true, norm_first = true })
    end,
    call = function(m, x)
      return m(x.tgt, x.memory, { tgt_is_causal = true, memory_key_padding_mask = x.memory_key_padding_mask })
    end },
  dec_nobias = {
    build = function() return nn.TransformerDecoderLayer(E, NH, { dim_feedforward = FF, dropout = 0, bias = false }) end,
    call = function(m, x) return m(x.tgt, x.memory) end },
  encoder_norm = {
    build = function()
      return nn.TransformerEncoder(nn.TransformerEncoderLayer(E, NH, FF, 0), 2, { norm = nn.LayerNorm(E) })
    end,
    call = function(m, x) return m(x.src, x.mask, x.src_key_padding_mask) end },
  decoder_norm = {
    build = function()
      return nn.TransformerDecoder(nn.TransformerDecoderLayer(E, NH, FF, 0), 2, { norm = nn.LayerNorm(E) })
    end,
    call = function(m, x)
      return m(x.tgt, x.memory, { tgt_is_causal = true, memory_key_padding_mask = x.memory_key_padding_mask })
    end },
  tfm_default = { build = function() return nn.Transformer(E, NH, 2, 1, TFF, 0) end,
    call = function(m, x) return m(x.src, x.tgt) end },
  tfm_bf = {
    build = function()
      return nn.Transformer { d_model = E, nhead = NH, num_encoder_layers = 1, num_decoder_layers = 1,
        dim_feedforward = TFF, dropout = 0, layer_norm_eps = 1e-3, batch_first = true }
    end,
    call = function(m, x) return m(x.src, x.tgt, { src_mask = x.src_mask, memory_mask = x.memory_mask }) end },
  tfm_pre_gelu = { build = function() return nn.Transformer(E, NH, 1, 1, TFF, 0, "gelu", { norm_first = true }) end,
    call = function(m, x)
      return m(x.src, x.tgt, { src_key_padding_mask = x.src_key_padding_mask,
        memory_key_padding_mask = x.memory_key_padding_mask })
    end },
  tfm_masks = { build = function() return nn.Transformer(E, NH, 1, 1, TFF, 0) end,
    call = function(m, x)  -- (PyTorch's positional order: src_mask, tgt_mask, memory_mask, the padding masks)
      local square = nn.Transformer.generate_square_subsequent_mask
      local src_mask = square(x.src:size(1), { device = x.src.device })
      local tgt_mask = square(x.tgt:size(1), x.tgt.device)
      -- the causal masks PyTorch's generate_square_subsequent_mask gave the generator, exactly
      assert.same(x.src_mask:to("cpu"):tolist(), src_mask:to("cpu"):tolist())
      assert.same(x.tgt_mask:to("cpu"):tolist(), tgt_mask:to("cpu"):tolist())
      return m(x.src, x.tgt, src_mask, tgt_mask, x.memory_mask, x.src_key_padding_mask, x.tgt_key_padding_mask,
        x.memory_key_padding_mask)
    end },
  tfm_custom = {
    build = function()
      local enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, NH, TFF, 0, "gelu"), 1)
      local dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, NH, { dim_feedforward = TFF, dropout = 0,
        norm_first = true }), 2, { norm = nn.LayerNorm(E) })
      return nn.Transformer(E, NH, { custom_encoder = enc, custom_decoder = dec })
    end,
    call = function(m, x) return m(x.src, x.tgt, { tgt_key_padding_mask = x.tgt_key_padding_mask }) end },
  tfm_nobias_causal = { build = function() return nn.Transformer(E, NH, 1, 1, TFF, 0, { bias = false }) end,
    call = function(m, x) return m(x.src, x.tgt, { src_is_causal = true, tgt_is_causal = true }) end },
}
local ORDER = {}
for name in pairs(CASES) do ORDER[#ORDER + 1] = name end
table.sort(ORDER)

local measured = {}  -- case -> {fwd = {abs, rel}, bwd = {abs, rel}}
local function compare(case, part, got, want, what)
  assert.is_not_nil(got, case .. ": no " .. what)
  if got.device ~= "cpu" then got = got:to("cpu") end
  assert.same(want:shape(), got:shape(), case .. ": shape of " .. what)
  H.assert_close(got:contiguous():view(-1):tolist(), want:contiguous():view(-1):tolist(), ATOL, RTOL, case .. ": " .. what)
  local d = (got - want):abs()
  local m = measured[case] or { fwd = { 0, 0 }, bwd = { 0, 0 } }
  measured[case] = m
  m[part][1] = math.max(m[part][1], d:max():item())
  m[part][2] = math.max(m[part][2], (d / (want:abs() + 1e-3)):max():item())
end

-- the case's module with PyTorch's state_dict, its inputs (float ones as leaves), run and compared
-- (device: the module and inputs moved there first; "cpu" by default)
local function run_case(name, device)
  device = device or "cpu"
  local c = CASES[name]
  local m = c.build()
  m:load_state_dict(entries(name, "p"))
  m:to(device)
  local x = {}
  for k, t in pairs(entries(name, "x")) do
    x[k] = t:clone():to(device)  -- (a new leaf: the golden tensor stays as it is)
    x[k].requires_grad = not k:find("mask", 1, true)
  end
  for k, t in pairs(entries(name, "b")) do x[k] = t:ne(0):to(device) end
  local y, w = c.call(m, x)
  compare(name, "fwd", y, G[name .. ".y"], "output")
  local loss = (y * G[name .. ".r"]:to(device)):sum()
  if G[name .. ".w"] then
    compare(name, "fwd", w, G[name .. ".w"], "attention weights")
    loss = loss + (w * G[name .. ".rw"]:to(device)):sum()
  else
    assert.is_nil(w, name .. ": weights")
  end
  loss:backward()
  for k, g in pairs(entries(name, "g")) do compare(name, "bwd", x[k].grad, g, "gradient of " .. k) end
  local params = {}
  for k, p in m:named_parameters() do params[k] = p end
  local want = entries(name, "gp")
  for k, g in pairs(want) do compare(name, "bwd", params[k] and params[k].grad, g, "gradient of " .. k) end
  for k in pairs(params) do assert.is_not_nil(want[k], name .. ": parameter " .. k .. " is not PyTorch's") end
  return m
end

describe("transformer modules against PyTorch (forward, input and parameter gradients)", function()
  for _, name in ipairs(ORDER) do
    it(name, function() run_case(name) end)
  end

  -- the same on the "cuda" device: the GPU where there is one, else its test double (backend/testdev)
  it("every case on the cuda device", function()
    if not fsdp.cuda.is_available() then fsdp._testdev_install() end
    for _, name in ipairs(ORDER) do run_case(name, "cuda") end
  end)

  -- the other attention path gives the same numbers: weights asked for (an explicit softmax, checked
  -- above) or not (F.scaled_dot_product_attention): the output against PyTorch's, the gradients of
  -- sum(y * r) against the explicit path's
  it("mha_self and mha_causal without weights (the fused path)", function()
    for _, name in ipairs { "mha_self", "mha_causal" } do
      local grads = {}
      for _, need_weights in ipairs { true, false } do
        local m = CASES[name].build()
        m:load_state_dict(entries(name, "p"))
        local q = G[name .. ".x.query"]:clone()
        q.requires_grad = true
        local y, w = m(q, q, q, { need_weights = need_weights, is_causal = name == "mha_causal" })
        assert.equal(need_weights, w ~= nil)
        compare(name, "fwd", y, G[name .. ".y"], "output")
        ;(y * G[name .. ".r"]):sum():backward()
        grads[#grads + 1] = { q.grad, m.in_proj_weight.grad, m.out_proj.weight.grad }
      end
      for i = 1, 3 do
        H.assert_close(grads[2][i]:tolist(), grads[1][i]:tolist(), ATOL, RTOL, name .. ": fused-path gradient " .. i)
      end
    end
  end)

  it("mha_causal: is_causal with the causal attn_mask too (PyTorch's hint) gives the same", function()
    local call = CASES.mha_causal.call
    CASES.mha_causal.call = function(m, x)
      local mask = fsdp.ones(5, 5):triu(1):ne(0)
      return m(x.query, x.query, x.query, { attn_mask = mask, is_causal = true })
    end
    local ok, err = pcall(run_case, "mha_causal")
    CASES.mha_causal.call = call
    assert(ok, err)
  end)

  teardown(function()
    if not os.getenv("TRANSFORMER_ERRORS") then return end
    for _, name in ipairs(ORDER) do
      local m = measured[name]
      if m then
        print(("%-24s fwd abs %.2e rel %.2e   bwd abs %.2e rel %.2e"):format(name, m.fwd[1], m.fwd[2], m.bwd[1], m.bwd[2]))
      end
    end
  end)
end)

describe("transformer state_dict", function()
  it("PyTorch's keys and values load, and come back equal", function()
    for _, name in ipairs(ORDER) do
      local m = CASES[name].build()
      local theirs = entries(name, "p")
      m:load_state_dict(theirs)
      local ours = m:state_dict()
      assert.same(H.sorted_keys(theirs), H.sorted_keys(ours), name)
      for k, t in pairs(theirs) do
        assert.same(t:tolist(), ours[k]:tolist(), name .. " " .. k)
      end
    end
  end)

  it("names: PyTorch's, including q/k/v_proj_weight, bias_k/bias_v and a bias-free layer", function()
    local keys = H.sorted_keys(nn.MultiheadAttention(8, 2, { kdim = 3, vdim = 4 }):state_dict())
    assert.same({ "in_proj_bias", "k_proj_weight", "out_proj.bias", "out_proj.weight", "q_proj_weight", "v_proj_weight" }, keys)
    local m = nn.MultiheadAttention(8, 2, { add_bias_kv = true })
    assert.same({ 1, 1, 8 }, m.bias_k:shape())
    assert.same({ 24, 8 }, m.in_proj_weight:shape())
    local sd = nn.TransformerEncoderLayer(8, 2, { bias = false }):state_dict()
    assert.is_nil(sd["norm1.bias"])
    assert.is_nil(sd["self_attn.in_proj_bias"])
    assert.same({ 2048, 8 }, sd["linear1.weight"]:shape())
  end)

  it("PyTorch's init: Xavier-uniform in_proj_weight, zero in_proj_bias and out_proj.bias", function()
    fsdp.manual_seed(1)
    local m = nn.MultiheadAttention(64, 4)
    local bound = math.sqrt(6 / (64 + 192))
    assert.is_true(m.in_proj_weight:abs():max():item() <= bound)
    assert.is_true(m.in_proj_weight:abs():max():item() > 0.9 * bound)
    assert.equal(0, m.in_proj_bias:abs():max():item())
    assert.equal(0, m.out_proj.bias:abs():max():item())
  end)
end)

describe("transformer stacks", function()
  it("TransformerEncoder holds deep copies: equal at first, separate tensors", function()
    local layer = nn.TransformerEncoderLayer(8, 2, 16)
    local enc = nn.TransformerEncoder(layer, 3)
    assert.equal(3, enc.layers:len())
    local w0 = enc.layers[1].linear1.weight
    for i = 2, 3 do assert.same(w0:tolist(), enc.layers[i].linear1.weight:tolist()) end
    assert.same(layer.linear1.weight:tolist(), w0:tolist())
    fsdp.no_grad(function() w0:fill_(7) end)
    assert.are_not.equal(7, enc.layers[2].linear1.weight:max():item())
    assert.are_not.equal(7, layer.linear1.weight:max():item())
    assert.is_true(enc.layers[2].linear1.weight.requires_grad)
    assert.equal(nn.TransformerEncoderLayer, getmetatable(enc.layers[3]))
    assert.equal(3 * #layer:parameters(), #enc:parameters())
  end)
end)

describe("transformer stacks built on meta and in bfloat16", function()
  it("inside fsdp.meta each copy records its own initialisation (PyTorch's to_empty + reset_parameters)", function()
    local enc = fsdp.meta(function() return nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 2) end)
    enc:to_empty { device = "cpu" }
    local a, b = enc.layers[1].self_attn, enc.layers[2].self_attn
    local bound = math.sqrt(6 / (8 + 24))
    for _, m in ipairs { a, b } do
      assert.is_true(m.in_proj_weight:abs():max():item() <= bound)
      assert.equal(0, m.in_proj_bias:abs():max():item())
      assert.equal(0, m.out_proj.bias:abs():max():item())
    end
    assert.is_true((a.in_proj_weight - b.in_proj_weight):abs():max():item() > 0.01, "the copies draw their own values")
    assert.equal(1, enc.layers[2].norm1.weight:min():item())
    local y = enc(fsdp.randn(5, 3, 8))
    assert.same({ 5, 3, 8 }, y:shape())
  end)

  it("bfloat16 parameters and inputs with bool masks: the float32 numbers within bfloat16 rounding", function()
    local name = "dec_post"
    local m = CASES[name].build()
    m:load_state_dict(entries(name, "p"))
    m:to("bfloat16")
    local x = {}
    for k, t in pairs(entries(name, "x")) do x[k] = k:find("mask", 1, true) and t or t:to("bfloat16") end
    for k, t in pairs(entries(name, "b")) do x[k] = t:ne(0) end
    local y = CASES[name].call(m, x)
    assert.equal("bfloat16", y.dtype)
    if os.getenv("TRANSFORMER_ERRORS") then print("bf16 max abs diff", (y:float() - G[name .. ".y"]):abs():max():item()) end
    -- (bfloat16 keeps 8 bits: measured max |diff| 0.018 on outputs of size ~1, three layer norms deep)
    H.assert_close(y:float():view(-1):tolist(), G[name .. ".y"]:view(-1):tolist(), 0.05, 0.02, "bfloat16 decoder layer")
  end)
end)

describe("nn.Transformer", function()
  local square = nn.Transformer.generate_square_subsequent_mask
  local ninf = -math.huge

  it("generate_square_subsequent_mask: -inf above the diagonal, 0 elsewhere; dtype and device", function()
    local m = square(4)
    assert.same({ 0, ninf, ninf, ninf, 0, 0, ninf, ninf, 0, 0, 0, ninf, 0, 0, 0, 0 }, m:tolist())
    assert.equal("float32", m.dtype)
    assert.equal("cpu", m.device)
    assert.is_false(m.requires_grad)
    assert.same({ 0, 0 }, square(0):shape())
    local b = square(3, { dtype = "bfloat16" })
    assert.equal("bfloat16", b.dtype)
    assert.same(square(3):tolist(), b:float():tolist())
    assert.equal("float16", square(2, "cpu", "half").dtype)
    if not fsdp.cuda.is_available() then fsdp._testdev_install() end
    local g = square(3, { device = "cuda" })
    assert.equal("cuda", g.device)
    assert.same(square(3):tolist(), g:to("cpu"):tolist())
  end)

  it("state_dict keys: PyTorch's (encoder.norm, decoder.norm; none of them biases with bias = false)", function()
    local sd = nn.Transformer(E, NH, 2, 1, TFF):state_dict()
    for _, k in ipairs { "encoder.layers.0.self_attn.in_proj_weight", "encoder.layers.1.linear2.bias",
      "encoder.norm.weight", "encoder.norm.bias", "decoder.layers.0.multihead_attn.out_proj.weight",
      "decoder.layers.0.norm3.bias", "decoder.norm.weight", "decoder.norm.bias" } do
      assert.is_not_nil(sd[k], k)
    end
    assert.equal(2 * 12 + 18 + 4, #H.sorted_keys(sd))
    local keys = H.sorted_keys(nn.Transformer(E, NH, 1, 1, TFF, { bias = false }):state_dict())
    for _, k in ipairs(keys) do assert.is_nil(k:find("bias", 1, true), k) end
    assert.equal(6 + 9 + 2, #keys)
  end)

  it("state_dict round trip: a fresh model with another's state_dict computes the same, gradients too", function()
    fsdp.manual_seed(3)
    local a, b = nn.Transformer(E, NH, 1, 1, TFF, 0), nn.Transformer(E, NH, 1, 1, TFF, 0)
    local src, tgt = fsdp.randn(4, 2, E), fsdp.randn(5, 2, E)
    assert.is_true((a(src, tgt) - b(src, tgt)):abs():max():item() > 1e-3, "two models start apart")
    b:load_state_dict(a:state_dict())
    local ya, yb = a(src, tgt, { tgt_is_causal = true }), b(src, tgt, { tgt_is_causal = true })
    assert.same(ya:tolist(), yb:tolist())
    ya:sum():backward()
    yb:sum():backward()
    assert.same(a.decoder.layers[1].multihead_attn.in_proj_weight.grad:tolist(),
      b.decoder.layers[1].multihead_attn.in_proj_weight.grad:tolist())
  end)

  it("unbatched src (S, E) and tgt (T, E): the batched run of that one sequence, batch_first or not", function()
    fsdp.manual_seed(5)
    local m = nn.Transformer(E, NH, 1, 1, TFF, 0)
    local src, tgt = fsdp.randn(4, E), fsdp.randn(5, E)
    local y = m(src, tgt, { tgt_mask = square(5) })
    assert.same({ 5, E }, y:shape())
    local y3 = m(src:unsqueeze(2), tgt:unsqueeze(2), { tgt_mask = square(5) }):squeeze(2)
    assert.same(y3:tolist(), y:tolist())
    local bf = nn.Transformer(E, NH, 1, 1, TFF, 0, { batch_first = true })
    bf:load_state_dict(m:state_dict())
    assert.same(y:tolist(), bf(src, tgt, { tgt_is_causal = true }):tolist())
  end)

  it("PyTorch's init: Xavier-uniform for every parameter with more than one dim, the layers distinct", function()
    local function check(m, what)
      local d, ff = 32, 64
      for name, p in m:named_parameters() do
        if p:dim() > 1 then
          local s = p:shape()
          local bound = math.sqrt(6 / (s[1] + s[2]))
          local top = p:abs():max():item()
          assert.is_true(top <= bound and top > 0.8 * bound, ("%s %s: max %g, bound %g"):format(what, name, top, bound))
        elseif name:find("norm", 1, true) then
          assert.equal(name:find("weight", 1, true) and 1 or 0, p:abs():max():item(), what .. " " .. name)
        end
      end
      -- (Linear's own init would stay below 1/sqrt(fan_in) = 0.177: Xavier's bound is 0.25)
      assert.is_true(m.encoder.layers[1].linear1.weight:abs():max():item() > 1 / math.sqrt(d) * 1.05)
      assert.equal(0, m.encoder.layers[1].self_attn.in_proj_bias:abs():max():item())
      local w1, w2 = m.encoder.layers[1].linear1.weight, m.encoder.layers[2].linear1.weight
      assert.is_true((w1 - w2):abs():max():item() > 0.01, what .. ": the layers draw their own values")
      assert.equal(ff, w1:size(1))
    end
    fsdp.manual_seed(4)
    check(nn.Transformer(32, 4, 2, 2, 64), "eager")
    local meta = fsdp.meta(function() return nn.Transformer(32, 4, 2, 2, 64) end)
    meta:to_empty { device = "cpu" }
    check(meta, "built on meta")
    check(fsdp.reset_parameters(nn.Transformer(32, 4, 2, 2, 64)), "fsdp.reset_parameters")
  end)
end)

describe("transformer dropout", function()
  it("eval mode equals dropout 0; training mode differs", function()
    local name = "enc_post_relu"
    local x = G[name .. ".x.src"]
    local mask, kpm = G[name .. ".b.src_mask"]:ne(0), G[name .. ".b.src_key_padding_mask"]:ne(0)
    local m = nn.TransformerEncoderLayer(E, NH, FF, 0.3)
    m:load_state_dict(entries(name, "p"))
    m:eval()
    H.assert_close(m(x, mask, kpm):tolist(), G[name .. ".y"]:tolist(), ATOL, RTOL, "eval with dropout 0.3")
    m:train()
    local d = (m(x, mask, kpm) - G[name .. ".y"]):abs():max():item()
    assert.is_true(d > 1e-2, "training output differs, by " .. d)
  end)

  it("MultiheadAttention: the weights dropped with probability p, the others scaled by 1/(1-p)", function()
    fsdp.manual_seed(5)
    local p = 0.25
    local m = nn.MultiheadAttention(E, NH, { dropout = p })
    local x = fsdp.randn(6, 200, E)
    m:eval()
    local _, w0 = m(x, x, x, { average_attn_weights = false })
    m:train()
    local _, w = m(x, x, x, { average_attn_weights = false })
    local dropped = w:eq(0)
    local frac = dropped:sum():item() / w:numel()
    -- 14400 draws: the fraction's standard deviation is 0.0036
    assert.is_true(math.abs(frac - p) < 0.02, "dropped fraction " .. frac)
    local kept = fsdp.where(dropped, 0, w0 / (1 - p))
    H.assert_close(w:view(-1):tolist(), kept:view(-1):tolist(), 1e-6, 1e-5, "kept weights scaled by 1/(1-p)")
  end)

  it("MultiheadAttention without weights: the mean output over many draws is the eval output", function()
    fsdp.manual_seed(6)
    local m = nn.MultiheadAttention(E, NH, { dropout = 0.5 })
    local x = fsdp.randn(4, 2, E)
    m:eval()
    local y0 = m(x, x, x, { need_weights = false })
    m:train()
    local acc = fsdp.zeros(4, 2, E)
    local n = 400
    for _ = 1, n do acc = acc + m(x, x, x, { need_weights = false }) end
    local diff = (acc / n - y0):abs():max():item()
    local first = (m(x, x, x, { need_weights = false }) - y0):abs():max():item()
    assert.is_true(first > 0.05, "one draw differs from eval: " .. first)
    assert.is_true(diff < first / 5, ("the mean of %d draws is within %g of eval (one draw: %g)"):format(n, diff, first))
  end)
end)

describe("transformer bad input", function()
  local x = fsdp.randn(5, 3, 8)
  local square = nn.Transformer.generate_square_subsequent_mask
  it("constructors", function()
    H.assert_error(function() nn.MultiheadAttention(8, 3) end, "MultiheadAttention", "embed_dim (8)", "num_heads (3)")
    H.assert_error(function() nn.MultiheadAttention(8, 0) end, "MultiheadAttention", "num_heads")
    H.assert_error(function() nn.MultiheadAttention(8, 2, { dropout = 2 }) end, "MultiheadAttention", "dropout")
    H.assert_error(function() nn.MultiheadAttention(8, 2, { kdim = 0.5 }) end, "MultiheadAttention", "kdim")
    H.assert_error(function() nn.TransformerEncoderLayer(8, 2, { activation = "tanh" }) end,
      "TransformerEncoderLayer", "activation", "tanh")
    H.assert_error(function() nn.TransformerEncoderLayer(8, 3) end, "MultiheadAttention", "num_heads (3)")
    H.assert_error(function() nn.TransformerEncoder(nn.Linear(2, 2)) end, "TransformerEncoder", "num_layers")
    H.assert_error(function() nn.TransformerEncoder(5, 2) end, "TransformerEncoder", "encoder_layer")
  end)
  it("shapes, in 1-based dims", function()
    local m = nn.MultiheadAttention(8, 2)
    H.assert_error(function() m(fsdp.randn(5, 3, 7), x, x) end, "MultiheadAttention", "query of shape (5, 3, 7)",
      "embed_dim = 8", "dim 3")
    H.assert_error(function() m(x, fsdp.randn(4, 3, 8), fsdp.randn(6, 3, 8)) end, "MultiheadAttention", "key (4, 3, 8)",
      "value (6, 3, 8)", "dim 1")
    H.assert_error(function() m(x, fsdp.randn(4, 2, 8), fsdp.randn(4, 2, 8)) end, "batch size (dim 2)")
    H.assert_error(function() m(x, x, x, { attn_mask = fsdp.zeros(5, 4) }) end, "attn_mask of shape (5, 4)",
      "(L, S) = (5, 5)", "(6, 5, 5)")
    H.assert_error(function() m(x, x, x, { key_padding_mask = fsdp.zeros(5, 3):ne(0) }) end,
      "key_padding_mask of shape (5, 3)", "(3, 5)")
    H.assert_error(function() m(fsdp.randn(5, 8), x, x) end, "must all be 3-D (batched) or all 2-D", "query (5, 8)")
    H.assert_error(function() m(x, x, x, { need_weights = 1 }) end, "MultiheadAttention", "need_weights")
    H.assert_error(function() m(x, x, x, { attn_mask = fsdp.zeros(5, 5, "int64") }) end, "bool or float")
    local bf = nn.MultiheadAttention(8, 2, { batch_first = true })
    H.assert_error(function() bf(x, fsdp.randn(3, 4, 8), fsdp.randn(3, 4, 8)) end, "batch size (dim 1)")
    local layer = nn.TransformerEncoderLayer(8, 2, 16)
    H.assert_error(function() layer(fsdp.randn(5, 3, 6)) end, "MultiheadAttention", "(5, 3, 6)", "self_attn")
    H.assert_error(function() layer(nil) end, "TransformerEncoderLayer", "src")
  end)
  it("nn.Transformer: options, shapes in 1-based dims, masks and generate_square_subsequent_mask", function()
    H.assert_error(function() nn.Transformer(8, 2, { activation = "tanh" }) end, "Transformer", "activation", "tanh")
    H.assert_error(function() nn.Transformer(8, 2, 0) end, "Transformer", "num_encoder_layers", "integer >= 1")
    H.assert_error(function() nn.Transformer(8, 2, { num_decoder_layers = 1.5 }) end, "Transformer", "num_decoder_layers")
    H.assert_error(function() nn.Transformer(8, 2, { dropout = -1 }) end, "Transformer", "dropout")
    H.assert_error(function() nn.Transformer(8, 2, { custom_encoder = 5 }) end, "Transformer", "custom_encoder")
    H.assert_error(function() nn.Transformer(8, 2, { custom_decoder = {} }) end, "Transformer", "custom_decoder")
    H.assert_error(function() nn.Transformer(8, 2, { bogus = 1 }) end, "Transformer", "unknown option bogus")
    local m = nn.Transformer(8, 2, 1, 1, 16)
    local src, tgt = fsdp.randn(4, 3, 8), fsdp.randn(5, 3, 8)
    H.assert_error(function() m(src, fsdp.randn(5, 2, 8)) end, "Transformer", "src (4, 3, 8)", "tgt (5, 2, 8)",
      "same batch size (dim 2)")
    H.assert_error(function() m(fsdp.randn(4, 3, 7), tgt) end, "Transformer", "src of shape (4, 3, 7)", "d_model = 8",
      "dim 3")
    H.assert_error(function() m(src, fsdp.randn(5, 3, 6)) end, "tgt of shape (5, 3, 6)", "d_model = 8")
    H.assert_error(function() m(src, fsdp.randn(5, 8)) end, "Transformer", "both be 3-D (batched) or both 2-D")
    H.assert_error(function() m(src) end, "Transformer", "tgt")
    H.assert_error(function() m(src, tgt, { src_mask = 5 }) end, "Transformer", "src_mask")
    H.assert_error(function() m(src, tgt, { tgt_is_causal = 1 }) end, "Transformer", "tgt_is_causal")
    H.assert_error(function() m(src, tgt, { memory_mask = fsdp.zeros(4, 5) }) end, "attn_mask of shape (4, 5)",
      "(L, S) = (5, 4)", "multihead_attn")
    local bf = nn.Transformer(8, 2, 1, 1, 16, { batch_first = true })
    H.assert_error(function() bf(fsdp.randn(3, 4, 8), fsdp.randn(2, 5, 8)) end, "same batch size (dim 1)")
    local fn = "Transformer.generate_square_subsequent_mask"
    H.assert_error(function() square(-1) end, fn, "sz", "integer >= 0")
    H.assert_error(function() square(2.5) end, fn, "sz")
    H.assert_error(function() square(3, { dtype = "int64" }) end, fn, "float dtype", "int64")
    H.assert_error(function() square(3, { dtype = "bogus" }) end, fn, "dtype")
    H.assert_error(function() square(3, { device = "tpu" }) end, fn, "device")
  end)
end)
