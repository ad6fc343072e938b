--- nn.Module: the base class of every layer and model (Torch7 idioms, PyTorch names).
--
--   local Block = nn.Module:extend("Block")   -- a class; Block(...) makes an instance, calls __init
--   function Block:__init(cin, cout)
--     self.conv = nn.Conv2d(cin, cout, 3)     -- assigning a Module registers a child, in order
--     self.scale = nn.Parameter(fsdp.ones{1}) -- assigning an nn.Parameter (or any leaf that
--                                             -- requires grad) registers a parameter
--   end
--   function Block:forward(x) return self.conv(x) * self.scale end
--
-- Registered children, parameters and buffers live in ordered tables (_modules, _parameters,
-- _buffers) rather than as raw fields, so every later assignment to their names passes through
-- __newindex: a parameter stays a parameter when it is replaced or frozen, a child can be
-- swapped. Names and traversal order are PyTorch's, so state_dict keys match a PyTorch model of
-- the same structure.
-- @classmod nn.Module
local ffi = require "ffi"
local fsdp = require "fsdp"
local C = fsdp.C
local is_tensor = fsdp.is_tensor

local Module = {}
Module.__name = "Module"
Module.__is_class = true

-- counts changes to the parameters or children of any module (one added, replaced or removed, by
-- assignment, register_parameter, add_module or a register_buffer over one): code that planned
-- around a model's structure (fsdp.wrap) compares it with the count it saw, and looks again only
-- when it moved. Values changed in place (copy_, load_state_dict) and buffers are no change.
Module._structure_version = 0
local function structure_changed() Module._structure_version = Module._structure_version + 1 end

--- Whether x is a module (an instance of nn.Module or a subclass).
-- @function is_module
-- @param x any value
local function is_module(x)
  return type(x) == "table" and rawget(x, "_modules") ~= nil
end
Module.is_module = is_module

-- the identity of a tensor (two handles of the same C tensor are the same parameter)
local tensor_key = fsdp._key

