-- Gradient accumulation with no_sync: every interleaving of synced (s) and unsynced (n) backwards up
-- to length 4, against one process, for every sharding strategy, freezing and placement.
--
--   bin/fsdprun -n 3 tests/scripts/grad_accum.lua [lua pattern on the case name]
--   FSDP_SABOTAGE=fold ...   the wrapped side's first micro-batch counts twice (its loss doubled):
--                            every case must FAIL (proves the comparison can fail)
--
-- A case: the nested model of fsdp_models.lua (Sequential(Linear, ReLU, Sequential(Linear, ReLU,
-- Linear), ReLU, Linear)), the inner Sequential and the root wrapped; a reference copy, unwrapped,
-- runs each micro-batch on the GLOBAL batch of 12 rows (divisible by 1-4 ranks), the wrapped copy
-- on this rank's rows. For the pattern's backwards (no zero_grad between them), then:
--   after the pattern   a pattern that ends synced: each .grad is this rank's piece of the
--                       reference's gradient; one that ends inside no_sync: each .grad is a local
--                       gradient of the full shape, whose average over ranks is the reference's,
--                       and the optimizer refuses to step on it (more than one rank)
--   one more backward   synced: every .grad is the reference's piece again
--   an SGD step         every parameter's piece equals the reference's
--   idle                every unit is idle after every backward
-- Rank 0 prints "CASE <name> ws=N maxdiff=.. PASS|FAIL" per case, "DETAIL <name> rank r: why" for
-- each failed check, and "SUMMARY ws=N cases=K failed=F max=.." at the end; exit status 1 on failure.
-- Tolerances: f32 1e-6 + 1e-5 rel (as fsdp_matrix.lua); bf16 (units compute in bfloat16) 5e-3 + 5e-2
-- relative to the larger of the element and the tensor's largest element (cmp).
local ffi = require "ffi"
local fsdp = require "fsdp"
local nn, F, C = fsdp.nn, fsdp.nn.functional, fsdp.C

fsdp.init()
fsdp.comm.set_timeout(60)
local R, N = fsdp.rank(), fsdp.world_size()
local pattern = arg and arg[1]
local sabotage = os.getenv("FSDP_SABOTAGE")
local GB = 12
local TOL = { f32 = { a = 1e-6, r = 1e-5 }, bf16 = { a = 5e-3, r = 5e-2, tensor_scale = true } }
local have_gpu = fsdp.cuda.is_available()
if not have_gpu then fsdp._testdev_install() end  -- offload cases run on the test double of a GPU

local function build()
  fsdp.manual_seed(11)
  return nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Sequential(nn.Linear(13, 11), nn.ReLU(), nn.Linear(11, 11)),
    nn.ReLU(), nn.Linear(11, 3))
end
local function batch(k)
  fsdp.manual_seed(1000 + k)
  return fsdp.randn{ GB, 7 }, fsdp.randint(0, 3, { GB })
end
local function rows(t)
  local b = GB / N
  return t:narrow(1, R * b + 1, b):contiguous()
end

local FREEZE = {
  none = {},
  mixed = { "0.bias", "2.2.weight" },  -- a frozen parameter beside trainable ones in both units
  frozen_unit = { "2.0.weight", "2.0.bias", "2.2.weight", "2.2.bias" },  -- the inner unit frozen whole
}
local function freeze(m, names)
  local set = {}
  for _, n in ipairs(names) do set[n] = true end
  for name, p in m:named_parameters() do if set[name] then p.requires_grad = false end end
end

local function flat(t) return t:contiguous():view(-1):tolist() end
local piece_start, piece_len = ffi.new("int64_t[1]"), ffi.new("int64_t[1]")
local function piece(p)  -- [start, start + len) of the flattened parameter this rank holds
  if C.fsdp_param_piece(p.p, piece_start, piece_len) == 0 then return 0, p:numel() end
  return tonumber(piece_start[0]), tonumber(piece_len[0])
