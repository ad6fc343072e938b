--- fsdp.wrap and friends: turning modules into FSDP units, and the utilities around them.
--
-- A unit is a module passed to fsdp.wrap. It owns the parameters in its subtree that no nested
-- unit owns; the C core (src/parallel/shard.c, src/parallel/sched.c) shards them and runs the gather / reshard /
-- reduce-scatter protocol. This file only finds the parameters, calls the C protocol around the
-- module's forward (it is the module's forward wrapper, which nn.Module.__call runs), and offers
-- no_sync, summon_full_params (as Module methods), full state dicts (a state-dict provider of
-- nn.Module), gradient clipping and auto_wrap. nn.Module itself knows nothing of FSDP.
-- Wrapping never changes a module's class, children or parameter names.
-- @module fsdp.wrap
local ffi = require "ffi"
local fsdp = require "fsdp"
local Module = require "fsdp.nn.module"
local C = fsdp.C
local check, wrap_t = fsdp._check, fsdp._wrap

local W = {}
local all_units = {}  -- every unit, in creation order (the order collectives are issued in)

local Unit = {}
Unit.__index = Unit

local shardings = { full = 0, full_shard = 0, grad_op = 1, shard_grad_op = 1, none = 2, no_shard = 2, hybrid = 3,
  hybrid_shard = 3 }
local state_names = { [0] = "IDLE", "FORWARD", "FORWARD_DONE", "BACKWARD", "BACKWARD_DONE" }

local function module_label(m) return m.__name or "Module" end

-- path of `m` below `root` ("" for root itself), or nil
local function path_in(root, m)
  for name, x in root:named_modules() do if x == m then return name end end
end

