-- A rank that stalls (SIGSTOP) at any point of a collective: before the ranks agree, right after
-- submitting, right after agreeing (in the data movement of each kind), between collectives and
-- at a random moment sent from outside. The survivor must fail within FSDP_COMM_TIMEOUT (plus
-- the agreement's grace when rank 0 is the one missing) naming the collective, the tag and the
-- missing rank, and after it sends SIGCONT to the stalled rank its next collective must fail with
-- the same first error. Trials run as 2-rank jobs (tests/scripts/comm_stall.sh), a few at a time;
-- the table of trials is printed.
local H = require "helpers"

local mpi = H.has_mpi()
local TIMEOUT = 2
-- victim, mode, step (collective numbers for "data<K>": step s has #5s-3 async all_reduce,
-- #5s-2 all_gather, #5s-1 reduce_scatter, #5s all_reduce, #5s+1 broadcast)
local trials = {
  { 1, "before", 3 }, { 0, "before", 4 }, { 1, "async", 5 }, { 0, "async", 3 },
  { 1, "data18", 0 }, { 1, "data24", 0 }, { 0, "data14", 0 }, { 0, "data31", 0 },
  { 1, "after", 6 }, { 1, "ext", 0 }, { 0, "ext", 0 }, { 1, "data35", 0 },
}

local function read(path)
  local f = io.open(path)
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

describe("a stalled rank", function()
  it("makes the other fail in bounded time, naming it, and the error sticks after SIGCONT", function()
    if not mpi then pending("no mpirun or libfsdp_mpi.so") return end
    math.randomseed(os.time())
    local dirs = {}
    for i, t in ipairs(trials) do
      dirs[i] = H.mkdtemp("fsdp_stall")
      t.delay = t[2] == "ext" and ("%.2f"):format(0.3 + 1.2 * math.random()) or "0"
    end
    -- 6 jobs at a time (stopped ranks use no CPU)
    for b = 1, #trials, 6 do
      local cmds = {}
      for i = b, math.min(b + 5, #trials) do
        local t = trials[i]
        cmds[#cmds + 1] = ("%scomm_stall.sh %s %d %s %d %s &"):format(H.scripts, dirs[i], t[1], t[2], t[3], t.delay)
      end
      os.execute(("cd /tmp && FSDP_COMM_TIMEOUT=%d timeout -k 5 60 bash -c '%s wait'"):format(TIMEOUT, table.concat(cmds, " ")))
    end
    local rows, failures = { "victim  where stopped        stop->error  message" }, {}
    for i, t in ipairs(trials) do
      local out = read(dirs[i] .. "/out") or ""
      local victim, survivor = t[1], 1 - t[1]
      local e, dt, msg = out:match(("rank %d error at ([%%d.]+) after ([%%d.]+) s: ([^\n]*)"):format(survivor))
      local stopped = tonumber(read(dirs[i] .. "/stopped") or "")
      local took = e and (stopped and tonumber(e) - stopped or tonumber(dt))
      local later = out:match(("rank %d later: ([^\n]*)"):format(survivor))
      local where = t[2] == "ext" and ("random, %s s"):format(t.delay) or (t[3] > 0 and ("%s step %d"):format(t[2], t[3]) or t[2])
      rows[#rows + 1] = ("  %d     %-22s %6s s    %s"):format(victim, where, took and ("%.2f"):format(took) or "-",
        msg and msg:gsub("^.-:%d+: ", "") or "(none)")
      local bound = 1.25 * TIMEOUT + 2 + 1.5  -- rank 0 missing in the agreement: the others' grace
      local ok = msg and msg:find(("timed out after %d s waiting for rank %d"):format(TIMEOUT, victim), 1, true)
        and msg:find("'s%d+%-%a+'") and took < bound and later and later == msg:gsub("^.-:%d+: ", "")
        and not out:find("rc=124", 1, true) and not out:find("rc=0\n", 1, true)
      if not ok then failures[#failures + 1] = ("trial %d (%d %s %d):\n%s"):format(i, t[1], t[2], t[3], out) end
      os.execute("rm -rf '" .. dirs[i] .. "'")
    end
    print("\n" .. table.concat(rows, "\n"))
    assert(#failures == 0, table.concat(failures, "\n"))
  end)
end)
