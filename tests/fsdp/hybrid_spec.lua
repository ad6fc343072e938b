-- Hybrid sharding's options and errors (its training against one process is in the FSDP matrix,
-- tests/scripts/fsdp_matrix.lua's sharding=hybrid cases at 1, 2 and 4 ranks; checkpoints across
-- hybrid and full sharding in tests/fsdp/checkpoint_spec.lua).
local fsdp = require "fsdp"
local nn = fsdp.nn
local H = require "helpers"

describe("hybrid sharding", function()
  it("on one rank: shard groups of the machine's ranks (one), and what is refused", function()
    local m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    fsdp.wrap(m, { sharding = "hybrid" })
    local plan = fsdp.summary(m, { print = false })
    assert.equal("hybrid", plan.units[1].sharding)
    H.assert_error(function() fsdp.wrap(nn.Linear(2, 2), { sharding = "hybrid", shard_group_size = 2 }) end,
      "hybrid sharding: a shard group of 2 ranks does not divide the world of 1 ranks")
    H.assert_error(function() fsdp.wrap(nn.Linear(2, 2), { sharding = "full", shard_group_size = 1 }) end,
      'fsdp.wrap: shard_group_size is an option of sharding = "hybrid" (sharding is "full")')
    H.assert_error(function() fsdp.wrap(nn.Linear(2, 2), { sharding = "hybrid", shard_group_size = 1.5 }) end,
      "fsdp.wrap: shard_group_size must be a positive integer, got 1.5")
    H.assert_error(function() fsdp.wrap(nn.Linear(2, 2), { sharding = "halfway" }) end,
      'fsdp.wrap: unknown sharding "halfway" (use "full", "grad_op", "hybrid" or "none")')
  end)

  it("at 4 ranks: one group size for every hybrid unit, and the plan names the all-reduce over replicas", function()
    if not H.has_mpi() then pending("no mpirun or libfsdp_mpi.so") return end
    local rc, out = H.sh(("%s -n 4 %shybrid_plan.lua"):format(H.fsdprun, H.scripts))
    assert.equal(0, rc, out)
    assert.truthy(out:find("second size: fsdp.wrap 'Linear': hybrid sharding: the shard groups are of 2 ranks already; every hybrid unit "
      .. "uses the same size (got 4)", 1, true), out)
    -- one step of the two-unit model: per unit one reduce-scatter within its pair of ranks, then one
    -- all-reduce of its piece over the two pairs; gathers within the pair
    assert.truthy(out:find("plan ag 3 rs 2 ar 2", 1, true), out)
    assert.truthy(out:find("stats ag 3 rs 2 ar 2", 1, true), out)
  end)
end)
