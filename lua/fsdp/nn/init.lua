-- fsdp.nn: modules, layers, functional ops and init helpers (PyTorch's torch.nn, Torch7's idioms).
--   local nn = fsdp.nn
--   local Block = nn.Module:extend("Block")     -- a class; Block(...) calls __init
--   nn.Sequential(nn.Linear(4, 8), nn.ReLU())   -- children "0", "1"
--   nn.functional (also fsdp.F), nn.init (weight init), nn.Parameter(t)
local Module = require "fsdp.nn.module"

local nn = {}
nn.Module = Module
nn.Parameter = Module.Parameter
nn.is_module = Module.is_module
nn.functional = require "fsdp.nn.functional"
nn.init = require "fsdp.nn.init_fns"
for name, cls in pairs(require "fsdp.nn.layers") do nn[name] = cls end
for name, cls in pairs(require "fsdp.nn.transformer") do nn[name] = cls end

return nn
