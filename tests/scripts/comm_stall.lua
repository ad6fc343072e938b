-- One trial of a stalled rank (tests/fsdp/comm_stall_spec.lua runs it through comm_stall.sh).
--   comm_stall.lua DIR VICTIM MODE STEP [LATE0]
-- Every rank writes its pid to DIR/pid<rank>, then runs rounds of an async all_reduce, then
-- all_gather, reduce_scatter, all_reduce and broadcast of 1 M floats (tags "s<step>-<kind>"). The
-- victim stops itself with SIGSTOP at round STEP: MODE "before" stops before submitting (the
-- others wait in the agreement), "async" right after submitting an async all_reduce (its comm
-- thread is then in the agreement or moving data), "after" right after a round completed; MODE
-- "ext" never stops itself (comm_stall.sh sends SIGSTOP from outside at a random moment). The stop
-- time goes to DIR/stopped (epoch seconds). LATE0 > 0: rank 0 comes to round STEP that many
-- seconds late (alive, so the others must still name the victim, not rank 0). Each survivor
-- prints "rank R error at E after T s: <msg>" (E: epoch seconds); once every survivor did, they
-- send SIGCONT to the victim, wait 1 s, call all_reduce again and print "rank R later: <msg>";
-- the first error must stick (exit 1). Without a stop: "rank R finished" (exit 0).
local fsdp = require "fsdp"
local ffi = require "ffi"
ffi.cdef [[
int poll(void* fds, unsigned long nfds, int timeout);
int getpid(void);
int kill(int pid, int sig);
typedef struct { long tv_sec; long tv_usec; } fsdp_stall_timeval;
int gettimeofday(fsdp_stall_timeval* tv, void* tz);
]]
local dir, victim, mode, stop_step, late0 = arg[1], tonumber(arg[2]), arg[3], tonumber(arg[4] or 0), tonumber(arg[5] or 0)
local r, N = fsdp.rank(), fsdp.world_size()
local SIGSTOP, SIGCONT = 19, 18

local tv = ffi.new("fsdp_stall_timeval")
local function now()
  ffi.C.gettimeofday(tv, nil)
  return tonumber(tv.tv_sec) + 1e-6 * tonumber(tv.tv_usec)
end
local function write(path, s)
  local f = assert(io.open(path, "w"))
  f:write(s)
  f:close()
end
local function stop_me()
  write(dir .. "/stopped", ("%.3f\n"):format(now()))
  ffi.C.kill(ffi.C.getpid(), SIGSTOP)
end

write(dir .. "/pid" .. r .. ".tmp", tostring(ffi.C.getpid()))
os.rename(dir .. "/pid" .. r .. ".tmp", dir .. "/pid" .. r)
fsdp.barrier()

local n = 1024 * 1024
local full, shard = fsdp.ones(n * N), fsdp.ones(n)
local function round(s)
  fsdp.all_gather(full, shard, { tag = ("s%d-ag"):format(s) })
  fsdp.reduce_scatter(shard, full, "avg", { tag = ("s%d-rs"):format(s) })
  fsdp.all_reduce(shard, "avg", { tag = ("s%d-ar"):format(s) })
  fsdp.broadcast(full, 0, { tag = ("s%d-bc"):format(s) })
end

local t_end = now() + 20
local s = 0
while now() < t_end do
  s = s + 1
  local t0 = now()
  local ok, err = pcall(function()
    if r == victim and s == stop_step and mode == "before" then stop_me() end
    if r == 0 and s == stop_step and late0 > 0 then ffi.C.poll(nil, 0, late0 * 1000) end
    local w = fsdp.all_reduce(shard, "avg", { tag = ("s%d-async"):format(s), async = true })
    if r == victim and s == stop_step and mode == "async" then stop_me() end
    w:wait()
    round(s)
    if r == victim and s == stop_step and mode == "after" then stop_me() end
  end)
  if not ok then
    io.write(("rank %d error at %.3f after %.2f s: %s\n"):format(r, now(), now() - t0, tostring(err)))
    io.flush()
    if r ~= victim then
      -- (the victim resumes only once every survivor failed: else it could still take a slower
      -- survivor's agreement and leave it failing later, in the data phase, for the rank that failed)
      write(dir .. "/failed" .. r, "")
      for _ = 1, 100 do
        local all = true
        for q = 0, N - 1 do
          local g = q ~= victim and io.open(dir .. "/failed" .. q)
          if g then g:close() elseif q ~= victim then all = false end
        end
        if all then break end
        ffi.C.poll(nil, 0, 50)
      end
      local f = io.open(dir .. "/pid" .. victim)
      if f then
        ffi.C.kill(tonumber(f:read("*a")), SIGCONT)
        f:close()
      end
      ffi.C.poll(nil, 0, 1000)  -- the victim runs again: the error must stick anyway
      local ok2, err2 = pcall(fsdp.all_reduce, fsdp.ones(2), "sum", { tag = "after SIGCONT" })
      io.write(ok2 and ("rank %d later: continued silently\n"):format(r)
        or ("rank %d later: %s\n"):format(r, tostring(err2)))
      io.flush()
    end
    ffi.C.poll(nil, 0, 300)
    os.exit(1)
  end
end
io.write(("rank %d finished %d rounds\n"):format(r, s))
