-- Parameters keep their logical shape under FSDP (issue 17 item 4), at any world size: a small
-- GPT-like model is wrapped (a nested unit and the root) and every parameter must answer shape,
-- size, dim, numel, #p and printing as before wrapping, while p:to_local() is this rank's piece.
-- The nanoGPT rule (weight decay for p:dim() >= 2) picks the same parameters after wrapping as
-- before, and AdamW with those two groups trains the wrapped model exactly as one process trains
-- the unwrapped one; num_parameters and clip_grad_norm agree with it too. Prints "param_shape OK
-- rank R" at the end, or fails with an error naming what differs.
local fsdp = require "fsdp"
local nn, F = fsdp.nn, fsdp.nn.functional
fsdp.init()
local rank, N = fsdp.rank(), fsdp.world_size()

local Net = nn.Module:extend("Net")
function Net:__init()
  self.emb = nn.Embedding(13, 6)
  self.block = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 6))
  self.head = nn.Linear(6, 13, { bias = false })
end
function Net:forward(x) return self.head(self.block(self.emb(x))) end

local function build()
  fsdp.manual_seed(3)
  return Net()
end
local function fail(msg) error(("rank %d: %s"):format(rank, msg), 0) end
local function shape_s(t) return table.concat(t, "x") end

-- the nanoGPT grouping: decay for matrices (dim >= 2), none for biases and norms
local function groups(model)
  local decay, no_decay, names = {}, {}, { decay = {}, no_decay = {} }
  for name, p in model:named_parameters() do
    if p:dim() >= 2 then decay[#decay + 1] = p; names.decay[#names.decay + 1] = name
    else no_decay[#no_decay + 1] = p; names.no_decay[#names.no_decay + 1] = name end
  end
  return { { params = decay, weight_decay = 0.1 }, { params = no_decay, weight_decay = 0.0 } }, names
end

-- what every parameter answers before wrapping
local ref = build()
local before = {}
for name, p in ref:named_parameters() do
  before[name] = { shape = p:shape(), dim = p:dim(), numel = p:numel(), len = #p, size1 = p:size(1), sizel = p:size(-1) }
end
local ref_groups, ref_names = groups(ref)

local model = build()
fsdp.wrap(model.block)
fsdp.wrap(model)

local function check_shapes(when)
  for name, p in model:named_parameters() do
    local b = before[name]
    if shape_s(p:shape()) ~= shape_s(b.shape) then fail(("%s: %s:shape() is %s, before wrapping %s"):format(when, name, shape_s(p:shape()), shape_s(b.shape))) end
    if shape_s(p:size()) ~= shape_s(b.shape) then fail(("%s: %s:size() is %s"):format(when, name, shape_s(p:size()))) end
    if p:dim() ~= b.dim or p.ndim ~= b.dim then fail(("%s: %s:dim() is %d, before wrapping %d"):format(when, name, p:dim(), b.dim)) end
    if p:numel() ~= b.numel then fail(("%s: %s:numel() is %d, before wrapping %d"):format(when, name, p:numel(), b.numel)) end
    if #p ~= b.len or p:size(1) ~= b.size1 or p:size(-1) ~= b.sizel then fail(("%s: %s: #p / size(1) / size(-1) differ"):format(when, name)) end
  end
end
check_shapes("after wrapping")

-- the local piece: 1-D, this rank's share of the flattened parameter; the pieces of all ranks
-- add up to the whole; printing says so
local held = 0
for name, p in model:named_parameters() do
  local l = p:to_local()
  local want = math.max(0, math.min(p:numel(), (rank + 1) * math.ceil(p:numel() / N)) - rank * math.ceil(p:numel() / N))
  if N > 1 and (l:dim() ~= 1 or l:numel() ~= want) then
    fail(("%s:to_local() has shape %s, expected (%d)"):format(name, shape_s(l:shape()), want))
  end
  if N == 1 and l ~= p then fail(name .. ":to_local() on one rank is not the parameter itself") end
  held = held + l:numel()
  local s = tostring(p)
  if not s:find("tensor(" .. shape_s(p:shape()) .. ", dtype=float32", 1, true) then fail(name .. " prints as " .. s) end
  if N > 1 and want < p:numel() and not s:find(("sharded: rank %d holds elements %d..%d of %d"):format(rank,
      rank * math.ceil(p:numel() / N) + 1, rank * math.ceil(p:numel() / N) + want, p:numel()), 1, true) then
    fail(name .. " prints as " .. s)
  end
end
local total = fsdp.tensor({ held })
if N > 1 then fsdp.all_reduce(total, "sum") end
if total:item() ~= ref:num_parameters() then fail(("the pieces hold %d elements in all, the model %d"):format(total:item(), ref:num_parameters())) end
if model:num_parameters() ~= ref:num_parameters() then
  fail(("num_parameters() is %d after wrapping, %d before"):format(model:num_parameters(), ref:num_parameters()))
end

-- the same groups after wrapping, and the same training
local fs_groups, fs_names = groups(model)
for _, k in ipairs { "decay", "no_decay" } do
  if table.concat(fs_names[k], ",") ~= table.concat(ref_names[k], ",") then
    fail(("%s group after wrapping {%s}, before {%s}"):format(k, table.concat(fs_names[k], ","), table.concat(ref_names[k], ",")))
  end
end
local ref_opt = fsdp.optim.AdamW(ref_groups, { lr = 1e-2 })
local fs_opt = fsdp.optim.AdamW(fs_groups, { lr = 1e-2 })
fsdp.manual_seed(7)
local x, y = fsdp.randint(0, 13, { 4 * N, 5 }), fsdp.randint(0, 13, { 4 * N * 5 })
local mine = x:narrow(1, rank * 4 + 1, 4)
local my_y = y:narrow(1, rank * 20 + 1, 20)
for step = 1, 3 do
  ref_opt:zero_grad()
  local rl = F.cross_entropy(ref(x):view(-1, 13), y)
  rl:backward()
  local rn = fsdp.clip_grad_norm(ref, 1e9)
  ref_opt:step()
  fs_opt:zero_grad()
  local out = model(mine)
  check_shapes("between forward and backward")
  local l = F.cross_entropy(out:view(-1, 13), my_y)
  l:backward()
  local n = fsdp.clip_grad_norm(model, 1e9)
  fs_opt:step()
  check_shapes("after step " .. step)
  -- the mean of the ranks' losses is the global batch's loss
  local lt = fsdp.tensor({ l:item() })
  if N > 1 then fsdp.all_reduce(lt, "avg") end
  if math.abs(lt:item() - rl:item()) > 1e-5 then fail(("step %d: loss %.7f, one process %.7f"):format(step, lt:item(), rl:item())) end
  if math.abs(n - rn) > 1e-4 * rn then fail(("step %d: gradient norm %.7f, one process %.7f"):format(step, n, rn)) end
end
-- the trained values, gathered, equal one process's; and the state dict has the full shapes
local sd, rsd = model:state_dict(), ref:state_dict()
for name, t in pairs(rsd) do
  local u = sd[name]
  if not u or shape_s(u:shape()) ~= shape_s(t:shape()) then fail("state_dict " .. name .. " differs in shape") end
  local d = (u - t):abs():max():item()
  if d > 1e-5 then fail(("%s differs from one process's by %.3g after 3 AdamW steps"):format(name, d)) end
end
check_shapes("after state_dict")
model:summon_full_params(function() check_shapes("inside summon_full_params") end)
-- a submodule inside a unit (no unit of its own) reads and loads its whole parameters: its
-- state_dict and load_state_dict gather the unit around it, as the model's own do
do
  local lin = model.block:children()[2]  -- Linear(6, 10) inside the unit 'block'
  local src = nn.Linear(6, 10)
  lin:load_state_dict(src:state_dict())
  local got, want = lin:state_dict(), src:state_dict()
  for _, k in ipairs { "weight", "bias" } do
    if shape_s(got[k]:shape()) ~= shape_s(want[k]:shape()) or (got[k] - want[k]):abs():max():item() ~= 0 then
      fail("load_state_dict into a Linear inside a unit did not load its whole " .. k)
    end
  end
  if (model:state_dict()["block.1.weight"] - want.weight):abs():max():item() ~= 0 then
    fail("the model's state_dict does not show what was loaded into block.1")
  end
end
print(("param_shape OK rank %d"):format(rank))
