--- fsdp.comm: process groups and collectives (the Lua face of src/parallel/comm.c).
--
--   fsdp.init([backend])            optional: "mpi" under fsdprun/mpirun, else "self" (1 rank)
--   fsdp.rank(), fsdp.world_size()  0-based rank like PyTorch; world size
--   fsdp.barrier()
--   fsdp.all_reduce(t, op)          in place, op "sum" (default) | "avg" | "max" (a NaN on any rank
--                                   wins, as torch.max of the values together); returns t
--   fsdp.broadcast(t, root)         in place from rank `root` (0-based); returns t
--   fsdp.all_gather(out, inp)       out (N * inp:numel()) = every rank's inp; fsdp.all_gather(inp)
--                                   allocates out with shape (N * inp.shape[1], ...)
--   fsdp.reduce_scatter(out, inp, op)  out (inp:numel() / N) = this rank's chunk of the reduction
--   fsdp.comm_stats()               {all_gather = {count=, bytes=}, reduce_scatter = ..., ...}
--   fsdp.comm_device_plane()        how GPU tensors move: "nccl" | "host" | "standin" (FSDP_DEVICE_COMM)
-- Every collective takes a trailing options table {tag = "...", async = true}: with async it
-- returns a Work (w:wait(), w:is_completed()) and the caller may compute while it runs; the
-- tensors must not be touched until wait() returns. Collectives run in issue order on a
-- communication thread; all ranks must issue the same ones in the same order, else every rank
-- gets an error naming the tags and ranks (a rank that never comes is a timeout error).
-- @module fsdp.comm
local ffi = require "ffi"
local fsdp = require "fsdp"
local C = fsdp.C
local check = fsdp._check

local comm = {}

local ops = { sum = 0, avg = 1, mean = 1, max = 2 }
local kinds = { "all_gather", "reduce_scatter", "all_reduce", "broadcast", "barrier" }

-- a backend that cannot load names the Debian package it needs (fsdp._missing_library_hint)
local function comm_init(backend)
  if C.fsdp_comm_init(backend) ~= 0 then
    local msg = ffi.string(C.fsdp_last_error())
    C.fsdp_clear_error()
    error(fsdp._missing_library_hint(msg), 3)
  end
end
local function init_once()
  if C.fsdp_comm_is_initialized() == 0 then comm_init(nil) end
end

--- Starts the comm backend (optional: the first collective does it).
-- @param backend "mpi" under fsdprun/mpirun, else "self" (1 rank); nil: from the launcher
function comm.init(backend)
  if backend ~= nil and type(backend) ~= "string" then
    error("fsdp.init: backend must be \"self\", \"mpi\" or nil, got " .. tostring(backend), 2)
  end
  comm_init(backend)
  return fsdp
