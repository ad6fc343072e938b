-- fsdp.data.DataLoader with num_workers > 0 (lua/fsdp/data/workers.lua): the batches and their
-- order against num_workers = 0 and against values written out by hand, per-worker seeds against
-- the RNG replayed in this process, worker_init_fn, get_worker_info, persistent workers, a worker's
-- error and death, no child process left after any way out (counted in /proc), tensor ops in a
-- worker after multithreaded ones here, 2 ranks through bin/fsdprun, and the options' errors.
local ffi = require "ffi"
local fsdp = require "fsdp"
local H = require "helpers"
local data = fsdp.data
pcall(ffi.cdef, "int getpid(void);")
pcall(ffi.cdef, "int kill(int pid, int sig);")

-- this process's children: {pid = state letter}
local function children()
  local out, me = {}, ffi.C.getpid()
  local ls = io.popen("ls /proc")
  for d in ls:lines() do
    local f = d:match("^%d+$") and io.open("/proc/" .. d .. "/stat")
    if f then
      local state, ppid = (f:read("*a") or ""):match("%) (%a) (%d+)")
      f:close()
      if tonumber(ppid) == me then out[tonumber(d)] = state end
    end
  end
  ls:close()
  return out
end
-- the number of this process's children that are luajit (workers; not the ls of children()),
-- after a full garbage collection unless told not to collect
local function n_children(no_collect)
  if not no_collect then
    collectgarbage("collect")
    collectgarbage("collect")
  end
  local n = 0
  for pid in pairs(children()) do
    local f = io.open("/proc/" .. pid .. "/comm")
    local comm = f and f:read("*l")
    if f then f:close() end
    if comm == "luajit" then n = n + 1 end
  end
  return n
end

-- a value with tensors replaced by {dtype, shape, values}, for are.same
local function plain(v)
  if fsdp.is_tensor(v) then return { v.dtype, v:shape(), v:float():contiguous():view(-1):totable() } end
  if type(v) ~= "table" then return v end
  local o = {}
  for k, x in pairs(v) do o[k] = plain(x) end
  return o
