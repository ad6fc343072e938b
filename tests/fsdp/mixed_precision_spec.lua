-- mixed_precision's casts at a unit's edges (one process; the FSDP matrix trains bf16 at 1-4 ranks):
-- float inputs go to the param dtype, int64 and bool tensors keep theirs (a bool attention mask
-- made bf16 was added to the scores instead of masking them), cast_forward_inputs = false keeps
-- the inputs, output = "fp32" casts the outputs (FSDP2's output_dtype).
local fsdp = require "fsdp"
local H = require "helpers"
local nn, F = fsdp.nn, fsdp.F

local Att = nn.Module:extend("Att")
function Att:__init() self.lin = nn.Linear(4, 4) end
function Att:forward(x, mask, ids)
  self.seen = { x = x.dtype, mask = mask and mask.dtype, ids = ids and ids.dtype }
  local q = self.lin(x)
  return F.scaled_dot_product_attention(q, q, q, { attn_mask = mask })
end

local function build(mp)
  fsdp.manual_seed(9)
  local m = Att()
  fsdp.wrap(m, { mixed_precision = mp })
  return m
end
local causal = fsdp.tensor { { true, false, false }, { true, true, false }, { true, true, true } }

describe("mixed precision at a unit's edges", function()
  it("casts float inputs only: a bool mask masks, int64 stays", function()
    local m = build { param = "bf16" }
    fsdp.manual_seed(1)
    local x = fsdp.randn(2, 3, 4)
    local y = m(x, causal, fsdp.tensor({ 1, 2 }, "int64"))
    assert.same({ x = "bfloat16", mask = "bool", ids = "int64" }, m.seen)
    local plain = build { param = "bf16" }
    local want = plain(x)  -- the same unit with is_causal's mask spelled as a float mask below
    local additive = fsdp.tensor { { 0, -math.huge, -math.huge }, { 0, 0, -math.huge }, { 0, 0, 0 } }
    H.assert_close(y:float(), build({ param = "bf16" })(x, additive):float(), 0, 0, "bool mask vs additive")
    assert.is_true((y:float() - want:float()):abs():max():item() > 0, "the mask changed nothing")
  end)

  it("cast_forward_inputs = false keeps the inputs' dtype", function()
    local m = build { param = "bf16", cast_forward_inputs = false }
    local ok = pcall(m, fsdp.randn(2, 3, 4))  -- (a float32 input meets bf16 weights: linear says so)
    assert.equal("float32", m.seen.x)
    assert.is_false(ok)
    m(fsdp.randn(2, 3, 4):bfloat16())
    assert.equal("bfloat16", m.seen.x)
  end)

  it("output = \"fp32\" casts the outputs, and gradients flow back through the cast", function()
    local m = build { param = "bf16", output = "fp32" }
    local x = fsdp.randn(2, 3, 4):requires_grad_()
    local y = m(x)
    assert.equal("float32", y.dtype)
    y:sum():backward()
    assert.equal("float32", x.grad.dtype)
    assert.truthy(m.lin.weight.grad)
  end)

  it("names the parts it takes", function()
    H.assert_error(function() build { param = "bf16", output_dtype = "fp32" } end,
      "unknown mixed_precision part output_dtype (param, reduce, output, cast_forward_inputs)", "{output = \"fp32\"}")
    H.assert_error(function() build { param = "bf16", cast_forward_inputs = 1 } end, "cast_forward_inputs")
    H.assert_error(function() build { param = "bf16", output = "f8" } end, "unknown dtype \"f8\"")
  end)
end)