-- every place a parameter is held in m's subtree: key -> {t, names = {full names, in module
-- order}}, and the keys in named_parameters order (a tied parameter is held by several modules)
local function param_uses(m)
  local uses, order = {}, {}
  for prefix, mod in m:named_modules() do
    local o = mod._parameters
    for _, pname in ipairs(o.names) do
      local t = o.values[pname]
      if t ~= nil then
        local key = fsdp._key(t)
        local e = uses[key]
        if not e then
          e = { t = t, names = {} }
          uses[key] = e
          order[#order + 1] = key
        end
        e.names[#e.names + 1] = prefix == "" and pname or (prefix .. "." .. pname)
      end
    end
  end
  return uses, order
end

-- The parameters m's unit owns, in named_parameters order: each parameter goes to the innermost
-- unit whose subtree holds all of its uses (a parameter tied between an embedding and an output
-- projection in different units belongs to the unit around both, whose gathered copy both use).
-- So a parameter of m's subtree is m's unless all its uses lie inside one unit nested below m,
-- or a unit around m wrapped before m holds it outside m too.
local function own_params(m)
  local nested = {}  -- prefixes of the outermost units below m
  for name, x in m:named_modules() do
    if name ~= "" and rawget(x, "_fsdp_unit") then nested[#nested + 1] = name .. "." end
  end
  local function unit_of(name)  -- the outermost nested unit holding this use, or "" (m itself)
    local best = ""
    for _, pre in ipairs(nested) do
      if name:sub(1, #pre) == pre and (best == "" or #pre < #best) then best = pre end
    end
    return best
  end
  local outer = {}  -- uses held by enclosing units wrapped earlier, outside m
  for _, v in ipairs(all_units) do
    local at = v.module ~= m and path_in(v.module, m)
    if at then
      local vu = param_uses(v.module)
      for key, e in pairs(vu) do
        for _, n in ipairs(e.names) do
          if n:sub(1, #at + 1) ~= at .. "." then outer[key] = true end
        end
      end
    end
  end
  local uses, order = param_uses(m)
  local ps, names = {}, {}
  for _, key in ipairs(order) do
    local e = uses[key]
    local first, single = unit_of(e.names[1]), true
    for i = 2, #e.names do single = single and unit_of(e.names[i]) == first end
    if not (single and first ~= "") and not outer[key] then
      ps[#ps + 1] = e.t
      names[#names + 1] = e.names[1]
    end
  end
  return ps, names
end

-- ---- the structure a unit was planned on -------------------------------------------------------------
-- A unit's parameters are fixed when it is wrapped. What its subtree held then -- parameters by
-- name, and the units nested in it by path -- is kept, and a forward after a change to it
-- (Module._structure_version moved: a parameter or child added, replaced or removed anywhere) looks
-- again and refuses if it differs. Values changed in place and freezing are no change.
local function structure(m)
  local params, units = {}, {}
  for prefix, x in m:named_modules() do
    if prefix ~= "" and rawget(x, "_fsdp_unit") then units[prefix] = x end
    local o = x._parameters
    for _, pname in ipairs(o.names) do
      local t = o.values[pname]
      if t ~= nil then params[prefix == "" and pname or (prefix .. "." .. pname)] = t end
    end
  end
  return { params = params, units = units }
end

local function unit_name(u) return u.parent and u.path or "<root>" end
local shape_of = fsdp._shape_str

-- the changes of u's subtree since it was wrapped, as sentences (names from the model's root)
local function structure_changes(u)
  local now, was = structure(u.module), u.structure
  local base = u.parent and (u.path .. ".") or ""
  local function owner(name, units)  -- the innermost unit holding `name`: its name
    local best
    for p in pairs(units) do
      if name:sub(1, #p + 1) == p .. "." and (not best or #p > #best) then best = p end
    end
    return best and unit_name(rawget(units[best], "_fsdp_unit")) or unit_name(u)
  end
  local r = {}
  for name, t in pairs(now.params) do
    local old = was.params[name]
    if old == nil then
      r[#r + 1] = ("%s%s (a new parameter of shape %s) is not in the plan of unit '%s'"):format(base, name, shape_of(t),
        owner(name, now.units))
    elseif fsdp._key(old) ~= fsdp._key(t) then
      r[#r + 1] = ("%s%s was replaced by a new parameter of shape %s, which is not in the plan of unit '%s'"):format(base,
        name, shape_of(t), owner(name, now.units))
    end
  end
  for name, t in pairs(was.params) do
    if now.params[name] == nil then
      r[#r + 1] = ("%s%s (a parameter of shape %s in the plan of unit '%s') was removed"):format(base, name, shape_of(t),
        owner(name, was.units))
    end
  end
  for p, m in pairs(was.units) do
    if now.units[p] ~= m then
      r[#r + 1] = ("unit '%s' (%s) was removed or replaced"):format(unit_name(rawget(m, "_fsdp_unit")), m.__name)
    end
  end
  for p, m in pairs(now.units) do
    if was.units[p] == nil then
      r[#r + 1] = ("unit %s%s (%s) was put inside unit '%s'"):format(base, p, m.__name, unit_name(u))
    end
  end
  table.sort(r)
  return r
end

local function check_structure(u)
  local changes = structure_changes(u)
  if #changes == 0 then
    u.seen_version = Module._structure_version
    return
  end
  local more = #changes > 3 and ("; and %d more"):format(#changes - 3) or ""
  error(("fsdp forward: the model changed after fsdp.wrap: %s%s; a unit's parameters are fixed when it is wrapped: "
    .. "build the model (and change its layers) before fsdp.wrap, or put back what was there (changing values in "
    .. "place -- copy_, load_state_dict -- and freezing are fine)"):format(table.concat(changes, "; ", 1,
    math.min(#changes, 3)), more), 0)
end

-- the options fsdp.wrap and fsdp.auto_wrap take; any other name is a typo or another framework's
-- spelling, an error rather than a setting silently not applied
-- the module and options every entry point takes: errors name fn
local function check_module(fn, m, opts)
  if type(m) ~= "table" or not rawget(m, "_modules") then fsdp._arg_error(fn, "module", "an nn.Module", m, 3) end
  if opts ~= nil and (type(opts) ~= "table" or fsdp.is_tensor(opts)) then fsdp._arg_error(fn, "options", "a table", opts, 3) end
end
local WRAP_OPTIONS = { "sharding", "shard_group_size", "reshard_after_forward", "mixed_precision", "forward_prefetch",
  "backward_prefetch", "sync_module_states", "offload", "checkpoint", "min_params", "module_classes" }
local MP_PARTS = { param = true, reduce = true, output = true, cast_forward_inputs = true }
local function check_option_names(opts)
  local known = {}
  for _, k in ipairs(WRAP_OPTIONS) do known[k] = true end
  for k in pairs(opts) do
    if not known[k] then
      local hint = ""
      if k == "param_dtype" or k == "reduce_dtype" then
        hint = ("; mixed precision is mixed_precision = {%s = \"bf16\"}"):format(k == "param_dtype" and "param" or "reduce")
      end
      error(("fsdp.wrap: unknown option %s (it takes %s)%s"):format(tostring(k), table.concat(WRAP_OPTIONS, ", "), hint), 4)
    end
  end
  if type(opts.mixed_precision) == "table" then
    for k in pairs(opts.mixed_precision) do
      if not MP_PARTS[k] then
        local hint = k == "output_dtype" and "; the output dtype is mixed_precision = {output = \"fp32\"}" or ""
        error(("fsdp.wrap: unknown mixed_precision part %s (param, reduce, output, cast_forward_inputs)%s")
          :format(tostring(k), hint), 4)
      end
    end
  end
end

local function unit_options(opts)
  check_option_names(opts)
  local o = ffi.new("fsdp_unit_options")
  local sh = opts.sharding or "full"
  o.sharding = shardings[sh] or error(("fsdp.wrap: unknown sharding %q (use \"full\", \"grad_op\", \"hybrid\" or \"none\")"):format(tostring(sh)), 3)
  -- hybrid: sharded within groups of shard_group_size ranks (default: the ranks of one machine),
  -- replicated across them
  local gs = opts.shard_group_size
  if gs ~= nil and o.sharding ~= 3 then
    error(("fsdp.wrap: shard_group_size is an option of sharding = \"hybrid\" (sharding is %q)"):format(tostring(sh)), 3)
  end
  if gs ~= nil and (type(gs) ~= "number" or gs < 1 or gs ~= math.floor(gs)) then
    error(("fsdp.wrap: shard_group_size must be a positive integer, got %s"):format(tostring(gs)), 3)
  end
  o.group_size = o.sharding == 3 and (gs or fsdp.local_world_size()) or 0
  if opts.reshard_after_forward == nil then o.reshard_after_forward = -1
  else o.reshard_after_forward = opts.reshard_after_forward and 1 or 0 end
  local mp = opts.mixed_precision or {}
  if type(mp) ~= "table" then error("fsdp.wrap: mixed_precision must be a table like {param = \"bf16\", reduce = \"fp32\"}", 3) end
  local function dt(v)
    if v == nil or v == "fp32" or v == "float32" then return 0 end
    return fsdp._dtype(v)
  end
  o.param_dtype = dt(mp.param)
  o.reduce_dtype = dt(mp.reduce)
  if mp.cast_forward_inputs ~= nil and type(mp.cast_forward_inputs) ~= "boolean" then
    fsdp._arg_error("fsdp.wrap", "mixed_precision.cast_forward_inputs", "true or false", mp.cast_forward_inputs, 3)
  end
  dt(mp.output)  -- (checked here; the unit keeps it on the Lua side)
  o.forward_prefetch = opts.forward_prefetch and 1 or 0
  o.backward_prefetch = opts.backward_prefetch == false and 0 or 1
  o.sync_module_states = opts.sync_module_states == false and 0 or 1
  -- CPU offload, FSDP's single switch (CPUOffload(offload_params=True), FSDP2's CPUOffloadPolicy):
  -- the shards live on the CPU, so their gradient pieces and the optimizer's step (which works on
  -- the pieces) do too. The table form names the three parts; they go together.
  local off = opts.offload
  if type(off) == "table" then
    local on = 0
    for _, k in ipairs { "params", "grads", "optimizer" } do on = on + (off[k] and 1 or 0) end
    for k in pairs(off) do
      if k ~= "params" and k ~= "grads" and k ~= "optimizer" then
        error(("fsdp.wrap: unknown offload part %q (params, grads, optimizer)"):format(tostring(k)), 3)
      end
    end
    if on ~= 0 and on ~= 3 then
      error("fsdp.wrap: offload = {params, grads, optimizer} go together: a parameter's piece on the CPU has its "
        .. "gradient and optimizer state there too (use offload = true)", 3)
    end
    off = on == 3
  elseif off ~= nil and type(off) ~= "boolean" then
    error("fsdp.wrap: offload must be true/false or {params = true, grads = true, optimizer = true}", 3)
  end
  o.offload = off and 1 or 0
  return o
end

local function set_path(u, path)
  u.path = path
  check(C.fsdp_unit_set_path(u.c, path == "" and "<root>" or path))
end

--- fsdp.wrap(module[, opts]) -> module (the same table, now an FSDP unit)
--   opts: sharding = "full" | "grad_op" | "none", reshard_after_forward = bool,
--         mixed_precision = {param = "bf16", reduce = "fp32"}, sync_module_states = true,
--         forward_prefetch = false, backward_prefetch = true,
--         offload = false (true: shards, gradient pieces and the optimizer step on the CPU; the
--         unit computes on its parameters' GPU), checkpoint = false (true: activation
--         checkpointing of the unit's forward, as nn.Checkpoint: only its inputs are kept, backward
--         gathers again and runs the forward again)
function W.wrap(module, opts)
  check_module("fsdp.wrap", module, opts)
  opts = opts or {}
  local existing = rawget(module, "_fsdp_unit")
  if existing then
    error(("fsdp.wrap: module %s is already wrapped (unit '%s'); wrap each module once"):format(module_label(module), existing.path), 2)
  end
  for _, u in ipairs(all_units) do
    if u.forwarded then
      local p = path_in(u.module, module)
      if p and p ~= "" then
        -- the module's path from the root (a nested unit's own path is already one), not from u
        -- (the matrix's bad/wrap-after-forward printed "cannot wrap 2 (Linear) inside unit '2'" for 2.2)
        if u.parent then p = u.path .. "." .. p end
        error(("fsdp.wrap: cannot wrap %s (%s) inside unit '%s' after that unit's first forward; wrap inner modules first")
          :format(p, module_label(module), u.path), 2)
      end
    end
  end
  local o = unit_options(opts)
  local c = C.fsdp_unit_new(module_label(module), o)
  if c == nil then fsdp._raise(2) end
  local u = setmetatable({ c = c, module = module, opts = opts, forwarded = false, path = module_label(module),
    tied = {} }, Unit)
  -- under mixed precision the gathered parameters are tensors of the param dtype, and so are the
  -- unit's float inputs (cast on the way in, as FSDP's MixedPrecision casts forward inputs, unless
  -- cast_forward_inputs = false); mixed_precision.output casts its float outputs (FSDP2's
  -- output_dtype)
  local mp = opts.mixed_precision or {}
  if o.param_dtype ~= C.FSDP_F32 and mp.cast_forward_inputs ~= false then u.compute_dtype = o.param_dtype end
  if mp.output ~= nil then
    u.output_dtype = (mp.output == "fp32" or mp.output == "float32") and C.FSDP_F32 or fsdp._dtype(mp.output)
  end
  -- units nested below take their paths from this module; this one is "<root>" until wrapped by a parent
  for name, x in module:named_modules() do
    local nu = rawget(x, "_fsdp_unit")
    if name ~= "" and nu then
      nu.parent = nu.parent or u
      set_path(nu, name)
    end
  end
  -- enclosing units wrapped earlier: the outermost one names this unit (and each now holds it)
  local best
  for _, v in ipairs(all_units) do
    local p = path_in(v.module, module)
    if p and p ~= "" then
      u.parent = u.parent or v
      if not best or #p > #best then best = p end
      v.structure.units[p] = module
    end
  end
  if best then set_path(u, best) end
  local ps, names = own_params(module)
  local arr = ffi.new("fsdp_tensor*[?]", math.max(#ps, 1))
  local carr = ffi.new("const char*[?]", math.max(#ps, 1))
  for i, p in ipairs(ps) do arr[i - 1] = p.p; carr[i - 1] = names[i] end
  -- A parameter taken from a unit that is neither inside this one nor around it (a sibling) is
  -- tied across units that no unit holds together yet: both units remember it, and their forward
  -- refuses until a unit around both takes it (wrapping the root does)
  for i, p in ipairs(ps) do
    local from = C.fsdp_param_unit(p.p)
    for _, v in ipairs(all_units) do
      if v.c == from and not path_in(module, v.module) and not path_in(v.module, module) then
        local msg = ("parameter '%s' of %s is also parameter '%s' of %s (unit '%s'), and no unit holds both modules; "
          .. "wrap a module around both (the root: fsdp.wrap(model)) so that unit owns it"):format(names[i],
          module_label(module), (param_uses(v.module)[fsdp._key(p)] or { names = { "?" } }).names[1],
          module_label(v.module), v.path)
        local e = { p = p, a = module, b = v.module, msg = msg }
        u.tied[#u.tied + 1] = e
        v.tied[#v.tied + 1] = e
      end
    end
  end
  check(C.fsdp_unit_set_params(c, #ps, arr, carr))
  -- buffers built on meta (fsdp.meta) are not sharded: every rank materialises them whole
  for _, b in module:named_buffers() do
    if C.fsdp_tensor_deferred(b.p) == 1 then check(C.fsdp_materialize_(b.p, C.fsdp_tensor_device(b.p))) end
  end
  rawset(module, "_fsdp_unit", u)
  u.structure, u.seen_version = structure(module), Module._structure_version
  rawset(module, "_forward_wrapper", u)  -- nn.Module.__call runs the unit's protocol around forward
  -- and module:forward(x) runs it too (as PyTorch's FSDP(module).forward(x) does): __call runs the
  -- forward kept here
  rawset(module, "_inner_forward", module.forward)
  rawset(module, "forward", function(m, ...) return m(...) end)
  if opts.checkpoint then rawset(module, "_checkpointed", true) end
  all_units[#all_units + 1] = u
  return module
end

--- fsdp.auto_wrap(module, {min_params = N, module_classes = {Class, ...}, ...wrap opts}): wraps,
-- innermost first, every submodule that is an instance of one of module_classes (PyTorch's
-- ModuleWrapPolicy / transformer_auto_wrap_policy: your own classes too, subclasses included) or
-- whose not-yet-wrapped parameters number at least min_params, then the root. Without
-- module_classes the size rule alone applies, min_params 1e5 by default; with it, the size rule
-- only when min_params is given.
function W.auto_wrap(module, opts)
  check_module("fsdp.auto_wrap", module, opts)
  opts = opts or {}
  local classes = opts.module_classes
  if classes ~= nil then
    if type(classes) ~= "table" or rawget(classes, "__is_class") ~= nil then
      fsdp._arg_error("fsdp.auto_wrap", "module_classes", "a list of Module classes ({nn.Linear, Block})", classes, 2)
    end
    for i = 1, fsdp._list(classes, "fsdp.auto_wrap", "module_classes") do
      local c = classes[i]
      if type(c) ~= "table" or rawget(c, "__is_class") == nil then
        fsdp._arg_error("fsdp.auto_wrap", ("module_classes[%d]"):format(i), "a Module class", c, 2)
      end
    end
  end
  local min = opts.min_params
  if min == nil and classes == nil then min = 1e5 end
  if min ~= nil and (type(min) ~= "number" or not (min >= 0)) then
    fsdp._arg_error("fsdp.auto_wrap", "min_params", "a number >= 0", min, 2)
  end
  local function visit(m, is_root)
    for _, child in m:named_children() do visit(child, false) end
    if is_root then return end
    if rawget(m, "_fsdp_unit") then return end
    if classes and #classes > 0 and Module.isinstance(m, classes) then W.wrap(m, opts); return end
    if min == nil then return end
    local n = 0
    for _, p in ipairs((own_params(m))) do n = n + p:numel() end
    if n >= min then W.wrap(m, opts) end
  end
  visit(module, true)
  return W.wrap(module, opts)
end

-- ---- forward protocol (called by nn.Module.__call) ------------------------------------------------------
local function pack(...) return { n = select("#", ...), ... } end

local function mark(u, v)
  if fsdp.is_tensor(v) then return wrap_t(C.fsdp_unit_mark_output(u.c, v.p)) end
  if type(v) == "table" and getmetatable(v) == nil then
    local r = {}
    for k, x in pairs(v) do r[k] = mark(u, x) end
    return r
  end
  return v
end

-- v with its float tensors (in plain tables too) in dtype; differentiable, so gradients flow back in
-- the inputs' own dtype. Only float tensors: int64 indices and bool masks keep their dtype (a bool
-- attention mask made float would add its 0s and 1s to the scores instead of masking them)
local FLOAT = { [C.FSDP_F32] = true, [C.FSDP_BF16] = true, [C.FSDP_F16] = true }
local function cast(v, dtype)  -- dtype: a dtype number
  if fsdp.is_tensor(v) then
    local p = fsdp._t(v, "FSDP forward (mixed precision cast)", "input")
    local d = C.fsdp_tensor_dtype(p)
    if d ~= dtype and FLOAT[d] then return wrap_t(C.fsdp_to_dtype(p, dtype)) end
    return v
  end
  if type(v) == "table" and getmetatable(v) == nil then
    local r = {}
    for k, x in pairs(v) do r[k] = cast(x, dtype) end
    return r
  end
  return v
end

local function cast_all(dtype, ...)
  if not dtype then return ... end
  local args = pack(...)
  for i = 1, args.n do args[i] = cast(args[i], dtype) end
  return unpack(args, 1, args.n)
end

-- a tied parameter this unit shares with a sibling is settled once a unit around both owns it
local function check_tied(u)
  for i = #u.tied, 1, -1 do
    local e = u.tied[i]
    local owner = C.fsdp_param_unit(e.p.p)
    local settled = false
    for _, v in ipairs(all_units) do
      if v.c == owner and path_in(v.module, e.a) and path_in(v.module, e.b) then settled = true end
    end
    if not settled then error(("FSDP unit '%s': %s"):format(u.path, e.msg), 0) end
    table.remove(u.tied, i)
  end
end

function Unit:run(module, inner, ...)
  -- a checkpointed region around this unit runs its forward again for backward: the parameters
  -- are gathered (its backward begins here), and the forward itself is all that runs again
  if C.fsdp_checkpoint_rerunning() ~= 0 then
    check(C.fsdp_unit_rerun(self.c))
    return cast_all(self.output_dtype, inner(module, cast_all(self.compute_dtype, ...)))
  end
  if self.seen_version ~= Module._structure_version then check_structure(self) end
  if #self.tied > 0 then check_tied(self) end
  check(C.fsdp_unit_pre_forward(self.c))
  self.forwarded = true
  local out = pack(pcall(inner, module, cast_all(self.compute_dtype, ...)))
  if not out[1] then
    C.fsdp_unit_abort_forward(self.c)
    error(out[2], 0)
  end
  for i = 2, out.n do out[i] = mark(self, out[i]) end
  if self.output_dtype then for i = 2, out.n do out[i] = cast(out[i], self.output_dtype) end end
  check(C.fsdp_unit_post_forward(self.c))
  return unpack(out, 2, out.n)
end

-- ---- inspection ------------------------------------------------------------------------------------------------
-- units in m's subtree (m included), in creation order
function W.units(m)
  local r = {}
  for _, u in ipairs(all_units) do
    if u.module == m or path_in(m, u.module) then r[#r + 1] = u end
  end
  return r
end

-- a unit's parameter by its name in the whole model ("block.0.weight": the unit's path, then the
-- name the unit knows it by) and its unit's path, for messages
function W.param_names(p)
  local c = C.fsdp_param_unit(p.p)
  local name = ffi.string(C.fsdp_param_name(p.p))
  for _, u in ipairs(all_units) do
    if u.c == c then return u.parent and (u.path .. "." .. name) or name, u.path end
  end
  return name, ffi.string(C.fsdp_param_unit_path(p.p))
end

--- {path = state name} for the units of m's subtree
function W.unit_states(m)
  check_module("fsdp.unit_states", m)
  local r = {}
  for _, u in ipairs(W.units(m)) do r[u.path] = state_names[C.fsdp_unit_state(u.c)] end
  return r
end

--- true when every unit is idle and no gathered buffer is held beyond its policy
function W.all_idle() return C.fsdp_units_all_idle() ~= 0 end

local function root_unit(m, what)
  local u = rawget(m, "_fsdp_unit")
  if not u then error(("%s: %s is not wrapped with fsdp.wrap"):format(what, module_label(m)), 3) end
  if u.parent then
    error(("%s is only allowed on the root FSDP unit; '%s' is nested in '%s'"):format(what, u.path, u.parent.path), 3)
  end
  return u
end

-- model:no_sync(fn): gradients of the backward passes inside fn accumulate locally (full size) and
-- are reduced by the first backward after it (gradient accumulation without communication)
function W.no_sync(m, fn)
  root_unit(m, "no_sync")
  local us = W.units(m)
  for _, u in ipairs(us) do C.fsdp_unit_set_sync_grads(u.c, 0) end
  local res = pack(pcall(fn))
  for _, u in ipairs(us) do C.fsdp_unit_set_sync_grads(u.c, 1) end
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, res.n)
end

-- the units that hold parameters of m's subtree: those in it, and those around it that own some of
-- its parameters (m a module inside a unit, or a unit whose tied parameter a unit around it owns),
-- in creation order (the order every rank gathers them in)
function W.units_holding(m)
  local owners = {}
  for _, p in ipairs(m:parameters()) do
    local c = C.fsdp_param_unit(p.p)
    if c ~= nil then owners[fsdp._addr(c)] = true end
  end
  local r = {}
  for _, u in ipairs(all_units) do
    if u.module == m or path_in(m, u.module) or owners[fsdp._addr(u.c)] then r[#r + 1] = u end
  end
  return r
end

-- model:summon_full_params(fn[, {writeback = true}]): every parameter of the subtree takes its
-- full shape and values while fn runs; with writeback, changes are kept afterwards. A call inside
-- another one's fn leaves the units the outer call summoned to it (their parameters stay whole
-- until it ends; its writeback decides).
function W.summon_full_params(m, fn, opts)
  check_module("summon_full_params", m, opts)
  fsdp._fn(fn, "summon_full_params", "fn")
  local writeback = not (opts and opts.writeback == false)
  local us = {}
  for _, u in ipairs(W.units_holding(m)) do
    if not u.summoned then us[#us + 1] = u end
  end
  check(C.fsdp_units_settle())  -- (a forward whose backward never came; checkpoint.lua's model_entries too)
  -- A unit whose layout world is 1 (world size 1, sharding "none") has no separate gathered
  -- buffer: the summoned parameters ARE the local ones, so without writeback the local values
  -- are saved here and restored afterwards (found by tests/scripts/fsdp_matrix.lua,
  -- misc/summon_full_params at world size 1: a change made with writeback=false persisted).
  local saved = {}
  if not writeback then
    for _, u in ipairs(us) do
      if C.fsdp_unit_world_size(u.c) == 1 then
        for _, p in ipairs((own_params(u.module))) do saved[#saved + 1] = { p, fsdp.no_grad(function() return p:clone() end) } end
      end
    end
  end
  local gathered = pack(pcall(function()
    for _, u in ipairs(us) do
      check(C.fsdp_unit_unshard(u.c))
      u.summoned = true
    end
  end))
  if not gathered[1] then
    for _, u in ipairs(us) do
      if u.summoned then C.fsdp_unit_reshard(u.c, 0) end
      u.summoned = nil
    end
    error(gathered[2], 0)
  end
  local res = pack(pcall(fn))
  for _, u in ipairs(us) do
    u.summoned = nil
    check(C.fsdp_unit_reshard(u.c, writeback and 1 or 0))
  end
  -- (restored only where fn changed it: a copy bumps the parameter's version, and a graph built
  -- before -- state_dict between forward and backward -- would refuse it as modified in place)
  if #saved > 0 then
    fsdp.no_grad(function()
      for _, e in ipairs(saved) do
        if (e[1] - e[2]):abs():max():item() ~= 0 then e[1]:copy_(e[2]) end
      end
    end)
  end
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, res.n)
end

-- whether any unit holds parameters of m's subtree (W.units_holding)
function W.has_units(m) return #W.units_holding(m) > 0 end

-- ---- the plan: fsdp.summary ----------------------------------------------------------------------------------------
-- fsdp.summary(model[, {optimizer = opt, print = true}]) -> plan table (and prints it on rank 0)
--   plan.units[i] = {path, module, parent (path or nil), sharding, world (its layout world),
--     reshard_after_forward, param_dtype, params = {{name, shape, numel, local_numel, trainable}},
--     elements = {full, this_rank, trainable, frozen}, bytes = {shards, gathered, grads, optimizer},
--     step = {all_gather = {count, bytes}, reduce_scatter = ..., all_reduce = ...}}
--     buffers = {count, elements} (the unit's modules' buffers: every rank holds them whole),
--   plan.step: the same counts summed: what one training step's collectives are (fsdp.comm_stats
--   counts them the same way: payload bytes, the full gathered or reduced buffer)
-- One step = forward, backward, gradient reduction. A unit gathers each of its two groups
-- (trainable, frozen) in forward; again in backward when it was resharded after forward and its
-- outputs take it into backward (known after a first forward: a frozen unit whose inputs need no
-- gradient is left out); its trainable group is reduce-scattered (all-reduced for sharding "none"
-- on several ranks). optimizer: its state tensors' bytes per unit, once its first step made them.
local function dtype_bytes(name) return tonumber(C.fsdp_dtype_size(fsdp._dtype(name))) end
local function human(b)
  if b >= 2 ^ 30 then return ("%.2f GiB"):format(b / 2 ^ 30) end
  if b >= 2 ^ 20 then return ("%.2f MiB"):format(b / 2 ^ 20) end
  if b >= 2 ^ 10 then return ("%.1f KiB"):format(b / 2 ^ 10) end
  return ("%d B"):format(b)
end
local KINDS = { "all_gather", "reduce_scatter", "all_reduce" }

-- the modules of unit module m that no unit nested in it holds (m itself included)
local function own_modules(m)
  local r, inner = {}, {}
  for name, x in m:named_modules() do
    local held = false
    for _, pre in ipairs(inner) do
      if name:sub(1, #pre) == pre then held = true; break end
    end
    if not held and name ~= "" and rawget(x, "_fsdp_unit") then inner[#inner + 1] = name .. "."; held = true end
    if not held then r[#r + 1] = x end
  end
  return r
end
-- buffers (replicated on every rank, never sharded) and the collectives a module issues itself per
-- training step (m:_step_collectives(world) -> {{kind, bytes}, ...}: SyncBatchNorm's all-reduces)
local function module_extras(e, m, world)
  local bufs = rawget(m, "_buffers")
  for _, name in ipairs(bufs and bufs.names or {}) do
    local t = bufs.values[name]
    if t ~= nil then
      e.buffers.count = e.buffers.count + 1
      e.buffers.elements = e.buffers.elements + t:numel()
    end
  end
  local f = m._step_collectives
  for _, c in ipairs(type(f) == "function" and f(m, world) or {}) do
    e.step[c[1]].count = e.step[c[1]].count + 1
    e.step[c[1]].bytes = e.step[c[1]].bytes + c[2]
  end
end

--- A table of the model's modules, shapes and parameter counts (a string).
-- @param model a Module
-- @param opts options table or nil
function W.summary(model, opts)
  if type(model) ~= "table" or not rawget(model, "_modules") then
    error("fsdp.summary: expected an nn.Module, got " .. type(model), 2)
  end
  if opts ~= nil and type(opts) ~= "table" then error("fsdp.summary: options must be a table like {optimizer = opt}", 2) end
  opts = opts or {}
  local world = fsdp.world_size()
  local numel, chunk, start, length = ffi.new("int64_t[1]"), ffi.new("int64_t[1]"), ffi.new("int64_t[1]"),
    ffi.new("int64_t[1]")
  local is_root, in_bw = ffi.new("int[1]"), ffi.new("int[1]")
  local shp = ffi.new("int64_t[8]")
  local plan = { world_size = world, rank = fsdp.rank(), units = {}, step = {} }
  for _, k in ipairs(KINDS) do plan.step[k] = { count = 0, bytes = 0 } end
  for _, u in ipairs(W.units(model)) do
    local o = u.opts
    local Wu = C.fsdp_unit_world_size(u.c)
    local pdt = (o.mixed_precision and o.mixed_precision.param) and fsdp._dtype_names[fsdp._dtype(o.mixed_precision.param)]
      or "float32"
    local ran = C.fsdp_unit_last_pass(u.c, is_root, in_bw) ~= 0
    local root = ran and is_root[0] ~= 0 or (not ran and u.parent == nil)
    local backward = not ran or in_bw[0] ~= 0
    local sharding = o.sharding or "full"
    local reshard = o.reshard_after_forward
    if reshard == nil then reshard = (shardings[sharding] == 0 or shardings[sharding] == 3) and not root end
    local e = { path = u.path, module = module_label(u.module), parent = u.parent and u.parent.path, sharding = sharding,
      world = Wu, reshard_after_forward = reshard, param_dtype = pdt, params = {},
      elements = { full = 0, this_rank = 0, trainable = 0, frozen = 0 },
      bytes = { shards = 0, gathered = 0, grads = 0, optimizer = 0 }, step = {}, buffers = { count = 0, elements = 0 } }
    for _, k in ipairs(KINDS) do e.step[k] = { count = 0, bytes = 0 } end
    for _, m in ipairs(own_modules(u.module)) do module_extras(e, m, world) end
    local S, F = { 0, 0 }, { 0, 0 }  -- per group (1 trainable, 2 frozen): shard and full elements
    local ps, pnames = own_params(u.module)  -- (the unit's parameters, in its order)
    for i = 0, C.fsdp_unit_num_params(u.c) - 1 do
      check(C.fsdp_unit_param_layout(u.c, i, numel, chunk, start, length))
      local t = ps[i + 1]
      local nd = C.fsdp_param_full_shape(t.p, shp)
      local shape = {}
      for d = 0, nd - 1 do shape[d + 1] = tonumber(shp[d]) end
      local g = t.requires_grad and 1 or 2
      S[g] = S[g] + tonumber(chunk[0])
      F[g] = F[g] + tonumber(numel[0])
      e.params[#e.params + 1] = { name = pnames[i + 1], shape = shape, numel = tonumber(numel[0]),
        local_numel = tonumber(length[0]), trainable = g == 1 }
      e.elements.full = e.elements.full + tonumber(numel[0])
      e.elements.this_rank = e.elements.this_rank + tonumber(length[0])
      if g == 1 then e.elements.trainable = e.elements.trainable + tonumber(numel[0])
      else e.elements.frozen = e.elements.frozen + tonumber(numel[0]) end
      for _, v in pairs(opts.optimizer and opts.optimizer:state_of(t) or {}) do
        if fsdp.is_tensor(v) then e.bytes.optimizer = e.bytes.optimizer + v:numel() * dtype_bytes(v.dtype) end
      end
    end
    local es = dtype_bytes(pdt)
    e.bytes.shards = (S[1] + S[2]) * 4
    e.bytes.grads = S[1] * 4
    e.bytes.gathered = (Wu > 1 or pdt ~= "float32") and (F[1] + F[2]) * es or 0
    local function add(kind, bytes)
      e.step[kind].count = e.step[kind].count + 1
      e.step[kind].bytes = e.step[kind].bytes + bytes
    end
    if Wu > 1 then
      for g = 1, 2 do
        if F[g] > 0 then
          add("all_gather", Wu * S[g] * es)
          if reshard and backward then add("all_gather", Wu * S[g] * es) end
        end
      end
      if F[1] > 0 then add("reduce_scatter", Wu * S[1] * 4) end
      -- hybrid: each piece is then averaged over the replicas (the other shard groups)
      if F[1] > 0 and world > Wu then add("all_reduce", S[1] * 4) end
    elseif world > 1 and F[1] > 0 then
      add("all_reduce", S[1] * 4)
    end
    for _, k in ipairs(KINDS) do
      plan.step[k].count = plan.step[k].count + e.step[k].count
      plan.step[k].bytes = plan.step[k].bytes + e.step[k].bytes
    end
    plan.units[#plan.units + 1] = e
  end
  if opts.print ~= false and fsdp.rank() == 0 then
    local lines = { ("FSDP plan of %s: %d unit(s), world size %d (per rank)"):format(module_label(model), #plan.units,
      world) }
    -- the unit tree, outer units first (plan.units keeps creation order: inner units first)
    local kids, order, depth = {}, {}, {}
    for _, e in ipairs(plan.units) do
      local k = e.parent or false
      kids[k] = kids[k] or {}
      table.insert(kids[k], e)
    end
    local function visit(e, d)
      order[#order + 1], depth[e] = e, d
      for _, c in ipairs(kids[e.path] or {}) do visit(c, d + 1) end
    end
    for _, e in ipairs(kids[false] or {}) do visit(e, 0) end
    for _, e in ipairs(order) do
      local ind = ("  "):rep(depth[e] + 1)
      lines[#lines + 1] = ("%sunit %s (%s): sharding %s over %d rank(s), %s, %sreshard after forward"):format(ind,
        e.path == "" and "<root>" or e.path, e.module, e.sharding, e.world, e.param_dtype,
        e.reshard_after_forward and "" or "no ")
      lines[#lines + 1] = ("%s  params %d: %d elements (%d trainable, %d frozen), %d on this rank"):format(ind,
        #e.params, e.elements.full, e.elements.trainable, e.elements.frozen, e.elements.this_rank)
      if e.buffers.count > 0 then
        lines[#lines + 1] = ("%s  buffers %d: %d elements, on every rank (not sharded)"):format(ind, e.buffers.count,
          e.buffers.elements)
      end
      lines[#lines + 1] = ("%s  bytes: shards %s, gathered %s while it computes, grads %s, optimizer %s"):format(ind,
        human(e.bytes.shards), human(e.bytes.gathered), human(e.bytes.grads),
        opts.optimizer and human(e.bytes.optimizer) or "(pass {optimizer = opt})")
      local c = {}
      for _, k in ipairs(KINDS) do
        if e.step[k].count > 0 then c[#c + 1] = ("%s x%d (%s)"):format(k, e.step[k].count, human(e.step[k].bytes)) end
      end
      lines[#lines + 1] = ("%s  per step: %s"):format(ind, #c > 0 and table.concat(c, ", ") or "no collectives")
    end
    local c = {}
    for _, k in ipairs(KINDS) do c[#c + 1] = ("%s x%d (%s)"):format(k, plan.step[k].count, human(plan.step[k].bytes)) end
    lines[#lines + 1] = "  one training step: " .. table.concat(c, ", ")
    print(table.concat(lines, "\n"))
  end
  return plan
end

-- ---- gradient clipping -----------------------------------------------------------------------------------------
-- fsdp.clip_grad_norm(model or params, max_norm[, norm_type = 2][, {error_if_nonfinite = false,
-- foreach = ignored}]) -> total norm: torch.nn.utils.clip_grad_norm_ over the whole model, whatever
-- its units and ranks. norm_type: any p > 0, or math.huge / "inf" (the largest |g|). The norm is of
-- every gradient element of the model once: a rank's piece of a sharded gradient is held by
-- world / W ranks (W: the ranks its unit is sharded over; 1 for NO_SHARD units and parameters no
-- unit owns, the shard group's size under hybrid sharding), so its sum of |g|^p counts that
-- fraction; the ranks' sums add up (all-reduce), and the largest |g| is the ranks' largest. Every
-- gradient is then scaled by min(1, max_norm / (norm + 1e-6)), PyTorch's formula, unless
-- error_if_nonfinite refuses a NaN or infinite norm.
-- the parameters of `what` (argument `arg` of fn): a module's, a tensor, or a list of tensors
-- without holes; errors at `level` (1: param_list's caller)
local function param_list(fn, arg, what, level)
  if fsdp.is_tensor(what) then return { what } end
  if type(what) == "table" and rawget(what, "_modules") then return what:parameters() end
  if type(what) ~= "table" then fsdp._arg_error(fn, arg, "an nn.Module or a list of parameters", what, level + 1) end
  for i = 1, fsdp._list(what, fn, arg, level + 1) do
    if not fsdp.is_tensor(what[i]) then fsdp._arg_error(fn, ("%s[%d]"):format(arg, i), "a tensor", what[i], level + 1) end
  end
  return what
end

local function clip_args(fn, model, opts_or_type, opts)
  -- (nn.utils' clip_grad_norm_ / clip_grad_value_ name it as PyTorch does: parameters)
  local params = param_list(fn, fn:sub(-1) == "_" and "parameters" or "model", model, 4)
  local norm_type = opts_or_type
  if type(opts_or_type) == "table" then opts, norm_type = opts_or_type, opts_or_type.norm_type end
  opts = opts or {}
  if type(opts) ~= "table" then fsdp._arg_error(fn, "options", "a table like {error_if_nonfinite = true}", opts, 4) end
  for k in pairs(opts) do
    if k ~= "norm_type" and k ~= "error_if_nonfinite" and k ~= "foreach" then
      error(("%s: unknown option %s (norm_type, error_if_nonfinite, foreach)"):format(fn, tostring(k)), 4)
    end
  end
  return params, norm_type, opts
end

-- the gradients of params (each once), refusing local ones a no_sync backward left (their sum is
-- not the model's gradient until a synced backward averages them)
local function grads_of(fn, params)
  local grads, seen = {}, {}
  for i, p in ipairs(params) do
    if not fsdp.is_tensor(p) then fsdp._arg_error(fn, ("params[%d]"):format(i), "a tensor", p, 4) end
    local g = p.grad
    if g ~= nil and not seen[fsdp._key(p)] then
      seen[fsdp._key(p)] = true
      if C.fsdp_param_grad_unreduced(p.p) ~= 0 then
        local name, unit = W.param_names(p)
        error(("%s: parameter '%s' of FSDP unit '%s' holds an unreduced gradient: the last backward ran inside "
          .. "no_sync; run one backward outside no_sync before clipping"):format(fn, name, unit), 4)
      end
      local unit = C.fsdp_param_unit(p.p)
      grads[#grads + 1] = { g = g, W = unit == nil and 1 or C.fsdp_unit_world_size(unit) }
    end
  end
  return grads
end

--- Scales the gradients so their total norm is at most max_norm (over every rank); returns the norm before.
-- @param model a model or a list of parameters
-- @param max_norm a number
-- @param norm_type 2 (default) or math.huge
-- @param opts options table or nil
-- @param fn the name errors give (nn.utils.clip_grad_norm_ passes its own; leave it out)
function W.clip_grad_norm(model, max_norm, norm_type, opts, fn)
  fn = fn or "clip_grad_norm"  -- (nn.utils.clip_grad_norm_ is this function under its own name)
  local params
  params, norm_type, opts = clip_args(fn, model, norm_type, opts)
  max_norm = fsdp._n(max_norm, fn, "max_norm")
  if not (max_norm >= 0) then error(("%s: max_norm must be a number >= 0 (math.huge: no clipping), got %s"):format(fn, tostring(max_norm)), 2) end
  if norm_type == nil then norm_type = 2 end
  if norm_type == "inf" then norm_type = math.huge end
  if type(norm_type) ~= "number" or not (norm_type > 0) then
    error(("%s: norm_type must be a number > 0 or math.huge (\"inf\"), got %s"):format(fn, tostring(norm_type)), 2)
  end
  local grads = grads_of(fn, params)
  local world, inf = fsdp.world_size(), norm_type == math.huge
  local total = 0
  fsdp.no_grad(function()
    local acc = {}  -- per device: the sum of |g|^p (or the largest |g|), one transfer each at the end
    for _, e in ipairs(grads) do
      local a = e.g:abs()
      local v
      if inf then v = a:numel() > 0 and a:max() or nil
      elseif norm_type == 1 then v = a:sum() * (e.W / world)
      elseif norm_type == 2 then v = (a * a):sum() * (e.W / world)
      else v = (a ^ norm_type):sum() * (e.W / world) end
      if v ~= nil then
        local d = e.g.device
        if acc[d] == nil then acc[d] = v
        elseif inf then acc[d] = fsdp.maximum(acc[d], v)
        else acc[d] = acc[d] + v end
      end
    end
    for _, v in pairs(acc) do
      local x = v:item()
      if not inf then total = total + x
      elseif x > total or x ~= x then total = x end  -- a NaN wins (math.max(nan, 3) is 3)
    end
    if world > 1 then
      local t = fsdp.tensor({ total }, { device = "cpu" })
      fsdp.all_reduce(t, inf and "max" or "sum")
      total = t:item()
    end
    if not inf then total = total ^ (1 / norm_type) end
  end)
  if opts.error_if_nonfinite and (total ~= total or total == math.huge) then
    error(("%s: the total norm of order %s for gradients from `parameters` is non-finite, so it cannot be clipped. "
      .. "To disable this error and scale the gradients by the non-finite norm anyway, set error_if_nonfinite = false")
      :format(fn, tostring(norm_type)), 2)
  end
  local coef = max_norm / (total + 1e-6)
  if coef < 1 or coef ~= coef then  -- (a NaN norm makes every gradient NaN, an infinite one zeroes them: PyTorch's)
    fsdp.no_grad(function() for _, e in ipairs(grads) do e.g:mul_(coef) end end)
  end
  return total
end

--- fsdp.clip_grad_value(model or params, clip_value[, {foreach = ignored}]): every gradient element
-- clamped to [-clip_value, clip_value] in place (torch.nn.utils.clip_grad_value_); elementwise, so
-- each rank clamps its pieces
-- @param model a model or a list of parameters
-- @param clip_value a number >= 0
-- @param opts options table or nil
-- @param fn the name errors give (nn.utils.clip_grad_value_ passes its own; leave it out)
function W.clip_grad_value(model, clip_value, opts, fn)
  fn = fn or "clip_grad_value"
  local params = clip_args(fn, model, opts, nil)
  clip_value = fsdp._n(clip_value, fn, "clip_value")
  if not (clip_value >= 0) then error(("%s: clip_value must be >= 0, got %s"):format(fn, tostring(clip_value)), 2) end
  local grads = grads_of(fn, params)
  fsdp.no_grad(function()
    for _, e in ipairs(grads) do e.g:copy_(e.g:clamp(-clip_value, clip_value)) end
  end)
end

-- ---- full state dicts ------------------------------------------------------------------------------------------------
-- state_dict of a model containing units: every parameter gathered and cloned, PyTorch names.
-- opts.rank0_only: other ranks get an empty table (they still take part in the gathers)
function W.state_dict(m, plain_state_dict, opts)
  local rank0_only = opts and opts.rank0_only
  return W.summon_full_params(m, function()
    local sd = plain_state_dict(m)
    if rank0_only and fsdp.rank() ~= 0 then return {} end
    for k, t in pairs(sd) do sd[k] = t:clone() end
    return sd
  end, { writeback = false })
end

-- load_state_dict of a model containing units: each rank copies its pieces out of the full entries
-- (no gather: a sharded parameter's copy_ takes its piece; from fsdp.load's file-backed tensors it
-- reads only that piece), buffers whole
function W.load_state_dict(m, plain_load, sd, strict)
  if not W.all_idle() then
    error("load_state_dict: a wrapped model loads between steps, not inside its forward or backward", 3)
  end
  return plain_load(m, sd, strict)
end

-- ---- what nn.Module gains from this file ------------------------------------------------------------
Module._state_dict_providers[#Module._state_dict_providers + 1] = {
  applies = W.has_units,
  state_dict = W.state_dict,
  load_state_dict = W.load_state_dict,
  -- model:apply(fn) after wrapping sees and writes whole parameters, as PyTorch FSDP's apply does
  with_full_params = function(m, fn) return W.summon_full_params(m, fn, { writeback = true }) end,
}
--- fsdp.reset_parameters(model): every module's reset_parameters() (children before their parent, as
-- constructors run them), the loop PyTorch users write after to_empty. A module that holds
-- parameters of its own and has no reset_parameters is an error naming it. On a wrapped model it
-- runs with whole parameters (summon_full_params), so each layer's init reads as it does eagerly.
function W.reset_parameters(model)
  if type(model) ~= "table" or not rawget(model, "_modules") then
    fsdp._arg_error("reset_parameters", "model", "an nn.Module", model, 2)
  end
  local order = {}
  local function walk(m, path)  -- registration order, children first
    for _, name in ipairs(rawget(m, "_modules").names) do
      local c = rawget(m, "_modules").values[name]
      if c then walk(c, path == "" and name or (path .. "." .. name)) end
    end
    order[#order + 1] = { m, path }
  end
  walk(model, "")
  for _, e in ipairs(order) do
    local m, path = e[1], e[2]
    if #m:parameters(false) > 0 and type(m.reset_parameters) ~= "function" then
      error(("reset_parameters: module '%s' (%s) holds parameters and has no reset_parameters(): give it one (its "
        .. "parameters' initialisation, in place), or build the model eagerly on rank 0 and wrap it with "
        .. "{sync_module_states = true}"):format(path == "" and "<root>" or path, module_label(m)), 2)
    end
  end
  local function run()
    fsdp.no_grad(function()
      for _, e in ipairs(order) do
        if type(e[1].reset_parameters) == "function" then e[1]:reset_parameters() end
      end
    end)
  end
  if W.has_units(model) then W.summon_full_params(model, run, { writeback = true }) else run() end
  return model
end

-- ---- nn.utils (torch.nn.utils): clipping and parameters as one vector ----------------------------------------
-- Here rather than in fsdp/nn: clipping is FSDP's (a sharded gradient's norm sums over the ranks),
-- one piece of code for wrapped and unwrapped models alike; fsdp.nn loads this file with itself.
local utils = {}
require("fsdp.nn").utils = utils
--- nn.utils.clip_grad_norm_(parameters, max_norm[, norm_type = 2][, {error_if_nonfinite = true}]):
-- torch.nn.utils.clip_grad_norm_, for a list of parameters or a model, wrapped or not (it is
-- fsdp.clip_grad_norm). Returns the total norm before clipping.
-- @param parameters a list of tensors or a module
-- @param max_norm a number
-- @param norm_type 2 (default), a number > 0 or math.huge
-- @param opts options table or nil
function utils.clip_grad_norm_(parameters, max_norm, norm_type, opts)
  return W.clip_grad_norm(parameters, max_norm, norm_type, opts, "clip_grad_norm_")
end
--- nn.utils.clip_grad_value_(parameters, clip_value): every gradient element clamped to
-- [-clip_value, clip_value] in place (it is fsdp.clip_grad_value).
-- @param parameters a list of tensors or a module
-- @param clip_value a number >= 0
function utils.clip_grad_value_(parameters, clip_value)
  return W.clip_grad_value(parameters, clip_value, nil, "clip_grad_value_")
end
--- nn.utils.parameters_to_vector(parameters): one 1-D tensor of every parameter's values, in order
-- (a sharded parameter: inside model:summon_full_params).
-- @param parameters a list of tensors or a module
function utils.parameters_to_vector(parameters)
  local ps, flat = param_list("parameters_to_vector", "parameters", parameters, 2), {}
  for i, p in ipairs(ps) do flat[i] = p:reshape(-1) end
  if #flat == 0 then return fsdp.zeros(0) end
  return fsdp.cat(flat)
end
--- nn.utils.vector_to_parameters(vec, parameters): copies consecutive slices of the 1-D vec into the
-- parameters, in order, in place without autograd (a sharded parameter takes the slice of its whole
-- values, each rank its piece).
-- @param vec a 1-D tensor of as many elements as the parameters hold
-- @param parameters a list of tensors or a module
function utils.vector_to_parameters(vec, parameters)
  fsdp._t(vec, "vector_to_parameters", "vec")
  local ps = param_list("vector_to_parameters", "parameters", parameters, 2)
  local total = 0
  for _, p in ipairs(ps) do total = total + p:numel() end
  if vec:dim() ~= 1 or vec:numel() ~= total then
    error(("vector_to_parameters: vec must be 1-D with the parameters' %d elements, got shape (%s)")
      :format(total, table.concat(vec:shape(), ", ")), 2)
  end
  fsdp.no_grad(function()
    local off = 1
    for _, p in ipairs(ps) do
      local n = p:numel()
      p:copy_(vec:narrow(1, off, n):view(p:shape()))
      off = off + n
    end
  end)
end

--- Runs fn with gradient reduction off (accumulation), as PyTorch FSDP's no_sync.
-- @param fn a function
function Module:no_sync(fn) return W.no_sync(self, fn) end
--- Runs fn with this wrapped model's full parameters gathered (PyTorch FSDP's summon_full_params).
-- @param fn a function
-- @param opts options table or nil
function Module:summon_full_params(fn, opts) return W.summon_full_params(self, fn, opts) end

return W
