-- What a training script takes from the library for its plumbing: fsdp.exit (Python's sys.exit(msg):
-- a message, status 1, no traceback, on one rank or several, never a hang) and fsdp.perf_counter
-- (Python's time.perf_counter: monotonic seconds). examples/gpt.lua and train.lua use both.
local H = require "helpers"
local fsdp = require "fsdp"

-- writes `code` into a script file named name (under a fresh directory) and returns its path
local dir = H.mkdtemp("fsdp_exit")
-- a script in dir that requires fsdp first, or with bare = true only code
local function script(name, code, bare)
  local path = dir .. "/" .. name
  local f = assert(io.open(path, "w"))
  f:write(bare and "" or "local fsdp = require 'fsdp'\n", code, "\n")
  f:close()
  return path
end

describe("fsdp.exit", function()
  it("writes '<script>: message' (formatted) to stderr, flushes stdout, exits 1 without a traceback", function()
    local path = script("bad_input.lua", [[
io.write("half a line")
fsdp.exit("--batch-size %d must be a multiple of %d (%s)", 10, 4, "ranks")
print("never here")]])
    local rc, out = H.sh(("%s %s"):format(H.fsdprun, path))
    assert.are.equal(1, rc, out)
    local at_out = out:find("half a line", 1, true)
    local at_err = out:find("bad_input.lua: --batch-size 10 must be a multiple of 4 (ranks)\n", 1, true)
    assert.truthy(at_out and at_err and at_out < at_err, out) -- stdout first: it is flushed before the message
    assert.falsy(out:find("never here", 1, true), out)
    assert.falsy(out:find("traceback", 1, true), out)
  end)

  it("takes a message without format arguments as it is, and exits 0 silently without one", function()
    local rc, out = H.sh(("%s %s"):format(H.fsdprun, script("plain.lua", 'fsdp.exit("100% done?")')))
    assert.are.equal(1, rc, out)
    assert.truthy(out:find("plain.lua: 100% done?\n", 1, true), out)
    rc, out = H.sh(("%s %s"):format(H.fsdprun, script("quiet.lua", 'print("before")\nfsdp.exit()\nprint("after")')))
    assert.are.equal(0, rc, out)
    assert.are.equal("before\n", (out:gsub("__rc=%d+%s*$", "")))
  end)

  if not H.has_mpi() then
    pending("fsdp.exit with several ranks (libfsdp_mpi.so or mpirun missing)")
    return
  end

  it("with 2 ranks: a message every rank gives is shown once, and status 1", function()
    local path = script("every_rank.lua", 'fsdp.init()\nfsdp.exit("the corpus is missing on rank %d of %d", 0, fsdp.world_size())')
    local rc, out = H.sh(("%s -n 2 %s"):format(H.fsdprun, path), "FSDP_COMM_TIMEOUT=30", 60)
    assert.are.equal(1, rc, out)
    local _, n = out:gsub("every_rank.lua: the corpus is missing on rank 0 of 2", "")
    assert.are.equal(1, n, out)
  end)

  it("with 2 ranks: one rank's exit while the other waits in a collective ends the job, no hang", function()
    local path = script("one_rank.lua", [[
fsdp.init()
if fsdp.rank() == 1 then fsdp.exit("rank 1 gives up") end
fsdp.all_reduce(fsdp.tensor({ 1 }), "sum")
print("rank 0 went on")]])
    local rc, out, secs = H.sh(("%s -n 2 %s"):format(H.fsdprun, path), "FSDP_COMM_TIMEOUT=30", 60)
    assert.are.equal(1, rc, out)
    assert.truthy(out:find("one_rank.lua: rank 1 gives up", 1, true), out)
    -- mpirun names the rank whose process ended first: rank 1 usually, rank 0 when its error at
    -- the mismatch beats rank 1's shutdown at exit, and then rank 0's message names rank 1
    assert.truthy(out:find("rank 1 failed first", 1, true) or out:find("rank 1 called shutdown", 1, true), out)
    assert.falsy(out:find("rank 0 went on", 1, true), out)
    assert.is_true(secs < 30, out) -- told at once, not by the comm timeout
  end)
end)

describe("fsdp.perf_counter", function()
  it("is monotonic seconds: it never goes back and it counts a sleep", function()
    local t0 = fsdp.perf_counter()
    local prev = t0
    for _ = 1, 1000 do
      local t = fsdp.perf_counter()
      assert.is_true(t >= prev)
      prev = t
    end
    os.execute("sleep 0.2")
    local dt = fsdp.perf_counter() - t0
    assert.is_true(dt >= 0.2 and dt < 60, tostring(dt))
  end)

  -- a script's own declaration of clock_gettime, after fsdp is loaded and before it
  local own = [[
local ffi = require "ffi"
ffi.cdef("typedef struct { long s; long ns; } my_ts; int clock_gettime(int, my_ts*);")
local ts = ffi.new("my_ts")
]]
  local check = [[
assert(ffi.C.clock_gettime(1, ts) == 0)
assert(math.abs(tonumber(ts.s) + tonumber(ts.ns) * 1e-9 - fsdp.perf_counter()) < 5, "two readings of one clock")
print("clock ok")]]
  for _, case in ipairs {
    { "leaves a script free to declare clock_gettime with a timespec struct of its own",
      function() return H.lua(own .. check) end },
    { "works when a script declared clock_gettime with its own struct before it required fsdp",
      function()
        local path = script("clock_first.lua", own .. 'local fsdp = require "fsdp"\n' .. check, true)
        return H.sh(("%s %s"):format(H.fsdprun, path))
      end },
  } do
    it(case[1], function()
      local rc, out = case[2]()
      assert.are.equal(0, rc, out)
      assert.truthy(out:find("clock ok", 1, true), out)
    end)
  end

  it("is the clock fsdp.progress counts with", function()
    assert.are.equal(fsdp.perf_counter, fsdp.progress.clock)
  end)
end)


teardown(function() os.execute("rm -rf '" .. dir .. "'") end)
