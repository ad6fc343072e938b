-- nn.utils (torch.nn.utils): clip_grad_norm_ / clip_grad_value_ on an unwrapped model against the
-- norm computed here element by element, and parameters as one vector there and back.
local fsdp = require "fsdp"
local H = require "helpers"
local nn = fsdp.nn

local function model_with_grads()
  fsdp.manual_seed(5)
  local m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
  m(fsdp.randn(6, 3)):pow(2):sum():backward()
  return m
end
local function grads(m)
  local r = {}
  for _, p in ipairs(m:parameters()) do
    for _, v in ipairs(H.flat(p.grad)) do r[#r + 1] = v end
  end
  return r
end

describe("nn.utils", function()
  it("clip_grad_norm_ returns the total norm and scales the gradients to max_norm", function()
    local m = model_with_grads()
    local g = grads(m)
    local s = 0
    for _, v in ipairs(g) do s = s + v * v end
    local norm = nn.utils.clip_grad_norm_(m:parameters(), 0.5)
    assert.near(math.sqrt(s), norm, 1e-4 * math.sqrt(s))
    local after = grads(m)
    for i, v in ipairs(after) do assert.near(g[i] * 0.5 / (math.sqrt(s) + 1e-6), v, 1e-6) end
  end)

  it("clip_grad_norm_ with norm_type math.huge is the largest |g|; a module stands for its parameters", function()
    local m = model_with_grads()
    local big = 0
    for _, v in ipairs(grads(m)) do big = math.max(big, math.abs(v)) end
    assert.near(big, nn.utils.clip_grad_norm_(m, math.huge, math.huge), 1e-6 * big)
  end)

  -- the inf-norm of gradients on two devices: each device's largest |g|, then the largest of those,
  -- which took math.max and so kept or dropped a NaN by the order of the devices
  it("clip_grad_norm_ with norm_type math.huge keeps a NaN from any device, in either order", function()
    if not fsdp.cuda.is_available() then fsdp._testdev_install() end
    for _, cpu_first in ipairs { true, false } do
      local a = fsdp.tensor({ 1, 2 }):requires_grad_()
      local b = fsdp.tensor({ 1, 2 }):to("cuda"):requires_grad_()
      a.grad = fsdp.tensor { 0.5, 0 / 0 }
      b.grad = fsdp.tensor({ 3, 1 }):to("cuda")
      local norm = nn.utils.clip_grad_norm_(cpu_first and { a, b } or { b, a }, 1, math.huge)
      assert.is_true(norm ~= norm, ("got %s (cpu first: %s)"):format(tostring(norm), tostring(cpu_first)))
    end
  end)

  it("clip_grad_value_ clamps every gradient element", function()
    local m = model_with_grads()
    local g = grads(m)
    nn.utils.clip_grad_value_(m:parameters(), 0.1)
    for i, v in ipairs(grads(m)) do assert.near(math.max(-0.1, math.min(0.1, g[i])), v, 1e-7) end
  end)

  it("parameters_to_vector and vector_to_parameters go there and back", function()
    local m = model_with_grads()
    local v = nn.utils.parameters_to_vector(m:parameters())
    assert.equal(m:num_parameters(), v:numel())
    assert.equal(m[1].weight[1][1]:item(), v[1]:item())
    assert.equal(m[3].bias[2]:item(), v[v:numel()]:item())
    nn.utils.vector_to_parameters(fsdp.arange(1, v:numel() + 1, "float32"), m)
    assert.same(H.flat(fsdp.arange(1, v:numel() + 1, "float32")), H.flat(nn.utils.parameters_to_vector(m)))
    H.assert_error(function() nn.utils.vector_to_parameters(fsdp.ones(3), m) end,
      "vector_to_parameters: vec must be 1-D with the parameters' 26 elements, got shape (3)")
  end)
end)