-- an ordered name -> value table: names in insertion order; a name may map to nil (e.g. a
-- Linear without bias registers "bias" = nil, as PyTorch does)
local function ordered() return { names = {}, values = {}, has = {} } end
local function oset(o, name, value)
  if not o.has[name] then o.has[name] = true; o.names[#o.names + 1] = name end
  o.values[name] = value
end
local function oremove(o, name)
  if not o.has[name] then return end
  o.has[name] = nil
  o.values[name] = nil
  for i, n in ipairs(o.names) do if n == name then table.remove(o.names, i); break end end
end
local function ohas(o, name) return o.has[name] == true end

local function register_tensor_param(t)
  C.fsdp_tensor_set_mem_category(t.p, C.FSDP_MEM_PARAMS)
end

-- whether t was made by nn.Parameter (or registered as a parameter of some module): its storage
-- counts as parameters
local function is_parameter(t)
  return C.fsdp_tensor_mem_category(t.p) == C.FSDP_MEM_PARAMS
end

--- nn.Parameter(t[, requires_grad = true]): t as a parameter, as in PyTorch: `self.w =
-- nn.Parameter(t)` registers it, trainable or frozen (requires_grad = false)
function Module.Parameter(t, requires_grad)
  assert(is_tensor(t), "nn.Parameter: expected a tensor")
  if not t.is_leaf then t = t:detach() end  -- nn.Parameter(fsdp.randn{3} * 0.1) is a new leaf
  t.requires_grad = requires_grad ~= false
  register_tensor_param(t)
  return t
end

-- ---- classes ---------------------------------------------------------------------------------------
-- instance metamethods; every class carries them raw (Lua looks metamethods up with rawget)
local function instance_index(self, k)
  local p = rawget(self, "_parameters")
  if p then
    local v = p.values[k]
    if v ~= nil then return v end
    local m = rawget(self, "_modules").values[k]
    if m ~= nil then return m end
    v = rawget(self, "_buffers").values[k]
    if v ~= nil then return v end
  end
  return getmetatable(self).__class_index[k]
end

local function instance_newindex(self, k, v)
  local params, mods, bufs = rawget(self, "_parameters"), rawget(self, "_modules"), rawget(self, "_buffers")
  if not params then rawset(self, k, v); return end
  if is_module(v) then
    oremove(params, k); oremove(bufs, k)
    oset(mods, k, v)
    structure_changed()
  elseif ohas(params, k) then
    -- an existing parameter stays a parameter (frozen, replaced or set to nil)
    if v ~= nil and not is_tensor(v) then
      error(("cannot assign %s to parameter %q of %s (expected a tensor or nil)"):format(type(v), k, self.__name), 2)
    end
    if v ~= nil then register_tensor_param(v) end
    local old = params.values[k]
    if v == nil or old == nil or tensor_key(v) ~= tensor_key(old) then structure_changed() end
    params.values[k] = v
  elseif ohas(bufs, k) then
    if v ~= nil and not is_tensor(v) then
      error(("cannot assign %s to buffer %q of %s (expected a tensor or nil)"):format(type(v), k, self.__name), 2)
    end
    bufs.values[k] = v
  elseif ohas(mods, k) then
    if v ~= nil then
      error(("cannot assign %s to child module %q of %s (expected a Module or nil)"):format(type(v), k, self.__name), 2)
    end
    oremove(mods, k)
    structure_changed()
  elseif is_tensor(v) and v.is_leaf and (v.requires_grad or is_parameter(v)) then
    oset(params, k, v)
    register_tensor_param(v)
    structure_changed()
  else
    rawset(self, k, v)
  end
end

--- Class:extend("Name") -> a subclass. Calling the class makes an instance and runs __init.
function Module.extend(parent, name)
  assert(type(name) == "string", "Module:extend(name): the class needs a name")
  local cls = {}
  cls.__name = name
  cls.__is_class = true
  cls.__parent = parent
  cls.__class_index = cls
  cls.__index = rawget(parent, "__index") or instance_index  -- (ModuleList's also reads list[i])
  cls.__newindex = instance_newindex
  cls.__call = parent.__call
  cls.__tostring = parent.__tostring
  return setmetatable(cls, {
    __index = parent,
    __call = function(c, ...) return c.new(c, ...) end,
    __tostring = function(c) return "class " .. c.__name end,
  })
end

--- Makes an instance of class cls and runs its __init (calling the class does this).
-- @param cls the class
-- @param ... the constructor's arguments
function Module.new(cls, ...)
  local self = {
    _parameters = ordered(), _buffers = ordered(), _modules = ordered(),
    _forward_pre_hooks = {}, _forward_hooks = {}, training = true,
  }
  setmetatable(self, cls)
  self:__init(...)
  return self
end

function Module:__init() end

--- is_module(x) also as a method: nn.Module.is(x)
function Module.is(x) return is_module(x) end

--- m:isinstance(nn.Linear) (PyTorch's isinstance(m, nn.Linear)): whether m's class is cls or was
-- made from it by extend; cls may be a list of classes ({nn.Linear, nn.Conv2d}: any of them).
-- nn.Module.isinstance(x, cls) answers false for a non-module x.
function Module.isinstance(x, cls)
  if type(cls) == "table" and rawget(cls, "__is_class") == nil and cls[1] ~= nil then
    for _, c in ipairs(cls) do
      if Module.isinstance(x, c) then return true end
    end
    return false
  end
  if type(cls) ~= "table" or rawget(cls, "__is_class") == nil then
    error(("isinstance: expected a Module class (nn.Linear, ...) or a list of them, got %s"):format(type(cls)), 2)
  end
  if not is_module(x) then return false end
  local c = getmetatable(x)
  while c ~= nil do
    if c == cls then return true end
    c = rawget(c, "__parent")
  end
  return false
end

--- The computation; every layer or model class defines it (calling the module calls forward).
function Module:forward()
  error(("%s: forward() is not implemented"):format(self.__name), 2)
end

-- ---- registration ------------------------------------------------------------------------------------
-- a child's or tensor's name: a non-empty string without '.' (it joins state-dict keys)
local function check_name(fn, name)
  if type(name) ~= "string" or name == "" or name:find(".", 1, true) then
    fsdp._arg_error(fn, "name", "a non-empty string without '.'", name, 3)
  end
end
--- Registers tensor t as parameter name (nil: a declared, absent parameter).
-- @param name a string
-- @param t a tensor or nil
function Module:register_parameter(name, t)
  check_name("register_parameter", name)
  if t ~= nil then
    if not is_tensor(t) then fsdp._arg_error("register_parameter", "param", "a tensor or nil", t, 2) end
    register_tensor_param(t)
  end
  oremove(self._modules, name); oremove(self._buffers, name); rawset(self, name, nil)
  oset(self._parameters, name, t)
  structure_changed()
  return t
end

--- buffers are state that is not trained (running stats, masks); persistent ones go into state_dict
function Module:register_buffer(name, t, persistent)
  check_name("register_buffer", name)
  if t ~= nil and not is_tensor(t) then fsdp._arg_error("register_buffer", "tensor", "a tensor or nil", t, 2) end
  fsdp._b(persistent, "register_buffer", "persistent")
  if ohas(self._modules, name) or ohas(self._parameters, name) then structure_changed() end
  oremove(self._modules, name); oremove(self._parameters, name); rawset(self, name, nil)
  oset(self._buffers, name, t)
  if persistent == false then
    rawset(self, "_non_persistent", rawget(self, "_non_persistent") or {})
    self._non_persistent[name] = true
  end
  return t
end

--- Registers child module m under name (PyTorch's add_module).
-- @param name a string
-- @param m a Module
-- @param fn the name errors give (internal: register_module passes its own; nil)
function Module:add_module(name, m, fn)
  check_name(fn or "add_module", name)
  if not is_module(m) then fsdp._arg_error(fn or "add_module", "module", "a Module", m, 2) end
  oremove(self._parameters, name); oremove(self._buffers, name); rawset(self, name, nil)
  oset(self._modules, name, m)
  structure_changed()
  return m
end
--- Same as add_module.
-- @param name a string
-- @param m a Module
function Module:register_module(name, m) return self:add_module(name, m, "register_module") end

-- ---- traversal ---------------------------------------------------------------------------------------
-- iterators yield (name, value); lists hold values
local function list_iter(list)
  local i = 0
  return function()
    i = i + 1
    local e = list[i]
    if e then return e[1], e[2] end
  end
end

local function collect_modules(self, prefix, seen, out)
  if seen[self] then return out end
  seen[self] = true
  out[#out + 1] = { prefix, self }
  for _, name in ipairs(self._modules.names) do
    local m = self._modules.values[name]
    if m then collect_modules(m, prefix == "" and name or (prefix .. "." .. name), seen, out) end
  end
  return out
end

--- An iterator of name, module pairs over every module, self (named prefix or "") first.
-- @param prefix the name's prefix
function Module:named_modules(prefix)
  if prefix ~= nil and type(prefix) ~= "string" then fsdp._arg_error("named_modules", "prefix", "a string", prefix, 2) end
  return list_iter(collect_modules(self, prefix or "", {}, {}))
end
--- Every module, a list, self first.
function Module:modules()
  local r = {}
  for _, m in self:named_modules() do r[#r + 1] = m end
  return r
end
--- An iterator of name, child pairs over the direct children.
function Module:named_children()
  local out = {}
  for _, name in ipairs(self._modules.names) do
    local m = self._modules.values[name]
    if m then out[#out + 1] = { name, m } end
  end
  return list_iter(out)
end
--- The direct children, a list in registration order.
function Module:children()
  local r = {}
  for _, m in self:named_children() do r[#r + 1] = m end
  return r
end

-- (name, tensor) pairs of `kind` ("_parameters" or "_buffers") over all modules, shared tensors once
local function collect_tensors(self, kind, recurse, skip_non_persistent, fn)
  fsdp._b(recurse, fn or kind:sub(2), "recurse")
  local out, seen = {}, {}
  local mods = recurse == false and { { "", self } } or collect_modules(self, "", {}, {})
  for _, e in ipairs(mods) do
    local prefix, m = e[1], e[2]
    local o = m[kind]
    local np = skip_non_persistent and rawget(m, "_non_persistent") or nil
    for _, name in ipairs(o.names) do
      local t = o.values[name]
      if t ~= nil and not (np and np[name]) then
        local key = tensor_key(t)
        if not seen[key] then
          seen[key] = true
          out[#out + 1] = { prefix == "" and name or (prefix .. "." .. name), t }
        end
      end
    end
  end
  return out
end

--- for name, p in model:named_parameters() do ... end  (PyTorch names: "0.conv.weight")
function Module:named_parameters(recurse)
  return list_iter(collect_tensors(self, "_parameters", recurse, nil, "named_parameters"))
end
--- The parameters, a list in registration order.
-- @param recurse false: this module's only
function Module:parameters(recurse)
  local r = {}
  for _, e in ipairs(collect_tensors(self, "_parameters", recurse)) do r[#r + 1] = e[2] end
  return r
end
--- An iterator of name, buffer pairs (PyTorch's dotted names).
-- @param recurse false: this module's only
function Module:named_buffers(recurse)
  return list_iter(collect_tensors(self, "_buffers", recurse, nil, "named_buffers"))
end
--- The buffers, a list in registration order.
-- @param recurse false: this module's only
function Module:buffers(recurse)
  local r = {}
  for _, e in ipairs(collect_tensors(self, "_buffers", recurse)) do r[#r + 1] = e[2] end
  return r
end

-- fn(module) on every child (recursively), then self. Where a provider manages the parameters
-- (fsdp.wrap's: sharded ones), fn runs while they are whole (with_full_params).
local provider_for
local function plain_apply(m, fn)
  for _, c in ipairs(m:children()) do plain_apply(c, fn) end
  fn(m)
end
--- Calls fn(m) on every submodule (children first) and on self; returns self.
-- @param fn a function
function Module:apply(fn)
  fsdp._fn(fn, "Module:apply", "fn")
  local p = provider_for(self)
  if p and p.with_full_params then p.with_full_params(self, function() plain_apply(self, fn) end)
  else plain_apply(self, fn) end
  return self
end

--- model:to_empty{device = "cpu"}: every parameter and buffer built on meta (fsdp.meta) gets storage on
-- device in place (identity kept), filled with what its recorded initialisation gives -- the values
-- the same construction gives eagerly with the same seed -- where PyTorch leaves them
-- uninitialised; fsdp.reset_parameters(model) draws afresh if wanted. Tensors with values stay as
-- they are. Returns model. (A wrapped model's parameters are materialised by fsdp.wrap, as pieces.)
function Module:to_empty(opts)
  if opts ~= nil and type(opts) ~= "table" and type(opts) ~= "string" then
    fsdp._arg_error("Module:to_empty", "options", "{device = ...} or a device name", opts, 2)
  end
  local device = type(opts) == "table" and opts.device or opts or "cpu"
  local d = fsdp._device(device, "Module:to_empty", 2)
  for _, kind in ipairs { "parameters", "buffers" } do
    for _, t in ipairs(self[kind](self)) do
      if C.fsdp_tensor_deferred(t.p) ~= 0 then fsdp._check(C.fsdp_materialize_(t.p, d)) end
    end
  end
  return self
end

--- model:to(device) moves every parameter and buffer to the device in place and returns model: the
-- tensors keep their identity, so optimizers and FSDP units built on them stay valid ("cuda" where
-- fsdp.cuda.is_available(), else the error says why not).
-- model:to(dtype) ("bfloat16", "float32", "float16"), or model:to{device = ..., dtype = ...}, also
-- converts every float parameter and buffer (and gradient) in place, keeping identity as PyTorch
-- does; integer buffers stay. Before fsdp.wrap only: a unit computes in bf16 by its mixed_precision.
function Module:to(what)
  local device, dtype
  if type(what) == "table" and not is_tensor(what) then
    device, dtype = what.device, what.dtype
    if device == nil and dtype == nil then fsdp._arg_error("Module:to", "options", "{device = ..., dtype = ...}", what, 2) end
  elseif type(what) ~= "string" then
    fsdp._arg_error("Module:to", "dtype or device", "a dtype or device name", what, 2)
  elseif fsdp._devices[what] or not pcall(fsdp._dtype, what) then
    device = what  -- (a name that is neither: the unknown-device error below names the devices)
  else
    dtype = what
  end
  local dt = dtype ~= nil and fsdp._dtype(dtype) or nil
  if dt == C.FSDP_I64 then error(("Module:to: %s is not a float dtype; parameters stay float"):format(dtype), 2) end
  for _, kind in ipairs { "parameters", "buffers" } do
    for _, t in ipairs(self[kind](self)) do
      if device ~= nil then fsdp._move_(t, device) end
      if dt ~= nil and t.dtype ~= "int64" then fsdp._check(C.fsdp_set_dtype_(t.p, dt)) end
    end
  end
  return self
end
--- Moves parameters and buffers to the CPU (self:to("cpu")).
function Module:cpu() return self:to("cpu") end
--- Casts the floating-point parameters and buffers to float32 (self:to("float32")).
function Module:float() return self:to("float32") end
--- Casts the floating-point parameters and buffers to bfloat16 (self:to("bfloat16")).
function Module:bfloat16() return self:to("bfloat16") end
--- Casts the floating-point parameters and buffers to float16 (self:to("float16")).
function Module:half() return self:to("float16") end

--- Training mode on (mode true or nil) or off, for self and every submodule; returns self.
-- @param mode a boolean
function Module:train(mode)
  mode = fsdp._b(mode, "train", "mode", true)
  for _, m in ipairs(self:modules()) do rawset(m, "training", mode and true or false) end
  return self
end
--- Evaluation mode: self:train(false).
function Module:eval() return self:train(false) end

--- drops every parameter's gradient (PyTorch's set_to_none default); zero_grad(false) zeroes them
function Module:zero_grad(set_to_none)
  fsdp._b(set_to_none, "zero_grad", "set_to_none")
  for _, p in ipairs(self:parameters()) do
    if set_to_none == false then
      local g = p.grad
      if g ~= nil then fsdp.no_grad(function() g:zero_() end) end
    else
      p.grad = nil
    end
  end
end

--- Sets requires_grad on every parameter; returns self.
-- @param flag a boolean (default true)
function Module:requires_grad_(flag)
  fsdp._b(flag, "requires_grad_", "requires_grad")
  for _, p in ipairs(self:parameters()) do p.requires_grad = flag ~= false end
  return self
end

--- total number of parameter elements (handy in examples)
function Module:num_parameters()
  local n = 0
  for _, p in ipairs(self:parameters()) do n = n + p:numel() end
  return n
end

-- ---- state_dict -----------------------------------------------------------------------------------
-- name -> detached alias of every parameter and persistent buffer (PyTorch keys)
local plain_state_dict, plain_load_state_dict

-- Code above nn may take over state dicts of the modules it manages: a provider is a table
-- {applies = fn(m), state_dict = fn(m, plain, opts), load_state_dict = fn(m, plain, sd, strict),
-- with_full_params = fn(m, f) (runs f while m's parameters are whole; Module:apply uses it)}
-- where plain is this file's own function. (fsdp.wrap registers one: parameters of FSDP units are
-- gathered and cloned.)
Module._state_dict_providers = {}
function provider_for(m)
  for _, p in ipairs(Module._state_dict_providers) do
    if p.applies(m) then return p end
  end
end

--- A table of name -> tensor, parameters and buffers by PyTorch's names (full tensors for a wrapped model).
-- @param opts options table or nil
function Module:state_dict(opts)
  if opts ~= nil and type(opts) ~= "table" then fsdp._arg_error("state_dict", "options", "a table or nil", opts, 2) end
  local p = provider_for(self)
  if p then return p.state_dict(self, plain_state_dict, opts) end
  return plain_state_dict(self)
end

function plain_state_dict(self)
  local sd = {}
  local mods = collect_modules(self, "", {}, {})
  for _, e in ipairs(mods) do
    local prefix, m = e[1], e[2]
    local np = rawget(m, "_non_persistent")
    for _, kind in ipairs { "_parameters", "_buffers" } do
      local o = m[kind]
      for _, name in ipairs(o.names) do
        local t = o.values[name]
        if t ~= nil and not (kind == "_buffers" and np and np[name]) then
          sd[prefix == "" and name or (prefix .. "." .. name)] = t:detach()
        end
      end
    end
  end
  return sd
end

local shape_str = fsdp._shape_str
local function quoted(list)
  local q = {}
  for i, k in ipairs(list) do q[i] = ("%q"):format(k) end
  return table.concat(q, ", ")
end

--- load_state_dict(sd[, strict = true]) copies every entry into the matching parameter/buffer
-- under no_grad. Nothing is copied unless all checks pass. strict: missing or unexpected keys are
-- an error; otherwise they are returned as {missing_keys = {...}, unexpected_keys = {...}}.
-- Shape mismatches are always an error.
function Module:load_state_dict(sd, strict)
  if type(sd) ~= "table" or is_tensor(sd) then fsdp._arg_error("load_state_dict", "state_dict", "a table of name -> tensor", sd, 2) end
  if type(strict) == "table" then fsdp._b(strict.strict, "load_state_dict", "strict")  -- ({strict = ...})
  else fsdp._b(strict, "load_state_dict", "strict") end
  local p = provider_for(self)
  if p then return p.load_state_dict(self, plain_load_state_dict, sd, strict) end
  return plain_load_state_dict(self, sd, strict)
end

function plain_load_state_dict(self, sd, strict)
  if type(strict) == "table" then strict = strict.strict end
  if strict == nil then strict = true end
  assert(type(sd) == "table", "load_state_dict: expected a table name -> tensor")
  -- own: name -> tensor; order: the names in PyTorch's load order (modules pre-order, each one's
  -- parameters then buffers), so that of a tied parameter's names the last one's entry is the
  -- value it ends with, as in PyTorch, whatever order pairs() would give
  local own, order = {}, {}
  for _, e in ipairs(collect_modules(self, "", {}, {})) do
    local prefix, m = e[1], e[2]
    local np = rawget(m, "_non_persistent")
    for _, kind in ipairs { "_parameters", "_buffers" } do
      for _, name in ipairs(m[kind].names) do
        local t = m[kind].values[name]
        if t ~= nil and not (kind == "_buffers" and np and np[name]) then
          local key = prefix == "" and name or (prefix .. "." .. name)
          own[key] = t
          order[#order + 1] = key
        end
      end
    end
  end
  local missing, unexpected, mismatch = {}, {}, {}
  for k, t in pairs(own) do
    local src = sd[k]
    if src == nil then
      missing[#missing + 1] = k
    elseif not is_tensor(src) then
      error(("load_state_dict: entry %q is a %s, expected a tensor"):format(k, type(src)), 2)
    elseif shape_str(src) ~= shape_str(t) then
      -- (a sharded parameter answers its full shape; copy_ takes its piece of the entry, and from a
      -- file-backed entry reads that piece only)
      local a, b, where = src:shape(), t:shape(), ""
      for d = 1, math.max(#a, #b) do
        if a[d] ~= b[d] then where = (" (dim %d: %s against %s)"):format(d, tostring(a[d] or "none"), tostring(b[d] or "none")) break end
      end
      mismatch[#mismatch + 1] = ("size mismatch for %q: copying a tensor of shape %s, the model has shape %s%s")
        :format(k, shape_str(src), shape_str(t), where)
    end
  end
  for k in pairs(sd) do
    if own[k] == nil then unexpected[#unexpected + 1] = tostring(k) end
  end
  table.sort(missing); table.sort(unexpected); table.sort(mismatch)
  local errs = {}
  if strict and #missing > 0 then errs[#errs + 1] = "Missing key(s) in state_dict: " .. quoted(missing) .. "." end
  if strict and #unexpected > 0 then errs[#errs + 1] = "Unexpected key(s) in state_dict: " .. quoted(unexpected) .. "." end
  for _, m in ipairs(mismatch) do errs[#errs + 1] = m .. "." end
  if #errs > 0 then
    error(("load_state_dict: Error(s) in loading state_dict for %s:\n\t%s"):format(self.__name, table.concat(errs, "\n\t")), 2)
  end
  fsdp.no_grad(function()
    for _, k in ipairs(order) do
      local src = sd[k]
      if src ~= nil then own[k]:copy_(src) end
    end
  end)
  return { missing_keys = missing, unexpected_keys = unexpected }
end

-- ---- hooks ---------------------------------------------------------------------------------------------
local function add_hook(list, fn, what)
  fsdp._fn(fn, what, "hook")
  local entry = { fn = fn }
  list[#list + 1] = entry
  return {
    remove = function()
      for i, e in ipairs(list) do if e == entry then table.remove(list, i); return end end
    end,
  }
end
--- fn(module, args) runs before forward; args is the list of inputs. Returning a table replaces
-- the inputs, returning a tensor (or any other single value) replaces them with that one value.
function Module:register_forward_pre_hook(fn) return add_hook(self._forward_pre_hooks, fn, "register_forward_pre_hook") end
--- fn(module, args, output) runs after forward; returning a value replaces the output
function Module:register_forward_hook(fn) return add_hook(self._forward_hooks, fn, "register_forward_hook") end

-- ---- calling: hooks around forward, and the module path on errors ------------------------------------
-- The modules currently inside __call, outermost first. When an error leaves a forward, the
-- deepest module records the stack; the outermost one turns it into a path and appends
-- "in module 0.conv (Conv2d)" to the message once.
local active, depth = {}, 0
local err_record = nil  -- { msg = error value, stack = {modules...} }

-- the dotted name of `child` inside `parent` (searching descendants), or nil
local function path_in(parent, child)
  for name, m in parent:named_modules() do
    if m == child then return name end
  end
end

local function module_path(stack)
  local parts = {}
  for i = 2, #stack do
    local name = path_in(stack[i - 1], stack[i])
    if name == nil then return nil end
    if name ~= "" then parts[#parts + 1] = name end
  end
  return table.concat(parts, ".")
end

local unpack, select = unpack, select
local function pack(...) return { n = select("#", ...), ... } end

-- the forward __call runs: the module's, or the one a forward wrapper kept when it routed
-- m:forward(...) through __call (fsdp.wrap: m:forward(x) works as m(x))
local function forward_of(self) return rawget(self, "_inner_forward") or self.forward end

local function run_hooks_and_forward(self, ...)
  local pre, post = self._forward_pre_hooks, self._forward_hooks
  if #pre == 0 and #post == 0 then return forward_of(self)(self, ...) end
  local args = pack(...)
  for _, h in ipairs(pre) do
    local r = h.fn(self, args)
    if r ~= nil then
      if type(r) == "table" and not is_module(r) and not is_tensor(r) then
        args = r
        args.n = args.n or #r
      else
        args = { n = 1, r }
      end
    end
  end
  local out = pack(forward_of(self)(self, unpack(args, 1, args.n)))
  for _, h in ipairs(post) do
    local r = h.fn(self, args, out.n <= 1 and out[1] or out)
    if r ~= nil then out = { n = 1, r } end
  end
  return unpack(out, 1, out.n)
end

local function finish(self, d, ok, ...)
  if not ok then
    local e = ...
    if err_record == nil or err_record.msg ~= e then  -- the deepest failing call records the stack
      local stack = {}
      for i = 1, d do stack[i] = active[i] end
      err_record = { msg = e, stack = stack }
    end
  end
  active[d] = nil
  depth = d - 1
  if ok then return ... end
  local e = ...
  if d == 1 then
    local stack = err_record.stack
    err_record = nil
    if type(e) == "string" then
      local path = module_path(stack) or "?"
      e = ("%s (in module %s (%s))"):format(e, path ~= "" and path or "<root>", stack[#stack].__name)
    end
  end
  error(e, 0)
end

-- a checkpointed module (nn.Checkpoint, fsdp.wrap's {checkpoint = true}) runs its hooks and forward
-- as one activation-checkpointing region (fsdp.checkpoint): nothing inside keeps activations, and
-- backward runs them again
local function checkpointed_forward(self, ...)
  return require("fsdp.autograd").checkpoint(run_hooks_and_forward, self, ...)
end
-- an instance may carry a forward wrapper, an object whose run(module, inner, ...) calls
-- inner(module, ...) with code around it (fsdp.wrap installs its unit: gather before, reshard after)
local function run_forward(self, ...)
  local inner = rawget(self, "_checkpointed") and checkpointed_forward or run_hooks_and_forward
  local w = rawget(self, "_forward_wrapper")
  if w then return w:run(self, inner, ...) end
  return inner(self, ...)
end

function Module:__call(...)
  local d = depth + 1
  depth = d
  if d == 1 then err_record = nil end
  active[d] = self
  return finish(self, d, pcall(run_forward, self, ...))
end

-- ---- printing ------------------------------------------------------------------------------------------
--- layers override extra_repr() to describe their configuration
function Module:extra_repr() return "" end

function Module:__tostring()
  local lines = {}
  local extra = self:extra_repr()
  local names = self._modules.names
  if #names == 0 then return ("%s(%s)"):format(self.__name, extra) end
  lines[1] = self.__name .. "("
  if extra ~= "" then lines[#lines + 1] = "  " .. extra end
  for _, name in ipairs(names) do
    local m = self._modules.values[name]
    if m then
      local s = tostring(m):gsub("\n", "\n  ")
      lines[#lines + 1] = ("  (%s): %s"):format(name, s)
    end
  end
  lines[#lines + 1] = ")"
  return table.concat(lines, "\n")
end

-- Module itself is a class too: nn.Module() makes an empty module
Module.__class_index = Module
Module.__index = instance_index
Module.__newindex = instance_newindex
setmetatable(Module, {
  __call = function(c, ...) return c.new(c, ...) end,
  __tostring = function(c) return "class " .. c.__name end,
})

return Module
