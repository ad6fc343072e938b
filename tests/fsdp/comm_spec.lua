-- The communicator: collectives in this process (self backend), then multi-rank runs through
-- bin/fsdprun on the scripts in tests/scripts/ (values for 1, 2 and 4 ranks, mismatches,
-- timeouts, a failing rank, exit status forwarding).
local fsdp = require "fsdp"
local H = require "helpers"

local root, scripts, fsdprun, sh = H.root, H.scripts, H.fsdprun, H.sh
local mpi = H.has_mpi()

local function count(s, pat)
  local n = 0
  for _ in s:gmatch(pat) do n = n + 1 end
  return n
end

describe("comm in this process (self backend)", function()
  it("initializes once and reports one rank", function()
    assert.equal(fsdp, fsdp.init())
    assert.equal(fsdp, fsdp.init())
    assert.equal(0, fsdp.rank())
    assert.equal(1, fsdp.world_size())
    assert.equal("self", fsdp.comm.backend())
    local ok, err = pcall(fsdp.init, "mpi")
    assert.is_false(ok)
    assert.truthy(err:find("already initialized with backend 'self'", 1, true))
  end)

  it("computes every collective's value for one rank", function()
    fsdp.comm.reset_stats()
    local x = fsdp.tensor({ 1, -2, 3, 4 })
    H.assert_close(fsdp.all_gather(x), { 1, -2, 3, 4 })
    local out = fsdp.full({ 4 }, 9, { dtype = "int64" })
    fsdp.all_gather(out, fsdp.tensor({ 5, 6, 7, 8 }, "int64"))
    assert.same({ 5, 6, 7, 8 }, out:tolist())
    for _, op in ipairs { "sum", "avg", "max" } do
      local o = fsdp.zeros(4)
      fsdp.reduce_scatter(o, x, op)
      H.assert_close(o, { 1, -2, 3, 4 })
      H.assert_close(fsdp.all_reduce(x:clone(), op), { 1, -2, 3, 4 })
    end
    H.assert_close(fsdp.broadcast(x:clone(), 0), { 1, -2, 3, 4 })
    fsdp.barrier()
    local s = fsdp.comm_stats()
    assert.same({ count = 2, bytes = 48 }, s.all_gather)
    assert.same({ count = 3, bytes = 48 }, s.reduce_scatter)
    assert.same({ count = 3, bytes = 48 }, s.all_reduce)
    assert.same({ count = 1, bytes = 16 }, s.broadcast)
    assert.same({ count = 1, bytes = 0 }, s.barrier)
  end)

  it("returns work handles with async = true", function()
    local ins, outs, works = {}, {}, {}
    for j = 1, 6 do
      ins[j] = fsdp.full({ 1000 }, j)
      outs[j] = fsdp.zeros(1000)
      works[j] = fsdp.all_gather(outs[j], ins[j], { async = true, tag = "w" .. j })
    end
    for j = 6, 1, -1 do
      assert.equal(outs[j], works[j]:wait())
      assert.is_true(works[j]:is_completed())
      assert.equal(j * 1000, outs[j]:sum():item())
    end
    local b = fsdp.comm.barrier_async()
    b:wait()
  end)

  it("raises errors naming the op, shapes and dtypes, and keeps working", function()
    local ok, err = pcall(fsdp.all_gather, fsdp.zeros(5), fsdp.zeros(4), { tag = "layers.0" })
    assert.is_false(ok)
    assert.truthy(err:find("all_gather 'layers.0'", 1, true) and err:find("(5)", 1, true) and err:find("(4)", 1, true))
    ok, err = pcall(fsdp.all_reduce, fsdp.zeros(3, { dtype = "int64" }))
    assert.is_false(ok)
    assert.truthy(err:find("all_reduce", 1, true) and err:find("int64", 1, true))
    ok, err = pcall(fsdp.all_reduce, fsdp.zeros(3), "median")
    assert.truthy(not ok and err:find('unknown op "median"', 1, true))
    ok, err = pcall(fsdp.broadcast, fsdp.zeros(3), 1)
    assert.truthy(not ok and err:find("root 1 is not a rank (world size 1", 1, true))
    ok, err = pcall(fsdp.all_gather, fsdp.zeros(3), "x")
    assert.truthy(not ok and err:find("all_gather: input must be a tensor", 1, true))
    H.assert_close(fsdp.all_reduce(fsdp.tensor({ 2, 3 }), "max"), { 2, 3 })
  end)
end)

