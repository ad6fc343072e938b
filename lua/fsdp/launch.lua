-- fsdp.launch: the output collector bin/fsdprun runs beside mpirun, for rank-tagged output.
--
--   luajit launch.lua collect OUT_FIFO ERR_FIFO
--
-- mpirun runs with --tag-output and writes its stdout into OUT_FIFO, its stderr into ERR_FIFO.
-- OpenMPI tags what it forwards at the start of every chunk it read from a rank and after every
-- newline ("[1,2]<stdout>:"), and chunks of different ranks follow each other anywhere, mid-line
-- included. Here the pieces are put back together per rank and stream, and every line goes out
-- whole, as "[rank 2] line" (a line ends at "\n" or "\r"; a partial line goes out as it is after
-- 0.1 s when a "\r" came before it -- a progress line redrawn in place stays live --, else after
-- 1 s). On stderr, identical lines that ranks print within 0.5 s of each other (the same error on
-- every rank) are shown once, as "[ranks 0-3] line". mpirun's own account of a rank that failed is
-- replaced by one line naming the rank that failed first, after one with that rank's Lua error,
-- and this process exits with that rank's status (0 when none failed), which fsdprun makes its own.
--
-- Plain LuaJIT and its FFI over libc (open, poll, read, write); it does not load fsdp.
local ffi = require "ffi"
local bit = require "bit"
local C = ffi.C

ffi.cdef [[
typedef struct { int fd; short events; short revents; } pollfd_t;
int poll(pollfd_t* fds, unsigned long nfds, int timeout);
int open(const char* path, int flags);
int close(int fd);
long read(int fd, void* buf, size_t n);
long write(int fd, const void* buf, size_t n);
typedef void (*sighandler_t)(int);
sighandler_t signal(int signum, sighandler_t handler);
typedef struct { long tv_sec; long tv_nsec; } timespec_t;
int clock_gettime(int clk, timespec_t* ts);
]]

local POLLIN, POLLHUP, POLLERR = 1, 16, 8
local SIGTERM, SIGINT, SIGHUP = 15, 2, 1
local WINDOW = 0.5  -- seconds a stderr line waits for the same line from other ranks

local function now()
  local ts = ffi.new("timespec_t")
  C.clock_gettime(1, ts)  -- CLOCK_MONOTONIC
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end

local function write_all(fd, s)
  local off, n = 0, #s
  while off < n do
    local w = C.write(fd, ffi.cast("const char*", s) + off, n - off)
    if w <= 0 then
      if ffi.errno() ~= 4 then return end  -- EINTR: again; anything else: the reader is gone
    else
      off = off + tonumber(w)
    end
  end
end

local buf = ffi.new("char[?]", 65536)
local function read_some(fd)  -- a chunk, "" at end of file
  while true do
    local n = C.read(fd, buf, 65536)
    if n >= 0 then return ffi.string(buf, n) end
    if ffi.errno() ~= 4 then return "" end
  end
end