end
-- |got - ref| <= a + r * |ref| elementwise; under bf16 the scale is the whole tensor's largest
-- |ref| at least (a sum of bfloat16 terms is off by their size, not by the sum's: a gradient
-- element that cancels to near zero is bf16-close to the terms that made it)
local function cmp(got, ref, off, tol)
  local md, bad, scale = 0, nil, 0
  if tol.tensor_scale then for i = 1, #ref do scale = math.max(scale, math.abs(ref[i])) end end
  for i = 1, #got do
    local e = ref[off + i]
    local d = math.abs(got[i] - e)
    if d ~= d then d = math.huge end
    md = math.max(md, d)
    if not bad and not (d <= tol.a + tol.r * math.max(math.abs(e), scale)) then bad = i end
  end
  return md, bad
end

-- ---- one case ------------------------------------------------------------------------------------------------
local summary = { cases = 0, failed = 0, max = 0 }

local function run_case(c)
  local fails, maxd = {}, 0
  local function fail(msg) fails[#fails + 1] = msg end
  local tol = TOL[c.mp and "bf16" or "f32"]
  local ok, err = pcall(function()
    local ref, fs = build(), build()
    freeze(ref, FREEZE[c.freeze]); freeze(fs, FREEZE[c.freeze])
    local dev = c.offload and "cuda" or "cpu"
    if c.offload then fs:to("cuda") end
    local opts = { sharding = c.sharding, offload = c.offload or nil,
      mixed_precision = c.mp and { param = c.mp } or nil }
    if c.sharding == "hybrid" then opts.shard_group_size = (N % 2 == 0) and N / 2 or 1 end
    fsdp.wrap(fs["2"], opts)
    fsdp.wrap(fs, opts)
    local rp, fp = {}, {}
    for name, p in ref:named_parameters() do rp[name] = p end
    local order = {}
    for name, p in fs:named_parameters() do fp[name] = p; order[#order + 1] = name end

    local function micro(k, sync)
      local x, y = batch(k)
      F.cross_entropy(ref(x), y):backward()
      local xs, ys = rows(x):to(dev), rows(y):to(dev)
      local function bw()
        local loss = F.cross_entropy(fs(xs), ys)
        if sabotage == "fold" and k == 1 then loss = loss * 2 end
        loss:backward()
      end
      if sync then bw() else fs:no_sync(bw) end
      if not fsdp.all_idle() then fail(("backward %d: units not idle"):format(k)) end
    end
    -- .grad against the reference: reduced (this rank's piece) or local (full; averaged over ranks)
    local function check_grads(when, local_form)
      for _, name in ipairs(order) do
        local p, q = fp[name], rp[name]
        local g, rg = p.grad, q.grad
        local s, l = piece(p)
        if (g == nil) ~= (rg == nil) and not (g == nil and l == 0) then
          fail(("%s: %s.grad is %s, the reference's is %s"):format(when, name, g == nil and "nil" or "set",
            rg == nil and "nil" or "set"))
        elseif g ~= nil then
          local got, off = nil, s
          if local_form and N > 1 then
            if g:numel() ~= p:numel() then
              fail(("%s: %s.grad has %d elements; a local gradient has the full %d"):format(when, name, g:numel(), p:numel()))
            else
              local avg = g:to("cpu"):contiguous():clone()
              fsdp.all_reduce(avg, "avg")
              got, off = flat(avg), 0
            end
          elseif g:numel() ~= l then
            fail(("%s: %s.grad has %d elements, the piece %d"):format(when, name, g:numel(), l))
          else
            got = flat(g:to("cpu"))
          end
          if got then
            local md, bad = cmp(got, flat(rg), off, tol)
            maxd = math.max(maxd, md)
            if bad then fail(("%s: %s.grad element %d: %.8g, reference %.8g"):format(when, name, off + bad, got[bad],
              flat(rg)[off + bad])) end
          end
        end
      end
    end

    local n = #c.pattern
    for k = 1, n do micro(k, c.pattern:sub(k, k) == "s") end
    local ends_local = c.pattern:sub(n, n) == "n"
    check_grads("after " .. c.pattern, ends_local)
    local opt = fsdp.optim.SGD(fs:parameters(), { lr = 0.1, momentum = 0.9 })
    local ropt = fsdp.optim.SGD(ref:parameters(), { lr = 0.1, momentum = 0.9 })
    if ends_local and N > 1 then
      local stepped, e = pcall(function() opt:step() end)
      if stepped then fail("the optimizer stepped on local (unreduced) gradients")
      elseif not tostring(e):find("no_sync", 1, true) then fail("the optimizer's refusal does not name no_sync: " .. tostring(e)) end
    end
    micro(n + 1, true)
    check_grads("after " .. c.pattern .. "+s", false)
    opt:step(); ropt:step()
    for _, name in ipairs(order) do
      local s = piece(fp[name])
      local md, bad = cmp(flat(fp[name]:to_local():to("cpu")), flat(rp[name]), s, tol)
      maxd = math.max(maxd, md)
      if bad then fail(("after the step: %s element %d differs"):format(name, s + bad)) end
    end
  end)
  if not ok then fail("error: " .. tostring(err)) end
  local v = fsdp.tensor({ maxd, #fails })
  if N > 1 then fsdp.all_reduce(v, "max") end
  v = v:tolist()
  local counts = N > 1 and fsdp.all_gather(fsdp.tensor({ #fails })):tolist() or { #fails }
  local first
  for r = 1, N do if counts[r] > 0 and not first then first = r - 1 end end
  if first == R then
    for i, f in ipairs(fails) do
      if i > 6 then print(("DETAIL %s rank %d: ... and %d more"):format(c.name, R, #fails - 6)); break end
      print(("DETAIL %s rank %d: %s"):format(c.name, R, f))
    end
    io.stdout:flush()
  end
  if N > 1 then fsdp.barrier() end
  local passed = v[2] == 0
  if R == 0 then print(("CASE %-40s ws=%d maxdiff=%.2e %s"):format(c.name, N, v[1], passed and "PASS" or "FAIL")) end
  io.stdout:flush()
  summary.cases = summary.cases + 1
  if not passed then summary.failed = summary.failed + 1 end
  if not c.mp then summary.max = math.max(summary.max, v[1]) end
end

-- ---- the table -----------------------------------------------------------------------------------------------
local patterns = {}
for len = 1, 4 do
  for bits = 0, 2 ^ len - 1 do
    local s = {}
    for i = 1, len do s[i] = math.floor(bits / 2 ^ (len - i)) % 2 == 1 and "n" or "s" end
    patterns[#patterns + 1] = table.concat(s)
  end
end
local cases = {}
for _, sh in ipairs { "full", "grad_op", "none", "hybrid" } do
  for _, fr in ipairs { "none", "mixed", "frozen_unit" } do
    for _, pat in ipairs(patterns) do
      cases[#cases + 1] = { name = ("%s/%s/%s"):format(sh, fr, pat), sharding = sh, freeze = fr, pattern = pat }
    end
  end
  -- CPU offload: the units compute on the GPU (the test double without one), shards and gradient
  -- pieces on the host
  for _, pat in ipairs(patterns) do
    cases[#cases + 1] = { name = ("%s/offload/%s"):format(sh, pat), sharding = sh, freeze = "mixed", pattern = pat,
      offload = true }
  end
end
for _, pat in ipairs { "sns", "nns", "snn", "nsns" } do  -- bf16 compute: local gradients accumulate in float32
  cases[#cases + 1] = { name = "full/bf16/" .. pat, sharding = "full", freeze = "mixed", pattern = pat, mp = "bf16" }
end
local selected = {}
for _, c in ipairs(cases) do
  if not pattern or c.name:find(pattern) then selected[#selected + 1] = c end
end
if R == 0 then print(("PLAN ws=%d cases=%d"):format(N, #selected)) end
for _, c in ipairs(selected) do run_case(c) end
if R == 0 then
  print(("SUMMARY ws=%d cases=%d failed=%d max_f32=%.2e"):format(N, summary.cases, summary.failed, summary.max))
end
io.stdout:flush()
os.exit(summary.failed == 0 and 0 or 1)
