-- fsdp.save / fsdp.load: safetensors checkpoints (the file format of Hugging Face's `safetensors`).
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

-- fsdp.save(path, {name = tensor, ...} [, {key = "value", ...}])
function M.save(path, tensors, metadata)
  if type(path) ~= "string" then error(("fsdp.save: path must be a string, got a %s"):format(type(path)), 2) end
  if type(tensors) ~= "table" then
    error(("fsdp.save: expected a table of name -> tensor, got a %s"):format(type(tensors)), 2)
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

-- fsdp.load(path) -> {name = tensor, ...}, {key = "value", ...}
function M.load(path)
  if type(path) ~= "string" then error(("fsdp.load: path must be a string, got a %s"):format(type(path)), 2) end
  local f = C.fsdp_st_open(path)
  if f == nil then fsdp._raise(2) end
  local ok, tensors, metadata = pcall(function()
    local out = {}
    for i = 0, C.fsdp_st_count(f) - 1 do
      local name = C.fsdp_st_name(f, i)
      if name == nil then fsdp._raise(1) end
      out[ffi.string(name)] = fsdp._wrap(C.fsdp_st_get(f, i))
    end
    return out, parse_metadata(ffi.string(C.fsdp_st_metadata(f)))
  end)
  C.fsdp_st_close(f)
  if not ok then error(tensors, 0) end
  return tensors, metadata
end

return M
