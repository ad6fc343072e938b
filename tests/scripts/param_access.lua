-- A sharded parameter outside forward and backward (docs/fsdp.md, "A sharded parameter outside forward and
-- backward"), family by family, against one process on the unwrapped model:
--   metadata        shape, size, dim, numel, #p, dtype answer the full parameter
--   reads           values, indexing, views, reductions, arithmetic, use as an op's or a collective's
--                   input: an error that names the operation, the parameter, its unit and piece
--                   and says how to reach the values (at 1 rank, where nothing is sharded, they
--                   compute what one process does)
--   in place        fills, scaling, add_/copy_ with a whole (or broadcast) operand, with a sharded
--                   operand laid out alike, random fills and nn.init: every rank changes its piece
--                   and the whole parameter ends as one process's does (bit for bit)
--   whole access    summon_full_params, apply (a Hugging Face style init), state_dict and
--                   load_state_dict of a submodule inside a unit, to_local and printing
--
--   bin/fsdprun -n 3 tests/scripts/param_access.lua
-- Prints "CHECK <name> PASS|FAIL" per check on rank 0 ("DETAIL" lines say why), then
-- "SUMMARY ws=N checks=K failed=F"; exit status 1 when a check failed.
local fsdp = require "fsdp"
local nn, F = fsdp.nn, fsdp.nn.functional
fsdp.init()
fsdp.comm.set_timeout(60)
local R, N = fsdp.rank(), fsdp.world_size()

local Net = nn.Module:extend("Net")
function Net:__init()
  self.emb = nn.Embedding(11, 6, { padding_idx = 0 })
  self.block = nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 5))
  self.head = nn.Linear(5, 3)
end
function Net:forward(x) return self.head(self.block(self.emb(x))) end
local function build()
  fsdp.manual_seed(7)
  return Net()
end
local function wrapped()
  local m = build()
  fsdp.wrap(m.block)
  fsdp.wrap(m)
  return m
end

local checks = dofile(((arg and arg[0] or ""):match("^(.*)/[^/]*$") or ".") .. "/checks.lua")
local check = checks.check

-- the gathered state dict of m against ref's: every entry bit for bit
local function same_state(fail, m, ref, what)
  local a, b = m:state_dict(), ref:state_dict()
  for k, t in pairs(b) do
    local u = a[k]
    if not u then fail(what .. ": no " .. k)
    else
      local d = (u - t):abs():max():item()
      if d ~= 0 then fail(("%s: %s differs from one process's by %.3g"):format(what, k, d)) end
    end
  end
end

-- ---- metadata --------------------------------------------------------------------------------------
check("metadata answers the full parameter", function(fail)
  local m, ref = wrapped(), build()
  local rp = {}
  for name, p in ref:named_parameters() do rp[name] = p end
  for name, p in m:named_parameters() do
    local q = rp[name]
    if table.concat(p:shape(), "x") ~= table.concat(q:shape(), "x") or p:numel() ~= q:numel() or p:dim() ~= q:dim()
      or #p ~= #q or p:size(-1) ~= q:size(-1) or p.dtype ~= q.dtype then
      fail(name .. ": metadata differs from the unwrapped parameter's")
    end
  end
end)

-- ---- reads ------------------------------------------------------------------------------------------
local x23 = fsdp.randn{ 2, 6 }
local READS = {
  { "index", function(p) return p[2] end },
  { "index assignment", function(p) fsdp.no_grad(function() p[1] = 0 end) end },
  { "narrow", function(p) return p:narrow(1, 2, 1) end },
  { "select", function(p) return p:select(1, 2) end },
  { "view", function(p) return p:view(-1) end },
  { "reshape", function(p) return p:reshape(-1) end },
  { "t", function(p) return p:t() end },
  { "contiguous", function(p) return p:contiguous() end },
  { "clone", function(p) return p:clone() end },
  { "detach", function(p) return p:detach() end },
  { "sum", function(p) return p:sum() end },
  { "mean", function(p) return p:mean() end },
  { "max", function(p) return p:max() end },
  { "abs", function(p) return p:abs() end },
  { "item", function(p) return p:sum():item() end },
  { "tolist", function(p) return p:tolist() end },
  { "totable", function(p) return p:totable() end },
  { "add", function(p) return p + 1 end },
  { "rsub", function(p) return 1 - p end },
  { "neg", function(p) return -p end },
  { "mul", function(p) return p * p end },
  { "gt", function(p) return p:gt(0) end },
  { "matmul", function(p) return x23:matmul(p:t()) end },
  { "linear", function(p) return F.linear(x23, p) end },
  { "to", function(p) return p:to("float32") end },
  { "all_reduce", function(p) fsdp.all_reduce(p, "sum") end },
  { "broadcast", function(p) fsdp.broadcast(p, 0) end },
}
for _, r in ipairs(READS) do
  check("read: " .. r[1], function(fail)
    local m, ref = wrapped(), build()
    local p, q = m.block["0"].weight, ref.block["0"].weight  -- (7, 6), sharded at 2 and 3 ranks
    local ok, got = pcall(r[2], p)
    if N == 1 then  -- nothing is sharded: it acts on the parameter, as on the unwrapped one
      if not ok then fail("at 1 rank it failed: " .. tostring(got)) return end
      local okr, want = pcall(r[2], q)
      if fsdp.is_tensor(got) and okr and table.concat(got:shape(), "x") ~= table.concat(want:shape(), "x") then
        fail("at 1 rank its shape differs from the unwrapped parameter's")
      end
      return
    end
    if ok then fail(r[1] .. " on a sharded parameter did not raise"); return end
    local e = tostring(got)
    for _, want in ipairs { "'block.0.weight'", "(7x6)", "sharded by FSDP unit 'block'", "summon_full_params",
      "to_local" } do
      if not e:find(want, 1, true) then fail(("the error does not say %s: %s"):format(want, e)) end
    end
    same_state(fail, m, ref, "after the refused " .. r[1])  -- and nothing changed
  end)
