-- Models built without storage (fsdp.meta) and materialised as shards, against one process building
-- the same model eagerly with the same seed (docs/fsdp.md, "Models larger than one rank"):
--   sharded init    every layer type with parameters, under several wrap plans and shardings, ties,
--                   frozen parameters, bf16 parameters, a strided init, a copy from a real tensor:
--                   the full parameters and buffers bit for bit the eager ones, and the RNG stream
--                   where the eager build leaves it
--   memory          the meta build allocates nothing; wrapping allocates exactly this rank's chunks
--                   (the params counter never holds a whole parameter), replay temporaries are
--                   bounded by a piece; fsdp.reset_parameters on the wrapped model = on the eager one
--   rank 0          sync_module_states with rank 0 eager and the others on meta: rank 0's values
--   checkpoints     load_state_dict(fsdp.load(full file)) reads each rank's pieces only (float32
--                   and bfloat16 files); load_sharded of a checkpoint saved at another world size
--   errors          a meta tensor's values read, a module without reset_parameters, rank 0 on meta
--                   and another rank eager
--
--   bin/fsdprun -n 3 tests/scripts/meta_init.lua [--save DIR | --load DIR]
-- Prints "CHECK <name> PASS|FAIL" per check on rank 0 ("DETAIL" lines say why), then
-- "SUMMARY ws=N checks=K failed=F"; exit status 1 when a check failed.
local fsdp = require "fsdp"
local nn = fsdp.nn
fsdp.init()
fsdp.comm.set_timeout(60)
local R, N = fsdp.rank(), fsdp.world_size()
local mode, dir = arg[1], arg[2]

-- every layer type with parameters, a tie, an init that writes a strided view, a copy from a real
-- tensor and scalar arithmetic, a buffer made by a fill
local Net = nn.Module:extend("Net")
function Net:__init()
  self.emb = nn.Embedding(11, 6, { padding_idx = 2 })
  self.conv = nn.Conv2d(2, 3, 3, { padding = 1 })
  self.convt = nn.ConvTranspose2d(3, 2, 2, { stride = 2 })
  self.bn1 = nn.BatchNorm1d(6)
  self.bn2 = nn.BatchNorm2d(3)
  self.gn = nn.GroupNorm(1, 2)
  self.ln = nn.LayerNorm(6)
  self.rms = nn.RMSNorm(6)
  self.blocks = nn.ModuleList({ nn.Linear(6, 7), nn.Linear(7, 6, { bias = false }), nn.Linear(6, 6) })
  self.wide = nn.Linear(96, 96)  -- (the largest: a whole-tensor read shows against a piece)
  self.head = nn.Linear(6, 11, { bias = false })
  self.head.weight = self.emb.weight
  self.scale = nn.Parameter(fsdp.empty(5, 3))
  self:register_buffer("table", fsdp.full({ 4 }, 0.5))
  self:reset_parameters()
  fsdp.no_grad(function()
    self.blocks[1].weight:t():narrow(1, 2, 2):fill_(0.125)  -- strided views
    self.blocks[2].weight:t():narrow(1, 3, 1):copy_(fsdp.arange(6):to("float32"))
    self.blocks[3].weight:copy_(fsdp.arange(36):reshape(6, 6):to("float32") / 36)
  end)
end
function Net:reset_parameters()
  fsdp.no_grad(function() self.scale:uniform_(-1, 1):mul_(0.5):add_(0.25) end)
end
local function eager(seed) fsdp.manual_seed(seed); return Net() end
local function meta(seed) fsdp.manual_seed(seed); return fsdp.meta(Net) end

local PLANS = {
  root = function(m, o) fsdp.wrap(m, o) end,
  each = function(m, o)
    for _, c in ipairs { m.conv, m.blocks[1], m.blocks[2], m.blocks[3], m.bn2, m.ln, m.wide } do fsdp.wrap(c, o) end
    fsdp.wrap(m, o)
  end,
  blocks = function(m, o) fsdp.wrap(m.blocks, o); fsdp.wrap(m, o) end,
}

local checks = dofile(((arg and arg[0] or ""):match("^(.*)/[^/]*$") or ".") .. "/checks.lua")
local check = checks.check

local function full_state(m)
  local out = {}
  for k, v in pairs(m:state_dict()) do out[k] = v:to("float32"):reshape(-1):tolist() end
  return out
