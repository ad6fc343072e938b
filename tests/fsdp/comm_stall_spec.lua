-- A rank that stalls (SIGSTOP) at any point of a collective: before the ranks agree, right after
-- submitting, right after agreeing (in the data movement of each kind), between collectives and
-- at a random moment sent from outside. Every other rank must fail within FSDP_COMM_TIMEOUT plus
-- the stated margin (docs/environment.md, FSDP_COMM_TIMEOUT: 0.5 s; SLACK below is the scheduling of the
-- ranks and of this measurement on a loaded machine), measured from the moment the victim
-- stopped, naming the collective, the tag and the missing rank; and after it sends SIGCONT to
-- the stalled rank its next collective must fail with the same first error. Trials run as 2- and
-- 3-rank jobs (tests/scripts/comm_stall.sh), a few at a time; the table of trials is printed.
local H = require "helpers"

local mpi = H.has_mpi()
local TIMEOUT = 2
local MARGIN, SLACK = 0.5, 0.5
-- victim, mode, step (collective numbers for "data<K>": step s has #5s-3 async all_reduce,
-- #5s-2 all_gather, #5s-1 reduce_scatter, #5s all_reduce, #5s+1 broadcast), ranks (default 2),
-- late0: rank 0 comes to that step so many seconds late (it decides the agreement, so the others
-- wait for its verdict, which names the victim: their bound counts from rank 0's arrival)
local trials = {
  { 1, "before", 3 }, { 0, "before", 4 }, { 1, "async", 5 }, { 0, "async", 3 },
  { 1, "data18", 0 }, { 1, "data24", 0 }, { 0, "data14", 0 }, { 0, "data31", 0 },
  { 1, "after", 6 }, { 1, "ext", 0 }, { 0, "ext", 0 }, { 1, "data35", 0 },
  { 0, "before", 4, np = 3 }, { 1, "data24", 0, np = 3 }, { 2, "before", 3, np = 3, late0 = 1 },
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
    -- 8 jobs at a time (stopped ranks use no CPU)
    for b = 1, #trials, 8 do
      local cmds = {}
      for i = b, math.min(b + 7, #trials) do
        local t = trials[i]
        cmds[#cmds + 1] = ("%scomm_stall.sh %s %d %s %d %s %d %s &"):format(H.scripts, dirs[i], t[1], t[2], t[3], t.delay,
          t.np or 2, t.late0 or 0)
      end
      os.execute(("cd /tmp && FSDP_COMM_TIMEOUT=%d timeout -k 5 60 bash -c '%s wait'"):format(TIMEOUT, table.concat(cmds, " ")))
    end
    local rows, failures = { "ranks victim  where stopped        survivor stop->error  message" }, {}
    local worst = 0
    for i, t in ipairs(trials) do
      local out = H.untag(read(dirs[i] .. "/out") or "")
      local victim = t[1]
      -- the stop: written by the victim (or comm_stall.sh) before SIGSTOP, or printed by the comm thread
      local stopped = tonumber(read(dirs[i] .. "/stopped") or "")
        or tonumber(out:match(("FSDP_COMM_STALL_AT: rank %d stops at ([%%d.]+)"):format(victim)))
      local where = t[2] == "ext" and ("random, %s s"):format(t.delay) or (t[3] > 0 and ("%s step %d"):format(t[2], t[3]) or t[2])
      if t.late0 then where = ("%s, 0 late %g s"):format(where, t.late0) end
      local bad = not stopped or out:find("rc=124", 1, true) or out:find("rc=0\n", 1, true)
      for survivor = 0, (t.np or 2) - 1 do
        if survivor ~= victim then
          local e, msg = out:match(("rank %d error at ([%%d.]+) after [%%d.]+ s: ([^\n]*)"):format(survivor))
          local took = e and stopped and tonumber(e) - stopped
          local later = out:match(("rank %d later: ([^\n]*)"):format(survivor))
          msg = msg and msg:gsub("^.-:%d+: ", "")
          rows[#rows + 1] = ("  %d     %d     %-22s %d     %6s s    %s"):format(t.np or 2, victim, where, survivor,
            took and ("%.2f"):format(took) or "-", msg or "(none)")
          if took then worst = math.max(worst, took - (t.late0 or 0)) end
          local ok = msg and msg:find(("timed out after %d s waiting for rank %d"):format(TIMEOUT, victim), 1, true)
            and msg:find("'s%d+%-%a+'") and took and took < (t.late0 or 0) + TIMEOUT + MARGIN + SLACK and later == msg
          bad = bad or not ok
        end
      end
      if bad then failures[#failures + 1] = ("trial %d (%d %s %d):\n%s"):format(i, t[1], t[2], t[3], out) end
      os.execute("rm -rf '" .. dirs[i] .. "'")
    end
    rows[#rows + 1] = ("worst stop->error %.2f s (bound: timeout %d s + margin %.1f s + slack %.1f s)"):format(worst,
      TIMEOUT, MARGIN, SLACK)
    print("\n" .. table.concat(rows, "\n"))
    assert(#failures == 0, table.concat(failures, "\n"))
  end)
end)
