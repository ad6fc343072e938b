-- The FSDP matrix: wrapping x freezing x usage x strategy, at world size 1, 2 and 4.
--
-- Each world size is ONE launch of tests/scripts/fsdp_matrix.lua (about 50 cases, each compared
-- with single-process training of the same unwrapped model on the global batch; see the header
-- of that script for what a case checks and the tolerances). This spec parses its output:
--   PLAN ws=N cases=K            printed first (rank 0)
--   CASE <name> ws=N ... PASS|FAIL   one line per case (rank 0)
--   DETAIL <name> rank r: <why>  for each failed check (any rank)
--   SUMMARY ws=N cases=K failed=F ...
-- and fails naming the failed cases, then again with the wrapped side on the "cuda" device. A last
-- launch sabotages the wrapped side (1% larger
-- learning rate) and expects every float32 case to FAIL: the comparison demonstrably can fail.
-- Rerun one world size by hand:  bin/fsdprun -n 2 tests/scripts/fsdp_matrix.lua [lua pattern]
local fsdp = require "fsdp"
local H = require "helpers"
local SCRIPT = H.scripts .. "fsdp_matrix.lua"
local MIN_CASES = 45

local function have_mpirun()
  return os.execute("command -v mpirun >/dev/null 2>&1") == 0
end

