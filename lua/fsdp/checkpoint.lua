--- Sharded checkpoints: every rank saves only what it owns, and a checkpoint loads at any world size.
--
--   fsdp.save_sharded("ckpt", model, opt, {epoch = 3, step = 1200})   -- collective: every rank calls it
--   local extra = fsdp.load_sharded("ckpt", model, opt)               -- extra.epoch == 3
--   $ bin/fsdp-consolidate ckpt full.safetensors [--with-optimizer]   -- one PyTorch-style file
--
-- Layout on disk (a checkpoint is replaced as a whole; a crash, even kill -9, at any point leaves
-- the previous one loadable):
--   DIR/ckpt-<gen>/rank-<r>-of-<N>.safetensors   one file per rank (fsdp.save: temp file + rename)
--   DIR/latest                                   "ckpt-<gen>\nworld_size <N>\n", replaced atomically by
--                                                rank 0 after every rank file is written
-- Older generations are removed after `latest` names the new one.
--
-- A rank file holds
--   "model.<name>"        this rank's piece of each parameter (the parameter tensor itself between
--                         steps: its flat elements [start, start + length)) and of each persistent
--                         buffer (buffers and parameters outside units are replicated: the whole tensor)
--   "optim.<name>.<key>"  the optimizer state tensors of that parameter (piece-shaped)
--   metadata (string -> string): format, world_size, rank, gen, fingerprint (sorted "name shape"
--   lines), layout (JSON: name -> {shape, numel, chunk, start, length, kind}), optim (JSON: class,
--   param groups with hyperparameters and parameter names, scalar state per parameter, state
--   tensor keys), rng (this rank's generator state), extra (JSON of the user's table).
-- Loading: each rank assembles the flat range it owns under the current layout from the
-- overlapping pieces of the old rank files (interval arithmetic over all of them), checks
-- everything first, then copies into the parameters and optimizer state in place. RNG: rank r
-- takes old rank r's state (old rank 0's when the old world had fewer ranks).
-- @module fsdp.checkpoint
local ffi = require "ffi"
local fsdp = require "fsdp"
local C = fsdp.C

local M = {}
local FORMAT = "fsdp-sharded-v1"

-- metadata values are strings; structured ones are JSON text (lua/fsdp/json.lua)
local json = require "fsdp.json"
local json_encode, json_decode = json.encode, json.decode

-- ---- files and directories (libc through the FFI; no shelling out from MPI ranks) ----------------
for _, decl in ipairs {
  "int mkdir(const char* path, unsigned int mode);",
  "int rmdir(const char* path);",
  "int fsync(int fd);",
  "int open(const char* path, int flags, ...);",
  "int close(int fd);",
  "long write(int fd, const void* buf, unsigned long n);",
  "int getpid(void);",
  "int kill(int pid, int sig);",
  "char* strerror(int errnum);",
  "typedef struct fsdp_ckpt_DIR fsdp_ckpt_DIR;",
  "fsdp_ckpt_DIR* opendir(const char* path);",
  "int closedir(fsdp_ckpt_DIR* d);",
  "struct fsdp_ckpt_dirent { uint64_t d_ino; int64_t d_off; unsigned short d_reclen; unsigned char d_type; char d_name[256]; };",
  "struct fsdp_ckpt_dirent* readdir(fsdp_ckpt_DIR* d);",
} do pcall(ffi.cdef, decl) end
local libc = ffi.C
local linux = ffi.os == "Linux"
local O_RDONLY, O_WRONLY_CREAT_TRUNC = 0, 1 + 64 + 512  -- Linux values

local function errno_str() return ffi.string(libc.strerror(ffi.errno())) end

-- nil when `path` is a regular file, else what it is (a FIFO would block io.open forever)
local not_regular = fsdp._not_regular_file

local function mkdir_p(path, what)
  local cur = path:sub(1, 1) == "/" and "/" or ""
  for part in path:gmatch("[^/]+") do
    cur = cur .. part
    if libc.mkdir(cur, tonumber("755", 8)) ~= 0 and ffi.errno() ~= 17 then  -- EEXIST
      error(("%s: cannot create the directory '%s': %s"):format(what, cur, errno_str()), 0)
    end
    cur = cur .. "/"
  end
end

