--- fsdp.argparse: command-line flags for training scripts, with Python argparse's names.
--
--   local argparse = require "fsdp.argparse"            -- also fsdp.argparse
--   local p = argparse.ArgumentParser { prog = "train.lua", description = "Trains a conv net." }
--   p:add_argument("--epochs", { type = "int", default = 8, metavar = "N", help = "epochs (default 8)" })
--   p:add_argument("--lr", { type = "float", default = 1e-3, help = "learning rate" })
--   p:add_argument("--device", { choices = { "cpu", "cuda" }, default = "cpu" })
--   p:add_argument("--summary", { action = "store_true", help = "print the FSDP plan" })
--   p:add_argument("data", { help = "a positional argument (required unless nargs = \"?\")" })
--   local args = p:parse_args(arg)                      -- args.epochs, args.batch_size ("--batch-size")
--   if args.lr <= 0 then p:error("--lr must be positive") end
--
-- As argparse: `--flag value` or `--flag=value`; a flag's name in the result is its long name with
-- dashes made underscores (`dest` overrides); `type` is "int", "float", "str" (the default) or a
-- function from the string to the value (nil, message when it is bad); `choices` a list of allowed
-- values; `action = "store_true"` a switch; `-h`/`--help` prints the help and exits 0. A bad
-- command line -- an unknown flag, a missing or malformed value, a missing positional -- is
-- `p:error(msg)`: "prog: msg (see --help)" on stderr and exit status 2, as argparse (with
-- `exit_on_error = false` in the parser's options it raises a Lua error instead, for tests and for
-- scripts that parse several command lines). One extension: `min = x` refuses values below x.
-- @module fsdp.argparse
local A = {}

local Parser = {}
Parser.__index = Parser

