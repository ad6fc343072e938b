-- fsdp.summary: the FSDP plan of a model, printed and as a table. Its prediction of one training
-- step's collectives is checked against fsdp.comm_stats() by every check_comm case of the FSDP
-- matrix (tests/scripts/fsdp_matrix.lua) at 2 and 4 ranks; here, one rank: the tree, the elements
-- and bytes per unit, the optimizer's bytes once its state exists, and bad arguments.
local fsdp = require "fsdp"
local nn = fsdp.nn
local H = require "helpers"

describe("fsdp.summary", function()
  it("shows the unit tree, elements and bytes per unit, and what a step sends", function()
    fsdp.manual_seed(1)
    local inner = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
    local m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), inner, nn.ReLU(), nn.Linear(16, 3))
    m:children()[1].bias.requires_grad = false
    fsdp.wrap(inner)
    fsdp.wrap(m)
    local opt = fsdp.optim.AdamW(m:parameters(), { lr = 1e-3 })
    local printed = {}
    local print0 = _G.print
    _G.print = function(s) printed[#printed + 1] = s end
    local ok, plan = pcall(fsdp.summary, m, { optimizer = opt })
    _G.print = print0
    assert(ok, plan)
    local text = table.concat(printed, "\n")
    assert.equal(2, #plan.units)
    local by = {}
    for _, e in ipairs(plan.units) do by[e.path] = e end
    local root, mid = by.Sequential, by["2"]
    assert.equal("Sequential", mid.parent)
    assert.is_nil(root.parent)
    -- the root owns 4*8+8 + 16*3+3 = 91 elements, 8 of them frozen (the first bias); 2 owns 416
    assert.same({ full = 91, this_rank = 91, trainable = 83, frozen = 8 }, root.elements)
    assert.same({ full = 416, this_rank = 416, trainable = 416, frozen = 0 }, mid.elements)
    assert.same({ shards = 364, gathered = 0, grads = 332, optimizer = 0 }, root.bytes)  -- no state yet
    assert.equal(4, #root.params)
    assert.same({ 8, 4 }, root.params[1].shape)
    assert.is_false(root.params[2].trainable)
    -- one rank: nothing to send
    for _, k in ipairs { "all_gather", "reduce_scatter", "all_reduce" } do assert.equal(0, plan.step[k].count) end
    assert.matches("unit Sequential %(Sequential%): sharding full over 1 rank%(s%), float32", text)
    assert.matches("\n    unit 2 %(Sequential%)", text)  -- nested below the root
    assert.matches("params 4: 91 elements %(83 trainable, 8 frozen%), 91 on this rank", text)
    -- after a step AdamW holds two float32 states per trainable element (exp_avg, exp_avg_sq)
    local x, y = fsdp.randn(8, 4), fsdp.randn(8, 3)
    opt:zero_grad(); nn.functional.mse_loss(m(x), y):backward(); opt:step()
    plan = fsdp.summary(m, { optimizer = opt, print = false })
    for _, e in ipairs(plan.units) do
      assert.equal(2 * 4 * e.elements.trainable, e.bytes.optimizer, e.path)
    end
  end)

  it("refuses what is not a module, and options that are not a table", function()
    H.assert_error(function() fsdp.summary(nil) end, "fsdp.summary: expected an nn.Module, got nil")
    H.assert_error(function() fsdp.summary(nn.Linear(2, 2), 3) end, "fsdp.summary: options must be a table")
  end)
end)
