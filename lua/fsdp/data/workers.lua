-- fsdp.data.workers: the DataLoader's worker processes (num_workers > 0), as PyTorch's.
--
-- A pool is N processes fork()ed from the main process when an iteration starts (or once, with
-- persistent_workers). A child inherits the Lua state, so the dataset, the collate function and
-- everything they reach just work there. One batch's path:
--   1. the main process sends task {b, slot, len, indices...} over worker w's socket (batch b goes
--      to worker (b - 1) % N, PyTorch's round robin), at most prefetch_factor tasks per worker
--      ahead of the batch the training loop takes next;
--   2. the worker builds the batch (dataset get + collate, the same function as num_workers = 0),
--      writes its structure (a short text, `encode`) and its tensors' bytes into the slot, a memfd
--      the main process made before the fork (the worker grows it with ftruncate), and replies
--      {b, status, meta bytes, total bytes}; a Lua error replies status 1 with the traceback;
--   3. the main process, taking batches strictly in order, maps the slot, rebuilds the batch
--      (`decode`: new tensors, copied out of the slot) and sends the next task.
-- Slot `slot_of(b)` is reused by batch b + N * prefetch_factor only after batch b was copied out.
--
-- Lifetime: a worker dies with its parent (prctl PR_SET_PDEATHSIG, SIGKILL), ignores SIGINT (the
-- main process handles Ctrl-C), runs one OpenMP thread (libgomp's thread pool does not survive a
-- fork), never calls MPI and leaves with _exit, so no atexit handler, MPI_Finalize or finalizer of
-- the parent's runs in it. The main process ends a pool with SIGKILL and waitpid (pool:shutdown),
-- at the end of an epoch, when an error stops it, or when its owner (the iterator, or the loader
-- with persistent_workers) is garbage-collected; a worker that dies is found by the end of file
-- on its socket (and a periodic waitpid) and named in an error, never waited for forever.
local ffi = require "ffi"
local bit = require "bit"
local fsdp = require "fsdp"

for _, decl in ipairs {
  "int fork(void);",
  "void _exit(int status);",
  "int getpid(void);",
  "int getppid(void);",
  "int prctl(int option, unsigned long a2, unsigned long a3, unsigned long a4, unsigned long a5);",
  "int socketpair(int domain, int type, int protocol, int sv[2]);",
  "long send(int fd, const void* buf, size_t n, int flags);",
  "long recv(int fd, void* buf, size_t n, int flags);",
  "int close(int fd);",
  "int memfd_create(const char* name, unsigned int flags);",
  "int ftruncate(int fd, int64_t length);",
  "void* mmap(void* addr, size_t length, int prot, int flags, int fd, int64_t offset);",
  "int munmap(void* addr, size_t length);",
  "int kill(int pid, int sig);",
  "int waitpid(int pid, int* status, int options);",
  "typedef void (*fsdp_sighandler)(int);",
  "fsdp_sighandler signal(int signum, fsdp_sighandler handler);",
  "struct fsdp_pollfd { int fd; short events; short revents; };",
  "int poll(struct fsdp_pollfd* fds, unsigned long nfds, int timeout);",
  "char* strerror(int errnum);",
} do pcall(ffi.cdef, decl) end
local C = ffi.C

local M = {}

local AF_UNIX, SOCK_STREAM_CLOEXEC, MFD_CLOEXEC = 1, 1 + 0x80000, 1
local MSG_NOSIGNAL, PR_SET_PDEATHSIG, WNOHANG = 0x4000, 1, 1
local SIGINT, SIGKILL = 2, 9
local PROT_READ, PROT_WRITE, MAP_SHARED = 1, 2, 1
local EINTR, POLLIN = 4, 1
local ALIGN = 64  -- every tensor's bytes in a slot start at a multiple of this
local signal_names = { [1] = "SIGHUP", [2] = "SIGINT", [4] = "SIGILL", [6] = "SIGABRT", [7] = "SIGBUS",
  [8] = "SIGFPE", [9] = "SIGKILL", [11] = "SIGSEGV", [13] = "SIGPIPE", [15] = "SIGTERM" }

