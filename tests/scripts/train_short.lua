-- A short single-process training run touching every op family, optimizer and safetensors;
-- `make asan-check` runs it under AddressSanitizer (leaks and invalid accesses fail it).
package.path = "./lua/?.lua;./lua/?/init.lua;./tests/?.lua;" .. package.path
local fsdp = require "fsdp"
local models = dofile("tests/golden/models.lua")
local F = fsdp.F

fsdp.manual_seed(0)
local function train(model, opt, batch, steps)
  local loss
  for _ = 1, steps do
    loss = batch(model)
    opt:zero_grad()
    loss:backward()
    opt:step()
  end
  return loss:item()
end

local mlp = models.mlp()
local l1 = train(mlp, fsdp.optim.SGD(mlp:parameters(), { lr = 0.1, momentum = 0.9 }), function(m)
  return F.cross_entropy(m(fsdp.randn { 16, 64 }), fsdp.randint(0, 10, { 16 }))
end, 5)
local conv = models.convnet()
local l2 = train(conv, fsdp.optim.Adam(conv:parameters(), { lr = 1e-2 }), function(m)
  return F.cross_entropy(m(fsdp.randn { 8, 1, 12, 12 }), fsdp.randint(0, 10, { 8 }))
end, 3)
local gpt = models.gpt()
local l3 = train(gpt, fsdp.optim.AdamW(gpt:parameters(), { lr = 3e-3 }), function(m)
  local idx = fsdp.randint(0, 50, { 4, 16 })
  return models.lm_loss(m(idx), fsdp.randint(0, 50, { 4, 16 }))
end, 3)
-- causal attention long enough for the row-block products (T >= 64), with a float mask and dropout
local q, k, v = fsdp.randn { 2, 2, 96, 8 }, fsdp.randn { 2, 2, 96, 8 }, fsdp.randn { 2, 2, 96, 8 }
local mask = fsdp.randn { 96, 96 }
for _, t in ipairs { q, k, v, mask } do t:requires_grad_() end
F.scaled_dot_product_attention(q, k, v, { causal = true, attn_mask = mask, dropout_p = 0.1 }):sum():backward()
assert(q.grad and k.grad and v.grad and mask.grad)
-- a 3x3 convolution with >= 16 channels takes the Winograd path (forward, input and weight gradients)
local wx, ww = fsdp.randn { 2, 16, 10, 10 }, fsdp.randn { 16, 16, 3, 3 }
for _, t in ipairs { wx, ww } do t:requires_grad_() end
F.conv2d(wx, ww, nil, { padding = 1 }):sum():backward()
assert(wx.grad and ww.grad)
-- a wrapped model (world size 1) and a checkpoint round trip
local w = models.mlp()
fsdp.wrap(w)
train(w, fsdp.optim.Adam(w:parameters()), function(m)
  return F.cross_entropy(m(fsdp.randn { 16, 64 }), fsdp.randint(0, 10, { 16 }))
end, 2)
local path = os.tmpname()
fsdp.save(path, mlp:state_dict())
mlp:load_state_dict(fsdp.load(path))
os.remove(path)
-- an error path, then more work
assert(not pcall(function() return fsdp.randn { 2, 3 }:matmul(fsdp.randn { 4, 5 }) end))
print(("train_short: losses %.4f %.4f %.4f"):format(l1, l2, l3))