-- names in a directory (nil when it cannot be listed)
local function listdir(path)
  local ok, res = pcall(function()
    local d = libc.opendir(path)
    if d == nil then return nil end
    local names = {}
    while true do
      local e = libc.readdir(d)
      if e == nil then break end
      local name = ffi.string(e.d_name)
      if name ~= "." and name ~= ".." then names[#names + 1] = name end
    end
    libc.closedir(d)
    return names
  end)
  return ok and res or nil
end

-- removes a checkpoint generation directory (its files, then itself); best effort
local function remove_generation(path, known_files)
  for _, name in ipairs(listdir(path) or known_files or {}) do os.remove(path .. "/" .. name) end
  libc.rmdir(path)
end

-- writes a small file durably and atomically: temp file, fsync, rename, fsync of the directory
local function write_atomic(path, text, what)
  local tmp = ("%s.tmp.%d"):format(path, linux and libc.getpid() or 0)
  if linux then
    local fd = libc.open(tmp, O_WRONLY_CREAT_TRUNC, ffi.cast("int", tonumber("644", 8)))
    if fd < 0 then error(("%s: cannot create '%s': %s"):format(what, tmp, errno_str()), 0) end
    local n = libc.write(fd, text, #text)
    local synced = libc.fsync(fd)
    libc.close(fd)
    if n ~= #text or synced ~= 0 then
      os.remove(tmp)
      error(("%s: cannot write '%s': %s"):format(what, tmp, errno_str()), 0)
    end
  else
    local f, err = io.open(tmp, "wb")
    if not f then error(("%s: cannot create '%s': %s"):format(what, tmp, err), 0) end
    f:write(text)
    f:close()
  end
  local ok, err = os.rename(tmp, path)
  if not ok then
    os.remove(tmp)
    error(("%s: cannot rename '%s' to '%s': %s"):format(what, tmp, path, tostring(err)), 0)
  end
  if linux then
    local dfd = libc.open(path:match("^(.*)/[^/]*$") or ".", O_RDONLY)
    if dfd >= 0 then libc.fsync(dfd); libc.close(dfd) end
  end
end

-- reads DIR/latest -> gen, world_size; nil, message when there is none
local function read_latest(dir)
  local path = dir .. "/latest"
  local kind = not_regular(path)
  if kind then return nil, ("'%s' is not a regular file (%s)"):format(path, kind) end
  local f, err = io.open(path, "rb")
  if not f then return nil, ("cannot read '%s' (%s)"):format(path, err) end
  local text = f:read("*a") or ""
  f:close()
  local gen = tonumber(text:match("^ckpt%-(%d+)\n"))
  local world = tonumber(text:match("\nworld_size (%d+)\n"))
  if not gen or not world or world < 1 or gen >= 2 ^ 53 or world >= 2 ^ 31 then
    return nil, ("'%s' is malformed: expected \"ckpt-<gen>\\nworld_size <N>\\n\", got %q"):format(path, text:sub(1, 100))
  end
  return gen, world
end

local function gen_dir(dir, gen) return ("%s/ckpt-%d"):format(dir, gen) end
local function rank_file(dir, gen, r, n) return ("%s/rank-%d-of-%d.safetensors"):format(gen_dir(dir, gen), r, n) end

-- ---- what a model holds: its tensors and their layout --------------------------------------------
local shape_str = fsdp._shape_str
local ptr_key = fsdp._addr  -- a raw C pointer as a number

-- list of {name, t, kind, shape, numel, chunk, start, length} for every parameter (named_parameters
-- order) and persistent buffer of `model`, under the current layout
local function model_entries(model, what)
  if type(model) ~= "table" or not rawget(model, "_modules") then
    error(("%s: expected an nn.Module, got a %s"):format(what, type(model)), 0)
  end
  fsdp._check(C.fsdp_units_settle())  -- units a forward left waiting for a backward: to their pieces
  local entries, by_name = {}, {}
  local unit_maps = {}
  local numel, chunk, start, length = ffi.new("int64_t[1]"), ffi.new("int64_t[1]"), ffi.new("int64_t[1]"), ffi.new("int64_t[1]")
  local shp = ffi.new("int64_t[?]", 8)
  for name, p in model:named_parameters() do
    local e = { name = name, t = p, kind = "param" }
    local u = C.fsdp_param_unit(p.p)
    if u == nil then
      e.shape, e.numel = p:shape(), p:numel()
      e.chunk, e.start, e.length = e.numel, 0, e.numel
    else
      local uk = ptr_key(u)
      local map = unit_maps[uk]
      if not map then
        map = {}
        for i = 0, C.fsdp_unit_num_params(u) - 1 do map[ptr_key(C.fsdp_unit_param(u, i))] = i end
        unit_maps[uk] = map
      end
      local i = map[fsdp._key(p)]
      if not i then
        error(("%s: parameter %q claims FSDP unit '%s' but is not among its parameters")
          :format(what, name, ffi.string(C.fsdp_unit_path(u))), 0)
      end
      fsdp._check(C.fsdp_unit_param_layout(u, i, numel, chunk, start, length))
      local nd = C.fsdp_param_full_shape(p.p, shp)
      e.shape = {}
      for d = 0, nd - 1 do e.shape[d + 1] = tonumber(shp[d]) end
      e.numel, e.chunk, e.start, e.length = tonumber(numel[0]), tonumber(chunk[0]), tonumber(start[0]), tonumber(length[0])
      e.unit = ffi.string(C.fsdp_unit_path(u))
    end
    local held = tonumber(C.fsdp_tensor_numel(p.p))
    if held ~= e.length then
      error(("%s: parameter %q of FSDP unit '%s' is gathered (%d elements, its local piece has %d); call it between "
        .. "steps, outside forward/backward and summon_full_params"):format(what, name, e.unit or "?", held, e.length), 0)
    end
    entries[#entries + 1] = e
    by_name[name] = e
  end
  for prefix, m in model:named_modules() do
    local np = rawget(m, "_non_persistent")
    local bufs = rawget(m, "_buffers")
    for _, bname in ipairs(bufs and bufs.names or {}) do
      local t = bufs.values[bname]
      local name = prefix == "" and bname or (prefix .. "." .. bname)
      if t ~= nil and not (np and np[bname]) and not by_name[name] then
        local e = { name = name, t = t, kind = "buffer", shape = t:shape(), numel = t:numel() }
        e.chunk, e.start, e.length = e.numel, 0, e.numel
        entries[#entries + 1] = e
        by_name[name] = e
      end
    end
  end
  return entries, by_name
end

local function fingerprint(list)  -- list of {name=, shape=}
  local lines = {}
  for i, e in ipairs(list) do lines[i] = e.name .. " " .. shape_str(e.shape) end
  table.sort(lines)
  return table.concat(lines, "\n")
end

local function flat_contig(t)  -- (a sharded parameter: its piece)
  t = t:to_local():detach()
  if not t:is_contiguous() then t = t:contiguous() end
  return t
end

-- ---- save ----------------------------------------------------------------------------------------
-- test hooks for the worst moment of a crash, "before_latest" (every rank file written, `latest`
-- not yet updated): M._crash_at = "before_latest" raises an error there; with M._crash_kill = true,
-- or the environment variable FSDP_CKPT_CRASH_AT=before_latest, the process kills itself (SIGKILL)
local function crash_point(name)
  local env = os.getenv("FSDP_CKPT_CRASH_AT")
  if M._crash_at ~= name and env ~= name then return end
  if M._crash_kill or env == name then
    io.stdout:flush(); io.stderr:flush()
    libc.kill(libc.getpid(), 9)
  end
  error("fsdp.save_sharded: simulated crash at " .. name, 0)
end

local function check_extra(extra, what)
  if extra == nil then return {} end
  if type(extra) ~= "table" or fsdp.is_tensor(extra) then
    error(("%s: extra must be a table of strings / numbers, got a %s"):format(what, type(extra)), 0)
  end
  return extra
end

--- fsdp.save_sharded(dir, model[, optimizer[, extra]]): collective; every rank writes its own file
function M.save_sharded(dir, model, optimizer, extra)
  local what = "fsdp.save_sharded"
  fsdp._path(dir, what, "dir")
  dir = dir:gsub("/+$", "")
  if dir == "" then dir = "/" end
  extra = check_extra(extra, what)
  local rank, world = fsdp.rank(), fsdp.world_size()
  local entries, by_name = model_entries(model, what)

  local tensors, layout = {}, {}
  for _, e in ipairs(entries) do
    tensors["model." .. e.name] = flat_contig(e.t)
    layout[e.name] = { shape = e.shape, numel = e.numel, chunk = e.chunk, start = e.start, length = e.length, kind = e.kind }
  end
  local meta = {
    format = FORMAT, world_size = tostring(world), rank = tostring(rank),
    fingerprint = fingerprint(entries), layout = json_encode(layout, what),
    extra = json_encode(extra, what, "extra"),
  }
  -- the other names of tied parameters (alias -> the name it is saved under), as PyTorch's
  -- state_dict lists every name: fsdp-consolidate writes them all
  local canonical, aliases = {}, {}
  for _, e in ipairs(entries) do if e.kind == "param" then canonical[fsdp._key(e.t)] = e.name end end
  for prefix, m in model:named_modules() do
    for _, pname in ipairs(m._parameters.names) do
      local t = m._parameters.values[pname]
      local name = prefix == "" and pname or (prefix .. "." .. pname)
      local c = t ~= nil and canonical[fsdp._key(t)]
      if c and c ~= name then aliases[name] = c end
    end
  end
  if next(aliases) then meta.aliases = json_encode(aliases, what .. ": aliases") end
  local rng = fsdp.get_rng_state()
  local parts = {}
  for i = 1, 4 do parts[i] = tostring(rng[i]):gsub("U?LL$", "") end
  meta.rng = table.concat(parts, ",")

  if optimizer ~= nil then
    if type(optimizer) ~= "table" or type(optimizer.param_groups) ~= "table" then
      error(what .. ": optimizer must be an fsdp.optim optimizer", 2)
    end
    local name_of = {}
    for _, e in ipairs(entries) do if e.kind == "param" then name_of[fsdp._key(e.t)] = e.name end end
    local groups, state = {}, {}
    for gi, g in ipairs(optimizer.param_groups) do
      local pg = { params = {} }
      for k, v in pairs(g) do if k ~= "params" then pg[k] = v end end
      for i, p in ipairs(g.params) do
        local name = name_of[fsdp._key(p)]
        if not name then
          error(("%s: parameter %d of the optimizer's group %d is not a parameter of the model"):format(what, i, gi), 2)
        end
        pg.params[i] = name
        local st = optimizer:state_of(p)
        if st and next(st) ~= nil then
          local s = { scalars = {}, tensors = {} }
          for k, v in pairs(st) do
            if fsdp.is_tensor(v) then
              if v:numel() ~= by_name[name].length then
                error(("%s: optimizer state %q of %q has %d elements, the parameter's piece %d")
                  :format(what, k, name, v:numel(), by_name[name].length), 2)
              end
              tensors["optim." .. name .. "." .. k] = flat_contig(v)
              s.tensors[#s.tensors + 1] = k
            else
              s.scalars[k] = v
            end
          end
          table.sort(s.tensors)
          state[name] = s
        end
      end
      groups[gi] = pg
    end
    meta.optim = json_encode({ class = optimizer.__name, groups = groups, state = state }, what, "optimizer")
  end

  -- agree on the generation (rank 0 reads `latest` and clears leftovers of a crashed attempt)
  local gen
  if rank == 0 then
    local prev = read_latest(dir)
    gen = (prev or 0) + 1
    mkdir_p(dir, what)
    remove_generation(gen_dir(dir, gen))
    mkdir_p(gen_dir(dir, gen), what)
  end
  if world > 1 then
    local t = fsdp.tensor({ gen or 0 }, "int64")
    fsdp.broadcast(t, 0, { tag = "save_sharded:gen" })
    gen = t:item()
  end
  meta.gen = tostring(gen)

  -- every rank writes its file; then every rank learns whether all of them succeeded
  local function agree(ok, err, doing)
    if world > 1 then
      local t = fsdp.tensor({ ok and 0 or 1 })
      fsdp.all_reduce(t, "max", { tag = "save_sharded:" .. doing })
      if t:item() ~= 0 and ok then
        error(("%s: another rank failed while %s in '%s' (see its error)"):format(what, doing, dir), 0)
      end
    end
    if not ok then error(err, 0) end
  end
  local path = rank_file(dir, gen, rank, world)
  local ok, err = pcall(fsdp.save, path, tensors, meta)
  agree(ok, ok or (what .. ": " .. tostring(err)), "writing rank files")

  crash_point("before_latest")

  ok, err = true, nil
  if rank == 0 then
    ok, err = pcall(function()
      write_atomic(dir .. "/latest", ("ckpt-%d\nworld_size %d\n"):format(gen, world), what)
      for _, name in ipairs(listdir(dir) or { ("ckpt-%d"):format(gen - 1) }) do
        local g = tonumber(name:match("^ckpt%-(%d+)$"))
        if g and g ~= gen then remove_generation(dir .. "/" .. name) end
        if name:match("^latest%.tmp%.") then os.remove(dir .. "/" .. name) end
      end
    end)
  end
  agree(ok, err, "updating latest")
  return gen
end

-- ---- reading a checkpoint (any world size, no communication) ---------------------------------------
-- Nothing in the files is trusted: M.read checks every metadata value and layout entry, each
-- tensor's element count and dtype, and that the pieces of each tensor cover it exactly, before
-- any value is read. Each problem is an error naming `what`, the file and the entry.
local function is_count(v) return type(v) == "number" and v >= 0 and v == math.floor(v) and v < 2 ^ 53 end
local function is_list(v, of)  -- a JSON array, of values of type `of`
  if type(v) ~= "table" then return false end
  local n = 0
  for _, x in pairs(v) do
    if type(x) ~= of then return false end
    n = n + 1
  end
  return n == #v
end

-- one entry of a rank file's layout: a shape of `numel` elements, and the file's piece of them,
-- elements [start, start + length)
local function check_entry(bad, name, l)
  if type(l) ~= "table" or not is_list(l.shape, "number") then bad(("has no valid shape for %q in its layout"):format(name)) end
  local n = 1
  for _, d in ipairs(l.shape) do
    if not is_count(d) then bad(("gives %q the shape %s in its layout"):format(name, shape_str(l.shape))) end
    n = n * d
  end
  if l.numel ~= n then
    bad(("gives %q %s elements in its layout, its shape %s has %d"):format(name, tostring(l.numel), shape_str(l.shape), n))
  end
  if not (is_count(l.start) and is_count(l.length) and l.start + l.length <= n) then
    local function show(v) return type(v) == "string" and ("%q"):format(v) or tostring(v) end
    bad(("gives %q the piece start %s, length %s in its layout: not within its %d elements")
      :format(name, show(l.start), show(l.length), n))
  end
end

-- "a,b,c,d" (the generator's four uint64 words in decimal) -> {4 uint64 cdata}
local function parse_rng(text, bad)
  local words = { text:match("^(%d+),(%d+),(%d+),(%d+)$") }
  if #words ~= 4 then bad(("has a malformed rng state %q"):format(text:sub(1, 100))) end
  local st = {}
  for i, num in ipairs(words) do
    num = num:gsub("^0+(%d)", "%1")
    if #num > 20 or (#num == 20 and num > "18446744073709551615") then bad(("has an rng word %s beyond 64 bits"):format(num)) end
    local v = 0ULL
    for k = 1, #num do v = v * 10ULL + (num:byte(k) - 48) end
    st[i] = v
  end
  return st
end

-- rank file r: {path, tensors (file-backed), meta, layout, optim, extra, aliases, rng, bad}
local function read_file(ck, r, what)
  local path = rank_file(ck.dir, ck.gen, r, ck.world_size)
  local ok, tensors, meta = pcall(fsdp.load, path)
  if not ok then error(("%s: cannot read checkpoint file '%s': %s"):format(what, path, tostring(tensors)), 0) end
  local function bad(msg) error(("%s: checkpoint file '%s' %s"):format(what, path, msg), 0) end
  local function decoded(key)  -- a JSON metadata value (nil when absent)
    if meta[key] == nil then return nil end
    local ok2, v = pcall(json_decode, meta[key], key)
    if not ok2 then bad("has bad metadata: " .. v) end
    return v
  end
  if meta.format ~= FORMAT then bad(("is not an fsdp sharded checkpoint file (format %q)"):format(tostring(meta.format))) end
  if tonumber(meta.world_size) ~= ck.world_size or tonumber(meta.rank) ~= r or tonumber(meta.gen) ~= ck.gen then
    bad(("says world_size %s, rank %s, gen %s; expected %d, %d, %d (from '%s/latest')")
      :format(tostring(meta.world_size), tostring(meta.rank), tostring(meta.gen), ck.world_size, r, ck.gen, ck.dir))
  end
  local f = { path = path, tensors = tensors, meta = meta, layout = decoded("layout"), optim = decoded("optim"),
              extra = decoded("extra"), aliases = decoded("aliases"), bad = bad }
  if type(f.layout) ~= "table" then bad("has no layout (a JSON object) in its metadata") end
  for name, l in pairs(f.layout) do check_entry(bad, name, l) end
  if meta.rng then f.rng = parse_rng(meta.rng, bad) end
  return f
end

-- rank file f describes the same tensors, of the same shapes, as rank 0's file f0
local function check_same_layout(f, f0)
  for name, l in pairs(f.layout) do
    local l0 = f0.layout[name]
    if not l0 then f.bad(("has %q in its layout, '%s' has not"):format(name, f0.path)) end
    if shape_str(l.shape) ~= shape_str(l0.shape) then
      f.bad(("gives %q the shape %s, '%s' %s"):format(name, shape_str(l.shape), f0.path, shape_str(l0.shape)))
    end
  end
  for name in pairs(f0.layout) do
    if not f.layout[name] then f.bad(("lacks %q in its layout, which '%s' has"):format(name, f0.path)) end
  end
end

-- rank 0's values for the whole checkpoint: extra (a table), aliases (name -> saved name), optim
-- ({class, groups = {{params = {names}, ...}}, state = {name = {scalars, tensors = {keys}}}})
local function check_shared(f0)
  local bad, layout = f0.bad, f0.layout
  if f0.extra ~= nil and type(f0.extra) ~= "table" then bad("has extra metadata that is not a JSON object") end
  if f0.aliases ~= nil and type(f0.aliases) ~= "table" then bad("has aliases that are not a JSON object") end
  for a, c in pairs(f0.aliases or {}) do
    if type(c) ~= "string" or not layout[c] then bad(("has the alias %q of %s, which is not in its layout"):format(a, tostring(c))) end
  end
  local o = f0.optim
  if o == nil then return end
  if type(o) ~= "table" or type(o.class) ~= "string" or not is_list(o.groups, "table") or type(o.state) ~= "table" then
    bad("has optimizer metadata that is not {class, groups, state}")
  end
  for gi, g in ipairs(o.groups) do
    if not is_list(g.params, "string") then bad(("has no list of parameter names in optimizer group %d"):format(gi)) end
    for _, name in ipairs(g.params) do
      if not layout[name] then bad(("names %q in optimizer group %d, which is not in its layout"):format(name, gi)) end
    end
  end
  for name, st in pairs(o.state) do
    if not layout[name] then bad(("has optimizer state for %q, which is not in its layout"):format(name)) end
    if type(st) ~= "table" or type(st.scalars or {}) ~= "table" or not is_list(st.tensors or {}, "string") then
      bad(("has malformed optimizer state for %q"):format(name))
    end
  end
end

-- every tensor in every file is a piece the metadata describes, with the piece's element count, and
-- the pieces of one tensor share a dtype; -> {key = dtype}
local function check_tensors(ck)
  local keys = {}  -- tensor key -> layout name
  for name in pairs(ck.layout) do keys["model." .. name] = name end
  for name, st in pairs(ck.optim and ck.optim.state or {}) do
    for _, k in ipairs(st.tensors or {}) do keys["optim." .. name .. "." .. k] = name end
  end
  local dtypes, first = {}, {}
  for r = 0, ck.world_size - 1 do
    local f = ck.files[r]
    for key, t in pairs(f.tensors) do
      if not keys[key] or not fsdp.is_tensor(t) then
        f.bad(("holds %q, which its metadata does not describe"):format(tostring(key)))
      end
    end
    for key, name in pairs(keys) do
      local t, length = f.tensors[key], f.layout[name].length
      if t == nil and (length > 0 or key:sub(1, 6) == "model.") then f.bad(("lacks the tensor %q"):format(key)) end
      if t ~= nil and t:numel() ~= length then
        f.bad(("holds %d elements of %q, its layout says %d"):format(t:numel(), key, length))
      end
      if t ~= nil and dtypes[key] == nil then dtypes[key], first[key] = t.dtype, f.path end
      if t ~= nil and t.dtype ~= dtypes[key] then
        f.bad(("holds %q as %s, '%s' as %s"):format(key, t.dtype, first[key], dtypes[key]))
      end
    end
  end
  return dtypes
end

-- the pieces of `name` in the rank files that hold any of it, by start: {r, start, length, f}
local function pieces_of(ck, name)
  local pieces = {}
  for r = 0, ck.world_size - 1 do
    local l = ck.files[r].layout[name]
    if l.length > 0 then pieces[#pieces + 1] = { r = r, start = l.start, length = l.length, f = ck.files[r] } end
  end
  table.sort(pieces, function(a, b) if a.start ~= b.start then return a.start < b.start end return a.r < b.r end)
  return pieces
end

-- the pieces of `name` cover its elements exactly: each element lies in one piece, or in replicas
-- of one piece (the same start and length in several files: hybrid sharding, NO_SHARD, buffers)
local function check_cover(ck, name, what)
  local pos, last = 0, nil
  for _, pc in ipairs(pieces_of(ck, name)) do
    if not (last and pc.start == last.start and pc.length == last.length) then
      if pc.start ~= pos then
        if pc.start > pos then
          error(("%s: no rank file of '%s' holds elements [%d, %d) of %q"):format(what, ck.path, pos, pc.start, name), 0)
        end
        error(("%s: the pieces of %q in '%s' (elements [%d, %d)) and '%s' (elements [%d, %d)) overlap")
          :format(what, name, last.f.path, last.start, pos, pc.f.path, pc.start, pc.start + pc.length), 0)
      end
      pos, last = pc.start + pc.length, pc
    end
  end
  local numel = ck.layout[name].numel
  if pos ~= numel then
    error(("%s: no rank file of '%s' holds elements [%d, %d) of %q"):format(what, ck.path, pos, numel, name), 0)
  end
end

--- -> {dir, gen, world_size, path, files = {[0..N-1] = {path, tensors, meta, layout, rng}}, layout, entries,
--     dtypes (tensor key -> dtype), optim, extra, aliases}, every part checked
function M.read(dir, what)
  what = what or "fsdp.read_sharded"
  fsdp._path(dir, what, "dir")
  dir = dir:gsub("/+$", "")
  local gen, world = read_latest(dir)
  if not gen then error(("%s: no checkpoint in '%s': %s"):format(what, dir, world), 0) end
  local ck = { dir = dir, gen = gen, world_size = world, path = gen_dir(dir, gen), files = {} }
  for r = 0, world - 1 do ck.files[r] = read_file(ck, r, what) end
  local f0 = ck.files[0]
  check_shared(f0)
  ck.layout, ck.optim, ck.extra, ck.aliases = f0.layout, f0.optim, f0.extra or {}, f0.aliases or {}
  for r = 1, world - 1 do
    local f = ck.files[r]
    if f.meta.fingerprint ~= f0.meta.fingerprint then f.bad(("describes another model than '%s'"):format(f0.path)) end
    check_same_layout(f, f0)
  end
  ck.dtypes = check_tensors(ck)
  ck.entries = {}
  for name, l in pairs(ck.layout) do
    check_cover(ck, name, what)
    ck.entries[#ck.entries + 1] = { name = name, shape = l.shape, numel = l.numel, kind = l.kind }
  end
  table.sort(ck.entries, function(a, b) return a.name < b.name end)
  return ck
end

-- where the flat elements [start, start + length) of `key` (a tensor stored piecewise under the
-- layout of `name`) are in the rank files (checked by M.read to cover it exactly): a list of
-- {t = 1-D view of a file's tensor, at = 1-based position in the range} (fsdp.load's tensors are
-- file-backed: a copy from a view reads that view's elements only)
local function parts_of(ck, key, name, start, length)
  local parts, pos, stop = {}, start, start + length
  for _, pc in ipairs(pieces_of(ck, name)) do
    local a, b = math.max(pos, pc.start), math.min(stop, pc.start + pc.length)
    if a == pos and b > a then
      parts[#parts + 1] = { t = pc.f.tensors[key]:reshape(-1):narrow(1, a - pc.start + 1, b - a), at = pos - start + 1 }
      pos = b
    end
  end
  return parts
end
-- dst (1-D, the range's length) <- the parts, each copy reading its own elements
local function copy_parts(dst, parts)
  local flat = dst:reshape(-1)  -- (a view: dst is contiguous)
  for _, part in ipairs(parts) do flat:narrow(1, part.at, part.t:numel()):copy_(part.t) end
  return dst
end
-- the range as a new 1-D tensor
local function assemble(ck, key, name, start, length)
  local dtype = ck.dtypes[key] or "float32"
  if length == 0 then return fsdp.empty({ 0 }, { dtype = dtype }) end
  local parts = parts_of(ck, key, name, start, length)
  if #parts == 1 then return parts[1].t:contiguous() end
  return copy_parts(fsdp.empty({ length }, { dtype = dtype }), parts)
end

-- ---- load ----------------------------------------------------------------------------------------
--- local extra = fsdp.load_sharded(dir, model[, optimizer]): every rank reads the checkpoint named
-- by dir/latest (saved at any world size) and fills its own pieces; nothing changes on error
function M.load_sharded(dir, model, optimizer)
  local what = "fsdp.load_sharded"
  local entries, by_name = model_entries(model, what)
  local ck = M.read(dir, what)

  -- same model? names and full shapes
  local missing, unexpected, mismatched = {}, {}, {}
  for _, e in ipairs(entries) do
    local l = ck.layout[e.name]
    if not l then missing[#missing + 1] = e.name
    elseif shape_str(l.shape) ~= shape_str(e.shape) then
      mismatched[#mismatched + 1] = ("%q: checkpoint %s, model %s"):format(e.name, shape_str(l.shape), shape_str(e.shape))
    end
  end
  for _, ce in ipairs(ck.entries) do if not by_name[ce.name] then unexpected[#unexpected + 1] = ce.name end end
  if #missing + #unexpected + #mismatched > 0 then
    table.sort(missing); table.sort(mismatched)
    local msg = {}
    if #missing > 0 then msg[#msg + 1] = "missing keys: " .. table.concat(missing, ", ") end
    if #unexpected > 0 then msg[#msg + 1] = "unexpected keys: " .. table.concat(unexpected, ", ") end
    if #mismatched > 0 then msg[#msg + 1] = "shape mismatch for " .. table.concat(mismatched, "; ") end
    error(("%s: the checkpoint '%s' does not match the model (%s)"):format(what, ck.path, table.concat(msg, "; ")), 2)
  end

  -- optimizer: same class, same groups of the same parameters
  local opt_sd
  if optimizer ~= nil then
    if type(optimizer) ~= "table" or type(optimizer.param_groups) ~= "table" then
      error(what .. ": optimizer must be an fsdp.optim optimizer", 2)
    end
    local o = ck.optim
    if not o then error(("%s: the checkpoint '%s' holds no optimizer state (it was saved without an optimizer)"):format(what, ck.path), 2) end
    if o.class ~= optimizer.__name then
      error(("%s: the checkpoint '%s' holds %s state, the optimizer is %s"):format(what, ck.path, tostring(o.class), tostring(optimizer.__name)), 2)
    end
    if #o.groups ~= #optimizer.param_groups then
      error(("%s: the checkpoint '%s' has %d parameter groups, the optimizer %d"):format(what, ck.path, #o.groups, #optimizer.param_groups), 2)
    end
    local name_of = {}
    for _, e in ipairs(entries) do if e.kind == "param" then name_of[fsdp._key(e.t)] = e.name end end
    opt_sd = { state = {}, param_groups = {} }
    local idx = 0
    for gi, g in ipairs(optimizer.param_groups) do
      local saved = o.groups[gi]
      local names = {}
      for i, p in ipairs(g.params) do
        names[i] = name_of[fsdp._key(p)] or error(("%s: parameter %d of the optimizer's group %d is not a parameter of the model"):format(what, i, gi), 2)
      end
      if table.concat(names, ",") ~= table.concat(saved.params or {}, ",") then
        error(("%s: parameter group %d of the checkpoint '%s' holds {%s}, the optimizer's {%s}")
          :format(what, gi, ck.path, table.concat(saved.params or {}, ", "), table.concat(names, ", ")), 2)
      end
      local pg = { params = {} }
      for k, v in pairs(saved) do if k ~= "params" then pg[k] = v end end
      for i, p in ipairs(g.params) do
        pg.params[i] = idx
        local st = o.state[names[i]]
        if st then
          local e = by_name[names[i]]
          local s = {}
          for k, v in pairs(st.scalars or {}) do s[k] = v end
          for _, k in ipairs(st.tensors or {}) do
            s[k] = assemble(ck, "optim." .. e.name .. "." .. k, e.name, e.start, e.length):reshape(fsdp._held_shape(p))
          end
          s.fsdp_piece = require("fsdp.optim")._piece_of(p)  -- assembled for this rank's piece
          opt_sd.state[idx] = s
        end
        idx = idx + 1
      end
      opt_sd.param_groups[gi] = pg
    end
  end

  -- where every piece is; then each piece copied out of the files, reading its own elements only
  -- (M.read checked the files whole: only a file changed on disk since can fail now)
  local plans = {}
  for i, e in ipairs(entries) do plans[i] = parts_of(ck, "model." .. e.name, e.name, e.start, e.length) end
  fsdp.no_grad(function()
    for i, e in ipairs(entries) do if e.length > 0 then copy_parts(e.t:to_local(), plans[i]) end end
  end)
  if opt_sd then optimizer:load_state_dict(opt_sd) end
  local r = fsdp.rank()
  local f = ck.files[r] or ck.files[0]
  if f.rng then fsdp.set_rng_state(f.rng) end
  return ck.extra
end

-- ---- consolidation (bin/fsdp-consolidate) ---------------------------------------------------------
--- writes the full tensors of the latest checkpoint in `dir` under their PyTorch names (and with
-- opts.with_optimizer the full optimizer state tensors as "optim.<name>.<key>") to one safetensors
-- file; returns {path=, gen=, world_size=, names = {...}, shapes = {name = shape}, bytes=}
function M.consolidate(dir, out, opts)
  local what = "fsdp-consolidate"
  fsdp._path(out, what, "out")
  opts = opts or {}
  local ck = M.read(dir, what)
  local tensors, shapes, names, bytes = {}, {}, {}, 0
  local function add(key, name, shape)
    local numel = ck.layout[name].numel
    local t = assemble(ck, key, name, 0, numel):reshape(shape)
    tensors[key] = t
    shapes[key] = shape
    names[#names + 1] = key
    bytes = bytes + t:numel() * tonumber(C.fsdp_dtype_size(fsdp._dtype(t.dtype)))
  end
  for _, e in ipairs(ck.entries) do add("model." .. e.name, e.name, e.shape) end
  -- PyTorch names: strip the "model." prefix; a tied parameter under each of its names
  local final = {}
  for _, k in ipairs(names) do final[k:sub(7)] = tensors[k]; shapes[k:sub(7)] = shapes[k] end
  for i, k in ipairs(names) do names[i] = k:sub(7) end
  local aliases = ck.aliases
  local alias_names = {}
  for a in pairs(aliases) do alias_names[#alias_names + 1] = a end
  table.sort(alias_names)
  for _, a in ipairs(alias_names) do
    local c = aliases[a]
    if not final[c] then error(("%s: alias %q names %q, which the checkpoint does not hold"):format(what, a, c), 0) end
    final[a], shapes[a] = final[c], shapes[c]
    names[#names + 1] = a
  end
  local meta = { format = "fsdp-consolidated", source = ck.path, world_size = tostring(ck.world_size),
                 gen = tostring(ck.gen), extra = ck.files[0].meta.extra }
  if opts.with_optimizer then
    if not ck.optim then error(("%s: the checkpoint '%s' holds no optimizer state"):format(what, ck.path), 0) end
    local layout_names = {}
    for name in pairs(ck.optim.state) do layout_names[#layout_names + 1] = name end
    table.sort(layout_names)
    for _, name in ipairs(layout_names) do
      for _, k in ipairs(ck.optim.state[name].tensors or {}) do
        local key = "optim." .. name .. "." .. k
        local t = assemble(ck, key, name, 0, ck.layout[name].numel):reshape(ck.layout[name].shape)
        final[key] = t
        shapes[key] = ck.layout[name].shape
        names[#names + 1] = key
        bytes = bytes + t:numel() * 4
      end
    end
    meta.optim = ck.files[0].meta.optim
  end
  fsdp.save(out, final, meta)
  return { path = out, gen = ck.gen, world_size = ck.world_size, source = ck.path, names = names, shapes = shapes, bytes = bytes }
end

return M