local function errno_str() return ffi.string(C.strerror(ffi.errno())) end
local function align(n) return math.ceil(n / ALIGN) * ALIGN end

-- ---- bytes over a socket ------------------------------------------------------------------------------
local function send_all(fd, buf, n)  -- false when the other side is gone
  local p, off = ffi.cast("const char*", buf), 0
  while off < n do
    local w = C.send(fd, p + off, n - off, MSG_NOSIGNAL)
    if w < 0 then
      if ffi.errno() ~= EINTR then return false end
    else
      off = off + tonumber(w)
    end
  end
  return true
end
local function recv_all(fd, buf, n)  -- false at the end of file (the other side is gone)
  local p, off = ffi.cast("char*", buf), 0
  while off < n do
    local r = C.recv(fd, p + off, n - off, 0)
    if r == 0 then return false end
    if r < 0 then
      if ffi.errno() ~= EINTR then return false end
    else
      off = off + tonumber(r)
    end
  end
  return true
end

-- ---- a batch as text + bytes ----------------------------------------------------------------------------
-- encode(v): the text of v's structure, tensors as "T<dtype>,<offset>,<ndim>,<sizes...>;" whose
-- bytes go at `offset` after the text; numbers "n<%.17g>;", strings "s<len>:<bytes>", booleans
-- "t"/"f", tables "{" key value ... "}". Anything else cannot leave the worker: an error.
local function encode(v, out, tensors, where)
  if fsdp.is_tensor(v) then
    if v.device ~= "cpu" then
      error(("DataLoader: the batch holds a %s tensor at %s; a worker process cannot use the GPU after fork: "
        .. "return CPU tensors and move each batch with :to(device) in the training loop"):format(v.device, where), 0)
    end
    local t = v:is_contiguous() and v or v:contiguous()
    local dtype = fsdp.C.fsdp_tensor_dtype(t.p)
    local nbytes = t:numel() * tonumber(fsdp.C.fsdp_dtype_size(dtype))
    local off = tensors.size
    tensors[#tensors + 1] = { t = t, off = off, nbytes = nbytes }
    tensors.size = align(off + nbytes)
    local shape = t:shape()
    out[#out + 1] = ("T%d,%d,%d%s%s;"):format(dtype, off, #shape, #shape > 0 and "," or "", table.concat(shape, ","))
  elseif type(v) == "number" then
    out[#out + 1] = ("n%.17g;"):format(v)
  elseif type(v) == "string" then
    out[#out + 1] = ("s%d:"):format(#v) .. v
  elseif type(v) == "boolean" then
    out[#out + 1] = v and "t" or "f"
  elseif type(v) == "table" then
    out[#out + 1] = "{"
    for k, x in pairs(v) do
      encode(k, out, tensors, where)
      encode(x, out, tensors, where .. "[" .. tostring(k) .. "]")
    end
    out[#out + 1] = "}"
  else
    error(("DataLoader: the batch holds a %s at %s, which cannot leave a worker process (a batch is made of "
      .. "tensors, numbers, strings, booleans and tables of them)"):format(type(v), where), 0)
  end
end

-- decode(text, pos, base): the value at text's pos, and the position after it; tensors are new
-- tensors holding a copy of their bytes at base + offset
local special = { ["inf"] = math.huge, ["-inf"] = -math.huge, ["nan"] = 0 / 0, ["-nan"] = 0 / 0 }
local function decode(s, pos, base)
  local c = s:sub(pos, pos)
  if c == "T" then
    local stop = s:find(";", pos, true)
    local f = {}
    for num in s:sub(pos + 1, stop - 1):gmatch("[^,]+") do f[#f + 1] = tonumber(num) end
    local dtype, off, ndim = f[1], f[2], f[3]
    local shape = { unpack(f, 4, 3 + ndim) }
    local t = fsdp.empty(shape, { dtype = fsdp._dtype_names[dtype] })
    local nbytes = t:numel() * tonumber(fsdp.C.fsdp_dtype_size(dtype))
    if nbytes > 0 then ffi.copy(t:data_ptr(), base + off, nbytes) end
    return t, stop + 1
  elseif c == "n" then
    local stop = s:find(";", pos, true)
    local text = s:sub(pos + 1, stop - 1)
    return tonumber(text) or special[text], stop + 1
  elseif c == "s" then
    local colon = s:find(":", pos, true)
    local len = tonumber(s:sub(pos + 1, colon - 1))
    return s:sub(colon + 1, colon + len), colon + len + 1
  elseif c == "t" or c == "f" then
    return c == "t", pos + 1
  end
  local out = {}  -- "{"
  pos = pos + 1
  while s:sub(pos, pos) ~= "}" do
    local k, v
    k, pos = decode(s, pos, base)
    v, pos = decode(s, pos, base)
    out[k] = v
  end
  return out, pos + 1
end

-- ---- slots: one memfd per (worker, prefetch position) --------------------------------------------------
-- a slot's mapping of at least n bytes in this process (grown by remapping; the worker side first
-- grows the file itself)
local function map_slot(slot, n, writable)
  if slot.len >= n then return slot.ptr end
  if slot.ptr ~= nil then C.munmap(slot.ptr, slot.len) end
  slot.ptr, slot.len = nil, 0
  local len = math.max(n, 65536)
  if writable then
    len = math.max(len, math.floor(slot.file * 1.5))
    if C.ftruncate(slot.fd, len) ~= 0 then error(("DataLoader worker: cannot grow a batch slot to %d bytes: %s"):format(len, errno_str()), 0) end
    slot.file = len
  end
  local p = C.mmap(nil, len, writable and bit.bor(PROT_READ, PROT_WRITE) or PROT_READ, MAP_SHARED, slot.fd, 0)
  if ffi.cast("intptr_t", p) == -1 then
    error(("DataLoader: cannot map a batch slot of %d bytes: %s"):format(len, errno_str()), 0)
  end
  slot.ptr, slot.len = ffi.cast("uint8_t*", p), len
  return slot.ptr
end

-- ---- the worker process ---------------------------------------------------------------------------------
-- never returns: serves tasks until the main process closes the socket, then _exit
local function worker_main(pool, w)
  local ok, err = pcall(function()
    C.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
    if C.getppid() ~= pool.owner then C._exit(0) end  -- the parent died before prctl took effect
    C.signal(SIGINT, ffi.cast("fsdp_sighandler", 1))  -- SIG_IGN
    for v, sock in ipairs(pool.socks) do
      C.close(sock)  -- the main process's ends, and the other workers'
      if v ~= w then C.close(pool.child_socks[v]) end
    end
    fsdp.set_num_threads(1)
    local id = w - 1
    local seed = pool.base_seed + id
    fsdp.data._worker_info = { id = id, num_workers = pool.n, seed = seed, dataset = pool.dataset }
    fsdp.manual_seed(seed)
    math.randomseed(seed)
    local sock = pool.child_socks[w]
    local slots = pool.slots[w]
    local head = ffi.new("int64_t[3]")
    local reply = ffi.new("int64_t[4]")
    local function answer(b, s, status, meta, tensors)
      local slot = slots[s]
      local data_at = align(#meta)
      local total = data_at + (tensors and tensors.size or 0)
      local p = map_slot(slot, total, true)
      ffi.copy(p, meta, #meta)
      for _, t in ipairs(tensors or {}) do
        if t.nbytes > 0 then ffi.copy(p + data_at + t.off, t.t:data_ptr(), t.nbytes) end
      end
      reply[0], reply[1], reply[2], reply[3] = b, status, #meta, total
      if not send_all(sock, reply, 32) then C._exit(0) end
    end
    if pool.init_fn then
      local iok, ierr = xpcall(pool.init_fn, debug.traceback, id)
      if not iok then
        -- every task of this worker answers with the error of worker_init_fn
        pool.init_error = ("worker_init_fn(%d) failed: %s"):format(id, tostring(ierr))
      end
    end
    while true do
      if not recv_all(sock, head, 24) then break end
      local b, s, len = tonumber(head[0]), tonumber(head[1]), tonumber(head[2])
      local idx = ffi.new("int64_t[?]", math.max(len, 1))
      if not recv_all(sock, idx, 8 * len) then break end
      local list = {}
      for i = 1, len do list[i] = tonumber(idx[i - 1]) end
      local bok, res = false, pool.init_error
      if not res then
        bok, res = xpcall(function()
          local batch = pool.make_batch(list)
          local out, tensors = {}, { size = 0 }
          encode(batch, out, tensors, "batch")
          return { meta = table.concat(out), tensors = tensors }
        end, debug.traceback)
      end
      if bok then answer(b, s, 0, res.meta, res.tensors)
      else answer(b, s, 1, tostring(res), nil) end
    end
  end)
  if not ok then io.stderr:write(("DataLoader worker %d: %s\n"):format(w - 1, tostring(err))) end
  io.stdout:flush()
  io.stderr:flush()
  C._exit(ok and 0 or 1)
end

-- ---- the pool, from the main process --------------------------------------------------------------------
local Pool = {}
Pool.__index = Pool

-- the words for a waitpid status
local function died_how(st)
  local sig = bit.band(st, 0x7f)
  if sig ~= 0 and sig ~= 0x7f then return ("killed by signal %d (%s)"):format(sig, signal_names[sig] or "?") end
  return ("exited with status %d"):format(bit.band(bit.rshift(st, 8), 0xff))
end

--- start({n =, prefetch =, dataset =, make_batch = fn(list of indices) -> batch, init_fn =, base_seed =})
-- -> a pool of n running workers
function M.start(o)
  local pool = setmetatable({ n = o.n, prefetch = o.prefetch, dataset = o.dataset, make_batch = o.make_batch,
    init_fn = o.init_fn, base_seed = o.base_seed, owner = C.getpid(), pids = {}, socks = {}, child_socks = {},
    slots = {}, sent = 0, taken = 0, epoch_base = 0 }, Pool)
  -- ends the workers when the pool's owner drops it (a table has no __gc in LuaJIT: a proxy does)
  pool.guard = newproxy(true)
  getmetatable(pool.guard).__gc = function() pool:shutdown() end
  for w = 1, o.n do
    local sv = ffi.new("int[2]")
    if C.socketpair(AF_UNIX, SOCK_STREAM_CLOEXEC, 0, sv) ~= 0 then
      pool:shutdown()
      error(("DataLoader: cannot make a socket for worker %d: %s"):format(w - 1, errno_str()), 0)
    end
    pool.socks[w], pool.child_socks[w] = sv[0], sv[1]
    pool.slots[w] = {}
    for s = 1, o.prefetch do
      local fd = C.memfd_create("fsdp-loader", MFD_CLOEXEC)
      if fd < 0 then
        pool:shutdown()
        error(("DataLoader: cannot make a batch slot (memfd_create): %s"):format(errno_str()), 0)
      end
      pool.slots[w][s] = { fd = fd, ptr = nil, len = 0, file = 0 }
    end
  end
  -- what the children inherit: flushed buffers (else both would write them), no garbage whose
  -- finalizers would run in a child
  io.stdout:flush()
  io.stderr:flush()
  collectgarbage("collect")
  for w = 1, o.n do
    local pid = C.fork()
    if pid == 0 then worker_main(pool, w) end
    if pid < 0 then
      local why = errno_str()
      pool:shutdown()
      error(("DataLoader: fork() of worker %d failed: %s"):format(w - 1, why), 0)
    end
    pool.pids[w] = pid
  end
  for w = 1, o.n do
    C.close(pool.child_socks[w])
    pool.child_socks[w] = -1
  end
  return pool
end

-- the worker and slot of batch b (1-based, counted over the pool's life)
function Pool:place(b)
  local w = (b - 1) % self.n + 1
  return w, math.floor((b - 1) / self.n) % self.prefetch + 1
end

--- Sends the next task: the pool's next batch is of the samples idx[k + 1 .. k + len].
function Pool:send(idx, k, len)
  self.sent = self.sent + 1
  local b = self.sent
  local w, s = self:place(b)
  local msg = ffi.new("int64_t[?]", 3 + len)
  msg[0], msg[1], msg[2] = b, s, len
  for i = 1, len do msg[2 + i] = idx[k + i] end
  -- a worker that is gone fails to take this task; take() names it at the first batch it owes
  send_all(self.socks[w], msg, 8 * (3 + len))
end

-- raises the error of worker w, which stopped answering while batch b was due
function Pool:fail(w, b)
  local st = ffi.new("int[1]")
  local pid = self.pids[w]
  local how = "stopped answering"
  if pid and C.waitpid(pid, st, 0) == pid then
    how = died_how(st[0])
    self.pids[w] = nil
  end
  self:shutdown()
  error(("DataLoader worker %d (pid %d) died while loading batch %d: %s"):format(w - 1, pid or -1,
    b - self.epoch_base, how), 0)
end

-- waits until worker w's socket has something to read (or is closed); a worker that died while
-- something else holds its socket open is found by waitpid every half second
function Pool:wait(w, b)
  local pfd = ffi.new("struct fsdp_pollfd[1]")
  pfd[0].fd, pfd[0].events = self.socks[w], POLLIN
  local st = ffi.new("int[1]")
  while true do
    local r = C.poll(pfd, 1, 500)
    if r > 0 then return end
    if r < 0 and ffi.errno() ~= EINTR then self:fail(w, b) end
    local pid = self.pids[w]
    if r == 0 and C.waitpid(pid, st, WNOHANG) == pid then
      self.pids[w] = nil
      self:shutdown()
      error(("DataLoader worker %d (pid %d) died while loading batch %d: %s"):format(w - 1, pid, b - self.epoch_base,
        died_how(st[0])), 0)
    end
  end
end

--- Takes the next batch, in order: the rebuilt batch, or the worker's error raised here.
function Pool:take()
  self.taken = self.taken + 1
  local b = self.taken
  local w, s = self:place(b)
  self:wait(w, b)
  local reply = ffi.new("int64_t[4]")
  if not recv_all(self.socks[w], reply, 32) then self:fail(w, b) end
  local status, meta_len, total = tonumber(reply[1]), tonumber(reply[2]), tonumber(reply[3])
  assert(tonumber(reply[0]) == b, "DataLoader: a worker answered out of order")
  local p = map_slot(self.slots[w][s], total, false)
  local meta = ffi.string(p, meta_len)
  if status ~= 0 then
    error(("DataLoader worker %d failed on batch %d:\n%s"):format(w - 1, b - self.epoch_base, meta), 0)
  end
  return (decode(meta, 1, p + align(meta_len)))
end

--- Starts an epoch: batches count from 1 again in errors; the tasks of an abandoned epoch are
-- taken and dropped first (persistent workers). false when the pool ended meanwhile (a worker
-- died): the caller starts a new one.
function Pool:new_epoch()
  while self.taken < self.sent do
    if self.closed then return false end
    pcall(self.take, self)
  end
  self.epoch_base = self.taken
  return not self.closed
end

--- Ends the workers (SIGKILL, then waitpid: no zombie) and frees the slots; idempotent, and a no-op
-- in a process that is not the pool's owner (a worker holds a copy of every pool).
function Pool:shutdown()
  if self.closed or C.getpid() ~= self.owner then return end
  self.closed = true
  local st = ffi.new("int[1]")
  for w = 1, self.n do
    local pid = self.pids[w]
    if pid then
      C.kill(pid, SIGKILL)
      while C.waitpid(pid, st, 0) < 0 and ffi.errno() == EINTR do end
      self.pids[w] = nil
    end
    if self.socks[w] then C.close(self.socks[w]) end
    if self.child_socks[w] and self.child_socks[w] >= 0 then C.close(self.child_socks[w]) end
    for _, slot in ipairs(self.slots[w] or {}) do
      if slot.ptr ~= nil then C.munmap(slot.ptr, slot.len) end
      C.close(slot.fd)
    end
  end
end

return M
