-- tools/layers.lua BUILD_DIR [--dot]: checks that src/ keeps its layers (`make layers`).
--
-- The folders of src/ and what each may use (a folder may always use itself and src/fsdp.h):
--   core          errors, memory, RNG, dtypes, storage, tensors, autograd, the backend registry
--   backend/cpu   CPU kernels and device functions; registers itself with core
--   backend/cuda  the CUDA backend's loader (load.c, in libfsdp.so; the .cu files are libfsdp_cuda.so)
--   backend/testdev  the test double of a GPU (the CPU's kernels behind a closed arena), tests only
--   ops           the device-independent op layer; reaches kernels only through core's registry
--   parallel      communication and FSDP (comm, shard, sched); installs its hooks into core
--   io            safetensors
-- Two kinds of edges are read, neither from a hand-kept list: `#include "..."` lines in the
-- sources, and calls, from the symbols each object in BUILD_DIR needs (nm: U) against the object
-- that defines them. Prints the folder graph with the number of symbols on each edge, then every
-- forbidden edge with its file and symbol; exits 1 when there is one. --dot prints the graph for
-- graphviz instead. The Lua modules get one rule too (below): nn and tensors load nothing of FSDP.
-- Inside a folder, files that call each other in a circle (from the same symbols) must be one of
-- the units below, each with the reason it is one piece; any other circle is an error, and so is
-- a unit that is no longer one circle (the list then says something untrue).
local allowed = {
  ["core"] = { "core" },
  ["backend/cpu"] = { "backend/cpu", "core" },
  ["backend/cuda"] = { "backend/cuda", "core" },
  ["backend/testdev"] = { "backend/testdev", "core" },
  ["ops"] = { "ops", "core" },
  ["parallel"] = { "parallel", "ops", "core" },
  ["io"] = { "io", "core" },
}
local order = { "io", "parallel", "ops", "backend/cpu", "backend/cuda", "backend/testdev", "core" }
local units = {
  { "src/core/autograd.c", "src/core/tensor.c",
    why = "a tensor owns its autograd hooks (releasing it frees them) and autograd makes tensors" },
  { "src/ops/broadcast.c", "src/ops/deferred.c", "src/ops/elem.c", "src/ops/factory.c", "src/ops/inplace.c",
    "src/ops/shape.c",
    why = "ops are made of ops: broadcasting expands (shape) and its backward sums (elem); fills and "
      .. "draws on meta are recorded (deferred) and replayed through the same factories and in-place ops" },
}

local build, dot = arg[1], arg[2] == "--dot"
if not build then
  io.stderr:write("usage: luajit tools/layers.lua BUILD_DIR [--dot]\n")
  os.exit(2)
end

local function lines(cmd)
  local p = assert(io.popen(cmd))
  local out = {}
  for l in p:lines() do out[#out + 1] = l end
  p:close()
  return out
end

-- "src/ops/elem.c" -> "ops", "src/backend/cpu/nn.c" -> "backend/cpu", "src/fsdp.h" -> nil (the API)
local function folder_of(path)
  local rel = path:gsub("^src/", "")
  if rel:match("^backend/") then return rel:match("^(backend/[^/]+)/") end
  return rel:match("^([^/]+)/")
end

local function is_allowed(from, to)
  for _, f in ipairs(allowed[from] or {}) do
    if f == to then return true end
  end
  return false
end

local edges = {}       -- from -> to -> { n = count, ex = example }
local violations = {}  -- text lines
local function add_edge(from, to, what, where)
  edges[from] = edges[from] or {}
  local e = edges[from][to] or { n = 0, ex = what }
  e.n = e.n + 1
  edges[from][to] = e
  if not is_allowed(from, to) then
    violations[#violations + 1] = ("%s: %s -> %s: %s"):format(where, from, to, what)
  end
end

-- sources: every file of a layer folder must be known, and its includes allowed
local sources = lines("find src -mindepth 2 -name '*.[ch]' | sort")
for _, file in ipairs(sources) do
  local from = folder_of(file)
  if not allowed[from] then
    violations[#violations + 1] = ("%s: folder %s is not a known layer (tools/layers.lua)"):format(file, tostring(from))
  else
    local n = 0
    for line in io.lines(file) do
      n = n + 1
      local inc = line:match('^%s*#%s*include%s+"([^"]+)"')
      if inc and inc ~= "fsdp.h" then
        local to = folder_of("src/" .. inc)
        if to and to ~= from then add_edge(from, to, "#include \"" .. inc .. "\"", file .. ":" .. n) end
      end
    end
  end
end

-- the Lua side: nn (modules, layers, functional) and tensors sit below FSDP and communication;
-- nothing there may load fsdp.wrap, fsdp.checkpoint or fsdp.comm (wrap.lua extends nn.Module
-- through its forward-wrapper and state-dict-provider hooks instead)
local lua_low = lines("ls lua/fsdp/tensor.lua lua/fsdp/nn/*.lua")
for _, file in ipairs(lua_low) do
  local n = 0
  for line in io.lines(file) do
    n = n + 1
    local code = line:gsub("%-%-.*$", "")
    for _, high in ipairs { "fsdp.wrap", "fsdp.checkpoint", "fsdp.comm" } do
      if code:find('"' .. high .. '"', 1, true) or code:find("'" .. high .. "'", 1, true) then
        add_edge("lua/nn", "lua/" .. high, high, file .. ":" .. n)
      end
    end
  end
end

-- objects: who defines each global symbol, and who needs it
-- (the object of every source of libfsdp.so; comm_mpi.c and comm_nccl.c are libraries of their own, see the Makefile)
local defined_in, needs = {}, {}
local objects = 0
for _, src in ipairs(sources) do
  if src:match("%.c$") and src ~= "src/parallel/comm_mpi.c" and src ~= "src/parallel/comm_nccl.c" then
    local obj = build .. "/" .. src:gsub("^src/", ""):gsub("%.c$", ".o")
    local f = io.open(obj, "rb")
    if not f then
      io.stderr:write(("tools/layers.lua: %s is missing (run make first)\n"):format(obj))
      os.exit(2)
    end
    f:close()
    objects = objects + 1
    needs[src] = { obj = obj }
  end
end
for src, need in pairs(needs) do
  local obj = need.obj
  for _, l in ipairs(lines("nm " .. obj)) do
    local kind, sym = l:match("^%x*%s+(%a)%s+(%S+)$")
    if kind == "U" then
      need[#need + 1] = sym
    elseif kind and kind:match("[TDBRCV]") then
      defined_in[sym] = src
    end
  end
end
for src, syms in pairs(needs) do
  local from = folder_of(src)
  for _, sym in ipairs(syms) do
    local def = defined_in[sym]
    if def then
      local to = folder_of(def)
      if to ~= from then add_edge(from, to, sym .. "()", src) end
    end
  end
end

-- circles of calls between the files of one folder (Tarjan's strongly connected components)
local calls = {}  -- file -> set of files of its folder it calls
for src, syms in pairs(needs) do
  calls[src] = {}
  for _, sym in ipairs(syms) do
    local def = defined_in[sym]
    if def and def ~= src and folder_of(def) == folder_of(src) then calls[src][def] = true end
  end
end
local index, low, on_stack, stack, circles, next_index = {}, {}, {}, {}, {}, 0
local function connect(v)
  index[v], low[v] = next_index, next_index
  next_index = next_index + 1
  stack[#stack + 1], on_stack[v] = v, true
  for w in pairs(calls[v]) do
    if index[w] == nil then connect(w); low[v] = math.min(low[v], low[w])
    elseif on_stack[w] then low[v] = math.min(low[v], index[w]) end
  end
  if low[v] == index[v] then
    local c = {}
    repeat
      local w = table.remove(stack)
      on_stack[w] = nil
      c[#c + 1] = w
    until w == v
    if #c > 1 then table.sort(c); circles[#circles + 1] = table.concat(c, " ") end
  end
end
local files = {}
for src in pairs(calls) do files[#files + 1] = src end
table.sort(files)
for _, v in ipairs(files) do if index[v] == nil then connect(v) end end
local declared = {}
for _, u in ipairs(units) do
  local names = { unpack(u) }
  table.sort(names)
  declared[table.concat(names, " ")] = u
end
local found = {}
for _, c in ipairs(circles) do
  found[c] = true
  if not declared[c] then
    violations[#violations + 1] = ("files that call each other in a circle: %s (break it, or make it a unit in "
      .. "tools/layers.lua with the reason)"):format(c)
  end
end
for c in pairs(declared) do
  if not found[c] then
    violations[#violations + 1] = ("unit %s is no longer one circle of calls: update tools/layers.lua's units"):format(c)
  end
end

-- the graph, top layer first
if dot then
  print("digraph layers {")
  for _, from in ipairs(order) do
    for _, to in ipairs(order) do
      local e = edges[from] and edges[from][to]
      if e then
        print(('  "%s" -> "%s" [label="%d"%s];'):format(from, to, e.n, is_allowed(from, to) and "" or ", color=red"))
      end
    end
  end
  print("}")
else
  print("folder dependencies in src/ (symbols and includes per edge; e.g. one of them):")
  for _, from in ipairs(order) do
    for _, to in ipairs(order) do
      local e = edges[from] and edges[from][to]
      if e then
        print(("  %-12s -> %-12s %4d   %s%s"):format(from, to, e.n, e.ex, is_allowed(from, to) and "" or "   FORBIDDEN"))
      end
    end
  end
end
table.sort(violations)
for _, v in ipairs(violations) do io.stderr:write("forbidden: " .. v .. "\n") end
if #violations > 0 then
  io.stderr:write(("make layers: %d forbidden edge(s); see tools/layers.lua for the layers\n"):format(#violations))
  os.exit(1)
end
if not dot then
  for _, u in ipairs(units) do print(("one unit: %s -- %s"):format(table.concat(u, ", "), u.why)) end
  print("make layers: every edge runs down the layers; no other circle of calls inside a folder")
end