end

-- ---- in place ---------------------------------------------------------------------------------------
-- each op runs on the wrapped model's parameters and on the unwrapped model's; the gathered
-- parameters must equal one process's bit for bit
local function inplace(name, op)
  check("in place: " .. name, function(fail)
    local m, ref = wrapped(), build()
    fsdp.no_grad(function()
      fsdp.manual_seed(99); op(m, "wrapped")
      fsdp.manual_seed(99); op(ref, "ref")
    end)
    same_state(fail, m, ref, name)
  end)
end
inplace("zero_, fill_, mul_, add_(number)", function(m)
  m.block["0"].weight:zero_(); m.head.weight:fill_(0.25); m.block["2"].weight:mul_(-3); m.emb.weight:add_(0.5)
end)
inplace("add_ and copy_ with whole operands", function(m)
  fsdp.manual_seed(5)
  local a, b = fsdp.randn{ 7, 6 }, fsdp.randn{ 5, 7 }
  m.block["0"].weight:add_(a, 0.3)
  m.block["2"].weight:copy_(b)
  m.head.bias:copy_(fsdp.tensor({ 1, 2, 3 }))
end)
inplace("add_ and copy_ with broadcast operands", function(m)
  m.block["0"].weight:add_(fsdp.arange(6):float():view(1, 6))
  m.block["2"].weight:copy_(fsdp.arange(7):float())
  m.emb.weight:mul_(0):add_(fsdp.tensor({ 2.5 }))
end)
inplace("uniform_, normal_ and nn.init", function(m)
  m.block["0"].weight:uniform_(-1, 1)
  m.block["2"].weight:normal_(0, 0.02)
  nn.init.kaiming_uniform_(m.head.weight, { a = math.sqrt(5) })
  nn.init.xavier_normal_(m.emb.weight)
  nn.init.constant_(m.block["0"].bias, 0.1)
end)
check("in place: add_ from another model's parameter laid out alike (an EMA)", function(fail)
  local m, ema, ref, rema = wrapped(), wrapped(), build(), build()
  fsdp.no_grad(function()
    for _, pair in ipairs { { m, ema }, { ref, rema } } do
      pair[1].block["0"].weight:mul_(2)
      local ps = pair[1]:parameters()
      for i, e in ipairs(pair[2]:parameters()) do e:mul_(0.9):add_(ps[i], 0.1) end
    end
  end)
  same_state(fail, ema, rema, "EMA")
end)
if N > 1 then
  check("in place: mismatched operands are errors", function(fail)
    local m = wrapped()
    local ok, e = pcall(function() fsdp.no_grad(function() m.block["0"].weight:copy_(fsdp.zeros{ 6, 7 }) end) end)
    if ok or not tostring(e):find("does not broadcast to the sharded parameter's full shape 7x6", 1, true) then
      fail("copy_ of a (6, 7) into a sharded (7, 6): " .. tostring(e))
    end
    ok, e = pcall(function() fsdp.no_grad(function() m.block["0"].weight:copy_(m.head.weight) end) end)
    if ok or not tostring(e):find("do not line up", 1, true) then
      fail("copy_ between sharded parameters of different shapes: " .. tostring(e))
    end
    same_state(fail, m, build(), "after the refused copies")
  end)
end

