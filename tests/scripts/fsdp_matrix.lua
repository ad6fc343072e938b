-- The FSDP test matrix: many cases in one launch.
--
--   bin/fsdprun -n 2 tests/scripts/fsdp_matrix.lua [pattern]     (also -n 4, and -n 1 = plain luajit)
--   FSDP_MATRIX_SABOTAGE=lr ...   the wrapped side trains with a 1% larger learning rate: every
--                                 case must FAIL (proves the comparison can fail)
--   FSDP_MATRIX_DEVICE=cuda ...   the wrapped side's model and batches live on the "cuda" device (the
--                                 test double of a GPU where there is none; collectives staged
--                                 through the host); the reference stays on the CPU
--
-- Every case trains two copies of one model built from the same seed:
--   reference  unwrapped, single process, on the GLOBAL batch
--   fsdp       wrapped as the case says, on this rank's slice of the global batch
-- for at least 3 steps (SGD with momentum unless the case says otherwise), and checks
--   loss   the ranks' mean loss equals the reference loss (per step)
--   grad   each parameter's .grad is the matching piece of the reference gradient (per step)
--   param  the gathered state_dict equals the reference's (same names, values), and each
--          parameter tensor is this rank's piece of the reference values (after the last step)
--   idle   fsdp.all_idle() and every fsdp.unit_states() entry is IDLE after every step
--   plus case-specific checks (collective counts/bytes, error messages, eval outputs, ...).
-- Rank 0 prints one line per case:
--   CASE <name> ws=<N> loss=<max diff> grad=<..> param=<..> aux=<..> PASS|FAIL
-- and any rank prints "DETAIL <name> rank <r>: <why>" for each failed check, then
--   SUMMARY ws=<N> cases=<n> failed=<n> max_loss=.. max_grad=.. max_param=.. (f32 cases) ... plane=<how
--   device tensors moved: fsdp.comm_device_plane(); FSDP_DEVICE_COMM picks it>
-- The exit status is 1 when a case failed.
--
-- Tolerances (|diff| <= atol + rtol * |reference|, elementwise):
--   f32   loss 1e-5 + 1e-5 rel; grads and params 1e-6 + 1e-5 rel  (measured maxima are printed)
--   bf16  loss 2e-2 + 2e-2 rel; grads 5e-3 + 5e-2 rel; params 5e-3 + 5e-2 rel (the units compute
--         in bf16 against the reference's f32; measured at 1, 2 and 4 ranks: loss <= 7.7e-3,
--         grads <= 1.1e-3, params <= 3.6e-4, the latter two gathered from the f32 masters)
--   bn    (SyncBatchNorm cases) loss as f32; grads and params 1e-5 + 1e-4 rel: the global
--         statistics and gradient sums add every rank's float32 partial sums, the reference sums
--         in one pass, and batch norm's backward subtracts nearly equal terms (measured at 2 and
--         4 ranks: grads <= 1.2e-6, params <= 3.3e-7, at the edge of the f32 tolerance)
local ffi = require "ffi"
local fsdp = require "fsdp"
local C = fsdp.C
local nn, F = fsdp.nn, fsdp.nn.functional

fsdp.init()
fsdp.comm.set_timeout(tonumber(os.getenv("FSDP_COMM_TIMEOUT") or "") or 60)
local R, N = fsdp.rank(), fsdp.world_size()
local Wr = require "fsdp.wrap"

local here = (debug.getinfo(1, "S").source:match("^@(.*/)") or "./")
local models = dofile(here .. "fsdp_models.lua")
local GB = models.GLOBAL_B
local pattern = arg and arg[1]
local sabotage = os.getenv("FSDP_MATRIX_SABOTAGE")
local DEVICE = os.getenv("FSDP_MATRIX_DEVICE")
if DEVICE == "cuda" and not fsdp.cuda.is_available() then fsdp._testdev_install() end

local TOL = {
  f32 = { loss_a = 1e-5, loss_r = 1e-5, a = 1e-6, r = 1e-5 },
  bf16 = { loss_a = 2e-2, loss_r = 2e-2, a = 5e-3, r = 5e-2 },
  bn = { loss_a = 1e-5, loss_r = 1e-5, a = 1e-5, r = 1e-4 },
}

-- ---- helpers ------------------------------------------------------------------------------------------
local function flat(t) return t:to_local():contiguous():tolist() end  -- (a sharded parameter: its piece)

-- a directory under /tmp that every rank names alike: rank 0's clock and pid, broadcast (each rank's
-- own clock could straddle a second)
pcall(ffi.cdef, "int getpid(void);")
local function shared_dir(prefix)
  local id = fsdp.tensor({ os.time() % 1000000, ffi.C.getpid() % 1000000 })
  if N > 1 then fsdp.broadcast(id, 0) end
  local v = id:tolist()
  return ("/tmp/%s_%d_%d"):format(prefix, v[1], v[2])
end

local function same_ptr(a, b) return ffi.cast("void*", a) == ffi.cast("void*", b) end

-- [start, start + len) of p's flattened full tensor that this rank holds as p
local function piece_range(p)
  local u = C.fsdp_param_unit(p.p)
  if u == nil then return 0, p:numel(), p:numel() end
  for i = 0, C.fsdp_unit_num_params(u) - 1 do
    if same_ptr(C.fsdp_unit_param(u, i), p.p) then
      local n, c, s, l = ffi.new("int64_t[1]"), ffi.new("int64_t[1]"), ffi.new("int64_t[1]"), ffi.new("int64_t[1]")
      assert(C.fsdp_unit_param_layout(u, i, n, c, s, l) == 0)
      return tonumber(s[0]), tonumber(l[0]), tonumber(n[0])
    end
  end
  error("parameter not found in its unit")
end

local function params_by_name(m)
  local r, order = {}, {}
  for name, p in m:named_parameters() do r[name] = p; order[#order + 1] = name end
  return r, order
end

-- compares `got` (flat list) with `ref` (flat list, from offset off) elementwise; returns max
-- |diff| and the first violating index (or nil)
local function cmp(got, ref, off, tol)
  local md, bad = 0, nil
  for i = 1, #got do
    local e = ref[off + i]
    local d = math.abs(got[i] - e)
    if d ~= d then d = math.huge end
    if d > md then md = d end
    if not bad and not (d <= tol.a + tol.r * math.abs(e)) then bad = i end
  end
  return md, bad
end

local function comm_snapshot()
  local s = fsdp.comm_stats()
  local r = {}
  for k, v in pairs(s) do r[k] = { count = v.count, bytes = v.bytes } end
  return r
end
local function comm_diff(a, b)
  local r = {}
  for k, v in pairs(b) do r[k] = { count = v.count - a[k].count, bytes = v.bytes - a[k].bytes } end
  return r
end

-- the reference's way of clipping (torch.nn.utils.clip_grad_norm_'s formula, in double precision over
-- every element): the p-norm of all gradients (the largest |g| for p = inf), every gradient scaled
-- by min(1, max_norm / (norm + 1e-6))
local function ref_clip(model, max_norm, p)
  p = p or 2
  local acc = 0
  for _, q in ipairs(model:parameters()) do
    if q.grad then
      for _, v in ipairs(flat(q.grad)) do
        if p == math.huge then acc = math.max(acc, math.abs(v)) else acc = acc + math.abs(v) ^ p end
      end
    end
  end
  local total = p == math.huge and acc or acc ^ (1 / p)
  local coef = max_norm / (total + 1e-6)
  if coef < 1 then
    fsdp.no_grad(function() for _, q in ipairs(model:parameters()) do if q.grad then q.grad:mul_(coef) end end end)
  end
  return total
