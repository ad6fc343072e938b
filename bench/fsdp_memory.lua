-- FSDP memory benchmark: per-rank peak bytes of parameters, gradients and optimizer state at
-- N = 1, 2, 4 ranks, against the formula  sum(unit sizes)/N + largest unit.
--
--   luajit bench/fsdp_memory.lua [--ns 1,2,4] [--steps 3] [--batch 16] [--sharding full] [--device cuda]
--       runs `bin/fsdprun -n N bench/fsdp_memory.lua --child ...` for each N and prints the table
--   bin/fsdprun -n 4 bench/fsdp_memory.lua --child      one world size, one result line
--
-- Model (bench/fsdp_models.lua units_mlp): Linear 512-1024-2048-512-10 with ReLUs, each Linear an
-- FSDP unit plus the (parameter-less) root, full sharding, Adam; a few training steps on random
-- data of `batch` rows per rank. Counted from fsdp.memory_stats() after wrapping (the peaks are
-- reset then), so the unsharded model built before fsdp.wrap does not count.
--
-- Two measurements per category set:
--   peak      fsdp.memory_stats()[cat].peak, the allocator's own per-category high-water mark
--   total     the highest params + grads + optimizer sum seen at any sampling point: every
--             autograd node (before and after), every GRAD_READY, every module's forward entry
--             and exit, and around zero_grad / step. The categories peak at different moments,
--             so this is below the sum of the three peaks; the components at that moment are
--             shown too.
-- Formula, in fp32 bytes, S = sum of unit sizes (parameters), L = the largest unit:
--   params:  4 * (S/N + L)                     (the shards + one gathered unit)
--   total:   4 * ((1 + 1 + 2) * S/N + L)       (shards of params, grads, Adam's two moments + one unit)
--   total+g: 4 * (4 * S/N + 2 L)               (... + the largest unit's full gradient while reduced)
-- At N = 1 nothing is gathered (the parameters are their own shard), so the measured values sit
-- below the formula's "+ L". The target is measured/formula <= 1.1 at N = 4.
-- --device cuda: the model and batches on the GPU (the test double of one where there is none)
-- and the device's counters read; with N > 1 the collectives go through the host, whose staging
-- buffers count as the CPU's comm bytes, not the device's.
local root = (arg and arg[0] or ""):match("^(.*)/bench/[^/]*$") or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. root .. "/bench/?.lua;" .. package.path
package.cpath = root .. "/?.so;" .. package.cpath

local opts = { ns = "1,2,4", steps = 3, batch = 16, sharding = "full", child = false, target = 1.1, gc = "both",
  device = "cpu" }
local U = require "util"
U.parse_args("bench/fsdp_memory.lua", opts, "[--ns 1,2,4] [--steps S] [--batch B] [--sharding full|grad_op|none] [--gc 1|0|both] [--device cpu|cuda] [--child]", { ["--child"] = function(o) o.child = true end })

local MB = 1024 * 1024
local function mb(b) return ("%.2f"):format(b / MB) end

-- ---- child: one world size ------------------------------------------------------------------------
local function child()
  local ffi = require "ffi"
  local fsdp = require "fsdp"
  local fm = require "fsdp_models"
  local C = fsdp.C
  local F = fsdp.nn.functional
  jit.off() -- the engine listener below is a C -> Lua callback; it must not be entered from a trace
  fsdp.init()
  local R, N = fsdp.rank(), fsdp.world_size()
  local dev = fsdp._devices[opts.device]
  if dev == 1 and not fsdp.cuda.is_available() then fsdp._testdev_install() end

  fsdp.manual_seed(0)
  local model = fm.units_mlp()
  local sizes = fm.unit_sizes(model)
  model:to(opts.device)
  fm.wrap_each(model, { sharding = opts.sharding })
  local opt = fsdp.optim.Adam(model:parameters(), { lr = 1e-3 })
  fsdp.manual_seed(1 + R)
  local x = fsdp.randn(opts.batch, fm.units_widths[1]):to(opts.device)
  local y = fsdp.randint(0, fm.units_widths[#fm.units_widths], { opts.batch }):to(opts.device)

  -- sampling of params + grads + optimizer
  local cur = ffi.new("int64_t[6]")
  local best, best_comm = { total = -1 }, { comm = -1 }
  local function sample(where)
    C.fsdp_memory_stats_device(dev, cur, nil)
    local p, g, o, c = tonumber(cur[0]), tonumber(cur[1]), tonumber(cur[2]), tonumber(cur[4])
    local t = p + g + o
    if t > best.total then best = { total = t, params = p, grads = g, optimizer = o, comm = c, where = where } end
    if c > best_comm.comm then best_comm = { comm = c, where = where } end
  end
  local phase = "?"
  for name, m in model:named_modules() do
    local label = name == "" and "<root>" or name
    m:register_forward_pre_hook(function() sample("forward enter " .. label) end)
    m:register_forward_hook(function() sample("forward exit " .. label) end)
  end
  local cb = ffi.cast("fsdp_listener_fn", function(ev, node)
    local what = ev == C.FSDP_EV_GRAD_READY and "grad ready" or ev == C.FSDP_EV_NODE_PRE and "before"
      or ev == C.FSDP_EV_NODE_POST and "after" or "event"
    if node ~= nil then what = what .. " " .. ffi.string(C.fsdp_node_name(node)) end
    sample("backward: " .. what)
    return 0
  end)
  local handle = C.fsdp_autograd_add_listener(C.FSDP_EV_NODE_PRE + C.FSDP_EV_NODE_POST + C.FSDP_EV_GRAD_READY
    + C.FSDP_EV_BACKWARD_END, cb, nil)

  C.fsdp_memory_reset_peaks()
  sample("after wrap")
  local loss
  for step = 1, opts.steps do
    phase = "step " .. step
    opt:zero_grad(); sample("after zero_grad")
    loss = F.cross_entropy(model(x), y)
    loss:backward(); sample("after backward")
    opt:step(); sample("after optimizer step")
    if opts.gc == "1" then collectgarbage() end
    assert(fsdp.all_idle(), "bench/fsdp_memory.lua: a unit is not idle after step " .. step)
  end
  C.fsdp_autograd_remove_listener(handle)
  cb:free()
  local _ = phase
  local st = fsdp.memory_stats(opts.device)

  -- the largest value over ranks of each number (ranks differ only by padding)
  local keys = { "params", "grads", "optimizer", "comm", "activations" }
  local vals = {}
  for _, k in ipairs(keys) do vals[#vals + 1] = st[k].peak end
  for _, k in ipairs { "total", "params", "grads", "optimizer", "comm" } do vals[#vals + 1] = best[k] end
  local t = fsdp.tensor(vals)
  if N > 1 then fsdp.all_reduce(t, "max") end
  local v = t:totable()
  if R == 0 then
    local S, L = 0, 0
    for _, s in ipairs(sizes) do S = S + s; L = math.max(L, s) end
    local sz = {}
    for _, s in ipairs(sizes) do sz[#sz + 1] = tostring(s) end
    print(("RESULT gc=%s n=%d S=%d L=%d sizes=%s peak_params=%d peak_grads=%d peak_optim=%d peak_comm=%d peak_act=%d "
      .. "total=%d t_params=%d t_grads=%d t_optim=%d t_comm=%d loss=%.4f comm_where=%s where=%s")
      :format(opts.gc, N, S, L, table.concat(sz, ","), v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10],
        loss:item(), best_comm.where:gsub(" ", "_"), best.where))
  end
  io.stdout:flush()
end

if opts.child then
  child()
  os.exit(0)
end

-- ---- driver: one launch per world size and GC mode, then the tables ------------------------------
local shell_quote = U.shell_quote
local runner = root .. "/bin/fsdprun"
local failed = 0

local function run_mode(gc)
  local results = {}
  for n in opts.ns:gmatch("%d+") do
    local cmd = ("%s -n %s %s --child --steps %d --batch %d --sharding %s --gc %s --device %s 2>&1"):format(
      shell_quote(runner), n, shell_quote(root .. "/bench/fsdp_memory.lua"), opts.steps, opts.batch, opts.sharding, gc,
      opts.device)
    io.stderr:write("  " .. cmd .. "\n")
    local p = io.popen(cmd)
    local out = p:read("*a")
    p:close()
    local line = out:match("RESULT ([^\n]*)")
    if not line then
      failed = failed + 1
      print(("N = %s FAILED:\n%s"):format(n, out:sub(-2000)))
    else
      local r = { where = line:match(" where=(.*)$"), sizes = line:match("sizes=(%S+)"),
        comm_where = (line:match("comm_where=(%S+)") or "?"):gsub("_", " ") }
      for k, val in line:gmatch("([%w_]+)=([%d%.%-]+)") do if k ~= "sizes" then r[k] = tonumber(val) end end
      results[#results + 1] = r
    end
  end
  return results
end

local function report(gc, results)
  print()
  print(gc == "1" and "-- collectgarbage() after every step (steady state: only live tensors count)"
    or "-- no forced collection (a plain training loop: dead tensors wait for Lua's GC)")
  print(("%-3s %9s %9s %6s | %9s %9s %9s %6s %7s | %9s %9s %9s | %8s %8s"):format("N", "params", "S/N+L", "ratio",
    "total", "4S/N+L", "+L grad", "ratio", "ratio+g", "grads", "optim", "sum-pk", "comm", "act"))
  local verdict
  for _, r in ipairs(results) do
    local S, L, N = r.S * 4, r.L * 4, r.n
    local f_params = S / N + L
    local f_total = 4 * S / N + L
    local f_total_g = f_total + L
    print(("%-3d %9s %9s %6.2f | %9s %9s %9s %6.2f %7.2f | %9s %9s %9s | %8s %8s"):format(N, mb(r.peak_params),
      mb(f_params), r.peak_params / f_params, mb(r.total), mb(f_total), mb(f_total_g), r.total / f_total,
      r.total / f_total_g, mb(r.peak_grads), mb(r.peak_optim), mb(r.peak_params + r.peak_grads + r.peak_optim),
      mb(r.peak_comm), mb(r.peak_act)))
    print(("      total peak at %s: params %s + grads %s + optim %s (comm %s then)"):format(r.where, mb(r.t_params),
      mb(r.t_grads), mb(r.t_optim), mb(r.t_comm)))
    if r.peak_comm > 0 then print(("      comm peak %s at %s"):format(mb(r.peak_comm), r.comm_where)) end
    if N == 4 then
      local function mark(x) return x <= opts.target and "" or " (MISSED)" end
      verdict = ("N = 4: params %.2fx of S/N+L%s; total %.2fx of 4S/N+L%s, %.2fx of 4S/N+2L%s; target <= %.2fx")
        :format(r.peak_params / f_params, mark(r.peak_params / f_params), r.total / f_total, mark(r.total / f_total),
          r.total / f_total_g, mark(r.total / f_total_g), opts.target)
    end
  end
  if verdict then print(verdict) end
end

local all = {}
local modes = opts.gc == "both" and { "1", "0" } or { opts.gc }
for _, gc in ipairs(modes) do all[#all + 1] = { gc, run_mode(gc) } end

print(("FSDP memory per rank (MiB) on %s: units_mlp = Linear 512-1024-2048-512-10, each Linear a unit + the root, "
  .. "%s sharding, Adam, batch %d per rank, %d steps"):format(opts.device == "cuda" and "the cuda device (the test double of a GPU where there is none)"
  or "the CPU", opts.sharding, opts.batch, opts.steps))
local first = all[1] and all[1][2][1]
if first then
  print(("unit sizes (parameters, wrap order, root last): %s; S = %d, L = %d (fp32: S = %s MiB, L = %s MiB)")
    :format(first.sizes or "?", first.S, first.L, mb(first.S * 4), mb(first.L * 4)))
end
print("params = peak of the params category; total = peak of params+grads+optim, sampled at every autograd node,")
print("module forward and optimizer call; sum-pk = the three category peaks added (an upper bound); comm, act = peaks")
for _, m in ipairs(all) do report(m[1], m[2]) end
if failed > 0 then os.exit(1) end