end
--- This process's rank, 0-based.
function comm.rank() init_once(); return C.fsdp_comm_rank() end
--- The number of ranks.
function comm.world_size() init_once(); return C.fsdp_comm_world_size() end
--- this rank among the ranks of its node (0-based, as torchrun's LOCAL_RANK), and their number
function comm.local_rank() init_once(); return C.fsdp_comm_local_rank() end
--- The number of ranks on this node.
function comm.local_world_size() init_once(); return C.fsdp_comm_local_world_size() end
--- The name of the comm backend in use ("self", "mpi", ...).
function comm.backend() init_once(); return ffi.string(C.fsdp_comm_backend_name()) end
--- how device (GPU) tensors move between ranks: "nccl", "host" (staged through host memory on the
-- backend), "standin" (the tests' double of NCCL); "" until the first collective on one
function comm.comm_device_plane() return ffi.string(C.fsdp_comm_device_plane()) end
--- the bootstrap of a device data plane alone ("nccl", "standin"), no device needed: every rank
-- returns the hex digest of the ids rank 0 made (the same on every rank)
function comm.plane_bootstrap(plane)
  init_once()
  local d = ffi.new("char[17]")
  check(C.fsdp_comm_plane_bootstrap(plane, d))
  return ffi.string(d)
end
--- Whether the comm backend is up.
function comm.is_initialized() return C.fsdp_comm_is_initialized() ~= 0 end
--- Waits until every rank reaches it.
function comm.barrier() init_once(); check(C.fsdp_barrier()) end
--- Shuts the comm backend down.
function comm.finalize() check(C.fsdp_comm_finalize()) end
--- seconds a rank waits for the others at a collective before it errors (default 300, env FSDP_COMM_TIMEOUT)
function comm.set_timeout(seconds) C.fsdp_comm_set_timeout(seconds) end
--- 0: ring of MPI_Sendrecv (default), 1: MPI_Reduce_scatter_block
function comm.set_reduce_scatter_algo(algo) C.fsdp_comm_set_reduce_scatter_algo(algo) end

-- ---- work handles ---------------------------------------------------------------------------------
local Work = {}
Work.__index = Work
function Work:wait()
  if not self.waited then
    self.waited = true
    local rc = C.fsdp_work_wait(self.handle)
    if rc ~= 0 then self.err = ffi.string(C.fsdp_last_error()); C.fsdp_clear_error() end
  end
  if self.err then error(self.err, 2) end
  return self.result
end
function Work:is_completed() return C.fsdp_work_test(self.handle) ~= 0 end

local function submit(name, handle, result, opts)
  if handle == nil then fsdp._raise(2) end
  handle = ffi.gc(handle, C.fsdp_work_free)
  local w = setmetatable({ handle = handle, result = result }, Work)
  if opts and opts.async then return w end
  local rc = C.fsdp_work_wait(handle)
  if rc ~= 0 then fsdp._raise(2) end
  return result
end

local function reduce_op(name, op)
  if op == nil then return 0 end
  local o = ops[op]
  if not o then error(("%s: unknown op %q (use \"sum\", \"avg\" or \"max\")"):format(name, tostring(op)), 3) end
  return o
end

local function need_tensor(name, what, t)
  if not fsdp.is_tensor(t) then error(("%s: %s must be a tensor, got %s"):format(name, what, type(t)), 3) end
  if t.p ~= nil and fsdp._piece(t.p) then fsdp._piece_error(t, name, what, 3) end  -- (a sharded parameter)
end

-- ---- collectives -----------------------------------------------------------------------------------
--- Reduces t over every rank in place and returns it.
-- @param t a tensor
-- @param op "sum" (default), "avg" or "max" (NaN-propagating)
-- @param opts {tag =, async =} or nil
function comm.all_reduce(t, op, opts)
  if type(op) == "table" then op, opts = nil, op end
  need_tensor("all_reduce", "tensor", t)
  local o = reduce_op("all_reduce", op)
  init_once()
  return submit("all_reduce", C.fsdp_all_reduce(t.p, o, opts and opts.tag or "all_reduce"), t, opts)
end

--- Copies rank root's t into every rank's t, in place; returns t.
-- @param t a tensor
-- @param root the source rank (0-based)
-- @param opts {tag =, async =} or nil
function comm.broadcast(t, root, opts)
  if type(root) == "table" then root, opts = nil, root end
  need_tensor("broadcast", "tensor", t)
  root = fsdp._i(root, "broadcast", "src", 0, 0)
  init_once()
  return submit("broadcast", C.fsdp_broadcast(t.p, root or 0, opts and opts.tag or "broadcast"), t, opts)
end

--- Gathers every rank's inp into out (rank order); all_gather(inp) allocates out.
-- @param out a tensor of N * inp:numel() elements
-- @param inp this rank's tensor
-- @param opts {tag =, async =} or nil
function comm.all_gather(out, inp, opts)
  if inp == nil or type(inp) == "table" then  -- all_gather(inp[, opts]): allocate out
    opts, inp = inp, out
    need_tensor("all_gather", "input", inp)
    init_once()
    local shape = fsdp._held_shape(inp)
    if #shape == 0 then shape = { 1 } end
    shape[1] = shape[1] * C.fsdp_comm_world_size()
    out = fsdp.empty(shape, { dtype = inp.dtype })
  end
  need_tensor("all_gather", "out", out)
  need_tensor("all_gather", "input", inp)
  init_once()
  return submit("all_gather", C.fsdp_all_gather(out.p, inp.p, opts and opts.tag or "all_gather"), out, opts)
end

--- Reduces inp over every rank; out gets this rank's chunk.
-- @param out a tensor of inp:numel() / N elements
-- @param inp this rank's tensor
-- @param op "sum" (default), "avg" or "max"
-- @param opts {tag =, async =} or nil
function comm.reduce_scatter(out, inp, op, opts)
  if type(op) == "table" then op, opts = nil, op end
  need_tensor("reduce_scatter", "out", out)
  need_tensor("reduce_scatter", "input", inp)
  local o = reduce_op("reduce_scatter", op)
  init_once()
  return submit("reduce_scatter", C.fsdp_reduce_scatter(out.p, inp.p, o, opts and opts.tag or "reduce_scatter"), out, opts)
end

--- A barrier that returns a Work (w:wait()).
-- @param opts {tag =} or nil
function comm.barrier_async(opts)
  init_once()
  return submit("barrier", C.fsdp_barrier_async(opts and opts.tag or "barrier"), nil, { async = true })
end

-- ---- stats -----------------------------------------------------------------------------------------
--- Counts and bytes per collective: {all_gather = {count =, bytes =}, ...}.
function comm.comm_stats()
  local c, b = ffi.new("int64_t[5]"), ffi.new("int64_t[5]")
  C.fsdp_comm_stats(c, b)
  local r = {}
  for i, k in ipairs(kinds) do r[k] = { count = tonumber(c[i - 1]), bytes = tonumber(b[i - 1]) } end
  return r
end
comm.stats = comm.comm_stats
--- Sets the counters of comm_stats() to zero.
function comm.reset_stats() C.fsdp_comm_reset_stats() end

return comm
