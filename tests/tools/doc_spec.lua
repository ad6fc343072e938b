-- Every public Lua function has an LDoc doc comment (`make doc` builds the API reference from them).
--
-- The public functions are those tests/scripts/hostile.lua walks, found the same way: fsdp's own
-- and those it gives on first use (fsdp._lazy_names(); the collectives are comm.lua's), fsdp.F,
-- nn.init, nn.Module's methods, fsdp.Tensor.methods, each nn layer class's constructor (__init),
-- fsdp.optim's optimizers and fsdp.optim.lr_scheduler's schedulers (constructor and methods),
-- fsdp.data (functions, classes, a DataLoader's methods); and besides those the modules fsdp.comm,
-- fsdp.autograd, fsdp.trace, fsdp.checkpoint (read, consolidate), fsdp.progress (and a bar's
-- methods) and fsdp.argparse (and a parser's methods). Names starting with "_" are internal.
--
-- The rule: a function is documented when the comment block that ends on the line just above its
-- definition (debug.getinfo(f, "S").linedefined) begins with `---`, after any section rules
-- (`-- ---- name ----`) at its top. A function made in a loop or
-- by a factory (its definition line is shared with another public function) and a class without a
-- constructor of its own are documented instead by a `---` block in the file of their definition
-- (for an nn class: nn/layers.lua, where every layer class is made) with the line `-- @function NAME`,
-- NAME as LDoc shows it: `Tensor:eq`, `fsdp.maximum`, `ReLU`, `AdamW`.
local fsdp = require "fsdp"

local function lines_of(path)
  local t = {}
  for l in io.lines(path) do t[#t + 1] = l end
  return t
end
local file_cache = {}
local function file_lines(path)
  file_cache[path] = file_cache[path] or lines_of(path)
  return file_cache[path]
end

-- the public functions: { label, f, doc_name (the @function name for rule 2), own (false: an
-- inherited constructor), doc_file (where rule 2 looks, when not the definition's file) }
local function public()
  local list, seen = {}, {}
  local function add(label, f, doc_name, own, doc_file)
    assert(type(f) == "function", label .. " is not a function")
    -- one function under two names counts once (fsdp.rank is fsdp.comm.rank), but a constructor
    -- shared by classes (nn.Dropout's is nn.Dropout2d's) is each class's
    if seen[f] and label:find("[.:]") then return end
    seen[f] = true
    list[#list + 1] = { label = label, f = f, doc_name = doc_name, own = own ~= false, doc_file = doc_file }
  end
  local function each(t, fn)
    local keys = {}
    for k, v in pairs(t) do
      if type(k) == "string" and k:sub(1, 1) ~= "_" and type(v) == "function" then keys[#keys + 1] = k end
    end
    table.sort(keys)
    for _, k in ipairs(keys) do fn(k, t[k]) end
  end
  local function module_fns(prefix, t) each(t, function(k, f) add(prefix .. k, f, prefix .. k) end) end
  local function methods(class_name, t) each(t, function(k, f) add(class_name .. ":" .. k, f, class_name .. ":" .. k) end) end
  -- a class: its constructor (own or inherited: then rule 2; a base class may have none) and its
  -- own methods
  local function class(name, cls, ctor)
    if cls[ctor] then add(name, cls[ctor], name, rawget(cls, ctor) ~= nil) end
    local own = {}
    for k, v in pairs(cls) do own[k] = v end
    own[ctor] = nil
    methods(name, own)
  end

  local comm = require "fsdp.comm"
  local given = {}
  for k, v in pairs(fsdp) do given[k] = v end
  for _, k in ipairs(fsdp._lazy_names()) do given[k] = fsdp[k] end
  for k in pairs(comm) do if given[k] then given[k] = comm[k] end end
  module_fns("fsdp.", given)
  module_fns("fsdp.comm.", comm)
  module_fns("fsdp.autograd.", fsdp.autograd)
  module_fns("fsdp.trace.", fsdp.trace)
  local ckpt = require "fsdp.checkpoint"
  module_fns("fsdp.checkpoint.", { read = ckpt.read, consolidate = ckpt.consolidate })
  module_fns("F.", fsdp.F)
  module_fns("nn.init.", fsdp.nn.init)
  module_fns("nn.utils.", fsdp.nn.utils)
  methods("Module", fsdp.nn.Module)
  methods("Tensor", fsdp.Tensor.methods)
  for k, cls in pairs(fsdp.nn) do
    if type(cls) == "table" and k ~= "Module" and k ~= "functional" and k ~= "init"
       and getmetatable(cls) and rawget(cls, "__name") then
      add(k, cls.__init, k, rawget(cls, "__init") ~= nil, "./lua/fsdp/nn/layers.lua")
    end
  end
  for _, k in ipairs { "Optimizer", "SGD", "Adam", "AdamW" } do class(k, fsdp.optim[k], "__init") end
  for k, cls in pairs(fsdp.optim.lr_scheduler) do
    if k ~= "LRScheduler" then class(k, cls, "new") else methods(k, cls) end
  end
  local data = fsdp.data
  for k, v in pairs(data) do
    if type(v) == "table" then class(k, v, "__init") elseif k:sub(1, 1) ~= "_" then add("data." .. k, v, k) end
  end
  methods("DataLoader", getmetatable(data.DataLoader({ 1 })).__index)
  local progress = fsdp.progress
  module_fns("progress.", progress)
  methods("Bar", getmetatable(progress.new(1, { file = io.open("/dev/null", "w") })).__index)
  local argparse = fsdp.argparse
  module_fns("argparse.", argparse)
  methods("Parser", getmetatable(argparse.ArgumentParser({ prog = "doc" })).__index)
  return list
end

-- the comment block that ends just above line n: its first line after section rules, or nil
local function block_start(lines, n)
  local i = n - 1
  while i >= 1 and lines[i]:match("^%s*%-%-") do i = i - 1 end
  i = i + 1
  while i < n and lines[i]:match("^%s*%-%- %-%-%-%-") do i = i + 1 end
  if i == n then return nil end
  return lines[i]
end

-- whether the file has a `---` block with "@function NAME"
local function names_function(lines, name)
  local in_doc = false
  for _, l in ipairs(lines) do
    if l:match("^%s*%-%-%-") and not l:match("^%s*%-%-%-%-") then in_doc = true
    elseif not l:match("^%s*%-%-") then in_doc = false end
    if in_doc and l:match("^%s*%-%-%s*@function%s+(%S+)%s*$") == name then return true end
  end
  return false
end

describe("API reference", function()
  it("every public function has an LDoc doc comment", function()
    local list = public()
    local at = {}
    for _, e in ipairs(list) do
      local i = debug.getinfo(e.f, "S")
      e.file, e.line = i.source:sub(2), i.linedefined
      local key = e.file .. ":" .. e.line
      if e.own then at[key] = (at[key] or 0) + 1 end
    end
    local missing = {}
    for _, e in ipairs(list) do
      local ok
      if (at[e.file .. ":" .. e.line] or 0) > 1 or not e.own then
        local file = e.doc_file or e.file
        ok = names_function(file_lines(file), e.doc_name)
        if not ok then e.why = ("%s has no `--- ... -- @function %s` block"):format(file, e.doc_name) end
      else
        local first = block_start(file_lines(e.file), e.line)
        ok = first ~= nil and first:match("^%s*%-%-%-") ~= nil and not first:match("^%s*%-%-%-%-")
        if not ok then e.why = ("%s:%d has no `---` comment above it"):format(e.file, e.line) end
      end
      if not ok then missing[#missing + 1] = e.label .. ": " .. e.why end
    end
    table.sort(missing)
    assert(#list > 300, "found only " .. #list .. " public functions")
    assert(#missing == 0, #missing .. " public functions without a doc comment:\n" .. table.concat(missing, "\n"))
  end)
end)
