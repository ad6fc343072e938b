-- fsdp.args: PyTorch's way of passing arguments, for every layer constructor, functional op,
-- optimizer and scheduler that takes more than its tensors (one piece of code for the idea).
--
--   local o = args("Conv2d", { { "in_channels" }, { "out_channels" }, { "kernel_size" },
--                              { "stride", 1 }, { "padding", 0 }, { "bias", true } }, ...)
--
-- The arguments are PyTorch's positional ones, in PyTorch's order, then optionally a trailing
-- options table that gives any of them by name -- so nn.Conv2d(3, 64, 3), nn.Conv2d(3, 64,
-- {kernel_size = 3}) and nn.Conv2d({in_channels = 3, out_channels = 64, kernel_size = 3}) are one
-- call. The trailing table is the options when it is a plain table (no metatable: not a module
-- or tensor) without an array part ({2, 2} is a pair); an empty {} in the place of an argument
-- marked `list` is that argument (an empty list), anywhere else it is no options. An argument given both ways, an unknown name, too
-- many positional arguments or a missing required one is an error naming `where` and the
-- argument.
--
-- spec: a list of { "name", default, optional = true, kw = true, list = true, check = RULE }:
-- a nil default makes the argument required unless it is `optional`; `kw` ones are keyword-only
-- (PyTorch's arguments after `*`), after every positional one; a `list` one may not have holes;
-- a `check` one, when given (not nil), must be a number that keeps RULE (below: "int>0",
-- "[0,1]", ...). Returns name -> value.
--
-- The older form args({"stride", "padding"}, ...) (names only, all optional, unknown names kept)
-- is still read, for callers written before this module.
local is_tensor, list_of = require("fsdp").is_tensor, require("fsdp")._list

local function is_options(v)
  return type(v) == "table" and getmetatable(v) == nil and not is_tensor(v) and v[1] == nil
end

-- raises msg at the first caller outside lua/fsdp (the user's line), whatever the depth of
-- library frames in between (a layer's __init under Module.new, an F function, an optimizer)
local lib = debug.getinfo(1, "S").source:match("^(@.*)args%.lua$")
local function raise(msg)
  local level = 2
  while true do
    local info = debug.getinfo(level, "S")
    if info == nil or info.what == "C" then error(msg, 0) end
    if lib == nil or info.source:sub(1, #lib) ~= lib then error(msg, level) end
    level = level + 1
  end
end

-- the number rules of `check`: name -> { test, what the number must be }
local function int(v) return v == math.floor(v) and v > -2 ^ 53 and v < 2 ^ 53 end
local function finite(v) return v == v and v > -math.huge and v < math.huge end
local RULES = {
  ["int>0"] = { function(v) return int(v) and v > 0 end, "a positive integer" },
  ["int>=0"] = { function(v) return int(v) and v >= 0 end, "an integer >= 0" },
  ["int>=-1"] = { function(v) return int(v) and v >= -1 end, "an integer >= -1" },
  ["int"] = { int, "an integer" },
  ["num"] = { finite, "a finite number" },
  ["num>0"] = { function(v) return finite(v) and v > 0 end, "a finite number > 0" },
  ["num>=0"] = { function(v) return finite(v) and v >= 0 end, "a finite number >= 0" },
  ["[0,1]"] = { function(v) return v >= 0 and v <= 1 end, "a number in [0, 1]" },
  ["(0,1]"] = { function(v) return v > 0 and v <= 1 end, "a number in (0, 1]" },
  ["[0,1)"] = { function(v) return v >= 0 and v < 1 end, "a number in [0, 1)" },
}
local function check_number(prefix, name, v, rule)
  local r = assert(RULES[rule], rule)
  if type(v) ~= "number" or not r[1](v) then
    raise(("%s%s must be %s, got %s"):format(prefix, name, r[2], type(v) == "number" and tostring(v) or type(v)))
  end
end

local NONE = {}  -- no options table given (never written)

local function parse(where, spec, open, ...)
  local n = select("#", ...)
  local vals = { ... }
  local positional = 0
  for _, s in ipairs(spec) do
    if not s.kw then positional = positional + 1 end
  end
  local kw = NONE
  local last = vals[n]
  if n > 0 and is_options(last) then
    local slot = spec[n]
    if next(last) ~= nil or not (slot and not slot.kw and slot.list) then
      kw = last
      n = n - 1
    end
  end
  local prefix = where and (where .. ": ") or ""
  if n > positional then
    raise(("%s%d arguments given, it takes at most %d"):format(prefix, n, positional))
  end
  local r = {}
  if kw ~= NONE then  -- (pairs only when there are options: the hot path stays compiled)
    local known = {}
    for _, s in ipairs(spec) do known[s[1]] = true end
    for k, v in pairs(kw) do
      if not known[k] then
        if not open then raise(("%sunknown option %s"):format(prefix, tostring(k))) end
        r[k] = v
      end
    end
  end
  for i, s in ipairs(spec) do
    local name = s[1]
    local v = kw[name]
    if i <= n and vals[i] ~= nil then
      if v ~= nil then raise(("%s%s given twice (by position and by name)"):format(prefix, name)) end
      v = vals[i]
    end
    if v == nil then v = s[2] end
    if v == nil and not s.optional and not open then raise(("%s%s is required"):format(prefix, name)) end
    if s.list and type(v) == "table" then
      local ok, err = pcall(list_of, v, where, name, 0)
      if not ok then raise(err) end
    end
    if s.check and v ~= nil then
      if s.list and type(v) == "table" then
        for j = 1, #v do check_number(prefix, ("%s[%d]"):format(name, j), v[j], s.check) end
      else
        check_number(prefix, name, v, s.check)
      end
    end
    r[name] = v
  end
  return r
end

return function(where, spec, ...)
  if type(where) == "table" then  -- the older form: a list of names
    local s = {}
    for i, name in ipairs(where) do s[i] = { name, optional = true } end
    return parse(nil, s, true, spec, ...)
  end
  return parse(where, spec, false, ...)
end