end
-- the reference's clip_grad_value: every gradient element clamped to [-v, v]
local function ref_clip_value(model, v)
  fsdp.no_grad(function()
    for _, q in ipairs(model:parameters()) do if q.grad then q.grad:copy_(q.grad:clamp(-v, v)) end end
  end)
end
-- a step that clips the gradients (the wrapped side by fsdp.clip_grad_norm / clip_grad_value): to
-- norm max_norm in the p-norm (the norm is the step's aux value), or to values in [-value, value]
local function clip_step_with(p, max_norm, value)
  return function(S, k)
    local x, y = S.batch(k)
    local loss = S.spec.loss(S.model(x), y)
    S.opt:zero_grad(); loss:backward()
    if value then
      if S.is_ref then ref_clip_value(S.model, value) else fsdp.clip_grad_value(S.model, value) end
      S.opt:step()
      return loss:item()
    end
    local norm = S.is_ref and ref_clip(S.model, max_norm, p) or fsdp.clip_grad_norm(S.model, max_norm, p)
    S.opt:step()
    return loss:item(), { norm }
  end
end
local clip_step = clip_step_with(2, 0.05)

-- ---- expected collectives -------------------------------------------------------------------------------
-- Computed independently of wrap.lua: each parameter belongs to the unit with the longest path
-- that prefixes its name ("" = the root); a unit's group (trainable / frozen) holds
-- S = sum(ceil(numel / W)) elements. Per step, with every unit in forward and backward:
--   full     all-gather per non-empty group in forward, again in backward except the root;
--            one reduce-scatter of W * S_trainable floats per unit with trainable parameters
--   grad_op  all-gathers in forward only; reduce-scatters as above
--   none     no all-gather; one all-reduce of S_trainable floats per unit with trainable params
-- opts.no_backward_gather = {path = true}: units that are never needed in backward (frozen, with
-- inputs that need no grad) gather only in forward. opts.gather_bytes: bytes per gathered element
-- (4; 2 under bf16 mixed precision, whose reductions stay float32).
-- hybrid: shard groups of HG ranks (half the world, at least 1),
-- the pieces then averaged over the N / HG replicas
local HG = math.max(1, math.floor(N / 2))
local function expected_comm(model, unit_paths, sharding, opts)
  opts = opts or {}
  local W = sharding == "none" and 1 or sharding == "hybrid" and HG or N
  local units = {}
  for _, path in ipairs(unit_paths) do units[path] = { s = { 0, 0 } } end
  for name, p in model:named_parameters() do
    local best
    for _, path in ipairs(unit_paths) do
      if path == "" or name:sub(1, #path + 1) == path .. "." then
        if not best or #path > #best then best = path end
      end
    end
    assert(best, "no unit owns " .. name)
    local g = p.requires_grad and 1 or 2
    local n = p:numel()
    units[best].s[g] = units[best].s[g] + math.ceil(n / W)
  end
  local e = {
    all_gather = { count = 0, bytes = 0 }, reduce_scatter = { count = 0, bytes = 0 },
    all_reduce = { count = 0, bytes = 0 }, broadcast = { count = 0, bytes = 0 }, barrier = { count = 0, bytes = 0 },
  }
  for path, u in pairs(units) do
    for g = 1, 2 do
      if u.s[g] > 0 and W > 1 then
        local times = 1
        if (sharding == "full" or sharding == "hybrid") and path ~= "" and not (opts.no_backward_gather or {})[path] then
          times = 2
        end
        e.all_gather.count = e.all_gather.count + times
        e.all_gather.bytes = e.all_gather.bytes + times * W * u.s[g] * (opts.gather_bytes or 4)
      end
    end
    if u.s[1] > 0 and W > 1 then
      e.reduce_scatter.count = e.reduce_scatter.count + 1
      e.reduce_scatter.bytes = e.reduce_scatter.bytes + W * u.s[1] * 4
    end
    if u.s[1] > 0 and N > W then  -- replicas: no sharding, or hybrid's shard groups
      e.all_reduce.count = e.all_reduce.count + 1
      e.all_reduce.bytes = e.all_reduce.bytes + u.s[1] * 4
    end
  end
  return e
end

local function comm_str(c)
  return ("ag %d/%dB rs %d/%dB ar %d/%dB bc %d"):format(c.all_gather.count, c.all_gather.bytes,
    c.reduce_scatter.count, c.reduce_scatter.bytes, c.all_reduce.count, c.all_reduce.bytes, c.broadcast.count)
end

-- ---- wrapping policies ----------------------------------------------------------------------------------
-- each returns the list of unit paths it created ("" = root), used for the expected collectives
local P = {}
P.nested = {
  root = function(m, o) fsdp.wrap(m, o); return { "" } end,
  children = function(m, o) fsdp.wrap(m["2"], o); fsdp.wrap(m, o); return { "2", "" } end,
  every = function(m, o)  -- every child (the ReLUs too: units without parameters); the root owns nothing
    local ps = {}
    for name, c in m:named_children() do fsdp.wrap(c, o); ps[#ps + 1] = name end
    fsdp.wrap(m, o); ps[#ps + 1] = ""
    return ps
  end,
  nested3 = function(m, o) fsdp.wrap(m["2"]["0"], o); fsdp.wrap(m["2"], o); fsdp.wrap(m, o); return { "2.0", "2", "" } end,
  outer_first = function(m, o) fsdp.wrap(m, o); fsdp.wrap(m["2"], o); return { "", "2" } end,
  auto = function(m, o)
    local oo = { min_params = 100 }
    for k, v in pairs(o) do oo[k] = v end
    fsdp.auto_wrap(m, oo)
    return { "0", "2.0", "2.2", "" }  -- own params: 0: 104, 2.0: 154, 2.2: 132, 4: 36 (stays with the root)
  end,
}
P.conv = {
  root = function(m, o) fsdp.wrap(m, o); return { "" } end,
  children = function(m, o) fsdp.wrap(m.trunk, o); fsdp.wrap(m.head, o); fsdp.wrap(m, o); return { "trunk", "head", "" } end,
  blocks = function(m, o)  -- three levels: Block -> trunk -> root; the root and the trunk own nothing
    fsdp.wrap(m.trunk["0"], o); fsdp.wrap(m.trunk["1"], o); fsdp.wrap(m.trunk, o); fsdp.wrap(m.head, o); fsdp.wrap(m, o)
    return { "trunk.0", "trunk.1", "trunk", "head", "" }
  end,
}
P.transformer = {
  root = function(m, o) fsdp.wrap(m, o); return { "" } end,
  blocks = function(m, o)
    fsdp.wrap(m.blocks["0"], o); fsdp.wrap(m.blocks["1"], o); fsdp.wrap(m, o)
    return { "blocks.0", "blocks.1", "" }
  end,
  auto = function(m, o)
    local oo = { min_params = 250 }
    for k, v in pairs(o) do oo[k] = v end
    fsdp.auto_wrap(m, oo)
    -- own params: attn 216 + 72, mlp.fc 288, mlp.proj 264; a block's rest (ln1, ln2) 32 stays with the root
    return { "blocks.0.attn", "blocks.0.mlp.fc", "blocks.0.mlp.proj", "blocks.1.attn", "blocks.1.mlp.fc",
             "blocks.1.mlp.proj", "" }
  end,
  by_class = function(m, o)  -- every instance of the blocks' class (transformer_auto_wrap_policy), then the root
    local oo = { module_classes = { getmetatable(m.blocks["0"]) } }
    for k, v in pairs(o) do oo[k] = v end
    fsdp.auto_wrap(m, oo)
    return { "blocks.0", "blocks.1", "" }
  end,
}
P.branchy = {
  aux = function(m, o) fsdp.wrap(m.aux, o); fsdp.wrap(m.body["2"], o); fsdp.wrap(m, o); return { "aux", "body.2", "" } end,
}
P.twice = {
  shared = function(m, o) fsdp.wrap(m.shared, o); fsdp.wrap(m, o); return { "shared", "" } end,
}
-- the tied parameter core.tok.weight = core.head.weight goes to the innermost unit around both
P.tied = {
  root = function(m, o) fsdp.wrap(m, o); return { "" } end,
  -- inside one unit: core holds both modules (and body is a unit of its own inside it)
  core = function(m, o) fsdp.wrap(m.core.body, o); fsdp.wrap(m.core, o); fsdp.wrap(m, o); return { "core.body", "core", "" } end,
  -- across sibling units: tok and head each a unit, the root around both owns it
  siblings = function(m, o)
    fsdp.wrap(m.core.tok, o); fsdp.wrap(m.core.head, o); fsdp.wrap(m.core.body, o); fsdp.wrap(m, o)
    return { "core.tok", "core.head", "core.body", "" }
  end,
  siblings_outer_first = function(m, o)
    fsdp.wrap(m, o); fsdp.wrap(m.core.tok, o); fsdp.wrap(m.core.head, o)
    return { "core.tok", "core.head", "" }
  end,
}

local function freeze(m, prefix, flag)
  for name, p in m:named_parameters() do
    if name == prefix or name:sub(1, #prefix + 1) == prefix .. "." then p.requires_grad = flag or false end
  end
end

-- ---- the runner -----------------------------------------------------------------------------------------
local results = {}   -- name -> {params = {name -> flat list}, comm = {per step}}
local summary = { cases = 0, failed = 0, f32 = { loss = 0, grad = 0, param = 0 }, bf16 = { loss = 0, grad = 0, param = 0 } }
local failed_names = {}

local function default_step(S, k)
  local x, y = S.batch(k)
  local loss = S.spec.loss(S.model(x), y)
  S.opt:zero_grad()
  loss:backward()
  S.opt:step()
  return loss:item()
end

local function make_side(c, spec, is_ref)
  local S = { is_ref = is_ref, spec = spec, case = c }
  S.model = spec.build()
  S.device = not is_ref and DEVICE or "cpu"
  if S.device ~= "cpu" then S.model:to(S.device) end
  -- rows of the global batch that this side trains on
  function S.rows(t)
    if is_ref or N == 1 then return t end
    local b = GB / N
    return t:narrow(1, R * b + 1, b):contiguous()
  end
  -- this rank's rows of a global-batch result (for comparing the reference's outputs)
  function S.slice(t)
    if N == 1 then return t end
    local b = GB / N
    return t:narrow(1, R * b + 1, b):contiguous()
  end
  function S.batch(seed)
    local x, y = spec.batch(seed)
    return S.rows(x):to(S.device), S.rows(y):to(S.device)
  end
  return S
end

local function make_opt(c, S)
  local lr = c.lr or 0.1
  if sabotage == "lr" and not S.is_ref then lr = lr * 1.01 end
  if c.optim == "adam" then return fsdp.optim.Adam(S.model:parameters(), { lr = lr * 0.1 }) end
  return fsdp.optim.SGD(S.model:parameters(), { lr = lr, momentum = 0.9 })
end

local function run_case(c)
  local tol = TOL[c.tol or "f32"]
  local spec = models[c.model]
  local fails = {}
  local function fail(msg) fails[#fails + 1] = msg end
  local st = { loss = 0, grad = 0, param = 0, aux = 0 }
  local ctx = { case = c, fail = fail, comm = {}, results = results, N = N, R = R }

  local ok, err = pcall(function()
    collectgarbage(); collectgarbage()
    ctx.mem0 = DEVICE and fsdp.memory_stats(DEVICE)  -- (earlier cases' units keep theirs)
    local ref, fs = make_side(c, spec, true), make_side(c, spec, false)
    ctx.ref, ctx.fs = ref, fs
    if c.freeze then c.freeze(ref.model); c.freeze(fs.model) end
    local opts = {}
    for k, v in pairs(c.opts or {}) do opts[k] = v end
    if c.wrap then
      ctx.unit_paths = c.wrap(fs.model, opts)
    end
    if ctx.unit_paths then  -- the units that exist are the ones the policy meant (auto_wrap included)
      local want, got = {}, {}
      for _, p in ipairs(ctx.unit_paths) do if p ~= "" then want[#want + 1] = p end end
      for p in pairs(fsdp.unit_states(fs.model)) do if p ~= fs.model.__name then got[#got + 1] = p end end
      table.sort(want); table.sort(got)
      if table.concat(want, ",") ~= table.concat(got, ",") then
        fail("units are {" .. table.concat(got, ",") .. "}, expected {" .. table.concat(want, ",") .. "}")
      end
    end
    if c.after_wrap then c.after_wrap(ref, ctx); c.after_wrap(fs, ctx) end
    ref.opt, fs.opt = make_opt(c, ref), make_opt(c, fs)
    local step = c.step or default_step
    for k = 1, c.steps or 3 do
      local aux_r, aux_f = {}, {}
      if c.before_step then
        aux_r = c.before_step(ref, k, ctx) or {}; aux_f = c.before_step(fs, k, ctx) or {}
        if not fsdp.all_idle() then fail(("before step %d: units not idle after the case's extra work"):format(k)) end
      end
      local lr_, ar = step(ref, k, ctx)
      local before = comm_snapshot()
      local lf, af = step(fs, k, ctx)
      ctx.comm[k] = comm_diff(before, comm_snapshot())
      for _, a in ipairs(ar or {}) do aux_r[#aux_r + 1] = a end
      for _, a in ipairs(af or {}) do aux_f[#aux_f + 1] = a end
      -- idle after every step
      if not fsdp.all_idle() then fail(("step %d: fsdp.all_idle() is false"):format(k)) end
      for path, s in pairs(fsdp.unit_states(fs.model)) do
        if s ~= "IDLE" then fail(("step %d: unit '%s' is %s"):format(k, path, s)) end
      end
      -- loss: mean over ranks of the slice losses
      local t = fsdp.tensor({ lf })
      if N > 1 then fsdp.all_reduce(t, "avg") end
      local d = math.abs(t:item() - lr_)
      if d ~= d then d = math.huge end
      st.loss = math.max(st.loss, d)
      if not (d <= tol.loss_a + tol.loss_r * math.abs(lr_)) then
        fail(("step %d: loss %.8g, reference %.8g"):format(k, t:item(), lr_))
      end
      -- aux values (eval outputs, norms ...): this rank's rows of the reference's
      if #aux_r ~= #aux_f then fail(("step %d: %d aux values vs %d in the reference"):format(k, #aux_f, #aux_r)) end
      for i = 1, math.min(#aux_r, #aux_f) do
        local a = type(aux_f[i]) == "number" and { aux_f[i] } or flat(aux_f[i])
        local b = type(aux_r[i]) == "number" and { aux_r[i] } or flat(aux_r[i])
        if #a ~= #b then fail(("step %d: aux %d has %d elements, reference %d"):format(k, i, #a, #b))
        else
          local md, bad = cmp(a, b, 0, tol)
          st.aux = math.max(st.aux, md)
          if bad then fail(("step %d: aux %d element %d: %.8g vs %.8g"):format(k, i, bad, a[bad], b[bad])) end
        end
      end
      -- gradients: the piece of the reference gradient
      local rp = params_by_name(ref.model)
      local fp, order = params_by_name(fs.model)
      for _, name in ipairs(order) do
        local p, q = fp[name], rp[name]
        local g, rg = p.grad, q and q.grad
        local s, l = piece_range(p)
        if (g == nil) ~= (rg == nil) and not (g == nil and l == 0) then
          fail(("step %d: %s.grad is %s, the reference's is %s"):format(k, name, g == nil and "nil" or "set",
            rg == nil and "nil" or "set"))
        elseif g ~= nil and rg ~= nil then
          if g:numel() ~= l then fail(("step %d: %s.grad has %d elements, the piece %d"):format(k, name, g:numel(), l))
          else
            local md, bad = cmp(flat(g), flat(rg), s, tol)
            st.grad = math.max(st.grad, md)
            if bad then fail(("step %d: %s.grad[%d] (piece %d+%d) differs: %.8g vs %.8g"):format(k, name, s + bad, s, l, flat(g)[bad], flat(rg)[s + bad])) end
          end
        end
      end
      if c.after_step then c.after_step(ctx, k) end
    end
    -- parameters: local pieces, then the gathered state dict (names and values)
    local rp = params_by_name(ref.model)
    local fp, order = params_by_name(fs.model)
    for _, name in ipairs(order) do
      local s, l = piece_range(fp[name])
      if not rp[name] then fail("parameter " .. name .. " is not in the reference")
      elseif fp[name]:to_local():numel() ~= l then
        fail(("%s holds %d elements, its piece %d"):format(name, fp[name]:to_local():numel(), l))
      else
        local md, bad = cmp(flat(fp[name]), flat(rp[name]), s, tol)
        st.param = math.max(st.param, md)
        if bad then fail(("local piece of %s differs at %d"):format(name, s + bad)) end
      end
    end
    local sr, sf = ref.model:state_dict(), fs.model:state_dict()
    local saved = {}
    for name, t in pairs(sr) do
      local u = sf[name]
      if not u then fail("state_dict lacks " .. name)
      elseif table.concat(u:shape(), "x") ~= table.concat(t:shape(), "x") then
        fail(("state_dict %s has shape %s, reference %s"):format(name, table.concat(u:shape(), "x"), table.concat(t:shape(), "x")))
      else
        local a = flat(u)
        saved[name] = a
        local md, bad = cmp(a, flat(t), 0, tol)
        st.param = math.max(st.param, md)
        if bad then fail(("param %s[%d]: %.8g vs reference %.8g"):format(name, bad, a[bad], flat(t)[bad])) end
      end
    end
    for name in pairs(sf) do if not sr[name] then fail("state_dict has an extra key " .. name) end end
    results[c.name] = { params = saved, comm = ctx.comm, unit_paths = ctx.unit_paths }
    if c.check then c.check(ctx) end
  end)
  if not ok then fail("error: " .. tostring(err)) end

  -- every rank's verdict
  local v = fsdp.tensor({ st.loss, st.grad, st.param, st.aux, #fails })
  if N > 1 then fsdp.all_reduce(v, "max") end
  v = v:tolist()
  local passed = v[5] == 0
  -- details come from one rank only (the lowest failing one), so output lines of different ranks
  -- never interleave; the CASE line names every failing rank
  local counts = N > 1 and fsdp.all_gather(fsdp.tensor({ #fails })):tolist() or { #fails }
  local failing = {}
  for r = 1, N do if counts[r] > 0 then failing[#failing + 1] = r - 1 end end
  if failing[1] == R then
    for i, f in ipairs(fails) do
      if i > 12 then print(("DETAIL %s rank %d: ... and %d more"):format(c.name, R, #fails - 12)); break end
      print(("DETAIL %s rank %d: %s"):format(c.name, R, f))
    end
    io.stdout:flush()
  end
  if N > 1 and not passed then fsdp.barrier() end
  if R == 0 then
    print(("CASE %-34s ws=%d loss=%.2e grad=%.2e param=%.2e aux=%.2e %s%s"):format(c.name, N, v[1], v[2], v[3], v[4],
      passed and "PASS" or "FAIL", passed and "" or (" (ranks " .. table.concat(failing, ",") .. ")")))
  end
  io.stdout:flush()
  summary.cases = summary.cases + 1
  if not passed then summary.failed = summary.failed + 1; failed_names[#failed_names + 1] = c.name end
  local m = summary[c.tol == "bf16" and "bf16" or "f32"]
  m.loss = math.max(m.loss, v[1]); m.grad = math.max(m.grad, v[2]); m.param = math.max(m.param, v[3])
end

-- ---- the cases ------------------------------------------------------------------------------------------
local cases = {}
local function case(c) cases[#cases + 1] = c end

-- exact collective counts and bytes per step, against expected_comm (this script's count) and
-- against fsdp.summary's plan (the library's prediction, from the units after the last step)
local function check_comm(sharding, opts)
  return function(ctx)
    if N == 1 then return end
    local e = expected_comm(ctx.ref.model, ctx.unit_paths, sharding, opts)
    local plan = fsdp.summary(ctx.fs.model, { print = false }).step
    plan.broadcast = { count = 0, bytes = 0 }
    for k, got in ipairs(ctx.comm) do
      for _, kind in ipairs { "all_gather", "reduce_scatter", "all_reduce", "broadcast" } do
        if got[kind].count ~= e[kind].count or got[kind].bytes ~= e[kind].bytes then
          ctx.fail(("step %d collectives: got %s, expected %s"):format(k, comm_str(got), comm_str(e)))
          break
        end
        if got[kind].count ~= plan[kind].count or got[kind].bytes ~= plan[kind].bytes then
          ctx.fail(("step %d collectives: got %s, fsdp.summary predicted %s"):format(k, comm_str(got), comm_str(plan)))
          break
        end
      end
    end
  end
end

-- (a) wrapping, for each model
for _, pol in ipairs { "root", "children", "every", "nested3", "outer_first", "auto" } do
  case { name = "nested/wrap=" .. pol, model = "nested", wrap = P.nested[pol], check = check_comm("full") }
end
case { name = "nested/wrap=none", model = "nested",  -- the harness itself: plain data parallel by hand
  step = function(S, k)
    if S.is_ref then return default_step(S, k) end
    local x, y = S.batch(k)
    local loss = S.spec.loss(S.model(x), y)
    S.opt:zero_grad(); loss:backward()
    if N > 1 then for _, p in ipairs(S.model:parameters()) do fsdp.all_reduce(p.grad, "avg") end end
    S.opt:step()
    return loss:item()
  end }
for _, pol in ipairs { "root", "children", "blocks" } do
  case { name = "conv/wrap=" .. pol, model = "conv", wrap = P.conv[pol], check = check_comm("full") }
end
for _, pol in ipairs { "root", "blocks", "auto", "by_class" } do
  case { name = "transformer/wrap=" .. pol, model = "transformer", wrap = P.transformer[pol], check = check_comm("full") }
end
-- Adam on the nested model (not the transformer: its key biases get gradients that are zero up
-- to rounding, which Adam normalizes to full-size steps of either sign)
case { name = "nested/children+adam", model = "nested", wrap = P.nested.children, optim = "adam", steps = 4 }

-- (b) freezing
case { name = "conv/freeze=trunk,blocks", model = "conv", wrap = P.conv.blocks,
  freeze = function(m) freeze(m, "trunk") end,
  -- the trunk's inputs need no grad and its parameters are frozen: nothing in backward needs it
  check = check_comm("full", { no_backward_gather = { ["trunk.0"] = true, ["trunk.1"] = true } }) }
case { name = "conv/freeze=trunk,children", model = "conv", wrap = P.conv.children, needs = "conv/wrap=children",
  freeze = function(m) freeze(m, "trunk") end,
  check = function(ctx)
    check_comm("full", { no_backward_gather = { trunk = true } })(ctx)
    -- frozen parameters add no reduce-scatter bytes: the difference to the unfrozen run is
    -- exactly the trunk's padded gradient (W * ceil(numel / W) floats per parameter)
    local base = results["conv/wrap=children"]
    if N == 1 then return end
    if not base then ctx.fail("no result for conv/wrap=children"); return end
    local trunk = 0
    for name, p in ctx.ref.model:named_parameters() do
      if name:find("^trunk%.") then trunk = trunk + N * math.ceil(p:numel() / N) * 4 end
    end
    local d = base.comm[1].reduce_scatter.bytes - ctx.comm[1].reduce_scatter.bytes
    if d ~= trunk then ctx.fail(("reduce-scatter bytes drop by %d when the trunk is frozen, expected %d"):format(d, trunk)) end
    local dc = base.comm[1].reduce_scatter.count - ctx.comm[1].reduce_scatter.count
    if dc ~= 1 then ctx.fail(("frozen trunk unit: reduce-scatter count drops by %d, expected 1"):format(dc)) end
  end }
case { name = "conv/freeze=head,blocks", model = "conv", wrap = P.conv.blocks,
  freeze = function(m) freeze(m, "head") end, check = check_comm("full") }
case { name = "nested/freeze=middle,nested3", model = "nested", wrap = P.nested.nested3,  -- a frozen unit between trainable ones
  freeze = function(m) freeze(m, "2.0") end, check = check_comm("full") }
case { name = "nested/freeze=middle,root", model = "nested", wrap = P.nested.root,
  freeze = function(m) freeze(m, "2.0") end, check = check_comm("full") }
case { name = "nested/freeze=mixed-in-unit", model = "nested", wrap = P.nested.children,
  freeze = function(m) freeze(m, "0.weight"); freeze(m, "2.2.bias"); freeze(m, "4.bias") end, check = check_comm("full") }
case { name = "nested/freeze=after-wrap", model = "nested", wrap = P.nested.nested3,
  after_wrap = function(S) freeze(S.model, "2") end }
case { name = "conv/unfreeze=trunk@3", model = "conv", wrap = P.conv.blocks, steps = 4,
  freeze = function(m) freeze(m, "trunk") end,
  before_step = function(S, k) if k == 3 then freeze(S.model, "trunk", true) end end,
  check = function(ctx)
    if N == 1 then return end
    local e = expected_comm(ctx.ref.model, ctx.unit_paths, "full")  -- everything trainable by now
    local g = ctx.comm[4]
    if g.reduce_scatter.count ~= e.reduce_scatter.count or g.reduce_scatter.bytes ~= e.reduce_scatter.bytes then
      ctx.fail("step 4 collectives after unfreezing: got " .. comm_str(g) .. ", expected " .. comm_str(e))
    end
  end }
case { name = "nested/freeze=2@3", model = "nested", wrap = P.nested.children, steps = 4,
  before_step = function(S, k) if k == 3 then freeze(S.model, "2") end end }
case { name = "nested/freeze=all-but-one-bias", model = "nested", wrap = P.nested.nested3,
  freeze = function(m) for name, p in m:named_parameters() do p.requires_grad = name == "2.0.bias" end end,
  check = check_comm("full") }
case { name = "transformer/freeze=embeddings", model = "transformer", wrap = P.transformer.blocks,  -- unit inputs need no grad
  freeze = function(m) freeze(m, "wte"); freeze(m, "wpe") end }

-- (c) usage
-- a tied parameter: owned by the innermost unit around all its uses, its gradient summed over
-- both, and state_dict keeps both names (the reference's plain state_dict has them too)
local function owner_is(want)
  return function(ctx)
    local p = ctx.fs.model.core.tok.weight
    local u = fsdp.C.fsdp_param_unit(p.p)
    local path = u ~= nil and ffi.string(fsdp.C.fsdp_unit_path(u)) or "(none)"
    if path ~= want then ctx.fail(("the tied parameter belongs to unit '%s', expected '%s'"):format(path, want)) end
    if ctx.fs.model.core.head.weight ~= p then ctx.fail("core.head.weight is no longer core.tok.weight") end
    local sd = ctx.fs.model:state_dict()
    if not (sd["core.tok.weight"] and sd["core.head.weight"]) then ctx.fail("state_dict lost a name of the tied parameter") end
  end
end
for _, pol in ipairs { "root", "core", "siblings", "siblings_outer_first" } do
  case { name = "tied/wrap=" .. pol, model = "tied", wrap = P.tied[pol],
    check = owner_is(pol == "core" and "core" or "Tied") }
end
case { name = "tied/siblings,bf16", model = "tied", wrap = P.tied.siblings, tol = "bf16",
  opts = { mixed_precision = { param = "bf16" } }, check = owner_is("Tied") }
case { name = "usage/unused-output", model = "branchy", wrap = P.branchy.aux }
case { name = "usage/called-twice", model = "twice", wrap = P.twice.shared }
case { name = "usage/no_grad-forward", model = "nested", wrap = P.nested.children,
  before_step = function(S, k)
    local x = S.batch(100 + k)
    local out = fsdp.no_grad(function() return S.model(x) end)
    return { S.is_ref and S.slice(out) or out }
  end }
-- forwards under grad whose backward never comes (a validation pass someone forgot to put under
-- no_grad, a loss computed and skipped): the units wait in FORWARD_DONE, and the next call that
-- needs them idle -- state_dict, summon_full_params, save_sharded, the next forward -- settles them
local function sd_sum(sd)
  local s, names = 0, {}
  for k in pairs(sd) do names[#names + 1] = k end
  table.sort(names)
  for i, k in ipairs(names) do for _, v in ipairs(flat(sd[k])) do s = s + i * v end end
  return s
end
case { name = "usage/validation-under-grad,state_dict", model = "nested", wrap = P.nested.children,
  before_step = function(S, k)
    local out = S.model(S.batch(300 + k))  -- dropped: never backpropagated
    return { S.is_ref and S.slice(out) or out, sd_sum(S.model:state_dict()) }
  end }
case { name = "usage/kept-output,summon_full_params", model = "transformer", wrap = P.transformer.blocks,
  before_step = function(S, k)
    S.kept = S.model(S.batch(400 + k))  -- kept alive, never backpropagated
    local w = 0
    local function read() for _, p in ipairs(S.model:parameters()) do w = w + p:sum():item() end end
    if S.is_ref then read() else S.model:summon_full_params(read, { writeback = false }) end
    return { w }
  end }
case { name = "usage/dropped-forward,save_sharded", model = "conv", wrap = P.conv.blocks,
  before_step = function(S, k, ctx)
    S.model(S.batch(500 + k))
    if S.is_ref then return end
    local dir = shared_dir("fsdp_matrix_drop")
    if R == 0 then os.execute("rm -rf " .. dir) end
    fsdp.barrier()
    fsdp.save_sharded(dir, S.model, S.opt)
    fsdp.barrier()
    if R == 0 then os.execute("rm -rf " .. dir) end
  end }
-- and a kept output backpropagated after state_dict settled its units: they gather again
case { name = "usage/backward-after-state_dict", model = "nested", wrap = P.nested.nested3,
  step = function(S, k)
    local x, y = S.batch(k)
    local loss = S.spec.loss(S.model(x), y)
    local s = sd_sum(S.model:state_dict())
    S.opt:zero_grad(); loss:backward(); S.opt:step()
    return loss:item(), { s }
  end }
case { name = "usage/eval-between-steps", model = "conv", wrap = P.conv.blocks, steps = 4,
  before_step = function(S, k)
    if k == 1 then return end
    S.model:eval()
    local x = S.batch(200 + k)
    local out = fsdp.no_grad(function() return S.model(x) end)
    S.model:train()
    return { S.is_ref and S.slice(out) or out }
  end }
case { name = "usage/no_sync-accumulation", model = "nested", wrap = P.nested.children,
  step = function(S, k, ctx)
    S.opt:zero_grad()
    local total = 0
    local function micro(j)
      local x, y = S.batch(k * 10 + j)
      local l = S.spec.loss(S.model(x), y)
      l:backward()
      total = total + l:item()
    end
    if S.is_ref then micro(1); micro(2); micro(3)
    else
      local b = comm_snapshot()
      S.model:no_sync(function() micro(1); micro(2) end)
      local d = comm_diff(b, comm_snapshot())
      if d.reduce_scatter.count + d.all_reduce.count > 0 then ctx.fail("no_sync reduced gradients: " .. comm_str(d)) end
      micro(3)
    end
    S.opt:step()
    return total
  end }
case { name = "usage/no_sync-accumulation,transformer", model = "transformer", wrap = P.transformer.blocks,
  step = function(S, k)
    S.opt:zero_grad()
    local total = 0
    local function micro(j)
      local x, y = S.batch(k * 10 + j)
      local l = S.spec.loss(S.model(x), y)
      l:backward()
      total = total + l:item()
    end
    if S.is_ref then micro(1); micro(2) else S.model:no_sync(function() micro(1) end); micro(2) end
    S.opt:step()
    return total
  end }

-- (d) strategies; hybrid: sharded within groups of HG ranks, replicated across them
for _, sh in ipairs { "grad_op", "none", "hybrid" } do
  local o = { sharding = sh, shard_group_size = sh == "hybrid" and HG or nil }
  case { name = "nested/children,sharding=" .. sh, model = "nested", wrap = P.nested.children, opts = o,
    check = check_comm(sh) }
  case { name = "transformer/blocks,sharding=" .. sh, model = "transformer", wrap = P.transformer.blocks,
    opts = o, check = check_comm(sh) }
  case { name = "conv/freeze=trunk,blocks,sharding=" .. sh, model = "conv", wrap = P.conv.blocks, opts = o,
    freeze = function(m) freeze(m, "trunk") end }
end
case { name = "misc/clip_grad_norm,sharding=hybrid", model = "nested", wrap = P.nested.children,
  opts = { sharding = "hybrid", shard_group_size = HG }, step = clip_step }
-- options: forward prefetch (same collectives, issued earlier); keeping parameters after forward
-- (full shard without the backward all-gathers, like grad_op)
case { name = "transformer/blocks,forward_prefetch", model = "transformer", wrap = P.transformer.blocks, steps = 4,
  opts = { forward_prefetch = true }, check = check_comm("full") }
case { name = "nested/every,reshard_after_forward=false", model = "nested", wrap = P.nested.every,
  opts = { reshard_after_forward = false }, check = check_comm("grad_op") }

-- different strategies in one model: the nested unit replicated, the root fully sharded
local function mixed_strategies(m, o)
  fsdp.wrap(m["2"], { sharding = "none" }); fsdp.wrap(m, { sharding = "full" })
  return { "2", "" }
end
case { name = "nested/mixed-strategies", model = "nested", wrap = mixed_strategies }
case { name = "misc/clip_grad_norm,mixed-strategies", model = "nested", wrap = mixed_strategies,
  step = clip_step }
-- other norms (1, 3, inf), and clip_grad_value, over sharded and replicated units with a frozen
-- parameter (the clip bound is below each step's norm, so every step scales)
for _, pn in ipairs { { 1, "1", 0.5 }, { 3, "3", 0.02 }, { math.huge, "inf", 0.01 }, { 0.5, "0.5", 20 } } do
  case { name = "misc/clip_grad_norm,p=" .. pn[2] .. ",mixed-strategies,frozen", model = "nested",
    wrap = mixed_strategies, freeze = function(m) freeze(m, "2.0.bias") end, step = clip_step_with(pn[1], pn[3]) }
end
case { name = "misc/clip_grad_norm,p=inf,sharding=hybrid", model = "nested", wrap = P.nested.children,
  opts = { sharding = "hybrid", shard_group_size = HG }, step = clip_step_with(math.huge, 0.01) }
case { name = "misc/clip_grad_value,mixed-strategies,frozen", model = "nested", wrap = mixed_strategies,
  freeze = function(m) freeze(m, "2.0.bias") end, step = clip_step_with(nil, nil, 0.01) }
-- bf16 parameters: within bf16 tolerance of the f32 reference, and measurably different from f32 FSDP
local function differs_from(base_name)
  return function(ctx)
    local base = results[base_name]
    local mine = results[ctx.case.name]
    if not base or not mine then ctx.fail("no result for " .. base_name); return end
    local md = 0
    for name, a in pairs(mine.params) do
      for i, v in ipairs(a) do md = math.max(md, math.abs(v - base.params[name][i])) end
    end
    if not (md > 1e-6) then ctx.fail(("bf16 parameters equal the f32 run's (max diff %.3g): the policy did nothing"):format(md)) end
    if R == 0 then print(("INFO %s: max |param - f32 fsdp param| = %.3e"):format(ctx.case.name, md)) end
  end
end
-- and all-gathers of 2-byte elements (the units compute on bf16 parameters), reductions in float32
local function bf16_checks(base_name)
  local differs, comm = differs_from(base_name), check_comm("full", { gather_bytes = 2 })
  return function(ctx) differs(ctx); comm(ctx) end
end
case { name = "nested/children,bf16", model = "nested", wrap = P.nested.children, tol = "bf16",
  opts = { mixed_precision = { param = "bf16" } }, check = bf16_checks("nested/wrap=children"), needs = "nested/wrap=children" }
case { name = "transformer/blocks,bf16", model = "transformer", wrap = P.transformer.blocks, tol = "bf16",
  opts = { mixed_precision = { param = "bf16" } }, check = bf16_checks("transformer/wrap=blocks"),
  needs = "transformer/wrap=blocks" }

case { name = "conv/freeze=trunk,blocks,bf16", model = "conv", wrap = P.conv.blocks, tol = "bf16",
  freeze = function(m) freeze(m, "trunk") end, opts = { mixed_precision = { param = "bf16" } },
  check = differs_from("conv/freeze=trunk,blocks"), needs = "conv/freeze=trunk,blocks" }
-- a replicated unit gathers a bf16 copy of its float32 parameters too: fresh after every step
case { name = "transformer/blocks,sharding=none,bf16", model = "transformer", wrap = P.transformer.blocks, tol = "bf16",
  opts = { sharding = "none", mixed_precision = { param = "bf16" } }, check = differs_from("transformer/blocks,sharding=none"),
  needs = "transformer/blocks,sharding=none" }

-- CPU offload (with the wrapped side on a device): the units compute there, but between steps
-- every parameter piece, its gradient and the optimizer's state are on the CPU, and the device
-- holds none of their bytes (the gathered parameters and the full gradients are gone)
local function check_offload(extra)
  return function(ctx)
    for _, p in ipairs(ctx.fs.model:parameters()) do
      if p.device ~= "cpu" or (p.grad and p.grad.device ~= "cpu") then
        ctx.fail(("a parameter piece of shape %s is on %s, its gradient on %s: offload keeps both on the cpu")
          :format(table.concat(p:to_local():shape(), "x"), p.device, p.grad and p.grad.device or "-"))
        break
      end
    end
    collectgarbage(); collectgarbage()
    local m = fsdp.memory_stats(DEVICE)
    for _, cat in ipairs { "params", "grads", "optimizer" } do
      -- (earlier cases' tensors may be freed meanwhile: only more bytes than before is a failure)
      local held = m[cat].current - ctx.mem0[cat].current
      if held > 0 then ctx.fail(("%d bytes of %s on %s between steps"):format(held, cat, DEVICE)) end
    end
    if extra then extra(ctx) end
  end
end
if DEVICE then
  case { name = "offload/nested,children", model = "nested", wrap = P.nested.children, opts = { offload = true },
    check = check_offload(check_comm("full")) }
  case { name = "offload/nested,children+adam", model = "nested", wrap = P.nested.children, optim = "adam", steps = 4,
    opts = { offload = { params = true, grads = true, optimizer = true } }, check = check_offload() }
  case { name = "offload/conv,freeze=trunk,blocks", model = "conv", wrap = P.conv.blocks,
    freeze = function(m) freeze(m, "trunk") end, opts = { offload = true }, check = check_offload() }
  case { name = "offload/transformer,blocks,sharding=none", model = "transformer", wrap = P.transformer.blocks,
    opts = { offload = true, sharding = "none" }, check = check_offload(check_comm("none")) }
  case { name = "offload/transformer,blocks,bf16", model = "transformer", wrap = P.transformer.blocks, tol = "bf16",
    opts = { offload = true, mixed_precision = { param = "bf16" } }, check = check_offload() }
  case { name = "offload/misc,clip_grad_norm", model = "nested", wrap = P.nested.children, opts = { offload = true },
    check = check_offload(),
    step = clip_step }
end

-- (e) state dicts, clipping, summon_full_params
case { name = "misc/state_dict-names", model = "transformer", wrap = P.transformer.blocks, steps = 1,
  check = function(ctx)
    local a, b = {}, {}
    for name in ctx.ref.model:named_parameters() do a[#a + 1] = name end
    for name in ctx.fs.model:named_parameters() do b[#b + 1] = name end
    if table.concat(a, ",") ~= table.concat(b, ",") then ctx.fail("named_parameters order differs: " .. table.concat(b, ",")) end
    local sd = ctx.fs.model:state_dict({ rank0_only = true })
    local n = 0
    for _ in pairs(sd) do n = n + 1 end
    if R == 0 and n ~= #a then ctx.fail(("rank0_only state_dict has %d entries on rank 0, expected %d"):format(n, #a)) end
    if R ~= 0 and n ~= 0 then ctx.fail(("rank0_only state_dict has %d entries on rank %d"):format(n, R)) end
  end }
case { name = "misc/load_state_dict-then-train", model = "nested", wrap = P.nested.children,
  after_wrap = function(S)
    -- a different starting point, loaded into the wrapped model (and into the reference)
    fsdp.manual_seed(77)
    local sd = {}
    for name, p in pairs(models.nested.build():state_dict()) do sd[name] = p * 0.5 + 0.01 end
    S.model:load_state_dict(sd)
    local back = S.model:state_dict()
    for name, t in pairs(sd) do
      local md = cmp(flat(back[name]), flat(t), 0, TOL.f32)
      if md > 0 then error(("load_state_dict: %s reads back with diff %.3g"):format(name, md)) end
    end
  end }
for _, sh in ipairs { "full", "none" } do
  case { name = "misc/clip_grad_norm,sharding=" .. sh, model = "nested", wrap = P.nested.children, opts = { sharding = sh },
    step = clip_step }
end
case { name = "misc/summon_full_params", model = "nested", wrap = P.nested.nested3, steps = 3,
  before_step = function(S, k, ctx)
    if k ~= 3 then return end
    local m = S.model
    if S.is_ref then fsdp.no_grad(function() m["2"]["0"].bias:fill_(0.5); m["4"].weight:mul_(2) end); return end
    -- without writeback, changes are dropped; shapes are the full ones while summoned
    m:summon_full_params(function()
      for name, p in m:named_parameters() do
        local want = table.concat(ctx.ref.model:state_dict()[name]:shape(), "x")
        if table.concat(p:shape(), "x") ~= want then ctx.fail(("summoned %s has shape %s, expected %s"):format(name, table.concat(p:shape(), "x"), want)) end
      end
      fsdp.no_grad(function() m["0"].weight:fill_(7) end)
    end, { writeback = false })
    for _, v in ipairs(flat(m:state_dict()["0.weight"])) do
      if v == 7 then ctx.fail("summon_full_params{writeback=false} kept a change"); break end
    end
    -- with writeback (the default) they persist, in every unit
    m:summon_full_params(function()
      fsdp.no_grad(function() m["2"]["0"].bias:fill_(0.5); m["4"].weight:mul_(2) end)
    end)
  end }

-- (f) bad input: a Lua error naming the unit and what was expected; the process keeps working
local function expect_error(ctx, what, fn, ...)
  local ok, err = pcall(fn)
  if ok then ctx.fail(what .. ": expected an error, the call succeeded"); return end
  err = tostring(err)
  if R == 0 then print(("INFO %s: %s -> %s"):format(ctx.case.name, what, (err:gsub("\n", " ")))) end
  for _, frag in ipairs { ... } do
    if not err:find(frag, 1, true) then ctx.fail(("%s: error %q does not mention %q"):format(what, err, frag)) end
  end
end
-- a parameter tied across two units with no unit around both: the first forward says so; wrapping
-- the root then gives it an owner and training goes on
case { name = "bad/tied-across-units-without-root", model = "tied",
  -- (units with no unit around them are named by their class: there is no path to name them by)
  wrap = function(m, o) fsdp.wrap(m.core.tok, o); fsdp.wrap(m.core.head, o); return { "Embedding", "Linear" } end,
  after_wrap = function(S, ctx)
    if S.is_ref then return end
    expect_error(ctx, "forward", function() return S.model(S.batch(1)) end, "FSDP unit 'Embedding': parameter 'weight' "
      .. "of Linear is also parameter 'weight' of Embedding (unit 'Embedding'), and no unit holds both modules; wrap a "
      .. "module around both (the root: fsdp.wrap(model))")
    fsdp.wrap(S.model)
  end }
case { name = "bad/wrap-twice", model = "nested", wrap = P.nested.children,
  after_wrap = function(S, ctx)
    if S.is_ref then return end
    expect_error(ctx, "wrap root twice", function() fsdp.wrap(S.model) end, "already wrapped")
    expect_error(ctx, "wrap child twice", function() fsdp.wrap(S.model["2"]) end, "already wrapped", "'2'")
  end }
case { name = "bad/wrap-after-forward", model = "nested", wrap = P.nested.children,
  before_step = function(S, k, ctx)
    if S.is_ref or k ~= 2 then return end
    expect_error(ctx, "wrap child after first forward", function() fsdp.wrap(S.model["4"]) end, "4", "first forward")
    expect_error(ctx, "wrap grandchild after first forward", function() fsdp.wrap(S.model["2"]["2"]) end, "2.2 (Linear)", "unit '2'", "first forward")
  end }
case { name = "bad/freeze-between-forward-and-backward", model = "nested", wrap = P.nested.nested3,
  before_step = function(S, k, ctx)
    if S.is_ref or k ~= 2 then return end
    local x, y = S.batch(k)
    local loss = S.spec.loss(S.model(x), y)
    local p = S.model["2"]["2"].weight
    p.requires_grad = false
    expect_error(ctx, "freeze between forward and backward", function() loss:backward() end, "'2'", "weight", "requires_grad")
    p.requires_grad = true
    if not fsdp.all_idle() then ctx.fail("units not idle after the failed backward") end
  end }
case { name = "bad/no_sync-on-nested-unit", model = "nested", wrap = P.nested.children,
  before_step = function(S, k, ctx)
    if S.is_ref or k ~= 2 then return end
    local ran = false
    expect_error(ctx, "no_sync on a nested unit", function() S.model["2"]:no_sync(function() ran = true end) end, "'2'", "root")
    if ran then ctx.fail("no_sync ran its function on a nested unit") end
    expect_error(ctx, "no_sync on an unwrapped module", function() S.model["4"]:no_sync(function() end) end, "not wrapped")
  end }

-- ---- batch norm (issue 19) ---------------------------------------------------------------------------------
-- SyncBatchNorm: the wrapped side converts every BatchNorm of the model (the reference keeps plain
-- BatchNorm on the global batch), so training equals the global batch's: losses, gradients,
-- parameters and the running statistics (state_dict buffers); the eval outputs before each step
-- use the running statistics; per step every SyncBatchNorm all-reduces 3 times (two in forward, one
-- in backward); a sharded checkpoint round-trips the running statistics.
local BN_LAYERS = 3
local function bn_eval_aux(S, k)
  if k == 1 then return end
  S.model:eval()
  local out = fsdp.no_grad(function() return S.model(S.batch(600 + k)) end)
  S.model:train()
  return { S.is_ref and S.slice(out) or out }
end
local function sync_all_reduces(ctx)
  if N == 1 then return end
  -- bytes: (C + 1) + C + 2C floats per layer, C = 4, 4, 6
  local bytes = 0
  for _, c in ipairs { 4, 4, 6 } do bytes = bytes + (4 * c + 1) * 4 end
  local plan = fsdp.summary(ctx.fs.model, { print = false }).step.all_reduce
  if plan.count ~= 3 * BN_LAYERS or plan.bytes ~= bytes then
    ctx.fail(("fsdp.summary plans %d all-reduces (%d B), expected %d (%d B)"):format(plan.count, plan.bytes,
      3 * BN_LAYERS, bytes))
  end
  for k, got in ipairs(ctx.comm) do
    if got.all_reduce.count ~= 3 * BN_LAYERS or got.all_reduce.bytes ~= bytes then
      ctx.fail(("step %d: %d all-reduces (%d B), expected %d (3 per SyncBatchNorm, %d B)"):format(k,
        got.all_reduce.count, got.all_reduce.bytes, 3 * BN_LAYERS, bytes))
    end
  end
end
local function running_stats(m)
  local r = {}
  for name, t in m:named_buffers() do r[name] = flat(t) end
  return r
end
local function sharded_roundtrip(ctx)
  local S = ctx.fs
  fsdp.barrier()
  local dir = shared_dir("fsdp_matrix_bn")
  fsdp.save_sharded(dir, S.model, S.opt)
  local before = running_stats(S.model)
  fsdp.no_grad(function()
    for name, t in S.model:named_buffers() do if t.dtype == "int64" then t:fill_(0) else t:fill_(7) end end
  end)
  fsdp.load_sharded(dir, S.model, S.opt)
  for name, v in pairs(running_stats(S.model)) do
    local md = cmp(v, before[name], 0, { a = 0, r = 0 })
    if md ~= 0 then ctx.fail(("load_sharded: buffer %s differs by %.3g"):format(name, md)) end
  end
  fsdp.barrier()
  if R == 0 then os.execute("rm -rf " .. dir) end
end
local function to_sync(wrap_fn)
  return function(m, o)
    nn.SyncBatchNorm.convert_sync_batchnorm(m)
    return wrap_fn(m, o)
  end
end
local bn_root = function(m, o) fsdp.wrap(m, o); return { "" } end
local bn_children = function(m, o) fsdp.wrap(m.trunk, o); fsdp.wrap(m.head, o); fsdp.wrap(m, o); return { "trunk", "head", "" } end
case { name = "norm/syncbn-root", model = "bnconv", tol = "bn", wrap = to_sync(bn_root), steps = 4,
  before_step = bn_eval_aux,
  check = function(ctx) sync_all_reduces(ctx); sharded_roundtrip(ctx) end }
case { name = "norm/syncbn-children", model = "bnconv", tol = "bn", wrap = to_sync(bn_children), steps = 4,
  before_step = bn_eval_aux, check = sync_all_reduces }
case { name = "norm/syncbn-grad_op", model = "bnconv", tol = "bn", wrap = to_sync(bn_children), opts = { sharding = "grad_op" },
  before_step = bn_eval_aux }
-- plain BatchNorm under FSDP normalizes with each rank's local batch (as under DDP): the reference
-- runs the model on every rank's slice in turn (the loss their mean), keeping the running
-- statistics of this rank's slice only, i.e. a single process trained on that slice
local function local_bn_step(S, k)
  local x, y = S.batch(k)
  if not S.is_ref or N == 1 then return default_step(S, k) end
  S.opt:zero_grad()
  local b, total = GB / N, nil
  for j = 0, N - 1 do
    local keep = {}
    if j ~= R then for name, t in S.model:named_buffers() do keep[name] = t:clone() end end
    local l = S.spec.loss(S.model(x:narrow(1, j * b + 1, b)), y:narrow(1, j * b + 1, b))
    fsdp.no_grad(function() for name, t in S.model:named_buffers() do if keep[name] then t:copy_(keep[name]) end end end)
    total = total and total + l or l
  end
  local loss = total / N
  loss:backward()
  S.opt:step()
  return loss:item()
end
case { name = "norm/batchnorm-local", model = "bnconv2d", wrap = bn_children, steps = 4, step = local_bn_step,
  before_step = bn_eval_aux }

-- ---- run -------------------------------------------------------------------------------------------------
local t0 = os.clock()
local selected, n_selected = {}, 0
for _, c in ipairs(cases) do
  if not pattern or c.name:find(pattern) then
    selected[c.name] = true
    if c.needs then selected[c.needs] = true end  -- a case comparing against another runs after it
  end
end
for _, c in ipairs(cases) do if selected[c.name] then n_selected = n_selected + 1 end end
if R == 0 then print(("PLAN ws=%d cases=%d"):format(N, n_selected)) end
for _, c in ipairs(cases) do
  if selected[c.name] then run_case(c) end
end
if R == 0 then
  print(("SUMMARY ws=%d cases=%d failed=%d f32: max_loss=%.2e max_grad=%.2e max_param=%.2e bf16: max_loss=%.2e max_grad=%.2e max_param=%.2e cpu=%.1fs plane=%s")
    :format(N, summary.cases, summary.failed, summary.f32.loss, summary.f32.grad, summary.f32.param,
      summary.bf16.loss, summary.bf16.grad, summary.bf16.param, os.clock() - t0, fsdp.comm_device_plane()))
  if #failed_names > 0 then print("FAILED " .. table.concat(failed_names, " ")) end
end
io.stdout:flush()
fsdp.barrier()
os.exit(summary.failed > 0 and 1 or 0)