end
local function same_state(fail, want, got, what)
  for k, w in pairs(want) do
    local g = got[k]
    if not g then fail(("%s: %s missing"):format(what, k))
    else
      for i = 1, #w do
        if w[i] ~= g[i] then fail(("%s: %s element %d is %.9g, eager %.9g"):format(what, k, i, g[i], w[i])); break end
      end
    end
  end
end
local function params_bytes() return fsdp.memory_stats().params end
-- this rank's chunk bytes of a wrapped model: each parameter's ceil(numel / W) float32 elements
local function chunk_bytes(m, W)
  local b, seen = 0, {}
  for _, p in ipairs(m:parameters()) do
    local k = fsdp._key(p)
    if not seen[k] then seen[k] = true; b = b + 4 * math.ceil(p:numel() / W) end
  end
  return b
end

if mode == "--save" then  -- (the first half of the checkpoint check: saved at this world size)
  local m = eager(21)
  PLANS.each(m)
  fsdp.save_sharded(dir, m)
  if R == 0 then print("SAVED") end
  os.exit(0)
end
if mode == "--load" then  -- (the second half: loaded at another)
  check("load_sharded at another world size, into a meta-built model", function(fail)
    local want = full_state(eager(21))
    local m = meta(99)
    PLANS.blocks(m)
    collectgarbage()
    local a0 = fsdp.memory_stats().activations.current
    fsdp.reset_peak_memory_stats()
    fsdp.load_sharded(dir, m)
    local largest = 0
    for _, p in ipairs(m:parameters()) do largest = math.max(largest, 4 * math.ceil(p:numel() / N)) end
    local tmp = fsdp.memory_stats().activations.peak - a0
    if tmp > largest + 1024 then
      fail(("load_sharded's temporaries peaked at %d bytes; a piece is at most %d"):format(tmp, largest))
    end
    same_state(fail, want, full_state(m), "loaded")
  end)
  checks.finish()
end

for _, plan in ipairs { "root", "each", "blocks" } do
  for _, sh in ipairs { "full", "grad_op", "none" } do
    check(("bit-identical init: plan %s, sharding %s"):format(plan, sh), function(fail)
      local want = full_state(eager(5))
      local after = fsdp.rand(4):tolist()
      local m = meta(5)
      if m.blocks[1].weight.device ~= "meta" then fail("the meta build made real parameters") end
      local after_meta = fsdp.rand(4):tolist()
      for i = 1, 4 do if after[i] ~= after_meta[i] then fail("the RNG stream moved differently") break end end
      PLANS[plan](m, { sharding = sh })
      same_state(fail, want, full_state(m), "wrapped")
    end)
  end
end

check("frozen parameters materialise alike; a meta model cannot change dtype", function(fail)
  local e = eager(8)
  e.emb.weight.requires_grad = false
  local m = meta(8)
  m.emb.weight.requires_grad = false
  PLANS.each(m)
  same_state(fail, full_state(e), full_state(m), "frozen")
  -- (Module:to needs values: on meta the error says how to materialise; mixed_precision is the way
  -- to compute in bf16 after wrapping)
  local ok, err = pcall(function() meta(8).conv:to("bfloat16") end)
  if ok or not tostring(err):find("on meta", 1, true) then fail("Module:to(bfloat16) on meta: " .. tostring(err)) end
end)

check("memory: nothing allocated on meta, exactly the chunks when wrapped", function(fail)
  collectgarbage()
  local before = params_bytes().current
  fsdp.reset_peak_memory_stats()
  local m = meta(3)
  if params_bytes().current ~= before then
    fail(("the meta build allocated %d parameter bytes"):format(params_bytes().current - before))
  end
  local act0 = fsdp.memory_stats().activations.current
  PLANS.each(m)
  local got, want = params_bytes().current - before, chunk_bytes(m, N)
  if got ~= want then fail(("wrapping allocated %d parameter bytes, this rank's chunks are %d"):format(got, want)) end
  local peak = params_bytes().peak - before
  if peak ~= want then fail(("the parameter bytes peaked at %d while wrapping, the chunks are %d"):format(peak, want)) end
  local largest = 0
  for _, p in ipairs(m:parameters()) do largest = math.max(largest, 4 * math.ceil(p:numel() / N)) end
  local tmp = fsdp.memory_stats().activations.peak - act0
  if tmp > 2 * largest + 1024 then
    fail(("replay temporaries peaked at %d bytes, more than a piece (%d) allows"):format(tmp, largest))
  end
end)

