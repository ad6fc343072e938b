--- fsdp.save / fsdp.load: safetensors checkpoints (the file format of Hugging Face's `safetensors`).
--
--   fsdp.save("ckpt.safetensors", model:state_dict(), {epoch = "3"})  -- metadata is optional
--   local tensors, metadata = fsdp.load("ckpt.safetensors")            -- name -> tensor, key -> string
--
-- The file is the same, byte for byte, as `safetensors.torch.save_file(state_dict, path, metadata)`
-- writes for the same tensors: entries are ordered as the Python library orders them (by dtype:
-- int64, float32, bfloat16, float16; then by name). Metadata keys are written sorted (the Python
-- library keeps them in a hash map, so its order for 2+ keys varies from run to run). Saving is
-- atomic (a temporary file renamed over the target), so a failed save leaves the old file as it
-- was. Loaded tensors are new contiguous CPU tensors in their stored dtype. The parsing and all
-- checks of untrusted files happen in C (src/io/safetensors.c); errors are Lua errors naming the file.
--
-- Beyond a flat name -> tensor table, fsdp.save takes what torch.save(dict) users save: numbers,
-- strings, booleans and nested tables (lists or string keys) with tensors anywhere in them,
--   fsdp.save("ckpt.safetensors", {model = model:state_dict(), epoch = 3, cfg = {lr = 1e-3}})
--   local ck = fsdp.load("ckpt.safetensors")    -- ck.model["0.weight"], ck.epoch == 3, ck.cfg.lr
-- A nested tensor is stored under its path joined with "." ("model.0.weight", a list's element
-- as "losses.1"), so PyTorch's safetensors loads every tensor; the table's shape and its
-- non-tensor values go, as JSON (lua/fsdp/json.lua), into the metadata under the reserved key
-- "__fsdp__" (a tensor there is {"__tensor__": name}; integer keys of a table that is not a list,
-- such as an optimizer state's 0-based parameter indices, go under "__int_keys__"), which
-- fsdp.load reads back and removes from the metadata it returns. A flat table of tensors is
-- written exactly as before (no reserved key). fsdp.load returns every tensor of a file: one the
-- tree does not place (another tool added it) comes back at the top under its own name.
-- @module fsdp.io
local ffi = require "ffi"
local fsdp = require "fsdp"
local json = require "fsdp.json"
local C = fsdp.C

local M = {}

-- the order of the Python library (its dtype enum, descending), so files come out identical
local dtype_rank = { int64 = 0, float32 = 1, bfloat16 = 2, float16 = 3, bool = 4 }

-- {k = "v", ...} -> '{"k":"v",...}' with sorted keys (lua/fsdp/json.lua); nil -> nil
local function metadata_json(meta)
  if meta == nil then return nil end
  if type(meta) ~= "table" then
    error(("fsdp.save: metadata must be a table of string -> string, got a %s"):format(type(meta)), 3)
  end
  for k, v in pairs(meta) do
    if type(k) ~= "string" then error(("fsdp.save: metadata keys must be strings, got %s"):format(tostring(k)), 3) end
    if type(v) ~= "string" then
      error(("fsdp.save: metadata value for %q must be a string, got a %s"):format(k, type(v)), 3)
    end
  end
  if next(meta) == nil then return "{}" end
  return json.encode(meta, "fsdp.save: metadata")
end

-- the compact metadata JSON that C returns: an object of string -> string
local function parse_metadata(s)
  if s == "" then return {} end
  local meta = json.decode(s, "fsdp.load: metadata")
  if type(meta) ~= "table" then error("fsdp.load: metadata is not a JSON object: " .. s, 0) end
  for k, v in pairs(meta) do
    if type(v) ~= "string" then error(("fsdp.load: metadata value for %q is not a string"):format(k), 0) end
  end
  return meta
end

local TREE_KEY = "__fsdp__"
M.TREE_KEY = TREE_KEY

-- a table that is not a flat name -> tensor table: {name = tensor} of its tensors (paths joined
-- with "."), and the JSON of its tree with each tensor replaced by {__tensor__ = name}; a table
-- with integer keys that is not a list 1..n (an optimizer's state by parameter index, 0-based as
-- in PyTorch) keeps them under {__int_keys__ = {["0"] = ...}} beside its string keys
local RESERVED = { __tensor__ = true, __int_keys__ = true }
local function flatten_tree(tbl)
  local flat, seen = {}, {}
  local function walk(v, path, where)
    if fsdp.is_tensor(v) then
      if flat[path] then error(("fsdp.save: two tensors would be stored as %q"):format(path), 0) end
      flat[path] = v
      return { __tensor__ = path }
    end
    local tv = type(v)
    if tv == "number" or tv == "string" or tv == "boolean" then return v end
    if tv ~= "table" then
      error(("fsdp.save: value at %s is a %s (only tensors, numbers, strings, booleans and tables of them)")
        :format(where, tv), 0)
    end
    if seen[v] then error(("fsdp.save: the table at %s contains itself"):format(where), 0) end
    seen[v] = true
    local strs, ints, count = {}, {}, 0
    for k, x in pairs(v) do
      if RESERVED[k] then error(("fsdp.save: the key %q (at %s) is reserved"):format(k, where), 0) end
      local tk = type(k)
      local int = tk == "number" and k == math.floor(k) and math.abs(k) < 2 ^ 53
      if tk ~= "string" and not int then
        error(("fsdp.save: the table at %s has the %s key %s; keys are strings or integers"):format(where, tk, tostring(k)), 0)
      end
      local ks = int and ("%d"):format(k) or k
      local w = (where == "the top" and "" or where) .. (int and ("[%s]"):format(ks) or ("[%q]"):format(ks))
      local y = walk(x, path == "" and ks or (path .. "." .. ks), w)
      if int then ints[k] = y else strs[k] = y end
      count = count + 1
    end
    seen[v] = nil
    local n = #ints
    local list = next(strs) == nil and n == count
    for i = 1, list and n or 0 do list = list and ints[i] ~= nil end
    if list then return ints end
    if next(ints) ~= nil then
      local keyed = {}
      for k, y in pairs(ints) do keyed[("%d"):format(k)] = y end
      strs.__int_keys__ = keyed
    end
    return strs
  end
  local tree = walk(tbl, "", "the top")
  return flat, json.encode(tree, "fsdp.save")
end

local function is_flat(tensors)
  for k, v in pairs(tensors) do
    if type(k) ~= "string" or not fsdp.is_tensor(v) then return false end
  end
  return true
end

--- fsdp.save(path, {name = tensor, ...} or a nested table [, {key = "value", ...}])
function M.save(path, tensors, metadata)
  fsdp._path(path, "fsdp.save", "path")
  if type(tensors) ~= "table" or fsdp.is_tensor(tensors) then
    error(("fsdp.save: expected a table of name -> tensor (or a nested table of values), got a %s"):format(
      fsdp.is_tensor(tensors) and "tensor" or type(tensors)), 2)
  end
  if type(metadata) == "table" and metadata[TREE_KEY] ~= nil then
    error(('fsdp.save: the metadata key "%s" is reserved (the table\'s non-tensor values go there)'):format(TREE_KEY), 2)
  end
  if not is_flat(tensors) then
    local ok, flat, tree = pcall(flatten_tree, tensors)
    if not ok then error(flat, 2) end
    local meta = {}
    if type(metadata) == "table" then for k, v in pairs(metadata) do meta[k] = v end
    elseif metadata ~= nil then metadata_json(metadata) end
    meta[TREE_KEY] = tree
    tensors, metadata = flat, meta
  end
  local names, dtypes = {}, {}
  for name, t in pairs(tensors) do
    if type(name) ~= "string" then
      error(("fsdp.save: tensor names must be strings, got the %s key %s"):format(type(name), tostring(name)), 2)
    end
    if name:find("\0", 1, true) then error(("fsdp.save: tensor name %q contains a NUL byte"):format(name), 2) end
    if not fsdp.is_tensor(t) then
      error(("fsdp.save: value for %q is a %s, not a tensor"):format(name, type(t)), 2)
    end
    names[#names + 1] = name
    dtypes[name] = dtype_rank[t.dtype] or 99
  end
  table.sort(names, function(a, b)
    if dtypes[a] ~= dtypes[b] then return dtypes[a] < dtypes[b] end
    return a < b
  end)
  local meta = metadata_json(metadata)
  local n = #names
  local cnames = ffi.new("const char*[?]", math.max(n, 1))
  local ctensors = ffi.new("fsdp_tensor*[?]", math.max(n, 1))
  for i, name in ipairs(names) do
    cnames[i - 1] = name          -- the Lua strings stay alive in `names` during the call
    ctensors[i - 1] = tensors[name].p  -- and the tensors in `tensors`
  end
  if C.fsdp_st_save(path, n, cnames, ctensors, meta) ~= 0 then fsdp._raise(2) end
end

-- the table fsdp.save flattened: `tree` (the decoded __fsdp__ JSON) with each {__tensor__ = name}
-- replaced by the file's tensor. Every tensor of the file comes back: one the tree does not place
-- (a file another tool added to) sits at the top under its own name, unless that name is taken.
local function build_tree(tree, tensors)
  local placed = {}
  local function build(v)
    if type(v) ~= "table" then return v end
    local name = v.__tensor__
    if name ~= nil then
      if type(name) ~= "string" then error(("a __tensor__ entry holds a %s, not a tensor name"):format(type(name)), 0) end
      for k in pairs(v) do
        if k ~= "__tensor__" then error(("the entry of the tensor %q has the other key %q"):format(name, tostring(k)), 0) end
      end
      if tensors[name] == nil then error(("the tensor %q is missing (the file lacks it)"):format(name), 0) end
      placed[name] = true
      return tensors[name]
    end
    local o = {}
    for k, x in pairs(v) do
      if k ~= "__int_keys__" then
        o[k] = build(x)
      elseif type(x) ~= "table" then
        error(("__int_keys__ holds a %s, not a table"):format(type(x)), 0)
      else
        for ik, y in pairs(x) do
          if not tostring(ik):match("^%-?%d+$") then error(("the integer key %q is not an integer"):format(tostring(ik)), 0) end
          o[tonumber(ik)] = build(y)
        end
      end
    end
    return o
  end
  local out = build(tree)
  if type(out) ~= "table" then error(("it is a %s, not a table"):format(type(out)), 0) end
  local unplaced = {}
  for name in pairs(tensors) do if not placed[name] then unplaced[#unplaced + 1] = name end end
  table.sort(unplaced)
  for _, name in ipairs(unplaced) do
    if out[name] ~= nil then
      error(("it does not place the file's tensor %q, and the key %q at the top holds another value"):format(name, name), 0)
    end
    out[name] = tensors[name]
  end
  return out
end

--- fsdp.load(path[, {lazy = true}]) -> {name = tensor, ...} (or the nested table saved), {key = "value", ...}
-- The tensors are file-backed (lazy, the default): each reads its values from the file when first
-- used, and as the source of a copy_ only the elements copied -- so model:load_state_dict(fsdp.load(p))
-- on a wrapped model reads each rank's pieces and no more (PyTorch's mmap=True / safetensors'
-- safe_open). The file stays open while any of them lives. {lazy = false} reads everything now.
function M.load(path, opts)
  fsdp._path(path, "fsdp.load", "path")
  if opts ~= nil and type(opts) ~= "table" then error(("fsdp.load: opts must be a table like {lazy = false}, got a %s"):format(type(opts)), 2) end
  local get = (opts == nil or opts.lazy ~= false) and C.fsdp_st_get_lazy or C.fsdp_st_get
  local f = C.fsdp_st_open(path)
  if f == nil then fsdp._raise(2, "fsdp.load: ") end
  local ok, tensors, metadata = pcall(function()
    local out = {}
    for i = 0, C.fsdp_st_count(f) - 1 do
      local name = C.fsdp_st_name(f, i)
      if name == nil then fsdp._raise(1) end
      out[ffi.string(name)] = fsdp._wrap(get(f, i))
    end
    return out, parse_metadata(ffi.string(C.fsdp_st_metadata(f)))
  end)
  C.fsdp_st_close(f)
  if not ok then error(tensors, 0) end
  local tree = metadata[TREE_KEY]
  if tree ~= nil then
    metadata[TREE_KEY] = nil
    local ok2, out = pcall(function() return build_tree(json.decode(tree, TREE_KEY), tensors) end)
    if not ok2 then error(("fsdp.load: %s: the metadata %s does not fit the file: %s"):format(path, TREE_KEY, out), 2) end
    return out, metadata
  end
  return tensors, metadata
end

return M
