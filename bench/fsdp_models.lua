-- The models of the FSDP benchmarks (bench/fsdp_memory.lua, bench/fsdp_speed.lua), ours; the
-- PyTorch DDP side (bench/ddp_torch.py) builds the same conv net and transformer from
-- bench/torch_models.py. Each builder returns an unwrapped model; wrap_each() turns chosen
-- children into FSDP units and then the root, the usual "each block + root" policy.
local fsdp = require "fsdp"
local nn = fsdp.nn
local models = require "models" -- bench/models.lua (F2): convnet, Transformer

local M = {}

-- memory model: Linear layers of different sizes, each one a unit (sizes in parameters)
--   0: 512->1024  525,312     2: 1024->2048  2,099,200 (the largest)
--   4: 2048->512 1,049,088    6: 512->10         5,130
M.units_widths = { 512, 1024, 2048, 512, 10 }
function M.units_mlp()
  local w, layers = M.units_widths, {}
  for i = 1, #w - 1 do
    layers[#layers + 1] = nn.Linear(w[i], w[i + 1])
    if i < #w - 1 then layers[#layers + 1] = nn.ReLU() end
  end
  return nn.Sequential(unpack(layers))
end

-- speed model: an MLP of `depth` hidden 1024-wide layers (784 -> 1024 x depth -> 10), each Linear a unit
function M.wide_mlp(depth, width)
  depth, width = depth or 4, width or 1024
  local layers = { nn.Linear(784, width), nn.ReLU() }
  for _ = 1, depth - 1 do
    layers[#layers + 1] = nn.Linear(width, width)
    layers[#layers + 1] = nn.ReLU()
  end
  layers[#layers + 1] = nn.Linear(width, 10)
  return nn.Sequential(unpack(layers))
end

-- the DDP comparison models, identical to bench/torch_models.py
M.convnet = models.convnet
function M.transformer() return models.Transformer(1000, 256, 4, 2, 128) end

-- the modules that become units below the root: every Linear/Conv2d of a Sequential, or the blocks
-- of the transformer
function M.unit_children(model)
  local r = {}
  if rawget(model, "blocks") then
    for _, b in model.blocks:named_children() do r[#r + 1] = b end
    return r
  end
  for _, c in model:named_children() do
    local n = c.__name or ""
    if n == "Linear" or n == "Conv2d" then r[#r + 1] = c end
  end
  return r
end

-- wraps each unit child, then the root, all with `opts`; returns the model
function M.wrap_each(model, opts)
  for _, c in ipairs(M.unit_children(model)) do fsdp.wrap(c, opts) end
  return fsdp.wrap(model, opts)
end

-- numel of each unit's own parameters, in wrap order, and of the root's leftovers
function M.unit_sizes(model)
  local sizes, inner = {}, {}
  for _, c in ipairs(M.unit_children(model)) do
    local n = 0
    for _, p in ipairs(c:parameters()) do n = n + p:numel(); inner[p] = true end
    sizes[#sizes + 1] = n
  end
  local root = 0
  for _, p in ipairs(model:parameters()) do if not inner[p] then root = root + p:numel() end end
  sizes[#sizes + 1] = root
  return sizes
end

-- timing shared by the benches (bench/util.lua)
local U = require "util"
M.now_ms, M.median = U.now_ms, U.median

-- min, max of a list
function M.range(t)
  local lo, hi = math.huge, -math.huge
  for _, v in ipairs(t) do lo, hi = math.min(lo, v), math.max(hi, v) end
  return lo, hi
end

return M