-- ---- whole access ------------------------------------------------------------------------------------
check("summon_full_params reads the whole parameter", function(fail)
  local m, ref = wrapped(), build()
  m:summon_full_params(function()
    local p, q = m.block["0"].weight, ref.block["0"].weight
    if p:sum():item() ~= q:sum():item() or p[2][3]:item() ~= q[2][3]:item() then
      fail("values inside summon_full_params differ from one process's")
    end
  end)
end)
check("apply sees and writes whole parameters (a Hugging Face style init)", function(fail)
  local function init(mod)
    if nn.Module.isinstance(mod, nn.Embedding) then
      mod.weight:normal_(0, 0.02)
      mod.weight[mod.padding_idx + 1]:zero_()
    elseif nn.Module.isinstance(mod, nn.Linear) then
      mod.weight:normal_(0, 0.02)
      if mod.bias then mod.bias:zero_() end
    end
  end
  local m, ref = wrapped(), build()
  fsdp.no_grad(function()
    fsdp.manual_seed(3); m:apply(init)
    fsdp.manual_seed(3); ref:apply(init)
  end)
  same_state(fail, m, ref, "apply")
  local row = m:state_dict()["emb.weight"][1]
  if row:abs():sum():item() ~= 0 then fail("apply did not zero the padding row") end
end)
check("a submodule inside a unit: state_dict, load_state_dict and apply act on whole parameters", function(fail)
  local m, ref = wrapped(), build()
  local src = nn.Linear(5, 3)
  m.head:load_state_dict(src:state_dict()); ref.head:load_state_dict(src:state_dict())
  fsdp.no_grad(function()
    m.block["2"]:apply(function(x) if x.weight then x.weight:fill_(0.5) end end)
    ref.block["2"]:apply(function(x) if x.weight then x.weight:fill_(0.5) end end)
  end)
  same_state(fail, m, ref, "submodule")
  local sd = m.block["2"]:state_dict()
  if table.concat(sd.weight:shape(), "x") ~= "5x7" then fail("a submodule's state_dict entry is not whole") end
end)
check("to_local is this rank's piece; printing says which", function(fail)
  local m, ref = wrapped(), build()
  local p = m.block["0"].weight
  local l = p:to_local()
  local want = ref.block["0"].weight:contiguous():view(-1)
  local chunk = math.ceil(42 / N)
  local start, len = R * chunk, math.max(0, math.min(chunk, 42 - R * chunk))
  if l:numel() ~= len then fail(("to_local has %d elements, the piece %d"):format(l:numel(), len)) end
  if len > 0 and (l:contiguous():view(-1) - want:narrow(1, start + 1, len)):abs():max():item() ~= 0 then
    fail("to_local's values differ")
  end
  local s = tostring(p)
  if N > 1 and not s:find(("sharded: rank %d holds elements %d..%d of 42"):format(R, start + 1, start + len), 1, true) then
    fail("printing does not say which piece: " .. s)
  end
end)

-- An optimizer's state_dict holds this rank's pieces of the sharded parameters' state: it loads back
-- on its own rank, and rank 0's (torch.save on rank 0, torch.load everywhere, as with DDP) is an
-- error on every other rank -- once it loaded quietly where the pieces were as long, and trained
-- each rank's elements with rank 0's moments.
check("an optimizer's state_dict holds this rank's pieces; another rank's is refused", function(fail)
  local m = wrapped()
  local opt = fsdp.optim.Adam(m:parameters(), { lr = 0.1 })
  F.cross_entropy(m(fsdp.tensor({ { 1, 2, 0 }, { 4, 0, 10 } }, { dtype = "int64" })):view(6, 3),
    fsdp.tensor({ 0, 1, 2, 2, 1, 0 }, { dtype = "int64" })):backward()
  opt:step()
  local w = m.block["0"].weight
  local before = opt:state_of(w).exp_avg:clone()
  opt:load_state_dict(opt:state_dict())  -- its own pieces
  local path = R == 0 and os.tmpname() or ""  -- rank 0's file, its name sent as character codes
  local codes = fsdp.zeros({ 256 })
  for i = 1, #path do codes[i] = path:byte(i) end
  if N > 1 then fsdp.broadcast(codes, 0) end
  path = string.char(unpack(codes:tolist())):gsub("%z+$", "")
  if R == 0 then fsdp.save(path, { optim = opt:state_dict() }) end
  if N > 1 then fsdp.barrier() end
  local ok, err = pcall(opt.load_state_dict, opt, fsdp.load(path).optim)
  if N > 1 then fsdp.barrier() end
  if R == 0 then os.remove(path) end
  if R == 0 and not ok then fail("rank 0 refused its own state: " .. tostring(err)) end
  -- (the first parameter it meets names the pieces; where they differ in length, the shapes)
  local e = tostring(err)
  if R > 0 and ok then fail("rank 0's optimizer state loaded on rank " .. R) end
  if R > 0 and not ok and not (e:find("sharded by FSDP", 1, true) and e:find("rank " .. R, 1, true)
    and e:find("elements 1..", 1, true)) then
    fail("the error does not name the parameter's pieces: " .. e)
  end
  if (opt:state_of(w).exp_avg - before):abs():max():item() ~= 0 then fail("a refused load changed the state") end
end)

checks.finish()
