-- The timeline trace (FSDP_TRACE=path, fsdp.trace.start/stop; src/core/trace.c): the files are
-- valid trace-event JSON, one per rank; slices on one track nest; every unit's forward and
-- backward, every collective (issue and run) and every optimizer step is there, as many as the
-- run made (against fsdp.comm_stats and the script's loop).
local fsdp = require "fsdp"
local json = require "fsdp.json"
local H = require "helpers"

local function load_trace(path)
  local doc = json.decode(H.read_file(path), path)
  assert.is_table(doc.traceEvents, path)
  return doc.traceEvents
end

-- X slices of one track must nest: each one ends before the one it starts inside
local function check_nesting(events, tid, what)
  local xs = {}
  for _, e in ipairs(events) do if e.ph == "X" and e.tid == tid then xs[#xs + 1] = e end end
  table.sort(xs, function(a, b) return a.ts < b.ts or (a.ts == b.ts and a.dur > b.dur) end)
  local stack = {}
  for _, e in ipairs(xs) do
    while #stack > 0 and stack[#stack].ts + stack[#stack].dur <= e.ts + 1e-3 do stack[#stack] = nil end
    local top = stack[#stack]
    if top then
      assert(e.ts + e.dur <= top.ts + top.dur + 1e-3,
        ("%s: '%s' starts inside '%s' but ends after it"):format(what, e.name, top.name))
    end
    stack[#stack + 1] = e
  end
  return #xs
end

local function count(events, pred)
  local n = 0
  for _, e in ipairs(events) do if pred(e) then n = n + 1 end end
  return n
end

local function check_rank(path, collectives)
  local ev = load_trace(path)
  local names = {}
  for _, e in ipairs(ev) do if e.ph == "M" and e.name == "thread_name" then names[e.tid] = e.args.name end end
  assert.same({ "compute", "communication", "backward (units)" }, names)
  check_nesting(ev, 1, path)
  local comm = check_nesting(ev, 2, path)
  assert.equal(collectives, comm, path .. ": collectives on the communication track")
  assert.equal(collectives, count(ev, function(e) return e.ph == "i" and e.name:find("^issue ") end), path)
  -- three forwards of each unit (two steps and the validation pass), two backwards, two steps
  for _, unit in ipairs { "Sequential", "2" } do
    assert.equal(3, count(ev, function(e) return e.ph == "X" and e.name == "forward " .. unit end), path .. " " .. unit)
    local open, done = {}, 0
    for _, e in ipairs(ev) do
      if e.name == "backward " .. unit then
        if e.ph == "b" then
          assert.is_nil(open[e.id], path .. ": backward opened twice"); open[e.id] = e.ts
        elseif e.ph == "e" then
          assert.truthy(open[e.id] and open[e.id] <= e.ts, path .. ": backward closed before it opened")
          open[e.id] = nil; done = done + 1
        end
      end
    end
    assert.equal(2, done, path .. ": backwards of " .. unit)
    assert.same({}, open, path .. ": a backward never closed")
  end
  assert.equal(2, count(ev, function(e) return e.ph == "X" and e.name == "optimizer step" end), path)
  if collectives > 0 then  -- (one rank: a unit's shard is its whole parameter, nothing to gather)
    assert.truthy(count(ev, function(e) return e.ph == "X" and e.name:find("^wait all_gather") end) > 0, path)
  end
end

describe("the timeline trace", function()
  it("records a run on one rank into the path it names", function()
    local dir = H.mkdtemp("fsdp_trace")
    local rc, out = H.sh(("luajit %strace_train.lua"):format(H.scripts),
      ("FSDP_TRACE=%s/t.json LUA_PATH='%s/lua/?.lua;%s/lua/?/init.lua;;' LUA_CPATH='%s/?.so;;'"):format(dir, H.root,
        H.root, H.root))
    assert.equal(0, rc, out)
    check_rank(dir .. "/t.json", tonumber(out:match("rank 0 collectives (%d+)")))
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("writes one file per rank, each with its collectives", function()
    if not H.has_mpi() then pending("no mpirun or libfsdp_mpi.so") return end
    local dir = H.mkdtemp("fsdp_trace")
    local rc, out = H.sh(("%s -n 2 %strace_train.lua"):format(H.fsdprun, H.scripts), ("FSDP_TRACE=%s/t.json"):format(dir))
    assert.equal(0, rc, out)
    for r = 0, 1 do
      local n = tonumber(out:match(("rank %d collectives (%%d+)"):format(r)))
      assert.truthy(n and n > 0, out)
      check_rank(("%s/t.rank%d.json"):format(dir, r), n)
    end
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("starts and stops from Lua, and says what is wrong", function()
    local dir = H.mkdtemp("fsdp_trace")
    fsdp.trace.start(dir .. "/s.json")
    assert.is_true(fsdp.trace.enabled())
    local opt = fsdp.optim.SGD({ fsdp.zeros(2):requires_grad_() }, { lr = 0.1 })
    opt:step()
    fsdp.trace.stop()
    assert.is_false(fsdp.trace.enabled())
    local ev = load_trace(dir .. "/s.json")
    assert.equal(1, count(ev, function(e) return e.name == "optimizer step" end))
    H.assert_error(function() fsdp.trace.stop() end, "trace.stop: no trace is running")
    H.assert_error(function() fsdp.trace.start(3) end, "fsdp.trace.start: path must be a string, got number")
    -- (a folder that cannot take the file is refused at the start, not at the end of the run)
    H.assert_error(function() fsdp.trace.start(dir .. "/no/such/dir/x.json") end,
      "trace.start: cannot write the trace '" .. dir .. "/no/such/dir/x.json': its folder '" .. dir .. "/no/such/dir'")
    assert.is_false(fsdp.trace.enabled())
    os.execute("rm -rf '" .. dir .. "'")
  end)
end)