-- formatter_class = A.ArgumentDefaultsHelpFormatter (Python's name): each flag's help ends with
-- its default, " (default: 100)", for the flags that have one (a switch's is false)
A.ArgumentDefaultsHelpFormatter = setmetatable({}, { __tostring = function() return "ArgumentDefaultsHelpFormatter" end })

--- ArgumentParser{prog =, usage =, description =, epilog =, formatter_class =, exit_on_error = true}
function A.ArgumentParser(o)
  o = o or {}
  if type(o) ~= "table" then error("ArgumentParser: expected an options table {prog =, description =, ...}", 2) end
  local prog = o.prog or ((arg and arg[0] or "script"):match("([^/]*)$"))
  if o.formatter_class ~= nil and o.formatter_class ~= A.ArgumentDefaultsHelpFormatter then
    error("ArgumentParser: formatter_class must be argparse.ArgumentDefaultsHelpFormatter, got " .. tostring(o.formatter_class), 2)
  end
  return setmetatable({ prog = prog, usage = o.usage, description = o.description, epilog = o.epilog,
    show_defaults = o.formatter_class ~= nil, exit_on_error = o.exit_on_error ~= false, flags = {}, by_name = {},
    positionals = {} }, Parser)
end

local converters = {
  int = function(s)
    local n = tonumber(s)
    if not n or n ~= math.floor(n) then return nil, "an integer" end
    return n
  end,
  float = function(s)
    local n = tonumber(s)
    if not n then return nil, "a number" end
    return n
  end,
  str = function(s) return s end,
}

--- p:add_argument("--name", {type =, default =, choices =, action =, help =, metavar =, dest =,
-- required =, min =, nargs = "?" (positionals)}) or p:add_argument("name", {...}) for a positional
function Parser:add_argument(name, o)
  o = o or {}
  if type(name) ~= "string" or name == "" then error("add_argument: expected a name like \"--epochs\" or \"data\"", 2) end
  if type(o) ~= "table" then error(("add_argument(%q): the options are a table {type =, default =, help = ...}"):format(name), 2) end
  local known = { type = true, default = true, choices = true, action = true, help = true, metavar = true, dest = true,
    required = true, min = true, nargs = true }
  for k in pairs(o) do
    if not known[k] then error(("add_argument(%q): unknown option %s"):format(name, tostring(k)), 2) end
  end
  local t = o.type or "str"
  local convert = type(t) == "function" and t or converters[t]
  if not convert then error(("add_argument(%q): type must be \"int\", \"float\", \"str\" or a function, got %s"):format(name, tostring(t)), 2) end
  if o.action ~= nil and o.action ~= "store_true" and o.action ~= "store" then
    error(("add_argument(%q): action must be \"store\" or \"store_true\", got %s"):format(name, tostring(o.action)), 2)
  end
  local long = name:match("^%-%-(.+)$")
  local a = { name = name, convert = convert, default = o.default, choices = o.choices, help = o.help or "",
    switch = o.action == "store_true", required = o.required, min = o.min, nargs = o.nargs }
  if long then
    a.dest = o.dest or long:gsub("%-", "_")
    a.metavar = o.metavar or long:upper():gsub("%-", "_")
    if a.switch and a.default == nil then a.default = false end
    if self.by_name[name] then error(("add_argument: %s is added twice"):format(name), 2) end
    self.by_name[name] = a
    self.flags[#self.flags + 1] = a
  else
    if name:sub(1, 1) == "-" then error(("add_argument(%q): flags are spelled --name"):format(name), 2) end
    a.dest = o.dest or name:gsub("%-", "_")
    a.metavar = o.metavar or name
    self.positionals[#self.positionals + 1] = a
  end
  return a
end

--- the usage line and every argument with its help (continuation lines of a help text indented)
function Parser:format_help()
  local lines = {}
  local usage = self.usage or (self.prog .. (#self.flags > 0 and " [flags]" or "")
    .. (function()
      local s = ""
      for _, a in ipairs(self.positionals) do s = s .. (a.nargs == "?" and (" [" .. a.metavar .. "]") or (" " .. a.metavar)) end
      return s
    end)())
  lines[#lines + 1] = "usage: " .. usage
  if self.description then lines[#lines + 1] = "\n" .. self.description end
  lines[#lines + 1] = ""
  local entries = {}
  for _, a in ipairs(self.positionals) do entries[#entries + 1] = { "  " .. a.metavar, a.help } end
  for _, a in ipairs(self.flags) do
    local help = a.help
    if self.show_defaults and a.default ~= nil then
      help = help .. (help == "" and "" or " ") .. "(default: " .. tostring(a.default):gsub("\n", "\\n") .. ")"
    end
    entries[#entries + 1] = { "  " .. a.name .. (a.switch and "" or (" " .. a.metavar)), help }
  end
  entries[#entries + 1] = { "  -h, --help", "this text" }
  local width = 0
  for _, e in ipairs(entries) do width = math.max(width, #e[1]) end
  width = width + 2
  for _, e in ipairs(entries) do
    local first = true
    for hl in (e[2] .. "\n"):gmatch("(.-)\n") do
      lines[#lines + 1] = (first and (e[1] .. string.rep(" ", width - #e[1])) or string.rep(" ", width)) .. hl
      first = false
    end
  end
  if self.epilog then lines[#lines + 1] = "\n" .. self.epilog end
  return table.concat(lines, "\n") .. "\n"
end

--- Writes format_help() to file (default io.stdout).
-- @param file a file or nil
function Parser:print_help(file) (file or io.stdout):write(self:format_help()) end

--- a usage error: "prog: msg" and status 2, or a Lua error when exit_on_error = false
function Parser:error(msg)
  if not self.exit_on_error then error(("%s: %s"):format(self.prog, msg), 2) end
  io.stderr:write(("%s: %s\n(see --help)\n"):format(self.prog, msg))
  io.stderr:flush()
  os.exit(2)
end

local function show(v) return type(v) == "string" and ("'" .. v .. "'") or tostring(v) end

-- the value of a given as the string s (converted, within choices and min), or a usage error
function Parser:_value(a, s)
  local v, want = a.convert(s)
  if v == nil then self:error(("%s expects %s, got '%s'"):format(a.name, want or "another value", s)) end
  if a.choices then
    local ok = false
    for _, c in ipairs(a.choices) do if c == v then ok = true end end
    if not ok then
      local names = {}
      for i, c in ipairs(a.choices) do names[i] = tostring(c) end
      local list = #names > 1 and (table.concat(names, ", ", 1, #names - 1) .. " or " .. names[#names]) or names[1]
      self:error(("%s expects %s, got %s"):format(a.name, list, show(s)))
    end
  end
  if a.min and v < a.min then self:error(("%s must be at least %s, got %s"):format(a.name, tostring(a.min), s)) end
  return v
end

--- p:parse_args(list): the table of values by dest; list defaults to the script's `arg`
function Parser:parse_args(list)
  list = list or arg or {}
  local r = {}
  for _, a in ipairs(self.flags) do r[a.dest] = a.default end
  for _, a in ipairs(self.positionals) do r[a.dest] = a.default end
  local seen, npos = {}, 0
  local i = 1
  while i <= #list do
    local s = list[i]
    if s == "-h" or s == "--help" then
      self:print_help()
      if self.exit_on_error then os.exit(0) end
      error({ help = true }, 0)
    end
    local key, inline = s:match("^(%-%-[^=]+)=(.*)$")
    key = key or (s:match("^%-%-.") and s)
    if key then
      local a = self.by_name[key]
      if not a then self:error(("unknown flag %s"):format(key)) end
      if a.switch then
        if inline then self:error(("%s takes no value"):format(key)) end
        r[a.dest] = true
      else
        local v = inline
        if v == nil then
          v = list[i + 1]
          if v == nil then self:error(("%s needs a value"):format(key)) end
          i = i + 1
        end
        r[a.dest] = self:_value(a, v)
      end
      seen[a] = true
    else
      npos = npos + 1
      local a = self.positionals[npos]
      if not a then self:error(("unexpected argument '%s'"):format(s)) end
      r[a.dest] = self:_value(a, s)
      seen[a] = true
    end
    i = i + 1
  end
  for _, a in ipairs(self.positionals) do
    if not seen[a] and a.nargs ~= "?" then self:error(("the argument %s is required"):format(a.metavar)) end
  end
  for _, a in ipairs(self.flags) do
    if a.required and not seen[a] then self:error(("the flag %s is required"):format(a.name)) end
  end
  return r
end

return A
