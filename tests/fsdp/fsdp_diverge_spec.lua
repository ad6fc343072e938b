-- Ranks that diverge stop with an error naming the unit and the ranks, within a bounded time
-- (FSDP_COMM_TIMEOUT=10 here), and fsdprun exits non-zero. Script: tests/scripts/fsdp_diverge.lua
local H = require "helpers"

local mpi = H.has_mpi()
local it_mpi = mpi and it or pending

local function run(case)
  local rc, out, secs = H.sh(("%s -n 2 %sfsdp_diverge.lua %s"):format(H.fsdprun, H.scripts, case),
    ("FSDP_COMM_TIMEOUT=10 LUA_PATH='%s/lua/?.lua;%s/lua/?/init.lua;;'"):format(H.root, H.root), 90)
  assert.is_true(rc ~= 0, case .. ": expected a non-zero exit, got 0:\n" .. out)
  assert.is_true(rc ~= 124 and rc ~= 137, case .. ": the run hung until the hard timeout:\n" .. out)
  assert.is_true(secs < 60, ("%s: took %d s to stop"):format(case, secs))
  return out
end

describe("diverging ranks", function()
  it_mpi("a unit that gets gradients on one rank only: mismatch naming both units and ranks", function()
    local out = run("grad_on_one_rank")
    assert.truthy(out:find("mismatch", 1, true), out)
    assert.truthy(out:find("rank 0", 1, true) and out:find("rank 1", 1, true), out)
    -- rank 0 gathers unit 'b' for its backward, rank 1 goes on to unit 'a'
    assert.truthy(out:find("rank 0 called all_gather(tag 'b'", 1, true), out)
    assert.truthy(out:find("rank 1 called all_gather(tag 'a'", 1, true), out)
  end)

  it_mpi("parameters of different shapes: the wrap-time broadcast names the parameter", function()
    local out = run("shape_differs")
    assert.truthy(out:find("mismatch", 1, true), out)
    assert.truthy(out:find("broadcast(tag 'Linear: weight', shape (4, 8)) but rank 1 called broadcast(tag 'Linear: weight', shape (5, 8))", 1, true), out)
  end)

  it_mpi("a rank that trains one step fewer: the others learn it finished", function()
    local out = run("skip_step")
    assert.truthy(out:find("rank 1", 1, true), out)
    assert.truthy(out:find("shutdown", 1, true), out)
  end)

  for _, case in ipairs { "skip_backward", "skip_backward_none" } do
    it_mpi(("a rank that skips a backward (%s): the error names the ranks, the steps and the unit"):format(case), function()
      local out = run(case)
      assert.truthy(out:find("collective mismatch", 1, true), out)
      local want = case == "skip_backward" and "; rank 0 is in the backward of training step 2, rank 1 in the forward of "
        .. "training step 3" or "; rank 0 is in the backward of training step 2, rank 1 in the backward of training step 3"
      assert.truthy(out:find(want, 1, true), out)
      assert.truthy(out:find("tag '", 1, true), out)  -- the unit
    end)
  end

  it_mpi("a rank that exits: every rank stops", function()
    local out = run("rank_exits")
    assert.is_nil(out:find("rank 0 finished", 1, true), out)
  end)
end)