describe("fsdprun", function()
  it("runs a 1-rank job without the launcher on the self backend", function()
    local env = ("LUA_PATH=%q"):format(root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;;")
    local rc, out = sh("luajit " .. scripts .. "comm_values.lua self", env)
    assert.equal(0, rc, out)
    assert.truthy(out:find("rank 0/1 ok", 1, true), out)
  end)

  it("runs plain luajit for -n 1 and forwards its exit status", function()
    local rc, out = sh(fsdprun .. " -n 1 " .. scripts .. "comm_values.lua self")
    assert.equal(0, rc, out)
    assert.truthy(out:find("rank 0/1 ok", 1, true), out)
    rc, out = sh(fsdprun .. " " .. scripts .. "comm_exit.lua 0 5")
    assert.equal(5, rc, out)
    rc, out = sh(fsdprun .. " -n")
    assert.equal(2, rc, out)
    assert.truthy(out:find("fsdprun: -n needs a value\nrun fsdprun --help for the options", 1, true), out)
  end)

  for _, n in ipairs { 2, 4 } do
    it(("computes every collective on %d ranks"):format(n), function()
      if not mpi then pending("no mpirun or libfsdp_mpi.so") return end
      local rc, out = sh(("%s -n %d %scomm_values.lua"):format(fsdprun, n, scripts))
      assert.equal(0, rc, out)
      for r = 0, n - 1 do assert.truthy(out:find(("rank %d/%d ok"):format(r, n), 1, true), out) end
    end)
  end

  -- device tensors through a device data plane: the stand-in communicator (the test double of
  -- NCCL, on the test double of a GPU; see tests/fsdp/fsdp_spec.lua); and through the host
  for _, c in ipairs { { 2, "standin" }, { 4, "standin" }, { 2, "host" } } do
    it(("computes every collective on cuda tensors on %d ranks through %s"):format(c[1], c[2]), function()
      if not mpi then pending("no mpirun or libfsdp_mpi.so") return end
      if fsdp.cuda.is_available() then pending("a real GPU: the test double is for machines without one") return end
      local rc, out = sh(("%s -n %d %scomm_values.lua"):format(fsdprun, c[1], scripts),
        "FSDP_VALUES_DEVICE=cuda FSDP_DEVICE_COMM=" .. c[2])
      assert.equal(0, rc, out)
      for r = 0, c[1] - 1 do assert.truthy(out:find(("rank %d/%d ok"):format(r, c[1]), 1, true), out) end
    end)
  end

  -- NCCL's unique ids need no GPU: the bootstrap of the nccl plane runs here for real
  it("bootstraps NCCL over MPI: rank 0's ids reach every rank, a new job gets new ones", function()
    if not mpi then pending("no mpirun or libfsdp_mpi.so") return end
    local lib = io.open(root .. "/libfsdp_nccl.so", "rb")
    if not lib then pending("libfsdp_nccl.so not built (no nccl.h)") return end
    lib:close()
    local seen = {}
    for run = 1, 2 do
      local rc, out = sh(("%s -n 2 %scomm_nccl_boot.lua"):format(fsdprun, scripts))
      assert.equal(0, rc, out)
      local d0, d1 = out:match("rank 0 digest (%x+)"), out:match("rank 1 digest (%x+)")
      assert.truthy(d0 and #d0 == 16, out)
      assert.equal(d0, d1, "the ranks hold different ids:\n" .. out)
      assert.truthy(out:find("rank 0 after: ok", 1, true) and out:find("rank 1 after: ok", 1, true), out)
      seen[run] = d0
    end
    assert.are_not.equal(seen[1], seen[2], "two jobs got the same NCCL ids")
  end)

  it("refuses the nccl plane on the test double of a GPU, and picks the host for it by default", function()
    if fsdp.cuda.is_available() then pending("a real GPU: the test double is for machines without one") return end
    local prog = [[
      fsdp._testdev_install()
      local ok, err = pcall(fsdp.all_reduce, fsdp.ones({ 2 }, { device = "cuda" }), "sum", { tag = "g" })
      print(ok and "ok " .. fsdp.comm_device_plane() or "error " .. err)]]
    local _, out = H.lua(prog, "FSDP_DEVICE_COMM=nccl")
    assert.truthy(out:find("all_reduce 'g': FSDP_DEVICE_COMM=nccl needs a real GPU, not the test double of one", 1, true), out)
    _, out = H.lua(prog)
    assert.truthy(out:find("ok host", 1, true), out)
    _, out = H.lua(prog, "FSDP_DEVICE_COMM=bogus")
    assert.truthy(out:find("FSDP_DEVICE_COMM must be auto, host, nccl or standin, got 'bogus'", 1, true), out)
  end)

  it("refuses ranks that move device tensors in different ways, naming both", function()
    if not mpi then pending("no mpirun or libfsdp_mpi.so") return end
    if fsdp.cuda.is_available() then pending("a real GPU: the test double is for machines without one") return end
    local rc, out, dt = sh(fsdprun .. " -n 2 " .. scripts .. "comm_plane_mismatch.lua")
    assert.is_not.equal(0, rc, out)
    local msg = "collective mismatch at #2: rank 0 called plane start(tag 'standin', 0 bytes, cuda tensors through "
      .. "the stand-in communicator) but rank 1 called all_reduce(tag 'grads', shape (4), cuda tensors through the host)"
    for r = 0, 1 do assert.truthy(out:find(("rank %d error: %s"):format(r, msg), 1, true), out) end
    assert.truthy(dt < 30, "took " .. dt .. " s")
  end)

  it("reports a collective mismatch on every rank, naming both tags and ranks", function()
    if not mpi then pending("no mpirun or libfsdp_mpi.so") return end
    local rc, out, dt = sh(fsdprun .. " -n 4 " .. scripts .. "comm_mismatch.lua")
    assert.is_not.equal(0, rc, out)
    local msg = "collective mismatch at #2: rank 0 called all_gather(tag 'A', 64 bytes) but rank 1 called "
      .. "reduce_scatter(tag 'B', 64 bytes)"
    for r = 0, 3 do
      assert.truthy(out:find(("rank %d error: %s"):format(r, msg), 1, true), out)
      assert.truthy(out:find(("rank %d later: "):format(r), 1, true), out)  -- broken: fails at once
    end
    assert.equal(8, count(out, "collective mismatch at #2"), out)
    assert.truthy(dt < 30, "took " .. dt .. " s")
  end)

  it("refuses the same bytes in different shapes: broadcast, and parameters at fsdp.wrap", function()
    if not mpi then pending("no mpirun or libfsdp_mpi.so") return end
    local cases = {
      broadcast = "rank 0 called broadcast(tag 'weights', shape (2, 3)) but rank 1 called broadcast(tag 'weights', shape (3, 2))",
      wrap = "rank 0 called broadcast(tag 'Sequential: 0.weight', shape (4, 1, 3, 2)) but rank 1 called "
        .. "broadcast(tag 'Sequential: 0.weight', shape (4, 1, 2, 3))",
      wrap_nosync = "rank 0 called barrier(tag 'Sequential: 0.weight', shape (4, 1, 3, 2)) but rank 1 called "
        .. "barrier(tag 'Sequential: 0.weight', shape (4, 1, 2, 3))",
    }
    for mode, msg in pairs(cases) do
      local rc, out, dt = sh(fsdprun .. " -n 2 " .. scripts .. "comm_shape_mismatch.lua " .. mode)
      assert.is_not.equal(0, rc, out)
      for r = 0, 1 do
        assert.truthy(out:find(("rank %d error: "):format(r), 1, true), mode .. ":\n" .. out)
      end
      assert.truthy(out:find(msg, 1, true), mode .. ":\n" .. out)
      assert.truthy(dt < 30, "took " .. dt .. " s")
    end
  end)

  it("times out naming the rank that skipped a collective", function()
    if not mpi then pending("no mpirun or libfsdp_mpi.so") return end
    local rc, out, dt = sh(fsdprun .. " -n 4 " .. scripts .. "comm_timeout.lua", "FSDP_COMM_TIMEOUT=1.5")
    assert.is_not.equal(0, rc, out)
    for _, r in ipairs { 0, 2, 3 } do
      assert.truthy(out:find(("rank %d error after %%d s: timed out after 1.5 s waiting for rank 1 in all_reduce 'skipped'"):format(r)), out)
    end
    assert.is_nil(out:find("woke up", 1, true), out)  -- the sleeping rank was stopped
    assert.truthy(dt < 30, "took " .. dt .. " s")
    -- rank 0 coordinates the check: when it is the one missing, the others name it
    rc, out, dt = sh(fsdprun .. " -n 2 " .. scripts .. "comm_timeout.lua 0", "FSDP_COMM_TIMEOUT=1")
    assert.is_not.equal(0, rc, out)
    assert.truthy(out:find("rank 1 error after %d s: timed out after 1 s waiting for rank 0 in all_reduce 'skipped'"), out)
    assert.is_nil(out:find("woke up", 1, true), out)
    assert.truthy(dt < 30, "took " .. dt .. " s")
  end)

  it("stops every rank when one raises a Lua error, showing its message", function()
    if not mpi then pending("no mpirun or libfsdp_mpi.so") return end
    for _, mode in ipairs { "", "early" } do
      local rc, out, dt = sh(fsdprun .. " -n 2 " .. scripts .. "comm_error.lua " .. mode)
      assert.is_not.equal(0, rc, out)
      assert.truthy(out:find(mode == "" and "rank 1 exploded on purpose" or "rank 1 exploded early on purpose", 1, true), out)
      assert.is_nil(out:find("passed the all_reduce", 1, true), out)
      assert.truthy(dt < 30, "took " .. dt .. " s")
    end
  end)

  it("forwards a rank's exit status", function()
    if not mpi then pending("no mpirun or libfsdp_mpi.so") return end
    local rc, out = sh(fsdprun .. " -n 2 " .. scripts .. "comm_exit.lua 1 7")
    assert.equal(7, rc, out)
    assert.truthy(out:find("rank 0/2 done", 1, true) and out:find("rank 1/2 done", 1, true), out)
  end)
end)