end
-- every batch of an epoch (all yielded values), plain
local function epoch(loader)
  local out = {}
  for a, b, c in loader() do out[#out + 1] = plain({ a, b, c }) end
  return out
end

-- sample i: a nested table of tensors (several dtypes, a transposed view, 0-dim, empty), numbers,
-- strings and booleans
local Rec = data.Dataset:extend("Rec")
function Rec:__init(n) self.n = n end
function Rec:len() return self.n end
function Rec:get(i)
  return { x = fsdp.full({ 2, 3 }, i):transpose(1, 2), half = fsdp.full({ 2 }, i / 4, "bfloat16"),
    id = fsdp.tensor({ i }, "int64")[1], none = fsdp.empty(0), i = i, f = i + 0.25, name = "s" .. i,
    odd = i % 2 == 1, nested = { { i, -i }, { tag = "t" .. i } } }
end
local function keep(samples) return { samples, #samples } end  -- a custom collate: the list as it is

describe("DataLoader with workers", function()
  it("gives the batches of num_workers = 0, in order, for every sampler and collation", function()
    local x = fsdp.randn(23, 3)
    local ds = data.TensorDataset(x, fsdp.arange(23))
    local rec = Rec(13)
    local cases = {
      { ds, { batch_size = 4 } },
      { ds, { batch_size = 4, shuffle = true, seed = 3 } },
      { ds, { batch_size = 5, drop_last = true, shuffle = true, seed = 1 } },
      { ds, { batch_size = 3, sampler = data.DistributedSampler(ds, { num_replicas = 3, rank = 1, seed = 2 }) } },
      { rec, { batch_size = 3 } },
      { rec, { batch_size = 2, shuffle = true, seed = 5, drop_last = true } },
      { rec, { batch_size = 4, collate_fn = keep } },
      { { 1.5, 2, 3, 4, 5 }, { batch_size = 2 } },  -- a plain list of numbers
    }
    for c, case in ipairs(cases) do
      local ds_, opts = case[1], case[2]
      local want = epoch(data.DataLoader(ds_, opts))
      assert.is_true(#want > 0)
      for _, nw in ipairs { 1, 2, 3 } do
        for _, pf in ipairs { 1, 2 } do
          local o = {}
          for k, v in pairs(opts) do o[k] = v end
          o.num_workers, o.prefetch_factor = nw, pf
          assert.are.same(want, epoch(data.DataLoader(ds_, o)), ("case %d, %d workers, prefetch %d"):format(c, nw, pf))
        end
      end
    end
    -- and by hand: batch 2 of Rec(13) at batch_size 3 is samples 4..6
    local b2
    local n = 0
    for b in data.DataLoader(rec, { batch_size = 3, num_workers = 2 })() do
      n = n + 1
      if n == 2 then b2 = b end
    end
    assert.are.same({ 4, 5, 6 }, b2.i:tolist())
    assert.are.same({ "s4", "s5", "s6" }, b2.name)
    assert.are.same({ false, true, false }, b2.odd)
    assert.are.same({ 3, 3, 2 }, b2.x:shape())
    assert.are.same({ 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6 }, b2.x:reshape(18):tolist())
    assert.are.equal("bfloat16", b2.half.dtype)
    assert.are.same({ 1.25, 1.25 }, b2.half[2]:float():tolist())
    assert.are.same({ 3, 0 }, b2.none:shape())
    assert.are.same({ 4.25, 5.25, 6.25 }, b2.f:tolist())
    assert.are.same({ -4, -5, -6 }, b2.nested[1][2]:tolist())
    assert.are.same({ "t4", "t5", "t6" }, b2.nested[2].tag)
    assert.are.equal(5, n)
    assert.are.equal(0, n_children())
  end)

  it("seeds worker w with base_seed + w, the base drawn from the global RNG per iteration", function()
    local Info = data.Dataset:extend("Info")
    function Info:len() return 12 end
    function Info:get(i)
      local w = data.get_worker_info()
      return { i = i, id = w.id, n = w.num_workers, seed = w.seed, same = w.dataset == self, r = fsdp.rand(1):item(),
        m = math.random(1000000), init = INIT_ID }  -- (a global: the worker_init_fn sets it in the worker)
    end
    assert.is_nil(data.get_worker_info())
    local ds = Info()
    local loader = data.DataLoader(ds, { batch_size = 2, num_workers = 3, worker_init_fn = function(id)
      INIT_ID = id * 10  -- (a global of the worker process)
    end })
    fsdp.manual_seed(11)
    local base = fsdp.randint(0, 2 ^ 31 - 1, { 1 }):item()
    fsdp.manual_seed(11)
    local rows = {}
    for b in loader() do
      local c = {}
      for k, v in pairs(b) do c[k] = fsdp.is_tensor(v) and v:tolist() or v end
      for j = 1, 2 do rows[#rows + 1] = { c.i[j], c.id[j], c.n[j], c.seed[j], c.same[j], c.r[j], c.m[j], c.init[j] } end
    end
    assert.is_nil(INIT_ID)  -- (worker_init_fn ran in the workers only)
    assert.are.equal(12, #rows)
    local draws = {}  -- per worker, its draws in order, replayed here
    for k, r in ipairs(rows) do
      local batch = math.floor((k - 1) / 2) + 1
      local id = (batch - 1) % 3
      assert.are.same({ k, id, 3, base + id, true }, { r[1], r[2], r[3], r[4], r[5] }, "sample " .. k)
      assert.are.equal(id * 10, r[8])
      draws[id] = draws[id] or {}
      table.insert(draws[id], { r[6], r[7] })
    end
    for id = 0, 2 do
      fsdp.manual_seed(base + id)
      math.randomseed(base + id)
      for j, d in ipairs(draws[id]) do
        local want = fsdp.rand(1):float():item()
        assert.are.equal(want, d[1], ("worker %d draw %d"):format(id, j))
        assert.are.equal(math.random(1000000), d[2])
      end
    end
    -- the next iteration draws the next base
    local seeds = {}
    for b in loader() do seeds[#seeds + 1] = b.seed:tolist()[1] end
    assert.are_not.equal(base, seeds[1])
    assert.are.equal(seeds[1] + 1, seeds[2])
    assert.are.equal(0, n_children())
  end)

  it("keeps persistent workers across epochs, and restarts others each epoch", function()
    local Pid = data.Dataset:extend("Pid")
    function Pid:len() return 8 end
    function Pid:get(i) return { i, ffi.C.getpid() } end
    local ds = Pid()
    local function pids(loader, stop)
      local idx, seen = {}, {}
      for i, p in loader() do
        for _, v in ipairs(i:tolist()) do idx[#idx + 1] = v end
        seen[p:tolist()[1]] = true
        if stop and #idx >= stop then break end
      end
      return idx, seen
    end
    local persistent = data.DataLoader(ds, { batch_size = 2, num_workers = 2, persistent_workers = true,
      shuffle = true, seed = 4 })
    local plain0 = data.DataLoader(ds, { batch_size = 2, shuffle = true, seed = 4 })
    local i1, p1 = pids(persistent)
    assert.are.equal(2, n_children())  -- kept between epochs
    local i2 = pids(persistent, 2)     -- an epoch left after one batch: its other tasks are dropped
    local i3, p3 = pids(persistent)
    assert.are.same(p1, p3)
    assert.are.same(pids(plain0), i1)  -- the same sequence without workers
    assert.are.same(pids(plain0, 2), i2)
    assert.are.same(pids(plain0), i3)
    assert.are_not.same(i1, i3)
    persistent = nil  -- (its workers end with it)
    assert.are.equal(0, n_children())
    local other = data.DataLoader(ds, { batch_size = 2, num_workers = 2 })
    local _, q1 = pids(other)
    assert.are.equal(0, n_children(true))
    local _, q2 = pids(other)
    for p in pairs(q1) do assert.is_nil(q2[p]) end
  end)

  it("re-raises a worker's error with its traceback and the batch", function()
    local Bad = data.Dataset:extend("Bad")
    function Bad:len() return 20 end
    function Bad:get(i)
      if i == 7 then error("sample seven is broken") end
      return i
    end
    local seen = 0
    local err = H.assert_error(function()
      for _ in data.DataLoader(Bad(), { batch_size = 2, num_workers = 2 })() do seen = seen + 1 end
    end, "DataLoader worker 1 failed on batch 4", "sample seven is broken", "stack traceback", "in function 'get'")
    assert.is_truthy(err:find("dataloader_workers_spec.lua:%d+: sample seven"), err)
    assert.are.equal(3, seen)
    assert.are.equal(0, n_children())
    H.assert_error(function()
      for _ in data.DataLoader(Bad(), { batch_size = 2, num_workers = 2, worker_init_fn = function(id)
        if id == 1 then error("no init for 1") end
      end })() do end
    end, "DataLoader worker 1 failed on batch 2", "worker_init_fn(1) failed", "no init for 1")
    H.assert_error(function()
      for _ in data.DataLoader({ 1, 2, 3 }, { num_workers = 1, collate_fn = function() return print end })() do end
    end, "DataLoader worker 0 failed on batch 1", "holds a function at batch")
    assert.are.equal(0, n_children())
  end)

  it("names a worker that died (killed, segfault), without hanging", function()
    local Die = data.Dataset:extend("Die")
    function Die:__init(how) self.how = how end
    function Die:len() return 10 end
    function Die:get(i)
      if i == 5 then
        if self.how == "kill" then ffi.C.kill(ffi.C.getpid(), 9) end
        ffi.cast("volatile int*", 0)[0] = 1
      end
      return i
    end
    local t0 = os.time()
    H.assert_error(function() for _ in data.DataLoader(Die("kill"), { batch_size = 2, num_workers = 2 })() do end end,
      "DataLoader worker 0 (pid", "died while loading batch 3", "killed by signal 9 (SIGKILL)")
    H.assert_error(function() for _ in data.DataLoader(Die("segv"), { batch_size = 2, num_workers = 2 })() do end end,
      "DataLoader worker 0 (pid", "died while loading batch 3", "SIGSEGV")
    assert.is_true(os.time() - t0 < 10)
    assert.are.equal(0, n_children())
  end)

  it("leaves no child after the end, a break, or an error in the loop", function()
    local ds = data.TensorDataset(fsdp.arange(30))
    local loader = data.DataLoader(ds, { batch_size = 3, num_workers = 2 })
    local it = loader()  -- (held: the epoch's end must end the workers, not the collector)
    for _ in it do end
    assert.are.equal(0, n_children(true))
    it = nil
    for _ in loader() do break end
    assert.are.equal(0, n_children())  -- (the iterator was collected)
    local ok = pcall(function() for _ in loader() do error("in the loop") end end)
    assert.is_false(ok)
    assert.are.equal(0, n_children())
  end)

  it("leaves no live worker when the program ends: os.exit, an error, SIGTERM, SIGINT, SIGKILL", function()
    local dir = H.mkdtemp("fsdp_loader")
    for _, mode in ipairs { "exit", "exit_close", "error", "sigterm", "sigint", "sigkill" } do
      -- (output into a file: a worker that outlived the script would hold a pipe open, and H.sh wait)
      local rc = H.sh(("luajit %sloader_exit.lua %s %s/pids > %s/out 2>&1"):format(H.scripts, mode, dir, dir),
        ("LUA_PATH='%s/lua/?.lua;%s/lua/?/init.lua;;' LUA_CPATH='%s/?.so;;'"):format(H.root, H.root, H.root), 30)
      local out = H.read_file(dir .. "/out")
      assert.are_not.equal(124, rc, out)
      local pids = {}
      for p in H.read_file(dir .. "/pids"):gmatch("%d+") do pids[#pids + 1] = tonumber(p) end
      assert.are.equal(2, #pids, mode .. ": the workers of the running iterator\n" .. out)
      -- each is gone, or a zombie of the init process: dead (SIGKILL by PR_SET_PDEATHSIG or by its pool)
      local alive
      for _ = 1, 50 do
        alive = {}
        for _, p in ipairs(pids) do
          local f = io.open("/proc/" .. p .. "/stat")
          local state = f and f:read("*a"):match("%) (%a) ")
          if f then f:close() end
          if state and state ~= "Z" then alive[#alive + 1] = p .. " " .. state end
        end
        if #alive == 0 then break end
        os.execute("sleep 0.1")
      end
      assert.are.same({}, alive, mode)
    end
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("runs tensor ops in workers after multithreaded ones in this process", function()
    local rc, out = H.lua([[
      fsdp.set_num_threads(2)
      local a, w = fsdp.randn(256, 256), fsdp.randn(8, 3, 3, 3)
      for _ = 1, 5 do local _ = a:matmul(a) + fsdp.nn.functional.conv2d(fsdp.randn(2, 3, 16, 16), w):sum() end
      local Ops = fsdp.data.Dataset:extend("Ops")
      function Ops:len() return 6 end
      function Ops:get(i)
        local x = a * i
        return { x:matmul(a):sum(), fsdp.nn.functional.conv2d(x:narrow(1, 1, 48):reshape(1, 3, 64, 64), w):sum(),
          tonumber(fsdp.C.fsdp_get_num_threads()) }
      end
      local want = {}  -- (one thread here too: a sum's order depends on the thread count)
      fsdp.set_num_threads(1)
      for m, c in fsdp.data.DataLoader(Ops(), { batch_size = 2 })() do want[#want + 1] = { m:tolist(), c:tolist() } end
      fsdp.set_num_threads(2)
      local _ = a:matmul(a):sum()
      local k = 0
      for m, c, nt in fsdp.data.DataLoader(Ops(), { batch_size = 2, num_workers = 2 })() do
        k = k + 1
        assert(table.concat(m:tolist(), ",") == table.concat(want[k][1], ","), "matmul")
        assert(table.concat(c:tolist(), ",") == table.concat(want[k][2], ","), "conv")
        assert(nt:tolist()[1] == 1, "one thread in a worker")
      end
      assert(k == 3 and fsdp.C.fsdp_get_num_threads() == 2)
      print("OPS OK")
    ]], "OMP_NUM_THREADS=2", 60)
    assert.are.equal(0, rc, out)
    assert.is_truthy(out:find("OPS OK", 1, true), out)
  end)

  it("on 2 ranks gives each rank what num_workers = 0 gives it, without MPI's fork warning", function()
    if not H.has_mpi() then pending("no MPI here") return end
    local rc, out = H.sh(("%s -n 2 %sdataloader_workers_ranks.lua"):format(H.fsdprun, H.scripts), "FSDP_STDOUT_TTY=0", 120)
    assert.are.equal(0, rc, out)
    assert.is_truthy(out:find("[rank 0] WORKERS OK 2", 1, true), out)
    assert.is_truthy(out:find("[rank 1] WORKERS OK 2", 1, true), out)
    assert.is_nil(out:lower():find("fork"), out)
  end)

  -- (with a GPU, tests/backends/cuda_spec.lua checks that the batches come pinned)
  it("says once without a GPU that pin_memory does nothing, and rejects bad options naming DataLoader", function()
    local rc, out = H.lua([[
      if fsdp.cuda.is_available() then print("GPU") return end
      local ds = fsdp.data.TensorDataset(fsdp.arange(4))
      for x in fsdp.data.DataLoader(ds, { pin_memory = true, batch_size = 2 })() do print(x:is_pinned()) end
      fsdp.data.DataLoader(ds, { pin_memory = true, num_workers = 1 })
      print("DONE")
    ]], "FSDP_CUDA_EMU=0")
    assert.are.equal(0, rc, out)
    if not out:find("GPU\n") then
      local _, lines = out:gsub("pin_memory = true does nothing here: there is no GPU %(", "")
      assert.are.equal(1, lines, out)
      assert.matches("false\nfalse\n", out)
      assert.matches("DONE", out)
    end
    local ds = data.TensorDataset(fsdp.arange(4))
    local function bad(opts, ...) H.assert_error(function() data.DataLoader(ds, opts) end, "DataLoader", ...) end
    bad({ num_workers = -1 }, "num_workers must be an integer >= 0")
    bad({ num_workers = 1.5 }, "num_workers")
    bad({ num_workers = "2" }, "num_workers")
    bad({ prefetch_factor = 2 }, "prefetch_factor needs num_workers > 0")
    bad({ num_workers = 1, prefetch_factor = 0 }, "prefetch_factor must be an integer >= 1")
    bad({ persistent_workers = true }, "persistent_workers = true needs num_workers > 0")
    bad({ num_workers = 1, persistent_workers = 1 }, "persistent_workers must be a boolean")
    bad({ worker_init_fn = 3 }, "worker_init_fn must be a function")
    bad({ pin_memory = "yes" }, "pin_memory must be a boolean")
    bad({ num_worker = 2 }, "unknown option num_worker")
  end)
end)