-- "rank 2", "ranks 0-3", "ranks 0,2,5-7" for a list of rank numbers
local function ranks_label(list)
  table.sort(list)
  local out, i = {}, 1
  while i <= #list do
    local j = i
    while j < #list and list[j + 1] == list[j] + 1 do j = j + 1 end
    out[#out + 1] = j > i and (list[i] .. "-" .. list[j]) or tostring(list[i])
    i = j + 1
  end
  return (#list > 1 and "ranks " or "rank ") .. table.concat(out, ",")
end

-- ---- one rank's stream: pieces in, whole lines out ----------------------------------------------------
-- emit(rank, piece, whole, cont): piece ends in "\n" or "\r" unless forced out partial (whole =
-- false); cont: it continues a line whose start went out partial (so it takes no tag)
local function line_buffer(rank, emit)
  local lb = { pending = "", after_cr = false, since = nil, mid = false }
  function lb.add(s)
    lb.pending = lb.pending .. s
    while true do
      local i = lb.pending:find("[\n\r]")
      if not i then break end
      local piece = lb.pending:sub(1, i)
      lb.pending = lb.pending:sub(i + 1)
      emit(rank, piece, true, lb.mid)
      lb.after_cr, lb.mid = piece:sub(-1) == "\r", false
    end
    lb.since = #lb.pending > 0 and (lb.since or now()) or nil
  end
  function lb.tick(force)
    if #lb.pending > 0 and (force or (lb.since and now() - lb.since >= (lb.after_cr and 0.1 or 1.0))) then
      emit(rank, lb.pending, false, lb.mid)
      lb.pending, lb.since, lb.mid = "", nil, true
    end
  end
  return lb
end

-- ---- mpirun's output: tagged pieces of the ranks, and mpirun's own lines ------------------------------
-- feeds a stream's raw bytes; calls piece(rank, text) for what ranks sent and own(line) for
-- mpirun's own whole lines
local TAG = "^%[%d+,(%d+)%]<std%a+>:"
local function demux(piece, own)
  local raw = ""
  local d = {}
  function d.add(s, eof)
    raw = raw .. s
    while #raw > 0 do
      local s1, e1, rank = raw:find(TAG)
      if s1 then
        -- the piece runs to its first newline, or to the next tag (a chunk that ended mid-line)
        local rest = raw:sub(e1 + 1)
        local nl = rest:find("\n", 1, true)
        local nt = rest:find("%[%d+,%d+%]<std%a+>:")
        local stop = nl and (not nt or nl < nt) and nl or (nt and nt - 1)
        if not stop then
          -- the piece so far, but not what could be the start of the next tag
          local keep = eof and #rest + 1 or (rest:find("%[[%d,%]<std%a>]*$") or #rest + 1)
          if keep > 1 then piece(tonumber(rank), rest:sub(1, keep - 1)) end
          raw = raw:sub(1, e1) .. rest:sub(keep)
          if keep == 1 or not eof then break end
        else
          piece(tonumber(rank), rest:sub(1, stop))
          raw = rest:sub(stop + 1)
        end
      elseif raw:find("^%[[%d,%]<std%a>]*$") and not eof then
        break  -- the start of a tag: wait for the rest
      else
        local nl = raw:find("\n", 1, true)
        if not nl and not eof then break end
        own(raw:sub(1, (nl or #raw + 1) - 1))
        raw = nl and raw:sub(nl + 1) or ""
      end
    end
  end
  return d
end

local function run_collect(out_path, err_path)
  -- fsdprun forwards one TERM/INT to mpirun; this process reads on until mpirun's output closes
  local ign = ffi.cast("sighandler_t", 1)
  C.signal(SIGTERM, ign); C.signal(SIGINT, ign); C.signal(SIGHUP, ign)
  local ofd, efd = C.open(out_path, 0), C.open(err_path, 0)  -- O_RDONLY: waits for mpirun to open them
  if ofd < 0 or efd < 0 then io.stderr:write("fsdp.launch: cannot open the output fifos\n"); os.exit(1) end

  -- stdout: each rank's lines, tagged, as they complete
  local function tagged(rank, piece, cont)  -- (a bare line end takes no tag: "\r" before a redraw)
    return ((cont or piece:find("^[\n\r]$")) and "" or ("[rank %d] "):format(rank)) .. piece
  end
  local function out_emit(rank, piece, _, cont) write_all(1, tagged(rank, piece, cont)) end
  -- stderr: lines wait WINDOW seconds for the same line of other ranks; partial ones go at once
  local queue = {}  -- {text, ranks, seen, t}, oldest first
  local function flush(all)
    local t = now()
    while #queue > 0 and (all or t - queue[1].t >= WINDOW) do
      local e = table.remove(queue, 1)
      write_all(2, ("[%s] %s"):format(ranks_label(e.ranks), e.text))
    end
  end
  -- each rank's error message: the line before its first "stack traceback:" (luajit's own "luajit:
  -- " prefix dropped), said again beside the line that names the rank that failed first, where it
  -- is easy to find among the ranks' tagged traceback lines
  local last_line, message = {}, {}
  local function note_error(rank, line)
    line = line:gsub("[\r\n]+$", "")
    if line == "stack traceback:" then
      message[rank] = message[rank] or last_line[rank]
    elseif not line:find("^%s") then
      last_line[rank] = line:gsub("^%S*luajit: ", "")
    end
  end
  local function err_emit(rank, piece, whole, cont)
    if whole and not cont then note_error(rank, piece) end
    if cont or not whole then flush(true); write_all(2, tagged(rank, piece, cont)); return end
    for _, e in ipairs(queue) do
      if e.text == piece and not e.seen[rank] then
        e.ranks[#e.ranks + 1] = rank
        e.seen[rank] = true
        return
      end
    end
    queue[#queue + 1] = { text = piece, ranks = { rank }, seen = { [rank] = true }, t = now() }
  end
  local bufs = { {}, {} }  -- per stream, per rank: line buffers
  local function buffer_of(k, rank)
    local b = bufs[k][rank]
    if not b then
      b = line_buffer(rank, k == 1 and out_emit or err_emit)
      bufs[k][rank] = b
    end
    return b
  end

  -- mpirun's own lines: its report of the rank that failed first is ours to give
  local failed  -- {rank, status}
  local block
  local function own_line(line, k)
    if k == 1 then write_all(1, line .. "\n") return end
    flush(true)
    if line:match("^%-%-%-%-%-%-%-%-%-%-") then
      if not block then block = {} return end
      local text = table.concat(block, "\n")
      block = nil
      local r = text:match("Process name: %[%[%d+,%d+%],(%d+)%]")
      local code = text:match("Exit code:%s*(%d+)")
      if r and code and not failed then failed = { tonumber(r), tonumber(code) } end
      local sr, sig = text:match("process rank (%d+) with PID %d+ on node %S+ exited on signal (%d+)")
      if sr and not failed then failed = { tonumber(sr), 128 + tonumber(sig) } end
      if not (text:find("non%-zero exit code") or text:find("non%-zero status") or sr) then
        write_all(2, ("-"):rep(74) .. "\n" .. text .. "\n" .. line .. "\n")
      end
    elseif block then
      block[#block + 1] = line
    else
      write_all(2, line .. "\n")
    end
  end

  local streams = {
    demux(function(rank, p) buffer_of(1, rank).add(p) end, function(l) own_line(l, 1) end),
    demux(function(rank, p) buffer_of(2, rank).add(p) end, function(l) own_line(l, 2) end),
  }
  local fds = ffi.new("pollfd_t[2]")
  local open = { true, true }
  while open[1] or open[2] do
    fds[0].fd, fds[0].events, fds[0].revents = open[1] and ofd or -1, POLLIN, 0
    fds[1].fd, fds[1].events, fds[1].revents = open[2] and efd or -1, POLLIN, 0
    local waiting = #queue > 0
    for k = 1, 2 do for _, b in pairs(bufs[k]) do waiting = waiting or b.since ~= nil end end
    C.poll(fds, 2, waiting and 50 or -1)
    for k = 1, 2 do
      if open[k] and bit.band(fds[k - 1].revents, POLLIN + POLLHUP + POLLERR) ~= 0 then
        local chunk = read_some(k == 1 and ofd or efd)
        if chunk == "" then open[k] = false end
        streams[k].add(chunk, chunk == "")
      end
    end
    for k = 1, 2 do for _, b in pairs(bufs[k]) do b.tick(false) end end
    flush(false)
  end
  for k = 1, 2 do for _, b in pairs(bufs[k]) do b.tick(true) end end
  flush(true)
  if block then write_all(2, table.concat(block, "\n") .. "\n") end
  if failed then
    local msg = message[failed[1]]
    if msg then write_all(2, ("fsdprun: rank %d's error: %s\n"):format(failed[1], msg)) end
    write_all(2, ("fsdprun: rank %d failed first (exit status %d); the job was stopped\n"):format(failed[1], failed[2]))
    os.exit(failed[2] > 255 and 1 or failed[2])
  end
  os.exit(0)
end

if arg[1] == "collect" and arg[2] and arg[3] then
  run_collect(arg[2], arg[3])
else
  io.stderr:write("usage: luajit launch.lua collect OUT_FIFO ERR_FIFO\n")
  os.exit(2)
end