-- runs the matrix; returns {status=, out=, plan=, cases={name -> "PASS"|"FAIL"}, order={names},
-- details={name -> {lines}}, summary=line}
local function launch(np, env)
  local cmd = ("cd '%s' && %s FSDP_COMM_TIMEOUT=60 timeout 400 bin/fsdprun -n %d '%s' 2>&1; echo \"EXIT=$?\"")
    :format(H.root, env or "", np, SCRIPT)
  local f = assert(io.popen(cmd))
  local out = H.untag(f:read("*a"))
  f:close()
  local r = { out = out, cases = {}, order = {}, details = {} }
  r.status = tonumber(out:match("EXIT=(%d+)%s*$"))
  r.plan = tonumber(out:match("PLAN ws=%d+ cases=(%d+)"))
  r.summary = out:match("(SUMMARY[^\n]*)")
  for line in out:gmatch("[^\n]+") do
    local name, rest = line:match("^CASE (%S+)%s+ws=%d+ (.*)$")
    if name then
      r.cases[name] = rest:find(" PASS$") and "PASS" or "FAIL"
      r.order[#r.order + 1] = name
    end
  end
  for name, line in out:gmatch("DETAIL (%S+) ([^\n]*)") do
    r.details[name] = r.details[name] or {}
    table.insert(r.details[name], line)
  end
  return r
end

local function report(r, names)
  local lines = {}
  for _, n in ipairs(names) do
    lines[#lines + 1] = "  " .. n
    for i, d in ipairs(r.details[n] or {}) do
      if i > 4 then lines[#lines + 1] = "      ..."; break end
      lines[#lines + 1] = "      " .. d
    end
  end
  return table.concat(lines, "\n")
end

local function check_matrix(np, env)
  local r = launch(np, env)
  assert(r.plan, ("world size %d: the matrix printed no PLAN line (crashed at start?); output:\n%s"):format(np, r.out:sub(-3000)))
  assert(r.plan >= MIN_CASES, ("world size %d: only %d cases planned, expected at least %d"):format(np, r.plan, MIN_CASES))
  local failed = {}
  for _, n in ipairs(r.order) do if r.cases[n] ~= "PASS" then failed[#failed + 1] = n end end
  if #failed > 0 then
    error(("world size %d: %d of %d FSDP cases failed:\n%s\n%s"):format(np, #failed, r.plan, report(r, failed),
      r.summary or ""), 0)
  end
  assert(#r.order == r.plan, ("world size %d: %d of %d cases reported before the run ended (hang or crash?); "
    .. "last reported: %s; output tail:\n%s"):format(np, #r.order, r.plan, r.order[#r.order] or "none", r.out:sub(-3000)))
  assert(r.summary and r.summary:find("failed=0", 1, true), ("world size %d: no clean SUMMARY line:\n%s"):format(np, r.out:sub(-3000)))
  assert(r.status == 0, ("world size %d: exit status %s although every case passed:\n%s"):format(np, tostring(r.status), r.out:sub(-3000)))
  -- the measured maxima go to the log
  print(("\n  fsdp matrix: %s"):format(r.summary))
  return r
end

describe("FSDP matrix against single-process training", function()
  it("world size 1 (plain luajit, self backend)", function()
    check_matrix(1)
  end)

  local mpi = have_mpirun()
  local it_mpi = mpi and it or pending

  it_mpi("world size 2 (fsdprun -n 2)", function()
    check_matrix(2)
  end)

  it_mpi("world size 4 (fsdprun -n 4, oversubscribed)", function()
    check_matrix(4)
  end)

  -- the wrapped side on the "cuda" device: the GPU where there is one, else the test double of one
  -- (backend/testdev); with more than one rank the collectives are staged through the host, as
  -- ranks sharing one GPU run them over MPI
  it("world size 1 with the wrapped side on the cuda device", function()
    check_matrix(1, "FSDP_MATRIX_DEVICE=cuda")
  end)
  it_mpi("world size 2 with the wrapped side on the cuda device (collectives through the host)", function()
    check_matrix(2, "FSDP_MATRIX_DEVICE=cuda")
  end)
  it_mpi("world size 4 with the wrapped side on the cuda device (collectives through the host)", function()
    check_matrix(4, "FSDP_MATRIX_DEVICE=cuda")
  end)

  -- the device data plane's stream/event protocol (what NCCL does on a GPU), on the double: the
  -- stand-in communicator (src/parallel/comm_standin.c, a test double of NCCL) queues each collective
  -- on a gather or a reduce stream, delays its start and its result at random, leaves the output
  -- NaN until it is done, and completes out of order across streams and ranks; code that uses a
  -- result before waiting for its event, or frees a buffer still in flight, reads NaN here. (At
  -- world size 1 a unit's shard is its whole parameter: FSDP runs no collective there.)
  if not fsdp.cuda.is_available() then
    for _, np in ipairs { 2, 4 } do
      it_mpi(("world size %d on the stand-in communicator (device collectives on streams)"):format(np),
        function()
          local r = check_matrix(np, "FSDP_MATRIX_DEVICE=cuda FSDP_DEVICE_COMM=standin")
          assert.matches("plane=standin", r.summary, 1, true)
        end)
    end
  end

  -- (world size 4: this model's largest unit is 57% of it, so at 2 ranks the shards plus one gathered
  -- unit weigh more than the whole model and the check could not tell sharded from unsharded)
  it_mpi("holds 1/N of the parameters on the device per rank (world size 4, device counters)", function()
    local cmd = ("cd '%s' && FSDP_COMM_TIMEOUT=60 FSDP_TESTDEV_MIB=256 timeout 200 bin/fsdprun -n 4 bench/fsdp_memory.lua "
      .. "--child --device cuda --gc 1 2>&1"):format(H.root)
    local f = assert(io.popen(cmd))
    local out = f:read("*a")
    f:close()
    local line = assert(out:match("RESULT ([^\n]*)"), "no RESULT line:\n" .. out:sub(-2000))
    local S, L = tonumber(line:match(" S=(%d+)")), tonumber(line:match(" L=(%d+)"))
    local params, grads = tonumber(line:match("peak_params=(%d+)")), tonumber(line:match("peak_grads=(%d+)"))
    -- the shards (S/4 floats) and one gathered unit (L), in fp32 bytes, within padding; the whole
    -- model would be 4 S
    local want = 4 * (S / 4 + L)
    assert(want < 0.9 * 4 * S, "the check must tell sharded from unsharded")
    assert(params <= 1.01 * want and params >= 0.95 * want, ("device params peak %d bytes, S/N + L is %d"):format(params, want))
    assert(grads < 0.7 * 4 * S, ("device grads peak %d bytes: not sharded (S = %d floats)"):format(grads, S))
  end)

  -- Combined params + grads + Adam state per rank at world size 4 stays within 1.10x of 4 S/N + L
  -- (shards of parameters, gradients and two moments, plus one gathered unit): the largest unit's
  -- full gradient must not coexist with its gathered parameters (a linear releases its weight
  -- before building its gradient and the unit drops its gathered bytes then; 1.25x before).
  for _, device in ipairs { "cpu", "cuda" } do
    it_mpi(("keeps params + grads + optimizer within 1.10x of 4S/N + L at world size 4 (%s)"):format(device), function()
      local cmd = ("cd '%s' && FSDP_COMM_TIMEOUT=60 FSDP_TESTDEV_MIB=256 timeout 200 bin/fsdprun -n 4 bench/fsdp_memory.lua "
        .. "--child --device %s --gc 1 2>&1"):format(H.root, device)
      local f = assert(io.popen(cmd))
      local out = f:read("*a")
      f:close()
      local line = assert(out:match("RESULT ([^\n]*)"), "no RESULT line:\n" .. out:sub(-2000))
      local S, L = tonumber(line:match(" S=(%d+)")), tonumber(line:match(" L=(%d+)"))
      local total = tonumber(line:match(" total=(%d+)"))
      local want = 4 * (4 * S / 4 + L)
      assert(total <= 1.10 * want, ("params + grads + optimizer peak %d bytes at %s, %.2fx of 4S/N + L = %d"):format(
        total, line:match(" where=(.*)$"), total / want, want))
    end)
  end

  it_mpi("fails every float32 case when the wrapped side trains differently", function()
    local r = launch(2, "FSDP_MATRIX_SABOTAGE=lr")
    assert(r.plan and #r.order == r.plan, "sabotaged run did not report every case:\n" .. r.out:sub(-3000))
    local passed = {}
    for _, n in ipairs(r.order) do
      -- bf16 cases compare within bf16 tolerance, which a 1% learning-rate change stays inside
      if r.cases[n] == "PASS" and not n:find("bf16", 1, true) then passed[#passed + 1] = n end
    end
    assert(#passed == 0, "these cases passed although the wrapped side used a different learning rate:\n  "
      .. table.concat(passed, "\n  "))
    assert(r.status ~= 0, "the sabotaged run exited with status 0")
  end)
end)
