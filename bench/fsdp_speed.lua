-- FSDP speed benchmarks at N = 2 ranks:
--   hybrid hybrid-shard step time (shard groups of half the ranks, replicated across them) against
--          full shard on the same model and batch, both in one run (alternating steps)
--   shard  full-shard step time against no-shard (sharding = "none") on the same model and batch,
--          both in one run (alternating steps); target full/none <= 1.15
--   ddp    ours (full sharding, each block/layer a unit + the root) against PyTorch DDP over gloo
--          (bench/ddp_torch.py) on the conv net and the transformer; target ours/DDP < 1
--
--   luajit bench/fsdp_speed.lua [--what shard,hybrid,ddp] [--rounds 3] [--warmup 3] [--iters 10]
--                               [--batch 128] [--depth 4] [--pair 1] [--python /usr/bin/python3]
--       the driver: launches `bin/fsdprun -n 2 bench/fsdp_speed.lua --child ...` (and ddp_torch.py)
--       `rounds` times each and prints medians and spreads; with --pair 1 (default) ours and DDP
--       run at once, taking turns step by step through FIFOs (see paired() below)
--   bin/fsdprun -n 2 bench/fsdp_speed.lua --child shard|hybrid|conv|transformer [--fifo DIR]   one measurement
--
-- A step is zero_grad + forward + loss + backward + optimizer step on a fixed random batch per
-- rank. Every timed step starts after a barrier and counts as long as its slowest rank took; a
-- measurement is the median over `iters` timed steps after `warmup` steps. Ranks run with
-- OPENBLAS_NUM_THREADS=1 (fsdprun's default). See bench/README.md ("FSDP benchmarks").
local root = (arg and arg[0] or ""):match("^(.*)/bench/[^/]*$") or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. root .. "/bench/?.lua;" .. package.path
package.cpath = root .. "/?.so;" .. package.cpath

local opts = { what = "shard,hybrid,ddp", rounds = 3, warmup = 3, iters = 10, batch = 128, depth = 4, width = 1024,
  python = "/usr/bin/python3", child = false, timeout = 600, fifo = "", pair = 1, n = 2, shard_target = 1.15, ddp_target = 1.0 }
local U = require "util"
U.parse_args("bench/fsdp_speed.lua", opts, "[--what shard,hybrid,ddp] [--rounds R] [--warmup W] [--iters I] [--batch B] "
  .. "[--depth D] [--width W] [--n 2] [--python PATH] | --child shard|hybrid|conv|transformer")

local fm = require "fsdp_models"

-- ---- child: measurements on the ranks ---------------------------------------------------------------
local function child(what)
  local fsdp = require "fsdp"
  local F = fsdp.nn.functional
  fsdp.init()
  local R, N = fsdp.rank(), fsdp.world_size()
  local tm = fsdp.tensor({ 0 })

  -- one timed step: barrier, step, the slowest rank's milliseconds
  -- paired mode (--fifo DIR): every step, warmup included, waits for the driver's token on
  -- DIR/go.<rank> and answers on DIR/done.<rank>, so the driver can alternate us and DDP step by step
  local go, done
  if opts.fifo ~= "" then
    go = assert(io.open(("%s/go.%d"):format(opts.fifo, R), "rb"))
    done = assert(io.open(("%s/done.%d"):format(opts.fifo, R), "wb"))
  end
  local function token_wait() if go then assert(go:read(1) == "g", "bench/fsdp_speed.lua: the driver went away") end end
  local function token_done() if done then done:write("d"); done:flush() end end

  -- one timed step: barrier, step, the slowest rank's milliseconds
  local function timed(step)
    token_wait()
    fsdp.barrier()
    local t0 = fm.now_ms()
    local loss = step()
    tm:fill_(fm.now_ms() - t0)
    fsdp.all_reduce(tm, "max")
    token_done()
    return tm:item(), loss
  end

  local function make_step(model, opt, loss_fn)
    return function()
      opt:zero_grad()
      local loss = loss_fn(model)
      loss:backward()
      opt:step()
      return loss
    end
  end

  local function mean_loss(loss)
    local t = fsdp.tensor({ loss:item() })
    fsdp.all_reduce(t, "avg")
    return t:item()
  end

  if what == "shard" or what == "hybrid" then
    -- the same MLP twice, steps alternating between them: full sharding and no sharding (shard),
    -- or hybrid sharding (shard groups of half the ranks, replicated across them) and full (hybrid)
    local cases = {}
    local names = what == "shard" and { "full", "none" } or { "hybrid", "full" }
    for k, sh in ipairs(names) do
      fsdp.manual_seed(0)
      local model = fm.wide_mlp(opts.depth, opts.width)
      fm.wrap_each(model, { sharding = sh, shard_group_size = sh == "hybrid" and math.max(1, math.floor(N / 2)) or nil })
      local opt = fsdp.optim.Adam(model:parameters(), { lr = 1e-3 })
      cases[k] = { name = sh, model = model, opt = opt, times = {} }
    end
    fsdp.manual_seed(1 + R)
    local x, y = fsdp.randn(opts.batch, 784), fsdp.randint(0, 10, { opts.batch })
    local lf = function(m) return F.cross_entropy(m(x), y) end
    for _, c in ipairs(cases) do c.step = make_step(c.model, c.opt, lf) end
    for _ = 1, opts.warmup do for _, c in ipairs(cases) do c.step() end end
    collectgarbage()
    fsdp.comm.reset_stats()
    for it = 1, opts.iters do
      for k = 1, 2 do
        local c = cases[(it + k) % 2 + 1] -- alternate which goes first
        local ms, loss = timed(c.step)
        c.times[#c.times + 1] = ms
        c.loss = loss
      end
    end
    local st = fsdp.comm_stats()
    local l1, l2 = mean_loss(cases[1].loss), mean_loss(cases[2].loss)
    if R == 0 then
      local lo1, hi1 = fm.range(cases[1].times)
      local lo2, hi2 = fm.range(cases[2].times)
      local a, b = names[1], names[2]
      print(("RESULT what=%s %s=%.3f %s=%.3f %s_lo=%.3f %s_hi=%.3f %s_lo=%.3f %s_hi=%.3f "
        .. "loss_%s=%.5f loss_%s=%.5f ag_bytes=%d rs_bytes=%d ar_bytes=%d")
        :format(what, a, fm.median(cases[1].times), b, fm.median(cases[2].times), a, lo1, a, hi1, b, lo2, b, hi2, a, l1, b, l2,
          st.all_gather.bytes / opts.iters, st.reduce_scatter.bytes / opts.iters, st.all_reduce.bytes / opts.iters))
    end
  elseif what == "conv" or what == "transformer" then
    fsdp.manual_seed(0)
    local model, opt, lf
    if what == "conv" then
      model = fm.convnet()
      fm.wrap_each(model, {})
      opt = fsdp.optim.Adam(model:parameters(), { lr = 1e-3 })
      fsdp.manual_seed(1 + R)
      local B = 32
      local x, y = fsdp.randn(B, 1, 28, 28), fsdp.randint(0, 10, { B })
      lf = function(m) return F.cross_entropy(m(x), y) end
    else
      local vocab, T, B = 1000, 128, 8
      model = fm.transformer()
      fm.wrap_each(model, {})
      opt = fsdp.optim.AdamW(model:parameters(), { lr = 3e-4, weight_decay = 0.01 })
      fsdp.manual_seed(1 + R)
      local x, y = fsdp.randint(0, vocab, { B, T }), fsdp.randint(0, vocab, { B, T })
      lf = function(m) return F.cross_entropy(m(x):view(B * T, vocab), y:view(B * T)) end
    end
    local step = make_step(model, opt, lf)
    for _ = 1, opts.warmup do timed(step) end
    collectgarbage()
    fsdp.comm.reset_stats()
    local times, loss = {}, nil
    for it = 1, opts.iters do times[it], loss = timed(step) end
    local st = fsdp.comm_stats()
    local l = mean_loss(loss)
    if R == 0 then
      local lo, hi = fm.range(times)
      -- collectives per step, the timing barrier and all-reduce not counted
      print(("RESULT what=%s ms=%.3f lo=%.3f hi=%.3f loss=%.5f ag_per_step=%g rs_per_step=%g")
        :format(what, fm.median(times), lo, hi, l, st.all_gather.count / opts.iters, st.reduce_scatter.count / opts.iters))
    end
  else
    error("bench/fsdp_speed.lua: --child expects shard, hybrid, conv or transformer, got " .. tostring(what))
  end
  io.stdout:flush()
end

if opts.child then
  child(opts.child)
  os.exit(0)
end

-- ---- driver -------------------------------------------------------------------------------------------
local function shell_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end
local runner, me = root .. "/bin/fsdprun", root .. "/bench/fsdp_speed.lua"
local failed = 0

local function run(cmd)
  cmd = ("timeout %d %s"):format(opts.timeout, cmd) -- a stuck job fails this measurement, not the bench
  io.stderr:write("  " .. cmd .. "\n")
  local p = io.popen(cmd .. " 2>&1")
  local out = p:read("*a")
  p:close()
  return out
end

local function ours(what)
  local out = run(("%s -n %d %s --child %s --warmup %d --iters %d --batch %d --depth %d --width %d"):format(
    shell_quote(runner), opts.n, shell_quote(me), what, opts.warmup, opts.iters, opts.batch, opts.depth, opts.width))
  local line = out:match("RESULT ([^\n]*)")
  if not line then
    failed = failed + 1
    print(("ours (%s) FAILED:\n%s"):format(what, out:sub(-2000)))
    return nil
  end
  local r = {}
  for k, v in line:gmatch("([%w_]+)=([%d%.%-]+)") do r[k] = tonumber(v) end
  return r
end

local function spread(t)
  local lo, hi = fm.range(t)
  return ("%.3f-%.3f"):format(lo, hi)
end

-- two models that start from the same weights and see the same batches must end at the same loss
local function losses_agree(la, lb, what)
  if math.abs(la - lb) > 1e-3 * math.max(1, math.abs(lb)) then
    failed = failed + 1
    print(("   FAILED: %s training diverged (loss %.6f vs %.6f)"):format(what, la, lb))
  end
end

local function fmt_list(t)
  local s = {}
  for _, v in ipairs(t) do s[#s + 1] = ("%.1f"):format(v) end
  return table.concat(s, " ")
end

-- ---- paired runs: ours and DDP started together, alternating one step at a time -------------------------
-- Each rank of each job blocks on a FIFO until the driver hands it the token for one step (see
-- token_wait in the child and --fifo in ddp_torch.py); the driver alternates the two jobs, which side
-- goes first changing every step. Waiting ranks sleep in read(), so they take no CPU.
local ffi = require "ffi"
pcall(ffi.cdef, [[
int mkfifo(const char* path, unsigned mode);
int open(const char* path, int flags, ...);
int close(int fd);
long read(int fd, void* buf, size_t n);
long write(int fd, const void* buf, size_t n);
struct fsdp_bench_pollfd { int fd; short events; short revents; };
int poll(struct fsdp_bench_pollfd* fds, unsigned long n, int timeout);
]])
local O_RDONLY, O_RDWR, O_NONBLOCK, POLLIN = 0, 2, 0x800, 1

local function paired(model)
  local dir = os.tmpname()
  os.remove(dir)
  assert(os.execute("mkdir -p " .. shell_quote(dir .. "/ours") .. " " .. shell_quote(dir .. "/ddp")) == 0 or true)
  local sides = {}
  for _, side in ipairs { "ours", "ddp" } do
    local s = { name = side, go = {}, done = {} }
    for r = 0, opts.n - 1 do
      local g, d = ("%s/%s/go.%d"):format(dir, side, r), ("%s/%s/done.%d"):format(dir, side, r)
      assert(ffi.C.mkfifo(g, 384) == 0 and ffi.C.mkfifo(d, 384) == 0, "mkfifo failed in " .. dir)
      s.go[r] = ffi.C.open(g, O_RDWR)                   -- never blocks; the rank's read waits for our byte
      s.done[r] = ffi.C.open(d, O_RDONLY + O_NONBLOCK)  -- polled with a timeout below
    end
    sides[#sides + 1] = s
  end
  local common = ("--warmup %d --iters %d"):format(opts.warmup, opts.iters)
  local cmds = {
    ("timeout %d %s -n %d %s --child %s %s --fifo %s"):format(opts.timeout, shell_quote(runner), opts.n, shell_quote(me),
      model, common, shell_quote(dir .. "/ours")),
    ("timeout %d %s %s --world %d --models %s %s --fifo %s"):format(opts.timeout, shell_quote(opts.python),
      shell_quote(root .. "/bench/ddp_torch.py"), opts.n, model, common, shell_quote(dir .. "/ddp")),
  }
  local pipes = {}
  for k, cmd in ipairs(cmds) do
    io.stderr:write("  [paired] " .. cmd .. "\n")
    pipes[k] = io.popen(cmd .. " 2>&1")
  end
  local buf, pfd = ffi.new("char[1]"), ffi.new("struct fsdp_bench_pollfd")
  local function turn(s)
    for r = 0, opts.n - 1 do
      buf[0] = 103 -- "g"
      if ffi.C.write(s.go[r], buf, 1) ~= 1 then return false end
    end
    for r = 0, opts.n - 1 do
      pfd.fd, pfd.events, pfd.revents = s.done[r], POLLIN, 0
      local ok = ffi.C.poll(pfd, 1, opts.timeout * 1000) == 1 and ffi.C.read(s.done[r], buf, 1) == 1
      if not ok then return false end
    end
    return true
  end
  local ok = true
  for step = 1, opts.warmup + opts.iters do
    local a, b = sides[1 + step % 2], sides[2 - step % 2]
    ok = turn(a) and turn(b)
    if not ok then break end
  end
  for _, s in ipairs(sides) do
    for r = 0, opts.n - 1 do ffi.C.close(s.go[r]); ffi.C.close(s.done[r]) end -- a stuck rank now reads EOF
  end
  local outs = {}
  for k, p in ipairs(pipes) do outs[k] = p:read("*a"); p:close() end
  os.execute("rm -rf " .. shell_quote(dir))
  local r, t
  local line = outs[1]:match("RESULT ([^\n]*)")
  if line then
    r = {}
    for k, v in line:gmatch("([%w_]+)=([%d%.%-]+)") do r[k] = tonumber(v) end
  end
  for l in outs[2]:gmatch("[^\n]+") do
    local ms = l:match('"ms": ([%d%.eE+-]+)')
    if ms then
      local times = {}
      for v in (l:match('"times": %[([^%]]*)%]') or ""):gmatch("[%d%.eE+-]+") do times[#times + 1] = tonumber(v) end
      t = { ms = tonumber(ms), lo = (fm.range(times)), loss = tonumber(l:match('"loss": ([%d%.eE+-]+)')),
        ver = l:match('"torch": "([^"]+)"') }
    end
  end
  if not (ok and r and t) then
    failed = failed + 1
    print(("paired %s run FAILED:\n-- ours:\n%s\n-- DDP:\n%s"):format(model, outs[1]:sub(-1500), outs[2]:sub(-1500)))
    return nil
  end
  return r, t
end

local what = {}
for w in opts.what:gmatch("[^,]+") do what[w] = true end

print(("FSDP speed at N = %d (OPENBLAS_NUM_THREADS=%s per rank), %d round(s) x (%d warmup + %d timed steps); "
  .. "ms per step = median over the timed steps of the slowest rank"):format(opts.n,
    os.getenv("OPENBLAS_NUM_THREADS") or "1", opts.rounds, opts.warmup, opts.iters))
local verdicts = {}

if what.shard then
  local full, none, ratio, best = {}, {}, {}, {}
  local last
  for _ = 1, opts.rounds do
    local r = ours("shard")
    if r then
      full[#full + 1], none[#none + 1], ratio[#ratio + 1] = r.full, r.none, r.full / r.none
      best[#best + 1] = r.full_lo / r.none_lo
      last = r
    end
  end
  print()
  print(("-- full shard vs no shard: MLP 784-%dx%d-10 (%d hidden layers of %d), each Linear a unit + root, Adam, batch %d per rank")
    :format(opts.width, opts.depth, opts.depth, opts.width, opts.batch))
  if last then
    local r3 = {}
    for k, v in ipairs(ratio) do r3[k] = ("%.3f"):format(v) end
    print(("   per round (ms): full %s | none %s | full/none %s"):format(fmt_list(full), fmt_list(none), table.concat(r3, " ")))
    print(("   median: full %.1f ms, none %.1f ms, full/none %.3f (round ratios %s); within the last round full %.1f-%.1f, none %.1f-%.1f")
      :format(fm.median(full), fm.median(none), fm.median(ratio), spread(ratio), last.full_lo, last.full_hi, last.none_lo,
        last.none_hi))
    print(("   fastest step full/fastest step none, median over rounds: %.3f (a load-insensitive cross-check)"):format(fm.median(best)))
    print(("   loss after the last step: full %.5f, none %.5f; bytes per step on rank 0: all-gather %.1f MiB, "
      .. "reduce-scatter %.1f MiB (full), all-reduce %.1f MiB (none)"):format(last.loss_full, last.loss_none, last.ag_bytes / 2 ^ 20,
        last.rs_bytes / 2 ^ 20, last.ar_bytes / 2 ^ 20))
    verdicts[#verdicts + 1] = ("full/none = %.3f (target <= %.2f)%s"):format(fm.median(ratio), opts.shard_target,
      fm.median(ratio) <= opts.shard_target and "" or "  MISSED")
    losses_agree(last.loss_full, last.loss_none, "full-shard and no-shard")
  end
end

if what.hybrid then
  local hyb, full, ratio = {}, {}, {}
  local last
  for _ = 1, opts.rounds do
    local r = ours("hybrid")
    if r then
      hyb[#hyb + 1], full[#full + 1], ratio[#ratio + 1] = r.hybrid, r.full, r.hybrid / r.full
      last = r
    end
  end
  print()
  local G = math.max(1, math.floor(opts.n / 2))
  print(("-- hybrid shard (groups of %d ranks, replicated across %d groups) vs full shard: the MLP above, same units")
    :format(G, math.floor(opts.n / G)))
  if last then
    print(("   per round (ms): hybrid %s | full %s"):format(fmt_list(hyb), fmt_list(full)))
    print(("   median: hybrid %.1f ms, full %.1f ms, hybrid/full %.3f (round ratios %s)"):format(fm.median(hyb),
      fm.median(full), fm.median(ratio), spread(ratio)))
    print(("   loss after the last step: hybrid %.5f, full %.5f"):format(last.loss_hybrid, last.loss_full))
    verdicts[#verdicts + 1] = ("hybrid/full = %.3f at N = %d (shard groups of %d)"):format(fm.median(ratio), opts.n, G)
    losses_agree(last.loss_hybrid, last.loss_full, "hybrid and full-shard")
  end
end

if what.ddp then
  local torch_ok = os.execute(shell_quote(opts.python) .. " -c 'import torch' >/dev/null 2>&1")
  torch_ok = torch_ok == 0 or torch_ok == true
  local models = { "conv", "transformer" }
  local res = {}
  for _, m in ipairs(models) do res[m] = { ours = {}, ddp = {}, ratio = {}, ours_lo = {}, ddp_lo = {} } end
  for _ = 1, opts.rounds do
    local tr = {}
    if torch_ok and opts.pair == 1 then -- both sides at once, alternating step by step
      for _, m in ipairs(models) do
        local r, t = paired(m)
        local x = res[m]
        if r and t then
          x.ours[#x.ours + 1], x.ddp[#x.ddp + 1], x.ratio[#x.ratio + 1] = r.ms, t.ms, r.ms / t.ms
          x.ours_lo[#x.ours_lo + 1], x.ddp_lo[#x.ddp_lo + 1] = r.lo, t.lo
          x.loss, x.tloss, x.ver = r.loss, t.loss, t.ver
        end
      end
    elseif torch_ok then -- both torch models in one spawn, then ours; alternating rounds
      local out = run(("%s %s --world %d --warmup %d --iters %d --models conv,transformer"):format(shell_quote(opts.python),
        shell_quote(root .. "/bench/ddp_torch.py"), opts.n, opts.warmup, opts.iters))
      for line in out:gmatch("[^\n]+") do
        local m, ms = line:match('"model": "(%w+)", "ms": ([%d%.eE+-]+)')
        if m then tr[m] = { ms = tonumber(ms), loss = tonumber(line:match('"loss": ([%d%.eE+-]+)')),
          ver = line:match('"torch": "([^"]+)"') } end
      end
      if not tr.conv then print("DDP (torch) FAILED:\n" .. out:sub(-2000)) end
    end
    if not (torch_ok and opts.pair == 1) then -- ours after torch (or alone)
      for _, m in ipairs(models) do
        local r = ours(m)
        local x = res[m]
        if r then x.ours[#x.ours + 1] = r.ms; x.loss = r.loss end
        if tr[m] then
          x.ddp[#x.ddp + 1] = tr[m].ms; x.tloss = tr[m].loss; x.ver = tr[m].ver
          if r then x.ratio[#x.ratio + 1] = r.ms / tr[m].ms end
        end
      end
    end
  end
  print()
  print("-- ours (full shard, each block/layer a unit + root) vs PyTorch DDP over gloo (torch.set_num_threads(1) per rank)")
  if torch_ok and opts.pair == 1 then print("   both jobs run at once and take turns step by step (--pair 1), so each pair of steps sees the same load") end
  if not torch_ok then print("   note: PyTorch not available to " .. opts.python .. "; only our times are shown") end
  local desc = { conv = "conv net 28x28, batch 32/rank, Adam", transformer = "transformer d256 h4 L2 T128, batch 8/rank, AdamW" }
  print(("   %-12s %-48s %9s %9s %8s %12s %s"):format("model", "configuration", "ours ms", "DDP ms", "ours/DDP",
    "ratio range", "loss ours/DDP"))
  for _, m in ipairs(models) do
    local x = res[m]
    local o, d, r = fm.median(x.ours), fm.median(x.ddp), fm.median(x.ratio)
    print(("   %-12s %-48s %9.1f %9s %8s %12s %s/%s"):format(m, desc[m], o, #x.ddp > 0 and ("%.1f"):format(d) or "-",
      #x.ratio > 0 and ("%.3f"):format(r) or "-", #x.ratio > 0 and spread(x.ratio) or "-",
      x.loss and ("%.3f"):format(x.loss) or "-", x.tloss and ("%.3f"):format(x.tloss) or "-"))
    print(("   %-12s per round: ours %s | DDP %s"):format("", fmt_list(x.ours), fmt_list(x.ddp)))
    if #x.ours_lo > 0 then
      print(("   %-12s fastest step: ours %.1f ms, DDP %.1f ms, ratio %.3f (a load-insensitive cross-check)"):format("",
        (fm.range(x.ours_lo)), (fm.range(x.ddp_lo)), (fm.range(x.ours_lo)) / (fm.range(x.ddp_lo))))
    end
    if #x.ratio > 0 then
      verdicts[#verdicts + 1] = ("%s ours/DDP = %.3f (target < %.2f)%s"):format(m, r, opts.ddp_target,
        r < opts.ddp_target and "" or "  MISSED")
    end
  end
  if res.conv.ver then print("   torch " .. res.conv.ver) end
end

print()
for _, v in ipairs(verdicts) do print(v) end
if failed > 0 then os.exit(1) end
