-- Ranks that disagree must stop with an error naming the unit and the ranks, never hang.
-- Usage: fsdprun -n 2 tests/scripts/fsdp_diverge.lua CASE
--   grad_on_one_rank  the second unit gets gradients on rank 0 only (data-dependent graph)
--   shape_differs     rank 1 builds its last layer with another shape
--   skip_step         rank 1 trains one step fewer
--   rank_exits        rank 1 exits in the middle of training
--   skip_backward     rank 1 computes step 2's loss but skips its backward and optimizer step
--                     (a NaN guard on one rank); skip_backward_none: the same with sharding "none",
--                     whose forward sends nothing (before, rank 1's step 3 silently paired with
--                     the others' step 2)
local fsdp = require "fsdp"
local nn, F = fsdp.nn, fsdp.F
local case = arg[1]
fsdp.init()
local R = fsdp.rank()

fsdp.manual_seed(0)
local out_features = (case == "shape_differs" and R == 1) and 5 or 4
-- two branches, each its own unit: forward returns both outputs
local Two = nn.Module:extend("Two")
function Two:__init()
  self.a = nn.Linear(8, 4)
  self.b = nn.Linear(8, out_features)
end
function Two:forward(x) return { self.a(x), self.b(x) } end
local model = Two()
local wopts = case == "skip_backward_none" and { sharding = "none" } or nil
fsdp.wrap(model.a, wopts)
fsdp.wrap(model.b, wopts)
fsdp.wrap(model, wopts)
local opt = fsdp.optim.SGD(model:parameters(), { lr = 0.1 })
local x, y = fsdp.randn { 4, 8 }, fsdp.randint(0, 4, { 4 })

local steps = (case == "skip_step" and R == 1) and 2 or 3
for step = 1, steps do
  local out = model(x)
  local loss = F.cross_entropy(out[1], y)
  -- data-dependent graph: unit 'b' takes part in rank 0's loss only
  if not (case == "grad_on_one_rank" and R == 1) then loss = loss + F.cross_entropy(out[2], y) end
  if not (case:find("^skip_backward") and R == 1 and step == 2) then
    opt:zero_grad()
    loss:backward()
    opt:step()
  end
  if case == "rank_exits" and R == 1 and step == 2 then os.exit(3) end
end
print(("rank %d finished %d steps"):format(R, steps))
