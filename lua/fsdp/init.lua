--- fsdp: Fully Sharded Data Parallel training from LuaJIT.
--
-- This file loads libfsdp.so, feeds ffi.cdef from the public header (lua/fsdp/cdef.lua is
-- generated from src/fsdp.h by make), and holds the few helpers every other Lua file uses:
--   fsdp.C          the library namespace
--   fsdp._wrap(p)   turns a new C tensor reference into a garbage-collected tensor handle, or
--                   raises the C error as a Lua error (a NULL result)
--   fsdp._t(v, fn, arg)  the C pointer of tensor argument `arg` of function `fn`, or a Lua error
--                   naming both (x.numel() gets "did you mean x:numel()?")
--   fsdp._p(v, fn, arg)  the same for an optional tensor (nil stays NULL)
--   fsdp._check(rc) raises the C error when a status is non-zero
--   fsdp._dim(d, n[, fn]) Lua's 1-based (or negative) dim -> C's 0-based dim (errors name fn)
--   fsdp._n / _i / _f / _b / _fn / _path (v, fn, arg): a number, an integer, a finite number, a
--                   boolean, a function, a path argument checked, or a Lua error naming fn and arg
--   fsdp._list(t, fn, what) / fsdp._pack(fn, what, level, ...): a list's length, or an error
--                   naming its hole; fsdp._shape(fn, ...) a checked shape
-- Tensor methods and operators live in fsdp/tensor.lua; nn, optim and functional load lazily.
-- @module fsdp
local ffi = require "ffi"

local fsdp = {}

-- this file's directory, and the checkout it sits in when it is a source checkout (lua/fsdp)
local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."
local checkout = here:match("^(.*)/lua/fsdp$") or (here .. "/../..")
-- nil when `path` is a regular file (or cannot be checked here), else what it is ("a FIFO", ...):
-- io.open() of a FIFO with no writer blocks forever, so every file fsdp reads is checked first.
-- (struct statx has one layout on every Linux architecture, unlike struct stat: 256 bytes.)
pcall(ffi.cdef, [[
struct fsdp_statx { uint32_t mask, blksize; uint64_t attributes; uint32_t nlink, uid, gid;
                    uint16_t mode, spare0; uint8_t rest[224]; };
int statx(int dirfd, const char* path, int flags, unsigned int mask, struct fsdp_statx* buf);
]])
local file_kinds = { [0x1000] = "a FIFO", [0x2000] = "a character device", [0x4000] = "a directory",
  [0x6000] = "a block device", [0xA000] = "a symbolic link", [0xC000] = "a socket" }
function fsdp._not_regular_file(path)
  if ffi.os ~= "Linux" then return nil end
  local buf = ffi.new("struct fsdp_statx")
  local ok, rc = pcall(function() return ffi.C.statx(-100, path, 0, 1, buf) end)  -- AT_FDCWD, STATX_TYPE
  if not ok or rc ~= 0 then return nil end  -- no statx, or no file: io.open says why
  local kind = bit.band(buf.mode, 0xF000)
  if kind == 0x8000 then return nil end
  return file_kinds[kind] or "not a plain file"
end

local function exists(path)
  if fsdp._not_regular_file(path) then return false end
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

-- a checkout that was never built (or an install that lost files) says what to run
local function not_built(what)
  if exists(checkout .. "/src/fsdp.h") then
    error(("fsdp is not built: %s is missing; run `make` in %s"):format(what, checkout), 0)
  end
  error(("fsdp is not installed completely: %s is missing; reinstall it (`luarocks make` or `make install`)"):format(what), 0)
end

local have_cdef, cdef = pcall(require, "fsdp.cdef")
if not have_cdef then not_built("lua/fsdp/cdef.lua (generated from src/fsdp.h)") end
ffi.cdef(cdef)

-- find libfsdp.so: package.cpath first (luarocks tree or ./libfsdp.so), then beside this file
-- in a source checkout
local function find_library()
  local path = package.searchpath("libfsdp", package.cpath)
  if path then return path end
  for _, cand in ipairs { checkout .. "/libfsdp.so", here .. "/libfsdp.so" } do
    if exists(cand) then return cand end
  end
  not_built("libfsdp.so (not in package.cpath: " .. package.cpath .. ")")
end