check("fsdp.reset_parameters on the wrapped model = on the eager one", function(fail)
  local e, m = eager(4), meta(4)
  PLANS.each(m)
  fsdp.manual_seed(40); fsdp.reset_parameters(e)
  fsdp.manual_seed(40); fsdp.reset_parameters(m)
  same_state(fail, full_state(e), full_state(m), "reset")
end)

check("each layer's reset_parameters on its pieces = on the eager layer", function(fail)
  local e, m = eager(14), meta(14)
  PLANS.root(m)
  for _, path in ipairs { "emb", "conv", "convt", "bn1", "gn", "rms", "wide" } do
    fsdp.manual_seed(#path); e[path]:reset_parameters()
    fsdp.manual_seed(#path); m[path]:reset_parameters()
  end
  same_state(fail, full_state(e), full_state(m), "reset on pieces")
end)

check("sync_module_states: rank 0 eager, the others on meta", function(fail)
  local want = full_state(eager(6))
  local m = R == 0 and eager(6) or meta(77)  -- (other ranks' seed differs: rank 0's values must win)
  PLANS.blocks(m)
  same_state(fail, want, full_state(m), "synced")
end)

check("sync_module_states: every rank on meta, other ranks seeded differently", function(fail)
  local want = full_state(eager(6))
  local m = meta(R == 0 and 6 or 60 + R)  -- (rank 0's recorded initialisation is what every rank replays)
  PLANS.each(m)
  same_state(fail, want, full_state(m), "synced")
end)

for _, dt in ipairs { "float32", "bfloat16" } do
  check(("load_state_dict(fsdp.load(full %s file)) reads the pieces only"):format(dt), function(fail)
    local path = os.getenv("TMPDIR") or "/tmp"
    path = ("%s/fsdp_meta_init_%d_%s.safetensors"):format(path, fsdp.broadcast(fsdp.tensor({ os.time() % 100000 }), 0):item(), dt)
    local e = eager(12)
    local sd = {}
    for k, v in pairs(e:state_dict()) do sd[k] = v.dtype == "float32" and v:to(dt) or v end
    if R == 0 then fsdp.save(path, sd) end
    fsdp.barrier()
    local want = {}
    for k, v in pairs(sd) do want[k] = v:to("float32"):reshape(-1):tolist() end
    local m = meta(13)
    PLANS.each(m)
    collectgarbage()
    local a0 = fsdp.memory_stats().activations.current
    fsdp.reset_peak_memory_stats()
    local p0 = params_bytes().current
    m:load_state_dict(fsdp.load(path))
    local largest = 0
    for _, p in ipairs(m:parameters()) do largest = math.max(largest, 4 * math.ceil(p:numel() / N)) end
    local tmp = fsdp.memory_stats().activations.peak - a0
    if tmp > largest + 1024 then
      fail(("the load's temporaries peaked at %d bytes; a piece is at most %d"):format(tmp, largest))
    end
    if params_bytes().peak ~= p0 then fail("the load allocated parameter bytes") end
    same_state(fail, want, full_state(m), "loaded")
    fsdp.barrier()
    if R == 0 then os.remove(path) end
  end)
end

check("errors: a meta tensor's values, a module without reset_parameters, rank 0 on meta only", function(fail)
  local m = meta(1)
  local ok, err = pcall(function() return m.blocks[1].weight:sum() end)
  if ok or not tostring(err):find("on meta", 1, true) or not tostring(err):find("fsdp.wrap", 1, true) then
    fail("reading a meta parameter: " .. tostring(err))
  end
  ok, err = pcall(function() return m.blocks[1](fsdp.randn(2, 6)) end)
  if ok or not tostring(err):find("on meta", 1, true) then fail("a meta module's forward: " .. tostring(err)) end
  local Bare = nn.Module:extend("Bare")
  function Bare:__init() self.w = nn.Parameter(fsdp.zeros(3)) end
  local holder = nn.Sequential(nn.Linear(2, 2), Bare())
  ok, err = pcall(fsdp.reset_parameters, holder)
  if ok or not tostring(err):find("'1' (Bare)", 1, true) or not tostring(err):find("sync_module_states", 1, true) then
    fail("reset_parameters without one: " .. tostring(err))
  end
  if N > 1 then  -- (every rank learns it at the same parameter: no rank waits for the others)
    local x = R == 0 and meta(2) or eager(2)
    ok, err = pcall(PLANS.root, x)
    if ok or not tostring(err):find("rank 0 built this parameter on meta", 1, true) then
      fail("rank 0 on meta, the others eager: " .. tostring(err))
    end
  end
end)

checks.finish()
