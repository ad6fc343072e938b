-- Gradient accumulation with no_sync against one process: tests/scripts/grad_accum.lua runs every
-- interleaving of synced and unsynced backwards up to length 4, for every sharding strategy, with
-- frozen parameters in mixed units and a frozen unit, with CPU offload (on the GPU, or the test
-- double of one) and bf16 compute, at 1, 2, 3 (uneven pieces) and 4 ranks. A sabotaged run (the
-- first micro-batch counted twice on the wrapped side) must fail every case it runs.
-- Rerun one world size by hand:  bin/fsdprun -n 3 tests/scripts/grad_accum.lua [lua pattern]
local H = require "helpers"
local SCRIPT = H.scripts .. "grad_accum.lua"

local function launch(np, env, pattern)
  local rc, out = H.sh(("%s -n %d %s %s"):format(H.fsdprun, np, SCRIPT, pattern or ""), "FSDP_COMM_TIMEOUT=60 " .. (env or ""), 400)
  out = H.untag(out)
  local r = { rc = rc, out = out, pass = 0, fail = {} }
  r.plan = tonumber(out:match("PLAN ws=%d+ cases=(%d+)"))
  r.summary = out:match("(SUMMARY[^\n]*)")
  for name, verdict in out:gmatch("CASE (%S+)%s+ws=%d+ maxdiff=%S+ (%u+)") do
    if verdict == "PASS" then r.pass = r.pass + 1 else r.fail[#r.fail + 1] = name end
  end
  return r
end

local function check(np)
  local r = launch(np)
  assert(r.plan and r.plan >= 480, ("world size %d: no PLAN line, or too few cases:\n%s"):format(np, r.out:sub(-3000)))
  if #r.fail > 0 then
    local details = {}
    for line in r.out:gmatch("DETAIL [^\n]*") do details[#details + 1] = line; if #details > 20 then break end end
    error(("world size %d: %d of %d cases failed: %s\n%s"):format(np, #r.fail, r.plan,
      table.concat(r.fail, ", ", 1, math.min(#r.fail, 12)), table.concat(details, "\n")), 0)
  end
  assert(r.pass == r.plan, ("world size %d: %d of %d cases reported:\n%s"):format(np, r.pass, r.plan, r.out:sub(-3000)))
  assert(r.rc == 0, ("world size %d: exit status %s"):format(np, tostring(r.rc)))
  print(("\n  grad accumulation: %s"):format(r.summary))
end

describe("no_sync gradient accumulation, every interleaving up to length 4, against one process", function()
  local it_mpi = H.has_mpi() and it or pending
  it("world size 1", function() check(1) end)
  it_mpi("world size 2", function() check(2) end)
  it_mpi("world size 3 (uneven pieces)", function() check(3) end)
  it_mpi("world size 4 (oversubscribed)", function() check(4) end)
  it_mpi("fails every full-sharding case when the wrapped side's first micro-batch counts twice", function()
    local r = launch(2, "FSDP_SABOTAGE=fold", "^full/")
    assert(r.plan and r.pass + #r.fail == r.plan, "the sabotaged run did not report every case:\n" .. r.out:sub(-3000))
    assert(r.pass == 0, ("%d cases passed although the wrapped side's gradients were wrong"):format(r.pass))
    assert(r.rc ~= 0, "the sabotaged run exited with status 0")
  end)
end)