-- Idle OpenMP threads sleep rather than spin for long: spinning threads take the cores OpenBLAS
-- (and other ranks) need. They spin briefly first (10000 pauses: ~0.35 ms where a pause is ~140
-- cycles, as on recent Intel cores; well under 0.1 ms on AMD's short pauses), as the next parallel
-- region of a step usually follows within that: waking a sleeping thread each time cost 5-8% of the
-- MLP and transformer steps at 2 threads on a Xeon family 6 model 143 (commit 12eb517). A user's own
-- setting of either wins. libgomp reads them when it loads with libfsdp.so, so set them first.
ffi.cdef [[ int setenv(const char* name, const char* value, int overwrite); int unsetenv(const char* name); ]]
ffi.C.setenv("OMP_WAIT_POLICY", "passive", 0)
ffi.C.setenv("GOMP_SPINCOUNT", "10000", 0)

-- FSDP_CPU_ISA caps the vector ISA of every kernel (src/backend/cpu/cpuinfo.c); C reads it once
local isa_cap = os.getenv("FSDP_CPU_ISA")
if isa_cap and isa_cap ~= "sse2" and isa_cap ~= "avx2" and isa_cap ~= "avx512f" then
  error(("FSDP_CPU_ISA=%s: expected sse2, avx2 or avx512f (the widest vector ISA fsdp's kernels may use)")
    :format(isa_cap), 0)
end

-- the Debian package that provides a shared library a load error names ("libdnnl.so.2: cannot
-- open shared object file"); the message as it was when it names none we know
local debian_packages = {
  { "libdnnl", "libdnnl-dev (oneDNN)" }, { "libopenblas", "libopenblas-dev" }, { "libgomp", "libgomp1" },
  { "libmpi", "libopenmpi-dev and openmpi-bin" }, { "libluajit", "libluajit-5.1-dev" },
}
function fsdp._missing_library_hint(msg)
  for lib in msg:gmatch("([%w_%-%.]+%.so[%.%d]*): cannot open shared object file") do
    for _, p in ipairs(debian_packages) do
      if lib:sub(1, #p[1]) == p[1] then
        return ("%s\n%s is missing: install the Debian package %s (`sudo apt-get install %s`)")
          :format(msg, lib, p[2], p[2]:match("^(%S+)"))
      end
    end
  end
  return msg
end

-- OpenBLAS runs single-threaded inside our OpenMP threads (src/backend/cpu/backend.c, "threads"),
-- so it should start no workers of its own: it starts OPENBLAS_NUM_THREADS - 1 (all cores when
-- unset) as it loads, and each spins in sched_yield for its first ~0.1-0.3 s, on the cores our
-- first steps run on. So it loads under OPENBLAS_NUM_THREADS=1, and the variable is put back
-- after: programs this process starts (a PyTorch to compare with) see the user's value.
local user_blas_threads = os.getenv("OPENBLAS_NUM_THREADS")
ffi.C.setenv("OPENBLAS_NUM_THREADS", "1", 1)
local lib_path = find_library()
local loaded, C = pcall(ffi.load, lib_path)
if user_blas_threads then ffi.C.setenv("OPENBLAS_NUM_THREADS", user_blas_threads, 1)
else ffi.C.unsetenv("OPENBLAS_NUM_THREADS") end
if not loaded then error(("fsdp: cannot load %s: %s"):format(lib_path, fsdp._missing_library_hint(tostring(C))), 0) end
fsdp.C = C

-- ---- errors ------------------------------------------------------------------------------------
local function raise(level, prefix)  -- (prefix: the public function's name, when C's message lacks it)
  local msg = ffi.string(C.fsdp_last_error())
  C.fsdp_clear_error()
  error((prefix or "") .. (msg ~= "" and msg or "fsdp: unknown error"), level + 1)
end
fsdp._raise = raise

function fsdp._check(rc)
  if rc ~= 0 then raise(2) end
  return rc
end

-- _wrap keeps the Lua GC informed about C memory: once enough activation bytes were allocated
-- since the last collection, collect.
-- Tensors die when their Lua handles are collected, so the GC runs when the activation bytes
-- allocated since the last collection exceed both a floor and what survived that collection (the
-- heap-doubling rule): garbage then never outgrows live memory, freed blocks return to the
-- allocator's cache before the next step asks for the same sizes, and no step waits on LuaJIT's
-- own GC, which sees only the small handles. (Measured on the conv bench model: alive activations
-- swung 25-160 MiB and each step took ~1500 fresh pages before; see git log.)
local gc_floor = 64 * 1024 * 1024
local cur = ffi.new("int64_t[6]")
local pressure = C.fsdp_memory_gc_pressure()
local survived = 0  -- activation bytes alive after the last collection
-- a collection now (activation checkpointing asks for one when a region's forward ends: the
-- activations inside it died with their handles)
function fsdp._collect()
  collectgarbage("collect")
  C.fsdp_memory_gc_done()
  C.fsdp_memory_stats(cur, nil)
  survived = tonumber(cur[3])
end
local function gc_if_needed()
  if pressure[0] > gc_floor and pressure[0] > survived then fsdp._collect() end
end

-- ---- tensor handles ---------------------------------------------------------------------------------
-- A tensor in Lua is a handle: a small struct that owns one reference to a C tensor, as ljsyscall
-- holds a file descriptor. Arithmetic on a struct goes through its metatype (__add, __mul, ...)
-- both in the interpreter and in compiled traces; on a bare `fsdp_tensor*`, LuaJIT's trace
-- recorder would compile `x + 1` as pointer arithmetic. Every C call passes `t.p`.
--
-- The metatype's finalizer (fsdp/tensor.lua) releases the reference when the handle is collected.
-- (LuaJIT aborts a trace it is recording when any finalizer runs; a loop that makes tensors then
-- compiles a few hundred iterations later rather than at once. A registry swept once per GC
-- cycle avoided that but made every op's trace bigger, and loops of 16 ops never compiled.)
ffi.cdef "typedef struct fsdp_tensor_handle { fsdp_tensor* p; } fsdp_tensor_handle;"
local handle_ct = ffi.typeof("fsdp_tensor_handle")
fsdp._handle_ct = handle_ct

-- Every new tensor reference passes through here. (`local t = ...; return t` on purpose: LuaJIT's
-- recorder counts tail calls of C functions and constructors against its loop-unroll limit, and
-- a loop body with many tensor ops would then never compile.)
function fsdp._wrap(p)
  if p == nil then raise(2) end
  gc_if_needed()
  local t = handle_ct(p)
  return t
end

-- Drops a reference now instead of at the next garbage collection: for short-lived handles to
-- big storage (the gradients an optimizer step reads), so memory does not wait for the Lua GC.
-- t must not be used afterwards.
local hooks_pending, regions_pending = C.fsdp_hooks_freed_pending(), C.fsdp_checkpoint_freed_pending()
function fsdp._release(t)
  local p = t.p
  if p == nil then return end
  t.p = nil
  C.fsdp_tensor_release(p)
  if hooks_pending[0] ~= 0 or regions_pending[0] ~= 0 then fsdp._hooks_freed() end
end
-- drops the Lua functions of tensor hooks, and the closures of checkpointed regions, that C freed
-- (fsdp/autograd.lua sets it; no hook or region exists before that module loads). Through the Lua
-- registry: the tensor type's finalizer is set once per process, by the first copy of this module
-- (a test runner like busted loads modules afresh per file), and must reach the copy of
-- fsdp/autograd.lua that holds the hooks
local registry = debug.getregistry()
function fsdp._hooks_freed()
  local drop = registry["fsdp.hooks_freed"]
  if drop then drop() end
end

-- ---- argument checks -----------------------------------------------------------------------------
-- Every tensor argument from Lua reaches C through fsdp._t or fsdp._p, so nil, a number, a
-- string, a table or a released handle is a Lua error naming the function and the argument,
-- never a NULL that C dereferences. The check is a type test on the hot path; the message is
-- only built on failure.
local function describe(v)
  if v == nil then return "nil" end
  if ffi.istype(handle_ct, v) then return v.p == nil and "a released tensor" or "a tensor" end
  if type(v) == "string" then return ("a string (%q)"):format(#v > 20 and v:sub(1, 20) .. "..." or v) end
  return "a " .. type(v)
end
-- raises "fn: expected WANT as ARG, got ..." at `level` (1 = the caller of fsdp._arg_error); a
-- bad self (x.numel() for x:numel()) adds the hint
function fsdp._arg_error(fn, arg, want, v, level)
  local msg = ("%s: expected %s as %s, got %s"):format(fn, want, arg, describe(v))
  if arg == "self" then msg = ("%s -- did you mean x:%s()?"):format(msg, fn) end
  error(msg, (level or 1) + 1)
end
local arg_error = fsdp._arg_error

-- A sharded FSDP parameter outside its unit's forward and backward holds only this rank's piece
-- of its values (elements [start, start + length) of the flattened whole), while it answers its
-- full shape. Nothing may then act on the piece as if it were the parameter (docs/fsdp.md, "A sharded
-- parameter outside forward and backward"): as self it may only be the argument of the methods
-- below, which act on the whole parameter (metadata) or change it elementwise, each rank its own
-- piece (tensor.lua); anything else -- reading values, indexing, views, arithmetic, an op's input --
-- is an error that says where its values are and how to reach them.
local piece_start, piece_len = ffi.new("int64_t[1]"), ffi.new("int64_t[1]")
local head_ptr = ffi.typeof("const fsdp_tensor_head*")
fsdp._head_ptr = head_ptr
local PIECE_METHODS = { dim = true, numel = true, shape = true, size = true, version = true, to_local = true,
  tostring = true, requires_grad_ = true, register_hook = true,
  zero_ = true, fill_ = true, mul_ = true, add_ = true, copy_ = true, uniform_ = true, normal_ = true }
function fsdp._piece(p)  -- start, length of a parameter in its piece form, else nil
  if C.fsdp_param_piece(p, piece_start, piece_len) == 0 then return nil end
  return tonumber(piece_start[0]), tonumber(piece_len[0])
end
function fsdp._piece_error(v, fn, arg, level)
  local start, len = fsdp._piece(v.p)
  local n = tonumber(C.fsdp_param_full_numel(v.p))
  local holds = len == 0 and ("no element of its %d"):format(n)
    or ("elements %d..%d of its %d"):format(start + 1, start + len, n)
  local shape = {}
  for i, d in ipairs(v:shape()) do shape[i] = tostring(d) end
  local name, unit = require("fsdp.wrap").param_names(v)
  error(("%s: %sparameter '%s' (%s) is sharded by FSDP unit '%s': rank %d holds %s. Outside the unit's "
    .. "forward and backward, read or change it whole inside model:summon_full_params(fn) (model:apply(fn) runs "
    .. "there too), or use p:to_local() for this rank's piece"):format(fn, arg and arg ~= "self" and (arg .. ": ") or "",
    name, table.concat(shape, "x"), unit, fsdp.rank(), holds), level + 1)
end

-- A tensor whose values are not in memory (fsdp.h, "deferred values"): a meta tensor (made inside
-- fsdp.meta) answers its shape and dtype, makes views, and records the in-place writes below -- how
-- layers initialise parameters -- to be replayed when it is materialised (fsdp.wrap, to_empty);
-- anything that reads its values is an error saying how to materialise it. A file-backed tensor
-- (fsdp.load) is read whole on its first use, except as the source of a copy_, which reads only
-- what it copies (a rank's piece of a parameter).
local META_METHODS = { dim = true, numel = true, shape = true, size = true, version = true, tostring = true,
  requires_grad_ = true, register_hook = true, zero_ = true, fill_ = true, mul_ = true, add_ = true, copy_ = true,
  uniform_ = true, normal_ = true, view = true, reshape = true, narrow = true, select = true, index = true,
  t = true, transpose = true, permute = true, expand = true, unsqueeze = true, squeeze = true, flatten = true,
  split = true, chunk = true, contiguous = true, detach = true, is_contiguous = true, stride = true,
  storage_offset = true }
local FILE_METHODS = { dim = true, numel = true, shape = true, size = true, version = true, view = true,
  reshape = true, narrow = true, expand = true, flatten = true, contiguous = true, is_contiguous = true,
  stride = true, storage_offset = true }
function fsdp._meta_error(v, fn, arg, level)
  local shape = {}
  for i, d in ipairs(v:shape()) do shape[i] = tostring(d) end
  error(("%s: %stensor of shape (%s) is on meta (made inside fsdp.meta): it has no values yet. Materialise it "
    .. "first: fsdp.wrap(model) gives each rank its pieces, model:to_empty{device = \"cpu\"} whole tensors (with "
    .. "the values its recorded initialisation gives); a module whose initialisation cannot be recorded is built "
    .. "eagerly on rank 0 and wrapped with {sync_module_states = true}"):format(fn,
    arg and arg ~= "self" and (arg .. ": ") or "", table.concat(shape, ", ")), level + 1)
end
-- v's pointer once its special form allows fn (a piece: PIECE_METHODS; deferred values: above)
local function special(v, p, fn, arg, level)
  local h = ffi.cast(head_ptr, p)
  if h.piece ~= 0 and not (arg == nil and PIECE_METHODS[fn]) then fsdp._piece_error(v, fn, arg, level + 1) end
  if h.deferred ~= 0 then
    local d = C.fsdp_tensor_deferred(p)  -- (another view may have brought the values in since)
    if d == 1 and not (arg == nil and META_METHODS[fn]) then
      fsdp._meta_error(v, fn, arg, level + 1)
    elseif d == 2 and not (arg == nil and FILE_METHODS[fn]) and not (fn == "copy_" and arg == "src") then
      if C.fsdp_materialize_(p, C.fsdp_tensor_device(p)) ~= 0 then fsdp._raise(level + 1) end
    end
  end
  return p
end

-- fsdp._t(v, fn[, arg = "self"[, want = "a tensor"]]): the C pointer of tensor argument v of
-- function fn, or a Lua error (at the level of fn's caller)
function fsdp._t(v, fn, arg, want)
  if ffi.istype(handle_ct, v) then
    local p = v.p
    if p ~= nil then
      local h = ffi.cast(head_ptr, p)
      if h.piece ~= 0 or h.deferred ~= 0 then return special(v, p, fn, arg, 3) end
      return p
    end
  end
  arg_error(fn, arg or "self", want or "a tensor", v, 3)
end

-- fsdp._p(v, fn, arg): the C pointer of an optional tensor argument (nil stays NULL)
function fsdp._p(v, fn, arg)
  if v == nil then return nil end
  if ffi.istype(handle_ct, v) then
    local p = v.p
    if p ~= nil then
      local h = ffi.cast(head_ptr, p)
      if h.piece ~= 0 or h.deferred ~= 0 then return special(v, p, fn or "?", arg or "argument", 3) end
      return p
    end
  end
  arg_error(fn or "?", arg or "argument", "a tensor or nil", v, 3)
end

-- fsdp._fn(v, fn, arg): v when it is callable, else a Lua error
function fsdp._fn(v, fn, arg)
  if type(v) == "function" then return v end
  local mt = type(v) == "table" and getmetatable(v)
  if mt and mt.__call then return v end
  arg_error(fn, arg, "a function", v, 3)
end

-- fsdp._path(v, fn, arg): path argument v of fn, a non-empty string without NUL bytes (C and libc
-- would cut it at the first one and use another file), else a Lua error naming fn and arg
function fsdp._path(v, fn, arg)
  if type(v) ~= "string" then error(("%s: %s must be a string, got %s"):format(fn, arg, type(v)), 3) end
  if v == "" then error(("%s: %s must be a non-empty string"):format(fn, arg), 3) end
  local at = v:find("\0", 1, true)
  if at then error(("%s: %s %q contains a NUL byte (\\0 at byte %d)"):format(fn, arg, v, at), 3) end
  return v
end

-- fsdp._n(v, fn, arg[, default]): number argument v of fn (default when v is nil and there is
-- one), or a Lua error naming fn and arg
function fsdp._n(v, fn, arg, default)
  if type(v) == "number" then return v end
  if v == nil and default ~= nil then return default end
  arg_error(fn, arg, "a number", v, 3)
end

-- fsdp._i(v, fn, arg[, default[, min]]): integer argument v of fn (exact in a double: |v| < 2^53;
-- at least min when given), default when v is nil and there is one, or a Lua error naming fn and arg
function fsdp._i(v, fn, arg, default, min)
  if v == nil and default ~= nil then return default end
  if type(v) ~= "number" or v ~= math.floor(v) or v >= 2 ^ 53 or v <= -2 ^ 53 then
    arg_error(fn, arg, min and ("an integer >= %d"):format(min) or "an integer", v, 3)
  end
  if min and v < min then arg_error(fn, arg, ("an integer >= %d"):format(min), v, 3) end
  return v
end
-- fsdp._b(v, fn, arg[, default]): boolean argument v of fn (default when nil), or a Lua error
function fsdp._b(v, fn, arg, default)
  if v == nil then return default end
  if type(v) ~= "boolean" then arg_error(fn, arg, "true or false", v, 3) end
  return v
end
-- fsdp._f(v, fn, arg[, default]): finite number argument v of fn (default when v is nil and there
-- is one), or a Lua error naming fn and arg
function fsdp._f(v, fn, arg, default)
  if v == nil and default ~= nil then return default end
  if type(v) ~= "number" or v ~= v or v == math.huge or v == -math.huge then arg_error(fn, arg, "a finite number", v, 3) end
  return v
end

-- the identity of a tensor as a number: two handles of the same C tensor have the same key
function fsdp._addr(p)
  local n = tonumber(ffi.cast("intptr_t", p))
  return n
end
function fsdp._key(t) return (fsdp._addr(t.p)) end


-- ---- dims, shapes and dtypes --------------------------------------------------------------------
-- (fn, the calling function's name, starts the message)
function fsdp._dim(d, ndim, fn)
  if type(d) ~= "number" or d == 0 or d ~= math.floor(d) then
    error(("%sdimension must be a non-zero integer (1-based, negative from the end), got %s")
      :format(fn and (fn .. ": ") or "", type(d) == "string" and ("%q"):format(d) or tostring(d)), 3)
  end
  if d > 2 ^ 31 or d < -2 ^ 31 then  -- (the C dims are ints: name the user's number, not a wrapped one)
    error(("%sdimension %s out of range (1-based, negative from the end)"):format(fn and (fn .. ": ") or "", tostring(d)), 3)
  end
  if d > 0 then return d - 1 end
  return d
end

local dtypes = {
  float32 = 0, float = 0, f32 = 0,
  int64 = 1, long = 1, i64 = 1,
  bfloat16 = 2, bf16 = 2,
  float16 = 3, half = 3, f16 = 3, fp16 = 3,
  bool = 4,
}
local dtype_names = { [0] = "float32", "int64", "bfloat16", "float16", "bool" }
fsdp._dtype_names = dtype_names
-- the C dtype of a dtype name (nil: float32); errors name `op` when given
function fsdp._dtype(name, op)
  if name == nil then return 0 end
  local d = type(name) == "string" and dtypes[name]
  if not d then
    error(("%sunknown dtype %s (use float32, int64, bfloat16, float16 or bool)")
      :format(op and (op .. ": ") or "", type(name) == "string" and ("%q"):format(name) or ("(a %s)"):format(type(name))), 3)
  end
  return d
end

-- the number of entries of a Lua list, or an error naming `op` and `what` when the list has a hole
-- (a nil before its last entry: Lua's # may stop at the first nil or at the last entry, so the
-- list would be cut short without a word); level 0: a message without the caller's position
function fsdp._list(t, op, what, level)
  local n = table.maxn(t)
  local hole = 1
  while hole <= n and t[hole] ~= nil do hole = hole + 1 end
  if hole <= n then
    error(("%s: %s has a hole: entry %d is nil but entry %d is not (give every entry)")
      :format(op, what, hole, n), level == 0 and 0 or (level or 2) + 1)
  end
  return n
end
-- the varargs ... as a list, or the same error when one of them but the last ones is nil
function fsdp._pack(op, what, level, ...)
  local t, n = { ... }, select("#", ...)
  while n > 0 and t[n] == nil do n = n - 1 end
  for i = 1, n do
    if t[i] == nil then
      error(("%s: %s has a hole: argument %d is nil but argument %d is not"):format(op, what, i, n), (level or 2) + 1)
    end
  end
  return t, n
end

-- fsdp._shape_str(x): a shape as error messages write it, "(2, 3)"; x a tensor or a list of sizes
function fsdp._shape_str(x)
  return "(" .. table.concat(fsdp.is_tensor(x) and x:shape() or x, ", ") .. ")"
end

-- a shape given as a table {2, 3} or as sizes (2, 3), checked: integers that fit in int64 (what
-- a size is: negative ones are the C op's to judge, view's -1), as (count, int64_t array); errors
-- name `op`
local INFERRED = { view = true, reshape = true, expand = true }  -- (where -1 stands for a size)
function fsdp._shape(op, ...)
  local first = ...
  local t, n
  if type(first) == "table" then
    t = first
    n = fsdp._list(t, op, "shape", 3)
  else
    t, n = fsdp._pack(op, "shape", 3, ...)
  end
  local arr = ffi.new("int64_t[?]", math.max(n, 1))
  for i = 1, n do
    local v = t[i]
    if type(v) ~= "number" or v ~= math.floor(v) then
      error(("%s: shape entries must be integers, got %s at position %d"):format(op, tostring(v), i), 3)
    end
    if v >= 2 ^ 63 or v < -2 ^ 63 then
      error(("%s: shape entry %s at position %d is too large (sizes must fit in int64)"):format(op, tostring(v), i), 3)
    end
    if v < 0 and not INFERRED[op] then
      error(("%s: negative size %d at position %d of the shape"):format(op, v, i), 3)
    end
    arr[i - 1] = v
  end
  return n, arr
end

-- a tensor's shape as its data is laid out here (what ops work on). The public x:shape(), size, dim
-- and numel answer a sharded FSDP parameter's full shape instead, as FSDP2's parameters do; its
-- layout is this rank's 1-D piece (x:to_local())
function fsdp._held_shape(t)
  local p = t.p
  local s = {}
  for i = 0, C.fsdp_tensor_ndim(p) - 1 do s[i + 1] = tonumber(C.fsdp_tensor_size(p, i)) end
  return s
end

-- ---- devices -------------------------------------------------------------------------------------
-- device names users pass; fsdp.backends() lists those whose backend is loaded and usable
fsdp._devices = { cpu = 0, cuda = 1 }
-- the device a name stands for (0 cpu, 1 cuda), or an error naming the devices, or why CUDA is not
-- there (asking loads the CUDA backend the first time: backend/cuda/load.c)
-- whether "cuda" has a backend: the real one (loaded on the first ask) or the tests' double; once it
-- has, it keeps it (backends never go away), so the answer is kept too
local cuda_ready = false
local function has_cuda()
  cuda_ready = cuda_ready or C.fsdp_device_has_backend(1) ~= 0 or C.fsdp_cuda_is_available() ~= 0
  return cuda_ready
end
function fsdp._device(device, op, level)
  local d = fsdp._devices[device]
  if d == nil then
    error(("%s: unknown device %q (use \"cpu\" or \"cuda\")"):format(op, tostring(device)), level + 1)
  end
  if d == 1 and not has_cuda() then
    error(("%s: device \"cuda\" is not available: %s"):format(op, ffi.string(C.fsdp_cuda_why_not())), level + 1)
  end
  return d
end
--- The compute backends loaded: a list of names ("cpu", "cuda").
function fsdp.backends()
  local b = { "cpu" }
  if has_cuda() then b[#b + 1] = "cuda" end
  return b
end
-- tests only: the test double of a GPU (backend/testdev/testdev.c) becomes the "cuda" device
function fsdp._testdev_install() fsdp._check(C.fsdp_testdev_install()) end
-- t on `device`: t itself when it is there, else a copy (differentiable)
function fsdp._to_device(t, device)
  local d = fsdp._device(device, "to", 3)
  if C.fsdp_tensor_device(t.p) == d then return t end
  return fsdp._wrap(C.fsdp_to_device(t.p, d))
end
-- t moved to `device` in place (Module:to: parameters keep their identity)
function fsdp._move_(t, device)
  local d = fsdp._device(device, "Module:to", 3)
  fsdp._check(C.fsdp_set_device_(t.p, d))
  return t
end

-- fsdp.cuda: what this machine's CUDA can do (the backend loads on first use; without a driver, a
-- device or libfsdp_cuda.so everything here still answers, and why_not() says which is missing)
local mem_names = { "params", "grads", "optimizer", "activations", "comm", "other" }
local function memory_stats_of(device)
  local c, p = ffi.new("int64_t[6]"), ffi.new("int64_t[6]")
  fsdp._check(C.fsdp_memory_stats_device(device, c, p))
  local r = {}
  for i, name in ipairs(mem_names) do r[name] = { current = tonumber(c[i - 1]), peak = tonumber(p[i - 1]) } end
  return r
end
fsdp.cuda = {
  is_available = function() return C.fsdp_cuda_is_available() ~= 0 end,
  -- "" when available, else the reason ("no NVIDIA driver (...)", "no CUDA device (...)", ...)
  why_not = function() return ffi.string(C.fsdp_cuda_why_not()) end,
  device_count = function() return tonumber(C.fsdp_cuda_device_count()) end,
  -- this process's GPU, 0-based (FSDP_CUDA_DEVICE, else the local rank modulo the GPUs)
  current_device = function() return tonumber(C.fsdp_cuda_current_device()) end,
  get_device_name = function() return ffi.string(C.fsdp_cuda_device_name()) end,
  versions = function() return ffi.string(C.fsdp_cuda_versions()) end,
  -- waits for the GPU's queued work; a failed kernel raises here
  synchronize = function() fsdp._check(C.fsdp_cuda_synchronize()) end,
  -- bytes per category on the GPU, as fsdp.memory_stats() on the CPU
  memory_stats = function() return memory_stats_of(1) end,
}

-- ---- tensors --------------------------------------------------------------------------------------
local Tensor = require "fsdp.tensor"
Tensor._init(fsdp)
fsdp.Tensor = Tensor
local wrap, shape = fsdp._wrap, fsdp._shape

--- Whether x is a tensor.
-- @param x any value
function fsdp.is_tensor(x) return (Tensor.is(x)) end

-- the device a creation function makes its tensor on: opts.device, else the default device
-- (fsdp.set_default_device; "cpu" to begin with). META: a meta tensor (fsdp.meta)
local META = -1
local default_device = 0
local meta_target = 0  -- (where meta tensors' values will live: the default device before "meta")
local function device_opt(opts, op)
  if opts.device == nil then return default_device end
  if opts.device == "meta" then return META end
  return fsdp._device(opts.device, op, 3)
end
--- fsdp.set_default_device("cpu" | "cuda" | "meta"): where creation functions make tensors
function fsdp.set_default_device(device)
  if device == "meta" then
    if default_device ~= META then meta_target = default_device end
    default_device = META
  else
    default_device = fsdp._device(device, "set_default_device", 2)
  end
end
--- The device new tensors go to ("cpu", "cuda" or "meta").
function fsdp.get_default_device()
  return default_device == META and "meta" or default_device == 0 and "cpu" or "cuda"
end
--- fsdp.meta(fn, ...): fn(...)'s results, with the tensors that shape-made creation functions make
-- inside it (empty, zeros, ones, full, rand, randn, and so every layer's parameters and buffers) on
-- meta: shapes, dtypes and names without storage, their initialisation recorded (PyTorch's `with
-- torch.device("meta")`). Tensors made from data (fsdp.tensor, arange, a loaded file) stay real.
function fsdp.meta(fn, ...)
  fsdp._fn(fn, "fsdp.meta", "fn")
  local prev, prev_target = default_device, meta_target
  fsdp.set_default_device("meta")
  local function pack(...) return { n = select("#", ...), ... } end
  local r = pack(pcall(fn, ...))
  default_device, meta_target = prev, prev_target
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2, r.n)
end
-- a tensor made on the CPU (values drawn or filled there) moved to the device asked for
local function placed(t, dev)
  if dev == 0 then return t end
  return (fsdp._wrap(C.fsdp_to_device(t.p, dev)))
end

--- fsdp.tensor({{1, 2}, {3, 4}}, "int64"); fsdp.tensor(3.5); fsdp.tensor(data, {dtype =, device =})
-- (on the default device unless device says otherwise, as torch.tensor)
function fsdp.tensor(data, dtype)
  local opts = type(dtype) == "table" and dtype or { dtype = dtype }
  dtype = opts.dtype
  local dt = fsdp._dtype(dtype, "fsdp.tensor")
  local dev = device_opt(opts, "fsdp.tensor")
  if dev == META then dev = 0 end  -- (made from data: real)
  if Tensor.is(data) then return (data:to(dtype or data.dtype):clone()) end
  local dims, flat = {}, {}
  local node = data
  while type(node) == "table" do node = node[1] end
  if dtype == nil and type(node) == "boolean" then dt = fsdp._dtype("bool") end  -- torch.tensor([True, False])
  if type(data) == "number" or type(data) == "boolean" then
    flat[1] = data == true and 1 or data == false and 0 or data
  else
    assert(type(data) == "table", "fsdp.tensor: expected a number or a (nested) table of numbers")
    node = data
    while type(node) == "table" do dims[#dims + 1] = fsdp._list(node, "fsdp.tensor", "data", 3); node = node[1] end
    local function walk(t, d)
      if fsdp._list(t, "fsdp.tensor", "data", 3) ~= dims[d] then error(("fsdp.tensor: ragged nested table at depth %d (%d vs %d entries)"):format(d, #t, dims[d]), 3) end
      for i = 1, #t do
        local v = t[i]
        if d < #dims then walk(v, d + 1)
        elseif type(v) == "boolean" then flat[#flat + 1] = v and 1 or 0  -- fsdp.tensor({true, false}, "bool")
        elseif type(v) ~= "number" then error(("fsdp.tensor: non-number %s in data"):format(tostring(v)), 4)
        else flat[#flat + 1] = v end
      end
    end
    walk(data, 1)
  end
  local n, arr = shape("fsdp.tensor", dims)
  local vals = ffi.new("double[?]", math.max(#flat, 1))
  for i = 1, #flat do vals[i - 1] = flat[i] end
  return (placed(wrap(C.fsdp_from_doubles(n, arr, dt, vals)), dev))
end

-- creation functions accept a shape table or sizes, then an optional options table {dtype=}
local function split_opts(op, ...)
  local args = fsdp._pack(op, "shape", 3, ...)
  local opts = {}
  if type(args[#args]) == "table" and (type(args[1]) ~= "table" or #args > 1) and args[#args][1] == nil then
    opts = table.remove(args)
  end
  if type(args[#args]) == "string" then opts = { dtype = table.remove(args) } end
  return args, opts
end

-- a meta tensor of the shape (n, arr), with fill value v recorded (nil: empty); inside fsdp.meta its
-- values will live on the default device of before (meta_target)
local function meta_full(n, arr, v, dtype, op)
  local t = wrap(C.fsdp_meta_empty(n, arr, fsdp._dtype(dtype, op), meta_target))
  if v ~= nil then fsdp._check(C.fsdp_fill_(t.p, v)) end
  return t
end
--- An uninitialized tensor of the shape given (sizes or a list, then an optional dtype or {dtype =, device =}).
-- @param ... the shape and options
function fsdp.empty(...)
  local args, opts = split_opts("empty", ...)
  local n, arr = shape("empty", unpack(args))
  local dev = device_opt(opts, "empty")
  if dev == META then return meta_full(n, arr, nil, opts.dtype, "empty") end
  return (wrap(C.fsdp_empty(n, arr, fsdp._dtype(opts.dtype, "empty"), dev)))
end
--- A tensor of the size given filled with value.
-- @param size a list of sizes
-- @param value a number
-- @param opts a dtype or {dtype =, device =}
function fsdp.full(size, value, opts)
  local n, arr = shape("full", size)
  value = fsdp._n(value, "full", "fill_value")
  opts = type(opts) == "table" and opts or { dtype = opts }
  local dev = device_opt(opts, "full")
  if dev == META then return meta_full(n, arr, value, opts.dtype, "full") end
  return (wrap(C.fsdp_full(n, arr, value, fsdp._dtype(opts.dtype, "full"), dev)))
end
--- A tensor of zeros of the shape given.
-- @param ... the shape and options
function fsdp.zeros(...)
  local args, opts = split_opts("zeros", ...)
  local n, arr = shape("zeros", unpack(args))
  local dev = device_opt(opts, "zeros")
  if dev == META then return meta_full(n, arr, 0, opts.dtype, "zeros") end
  return (wrap(C.fsdp_full(n, arr, 0, fsdp._dtype(opts.dtype, "zeros"), dev)))
end
--- A tensor of ones of the shape given (sizes or a list, then an optional dtype or options).
-- @param ... the shape and options
function fsdp.ones(...)
  local args, opts = split_opts("ones", ...)
  local n, arr = shape("ones", unpack(args))
  local dev = device_opt(opts, "ones")
  if dev == META then return meta_full(n, arr, 1, opts.dtype, "ones") end
  return (wrap(C.fsdp_full(n, arr, 1, fsdp._dtype(opts.dtype, "ones"), dev)))
end
local function full_like(t, v, op)
  fsdp._t(t, op, "input")
  local n, arr = shape(op, fsdp._held_shape(t))
  return (wrap(C.fsdp_full(n, arr, v, C.fsdp_tensor_dtype(t.p), C.fsdp_tensor_device(t.p))))
end
--- A tensor of zeros with t's shape, dtype and device.
-- @param t a tensor
function fsdp.zeros_like(t) return full_like(t, 0, "zeros_like") end
--- A tensor of ones with t's shape, dtype and device.
-- @param t a tensor
function fsdp.ones_like(t) return full_like(t, 1, "ones_like") end
-- random values come from the one RNG stream on the host, so a seed gives the same values on
-- every device
-- (drawn in float32, then rounded to a 16-bit float dtype when one is asked for)
local function random_dtype(t, dtype, op)
  local d = fsdp._dtype(dtype, op)
  if d == 0 then return t end
  if dtype ~= "bfloat16" and dtype ~= "float16" then
    error(("%s: dtype %s is not a floating point dtype (float32, bfloat16 or float16)"):format(op, dtype), 3)
  end
  return (t:to(dtype))
end
--- Standard normal samples of the shape given.
-- @param ... the shape and options
function fsdp.randn(...)
  local args, opts = split_opts("randn", ...)
  local n, arr = shape("randn", unpack(args))
  local dev = device_opt(opts, "randn")
  if dev == META then return random_dtype(meta_full(n, arr, nil, nil, "randn"):normal_(0, 1), opts.dtype, "randn") end
  return random_dtype(placed(wrap(C.fsdp_randn(n, arr, 0, 1)), dev), opts.dtype, "randn")
end
--- Uniform [0, 1) samples of the shape given.
-- @param ... the shape and options
function fsdp.rand(...)
  local args, opts = split_opts("rand", ...)
  local n, arr = shape("rand", unpack(args))
  local dev = device_opt(opts, "rand")
  if dev == META then return random_dtype(meta_full(n, arr, nil, nil, "rand"):uniform_(0, 1), opts.dtype, "rand") end
  return random_dtype(placed(wrap(C.fsdp_rand(n, arr, 0, 1)), dev), opts.dtype, "rand")
end
--- fsdp.randint(lo, hi, shape): int64 in [lo, hi)
function fsdp.randint(lo, hi, size)
  lo, hi = fsdp._i(lo, "randint", "low"), fsdp._i(hi, "randint", "high")
  local n, arr = shape("randint", size)
  return (wrap(C.fsdp_randint(lo, hi, n, arr)))
end
--- A random permutation of 0..n-1 (int64).
-- @param n an integer >= 0
function fsdp.randperm(n) return (wrap(C.fsdp_randperm(fsdp._i(n, "randperm", "n", nil, 0)))) end
--- fsdp.arange(n), fsdp.arange(start, stop[, step][, dtype]); float32 unless all arguments are integers
function fsdp.arange(...)
  local a, n = fsdp._pack("arange", "arguments", 2, ...)
  local dtype
  if n > 1 and type(a[n]) == "string" then dtype, n = a[n], n - 1 end
  if n < 1 or n > 3 then
    error(("arange: give end, or start and end, or start, end and step (then optionally a dtype); got %d arguments")
      :format(select("#", ...)), 2)
  end
  local names = ({ { "end" }, { "start", "end" }, { "start", "end", "step" } })[n]
  for i = 1, n do fsdp._f(a[i], "arange", names[i]) end
  local start, stop, step = n == 1 and 0 or a[1], n == 1 and a[1] or a[2], n == 3 and a[3] or 1
  if dtype == nil then
    local ints = start == math.floor(start) and stop == math.floor(stop) and step == math.floor(step)
    dtype = ints and "int64" or "float32"
  end
  return (wrap(C.fsdp_arange(start, stop, step, fsdp._dtype(dtype, "arange"))))
end
--- Concatenates a list of tensors along dim (1-based, default 1).
-- @param list a list of tensors
-- @param dim a dim
function fsdp.cat(list, dim)
  if type(list) ~= "table" then arg_error("cat", "tensors", "a list of tensors", list, 2) end
  local n = #list
  local arr = ffi.new("fsdp_tensor*[?]", n)
  for i = 1, n do arr[i - 1] = fsdp._t(list[i], "cat", ("tensors[%d]"):format(i)) end
  for k in pairs(list) do
    if type(k) ~= "number" or k < 1 or k > n or k ~= math.floor(k) then
      arg_error("cat", ("tensors (a hole or extra key %s)"):format(tostring(k)), "a list of tensors", list[k], 2)
    end
  end
  dim = dim or 1
  local nd = n > 0 and C.fsdp_tensor_ndim(list[1].p) or 1
  return (wrap(C.fsdp_cat(n, arr, fsdp._dim(dim, nd, "cat"))))
end

--- fsdp.stack(list, dim): the tensors (one shape) joined along a new dim (1..ndim+1, or negative
-- from the end; default 1), as cat of their unsqueezed views
function fsdp.stack(list, dim)
  if type(list) ~= "table" or fsdp._list(list, "stack", "tensors") == 0 then
    arg_error("stack", "tensors", "a non-empty list of tensors", list, 2)
  end
  fsdp._t(list[1], "stack", "tensors[1]")
  local shape0 = fsdp._held_shape(list[1])
  local parts = {}
  dim = dim or 1
  local cd = fsdp.Tensor._dim_in(dim, #shape0 + 1, "stack", #shape0)
  for i = 1, #list do
    fsdp._t(list[i], "stack", ("tensors[%d]"):format(i))
    local s = fsdp._held_shape(list[i])
    if table.concat(s, "x") ~= table.concat(shape0, "x") then
      error(("stack: tensors[%d] has shape {%s} but tensors[1] has {%s} (all must have one shape)")
        :format(i, table.concat(s, ", "), table.concat(shape0, ", ")), 2)
    end
    parts[i] = list[i]:unsqueeze(cd + 1)
  end
  return (fsdp.cat(parts, cd + 1))
end
--- fsdp.multinomial(probs, n, {replacement = false}): int64 (n) or (rows, n) category indices (0-based)
-- drawn from probs (1-D, or 2-D rows; >= 0, need not sum to 1) with the generator fsdp.manual_seed
-- seeds: the same seed gives the same samples on every rank and every run
function fsdp.multinomial(probs, n, opts)
  local p = fsdp._t(probs, "multinomial", "probs")
  if type(n) ~= "number" or n ~= math.floor(n) then arg_error("multinomial", "num_samples", "an integer", n, 2) end
  if opts ~= nil and type(opts) ~= "table" then arg_error("multinomial", "options", "a table {replacement = ...}", opts, 2) end
  local replacement = opts and opts.replacement
  if replacement ~= nil and type(replacement) ~= "boolean" then
    arg_error("multinomial", "replacement", "a boolean", replacement, 2)
  end
  return (fsdp._wrap(C.fsdp_multinomial(p, n, replacement and 1 or 0)))
end

-- ---- process, seeds, grad mode, memory -----------------------------------------------------------
--- (seeds as PyTorch takes them: integers in [-2^63, 2^64); a negative one counts from 2^64)
function fsdp.manual_seed(seed)
  if type(seed) ~= "number" or seed ~= math.floor(seed) or seed < -2 ^ 63 or seed >= 2 ^ 64 then
    arg_error("manual_seed", "seed", "an integer in [-2^63, 2^64)", seed, 2)
  end
  C.fsdp_manual_seed(seed < 0 and ffi.cast("uint64_t", ffi.cast("int64_t", seed)) or seed)
end
--- The random generator's state (a value set_rng_state takes).
function fsdp.get_rng_state()
  local s = ffi.new("uint64_t[4]")
  C.fsdp_rng_get_state(s)
  return { s[0], s[1], s[2], s[3] }
end
-- st: what get_rng_state returns, the 4 words of the xoshiro256** state (src/core/tensor.c): uint64_t
-- cdata, or Lua numbers that hold the word exactly (integers 0..2^53). Not all 0: that state never
-- leaves 0 (every draw would be the same)
local uint64_ct, int64_ct = ffi.typeof("uint64_t"), ffi.typeof("int64_t")
local function rng_word(v, i)
  if ffi.istype(uint64_ct, v) then return v end
  if ffi.istype(int64_ct, v) and v >= 0 then return ffi.cast(uint64_ct, v) end
  if type(v) == "number" and v == math.floor(v) and v >= 0 and v <= 2 ^ 53 then return ffi.cast(uint64_ct, v) end
  local shown = (v == nil or type(v) == "number" or type(v) == "cdata") and tostring(v) or ("a " .. type(v))
  error(("set_rng_state: state[%d] = %s is not a 64-bit word (expected an integer 0..2^53 as a Lua number, or a "
    .. "uint64_t as get_rng_state returns)"):format(i, shown), 3)
end
--- Restores a state get_rng_state returned.
-- @param st the state
function fsdp.set_rng_state(st)
  if type(st) ~= "table" then arg_error("set_rng_state", "state", "a table of 4 numbers", st, 2) end
  for k in pairs(st) do
    if k ~= 1 and k ~= 2 and k ~= 3 and k ~= 4 then
      error(("set_rng_state: state has the key %s; expected the 4 entries state[1..4] of get_rng_state"):format(
        tostring(k)), 2)
    end
  end
  local s = ffi.new("uint64_t[4]")
  for i = 1, 4 do s[i - 1] = rng_word(st[i], i) end
  if s[0] == 0 and s[1] == 0 and s[2] == 0 and s[3] == 0 then
    error("set_rng_state: state is all 0, which xoshiro256** never leaves (every draw would be the same)", 2)
  end
  C.fsdp_rng_set_state(s)
end
--- n: a whole number of threads, 1 to fsdp_max_num_threads() (1024, or OMP_THREAD_LIMIT if lower:
-- libgomp cannot start many more -- src/backend/cpu/backend.c, "threads")
function fsdp.set_num_threads(n)
  if type(n) ~= "number" then arg_error("set_num_threads", "n", "a positive integer", n, 2) end
  if n ~= math.floor(n) or n < 1 then  -- (NaN and fractions; inf fails the limit)
    error(("set_num_threads: n = %s is not a positive integer"):format(tostring(n)), 2)
  end
  local limit = C.fsdp_max_num_threads()
  if n > limit then
    error(("set_num_threads: n = %s is above the limit of %d threads (fsdp's cap is 1024; OMP_THREAD_LIMIT "
      .. "lowers it)"):format(tostring(n), limit), 2)
  end
  C.fsdp_set_num_threads(n)
end

--- Whether autograd records now.
function fsdp.is_grad_enabled() return C.fsdp_is_grad_enabled() ~= 0 end
--- Turns autograd recording on or off.
-- @param on a boolean
function fsdp.set_grad_enabled(on) C.fsdp_set_grad_enabled(on and 1 or 0) end
--- fsdp.no_grad(fn, ...) runs fn with autograd recording off and returns its results
function fsdp.no_grad(fn, ...)
  fsdp._fn(fn, "no_grad", "fn")
  local prev = C.fsdp_is_grad_enabled()
  C.fsdp_set_grad_enabled(0)
  local res = { pcall(fn, ...) }
  C.fsdp_set_grad_enabled(prev)
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

-- fsdp.perf_counter(): seconds on a monotonic clock, for timing (Python's time.perf_counter())
-- (the first declaration of a C function is the one LuaJIT keeps: ours takes a void*, so a script's
-- own later `int clock_gettime(int, its_timespec*)` still takes its struct, and we pass a void*,
-- which converts to whatever struct pointer a script declared it with first)
pcall(ffi.cdef, "typedef struct { long tv_sec; long tv_nsec; } fsdp_timespec;")
pcall(ffi.cdef, "int clock_gettime(int, void*);")
local timespec = ffi.new("fsdp_timespec")
local timespec_arg = ffi.cast("void*", timespec)
--- Seconds from a monotonic clock (for timing).
function fsdp.perf_counter()
  ffi.C.clock_gettime(1, timespec_arg) -- CLOCK_MONOTONIC
  return tonumber(timespec.tv_sec) + tonumber(timespec.tv_nsec) * 1e-9
end

--- fsdp.exit(fmt, ...): a script's way out on bad input (Python's sys.exit(msg), with the message
-- formatted as string.format does): writes "<script>: message" to stderr, flushes stdout, and exits
-- with status 1, without a traceback. With several ranks the others learn it at their next
-- collective (the comm's shutdown at exit), and bin/fsdprun shows a line every rank wrote once.
-- fsdp.exit() alone exits with status 0 and says nothing.
function fsdp.exit(fmt, ...)
  io.stdout:flush()
  if fmt == nil then os.exit(0) end
  local msg = select("#", ...) > 0 and tostring(fmt):format(...) or tostring(fmt)
  io.stderr:write(((arg and arg[0] or "fsdp"):match("[^/]*$")), ": ", msg, "\n")
  io.stderr:flush()
  os.exit(1)
end

--- fsdp.memory_stats([device]) -> { params = {current=, peak=}, grads = ..., ... } in bytes, on the
-- CPU or the device named ("cuda")
function fsdp.memory_stats(device)
  local d = device == nil and 0 or fsdp._devices[device]
  if d == nil then error(("memory_stats: unknown device %q (use \"cpu\" or \"cuda\")"):format(tostring(device)), 2) end
  return memory_stats_of(d)
end
--- Sets the peak counters of memory_stats() to the current values.
function fsdp.reset_peak_memory_stats() C.fsdp_memory_reset_peaks() end

-- the timeline trace (src/core/trace.c): Chrome/Perfetto trace-event JSON, one file per rank
-- (path itself on one rank, else path.rank<R>.json); FSDP_TRACE=path records a whole run
fsdp.trace = {
  --- Starts recording a trace to path.
  -- @function fsdp.trace.start
  -- @param path a file path
  start = function(path)
    fsdp._path(path, "fsdp.trace.start", "path")
    fsdp._check(C.fsdp_trace_start(path))
  end,
  --- Stops recording and writes the trace.
  -- @function fsdp.trace.stop
  stop = function() fsdp._check(C.fsdp_trace_stop()) end,
  --- Whether a trace is recording.
  -- @function fsdp.trace.enabled
  enabled = function() return C.fsdp_trace_enabled() ~= 0 end,
}

-- communication (fsdp/comm.lua, loaded on first use): fsdp.init/rank/world_size/barrier and
-- the collectives; fsdp.comm holds the rest (set_timeout, finalize, ...)
for _, k in ipairs { "init", "rank", "world_size", "local_rank", "local_world_size", "barrier", "all_reduce",
                     "broadcast", "all_gather", "reduce_scatter", "comm_stats", "comm_device_plane" } do
  fsdp[k] = function(...) local f = require("fsdp.comm")[k]; fsdp[k] = f; return f(...) end
end

-- lazily loaded submodules: fsdp.nn, fsdp.optim, fsdp.F, fsdp.autograd, save/load
local lazy = {
  nn = "fsdp.nn", optim = "fsdp.optim", autograd = "fsdp.autograd", io = "fsdp.io", comm = "fsdp.comm",
  data = "fsdp.data", progress = "fsdp.progress", argparse = "fsdp.argparse",
}
-- functions of other modules that fsdp gives by name (fsdp.checkpoint is activation checkpointing,
-- fsdp.autograd's, not the module fsdp.checkpoint of sharded checkpoints)
local lazy_fns = {
  save = "fsdp.io", load = "fsdp.io", save_sharded = "fsdp.checkpoint", load_sharded = "fsdp.checkpoint",
  wrap = "fsdp.wrap", auto_wrap = "fsdp.wrap", clip_grad_norm = "fsdp.wrap", clip_grad_value = "fsdp.wrap",
  unit_states = "fsdp.wrap", all_idle = "fsdp.wrap", summary = "fsdp.wrap", reset_parameters = "fsdp.wrap",
  checkpoint = "fsdp.autograd",
}
setmetatable(fsdp, {
  __index = function(t, k)
    if k == "nn" then
      -- FSDP's Module methods (no_sync, summon_full_params) and state-dict provider come with nn
      local m = require "fsdp.nn"
      require "fsdp.wrap"
      rawset(t, k, m)
      return m
    elseif lazy[k] then
      local m = require(lazy[k]); rawset(t, k, m); return m
    elseif k == "F" then
      local m = require "fsdp.nn.functional"; rawset(t, k, m); return m
    elseif lazy_fns[k] then
      return require(lazy_fns[k])[k]
    end
  end,
})
-- the names of the functions above (tests/scripts/hostile.lua calls each)
function fsdp._lazy_names()
  local r = {}
  for k in pairs(lazy_fns) do r[#r + 1] = k end
  table.sort(r)
  return r
end

package.loaded.fsdp = fsdp
return fsdp
