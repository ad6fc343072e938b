-- Hostile values (issue 39, items 1-4): a thread count, a float that becomes an int64, a generator
-- state and an in-place destination that the library cannot honour are each a Lua error naming the
-- function, the argument and what was expected -- never a crash, a stuck generator or a silently
-- wrong tensor -- and the process keeps working after it. Probes that crashed before run in a child
-- process, so a crash fails the test instead of killing busted.
local fsdp = require "fsdp"
local H = require "helpers"

-- `code` (Lua, fsdp loaded) must run to its end in a child process and print "DONE"; env before it
local function child_ok(code, env)
  local rc, out = H.lua(code .. "\nprint('DONE')", env, 120)
  assert(rc == 0 and out:find("DONE", 1, true), ("the child process failed (exit %s):\n%s"):format(tostring(rc), out))
  return out
end

describe("fsdp.set_num_threads (item 1)", function()
  it("refuses 100000 threads, naming the limit, and a matmul after it still works (it crashed)", function()
    child_ok [[
      local ok, err = pcall(fsdp.set_num_threads, 100000)
      assert(not ok, "set_num_threads(100000) was accepted")
      for _, frag in ipairs { "set_num_threads", "n = 100000", "above the limit of", "threads" } do
        assert(tostring(err):find(frag, 1, true), ("%q does not mention %q"):format(tostring(err), frag))
      end
      for _, n in ipairs { 2 ^ 31, 2 ^ 32 + 100000, 1e300, math.huge } do
        assert(not pcall(fsdp.set_num_threads, n), ("set_num_threads(%s) was accepted"):format(tostring(n)))
      end
      fsdp.manual_seed(0)
      local a = fsdp.randn(512, 512)
      local ref = a:matmul(a)
      assert(ref:shape()[1] == 512)
    ]]
  end)

  it("refuses a count that is not a positive integer, naming n", function()
    local before = fsdp.C.fsdp_get_num_threads()
    for _, n in ipairs { 2.5, 0, -1, 0 / 0, -math.huge } do
      H.assert_error(function() fsdp.set_num_threads(n) end, "set_num_threads", "n = ", "positive integer")
    end
    H.assert_error(function() fsdp.set_num_threads(nil) end, "set_num_threads", "as n", "got nil")
    H.assert_error(function() fsdp.set_num_threads("4") end, "set_num_threads", "as n", "string")
    assert.equal(before, fsdp.C.fsdp_get_num_threads())
  end)

  it("takes every count up to the limit, and a matmul at the limit gives the one-thread result", function()
    local limit = fsdp.C.fsdp_max_num_threads()
    assert.is_true(limit >= 1 and limit <= 1024)
    child_ok(([[
      fsdp.manual_seed(0)
      local a = fsdp.randn(512, 512)
      fsdp.set_num_threads(1)
      local one = a:matmul(a)
      fsdp.set_num_threads(%d)
      assert(fsdp.C.fsdp_get_num_threads() == %d)
      local many = a:matmul(a)
      local d = (many - one):abs():max():item()
      assert(d <= 1e-3, "the matmul at the limit differs by " .. d)
    ]]):format(limit, limit))
    -- OMP_THREAD_LIMIT lowers it, and the message says so
    local out = child_ok([[
      assert(fsdp.C.fsdp_max_num_threads() == 3)
      fsdp.set_num_threads(3)
      local ok, err = pcall(fsdp.set_num_threads, 4)
      assert(not ok)
      print(err)
    ]], "OMP_THREAD_LIMIT=3")
    assert.truthy(out:find("n = 4 is above the limit of 3 threads", 1, true), out)
  end)
end)

describe("floats into int64 (item 2)", function()
  local RANGE = "does not fit in int64"

  it("to / long refuse NaN, inf and values outside int64, naming the first one and its position", function()
    H.assert_error(function() fsdp.tensor({ 1e30, -1e30, 0 / 0 }):to("int64") end, "to: element 1 ", "1.00000002e+30",
      RANGE)
    H.assert_error(function() fsdp.tensor({ 1, -1e30 }):long() end, "to: element 2 ", RANGE)
    H.assert_error(function() fsdp.tensor({ { 1, 2 }, { 3, 0 / 0 } }):long() end, "element 4 ", "shape (2, 2)", "nan")
    H.assert_error(function() fsdp.tensor({ 1, 1 / 0 }):long() end, "element 2 ", "inf", RANGE)
    H.assert_error(function() fsdp.tensor({ 2 ^ 63 }):long() end, "element 1 ", RANGE)
    H.assert_error(function() fsdp.tensor({ 1, 1 / 0 }):to("float16"):long() end, "float16", "inf")
    H.assert_error(function() fsdp.tensor({ 0 / 0 }):to("bfloat16"):long() end, "bfloat16", "nan")
    H.assert_error(function() fsdp.tensor({ { 1, 1e20 } }):t():long() end, "element 2 ", "shape (2, 1)")
  end)

  it("keeps PyTorch's conversion of what fits: truncation toward zero, -2^63 exactly, NaN as true in bool", function()
    assert.same({ 2, -2, 2, -2, 0 }, fsdp.tensor({ 2.5, -2.5, 2.9, -2.9, 0.5 }):long():tolist())
    assert.same({ -2 ^ 63, 2 ^ 62 }, fsdp.tensor({ -2 ^ 63, 2 ^ 62 }):long():tolist())
    assert.same({ true, true, false }, fsdp.tensor({ 0 / 0, 1 / 0, 0 }):to("bool"):totable())
    assert.same({ 3, 4 }, fsdp.tensor({ 3.5, 4.5 }):to("bfloat16"):long():tolist())
  end)

  it("fsdp.tensor, full, fill_, x[i] = v, copy_ and arange into int64 refuse the same values", function()
    H.assert_error(function() fsdp.tensor({ 1, 1e30 }, "int64") end, "tensor: element 2 = 1e+30", RANGE)
    H.assert_error(function() fsdp.tensor({ { 1 }, { 0 / 0 } }, "int64") end, "element 2 = nan", RANGE)
    H.assert_error(function() fsdp.full({ 2 }, 0 / 0, "int64") end, "full: value nan", RANGE)
    H.assert_error(function() fsdp.full({ 2 }, -1e19, { dtype = "int64" }) end, "full: value -1e+19", RANGE)
    H.assert_error(function() fsdp.zeros({ 2 }, "int64"):fill_(1 / 0) end, "fill_: value inf", RANGE)
    local x = fsdp.zeros({ 3 }, "int64")
    H.assert_error(function() x[2] = 1e30 end, "fill_: value 1e+30", RANGE)
    H.assert_error(function() x[{ { 2, 3 } }] = fsdp.tensor({ 1, 0 / 0 }) end, "copy_: element 2 ", "nan", RANGE)
    H.assert_error(function() x:copy_(fsdp.tensor({ 1, 2, 1e19 })) end, "copy_: element 3 ", RANGE)
    assert.same({ 0, 0, 0 }, x:tolist())  -- nothing written
    H.assert_error(function() fsdp.arange(1e19, 1e19 + 1e5, 4096, "int64") end, "arange: start 1e+19", RANGE)
    H.assert_error(function() fsdp.arange(5e18, 1e19, 4.5e18, "int64") end, "arange: the last value 9.5e+18", RANGE)
    H.assert_error(function() fsdp.where(fsdp.tensor({ true }), x:narrow(1, 1, 1), 1e30) end, RANGE)
    H.assert_error(function() fsdp.full({ 2 }, 1e30, { dtype = "int64", device = "meta" }) end, "value 1e+30", RANGE)
    H.assert_error(function()
      fsdp.meta(function() fsdp.zeros({ 2 }, "int64"):copy_(fsdp.tensor({ 0 / 0, 1 }):to("cpu")) end)
    end, "copy_", RANGE)
    -- and what fits is written, truncated as PyTorch does
    x:fill_(2.5)
    x[3] = -7.9
    assert.same({ 2, 2, -7 }, x:tolist())
    x:copy_(fsdp.tensor({ 1.5, -1.5, 2 ^ 62 }))
    assert.same({ 1, -1, 2 ^ 62 }, x:tolist())
    assert.same({ 5, 7 }, fsdp.tensor({ 5.5, 7.2 }, "int64"):tolist())
    assert.same({ 4, 4 }, fsdp.full({ 2 }, 4.9, "int64"):tolist())
    assert.same({ 0, 3, 6 }, fsdp.arange(0, 9, 3, "int64"):tolist())
  end)

  it("refuses them on another device too, before its cast kernel runs (the test double of a GPU)", function()
    child_ok [[
      fsdp._testdev_install()
      local x = fsdp.tensor({ { 1, 2 }, { 1e30, 4 } }):to("cuda")
      local ok, err = pcall(function() return x:to("int64") end)
      assert(not ok and err:find("to: element 3 ", 1, true) and err:find("does not fit in int64", 1, true), err)
      local z = fsdp.zeros({ 2 }, { dtype = "int64", device = "cuda" })
      ok, err = pcall(function() z:copy_(x[2]) end)
      assert(not ok and err:find("copy_: element 1 ", 1, true), err)
      ok, err = pcall(function() z:fill_(0 / 0) end)
      assert(not ok and err:find("fill_: value nan", 1, true), err)
      local y = fsdp.tensor({ 2.5, -3.7 }):to("cuda"):long():to("cpu"):tolist()
      assert(y[1] == 2 and y[2] == -3, "truncation on the device")
    ]]
  end)

  local emu_lib = H.root .. "/libfsdp_cudaemu.so"
  local have_emu = io.open(emu_lib, "rb")
  if have_emu then have_emu:close() end
  local it_emu = have_emu and it or pending
  it_emu("refuses them on the CUDA executor, whose cast kernel gave -2^63 (make cudaemu)", function()
    child_ok([[
      assert(fsdp.cuda.is_available(), fsdp.cuda.why_not())
      local x = fsdp.tensor({ 1e30, -1e30, 0 / 0 }):to("cuda")
      local ok, err = pcall(function() return x:to("int64") end)
      assert(not ok and err:find("to: element 1 ", 1, true) and err:find("does not fit in int64", 1, true), err)
      local y = fsdp.tensor({ 2.5, -3.7, 2 ^ 40 }):to("cuda"):long():to("cpu"):tolist()
      assert(y[1] == 2 and y[2] == -3 and y[3] == 2 ^ 40, "truncation on the device")
    ]], ("FSDP_CUDA_EMU=1 FSDP_CUDA_EMU_LIB=%s OMP_NUM_THREADS=1"):format(emu_lib))
  end)
end)

describe("fsdp.set_rng_state (item 3)", function()
  after_each(function() fsdp.manual_seed(0) end)

  it("refuses the all-zero state, which xoshiro256** never leaves, and the generator goes on", function()
    fsdp.manual_seed(5)
    H.assert_error(function() fsdp.set_rng_state({ 0, 0, 0, 0 }) end, "set_rng_state", "all 0")
    H.assert_error(function() fsdp.set_rng_state({ 0ULL, 0LL, 0, 0ULL }) end, "set_rng_state", "all 0")
    local a, b = fsdp.randn(3):tolist(), fsdp.randn(3):tolist()
    assert.are_not.equal(a[1], b[1])
  end)

  it("refuses malformed states, naming the entry", function()
    local bad = {
      { { 1, 2, 3 }, "state[4] = nil" },
      { { 1, nil, 3, 4 }, "state[2] = nil" },
      { { 1, 2, 3, 4, 5 }, "key 5" },
      { { 1, 2, 3, 4, seed = 1 }, "key seed" },
      { { 1.5, 2, 3, 4 }, "state[1] = 1.5" },
      { { 1, -1, 3, 4 }, "state[2] = -1" },
      { { 1, 2, 2 ^ 60, 4 }, "state[3] = 1.1529215046068e+18" },
      { { 1, 2, 3, 0 / 0 }, "state[4] = " },
      { { 1, 2, 3, 1 / 0 }, "state[4] = inf" },
      { { "1", 2, 3, 4 }, "state[1] = a string" },
      { { 1, 2, -5LL, 4 }, "state[3] = -5LL" },
    }
    for _, case in ipairs(bad) do
      H.assert_error(function() fsdp.set_rng_state(case[1]) end, "set_rng_state: ", case[2])
    end
    H.assert_error(function() fsdp.set_rng_state(7) end, "set_rng_state", "state")
  end)

  it("still takes get_rng_state's words bit for bit, and small Lua integers", function()
    fsdp.manual_seed(123)
    local st = fsdp.get_rng_state()
    local u = fsdp.rand(4):tolist()
    fsdp.rand(7)
    fsdp.set_rng_state(st)
    assert.same(u, fsdp.rand(4):tolist())
    assert.same(st, (function() fsdp.set_rng_state(st); return fsdp.get_rng_state() end)())
    fsdp.set_rng_state({ 1, 2, 3, 2 ^ 53 })
    assert.same({ 1ULL, 2ULL, 3ULL, 9007199254740992ULL }, fsdp.get_rng_state())
    fsdp.set_rng_state({ 0xFFFFFFFFFFFFFFFFULL, 0, 0, 0 })
    local v = fsdp.randn(3):tolist()
    assert.are_not.equal(v[1], fsdp.randn(3):tolist()[1])
  end)
end)

describe("in-place writes: copy_ broadcasting and aliased destinations (item 4)", function()
  it("copy_ refuses a src of the same element count that does not broadcast, naming both shapes and the dim", function()
    local x = fsdp.zeros({ 2, 3 })
    H.assert_error(function() x:copy_(fsdp.ones({ 3, 2 })) end, "copy_", "(3, 2)", "(2, 3)", "dim 1 ")
    H.assert_error(function() x:copy_(fsdp.ones({ 6 })) end, "copy_", "(6)", "dim 2 ")
    H.assert_error(function() fsdp.zeros({ 6 }):copy_(fsdp.ones({ 2, 3 })) end, "copy_", "more dims")
    H.assert_error(function() fsdp.zeros({ 3 }):copy_(fsdp.ones({ 1, 3 })) end, "copy_", "more dims")
    H.assert_error(function() x[{ ":", { 1, 2 } }] = fsdp.ones({ 4 }) end, "copy_", "(4)", "(2, 2)")
    assert.equal(0, x:abs():sum():item())
    -- what broadcasts is still copied
    x:copy_(fsdp.tensor({ 1, 2, 3 }))
    assert.same({ 1, 2, 3, 1, 2, 3 }, x:tolist())
    x:copy_(fsdp.tensor({ { 5 }, { 6 } }))
    assert.same({ 5, 5, 5, 6, 6, 6 }, x:tolist())
    assert.same({ 1, 2, 3 }, fsdp.zeros({ 1, 3 }):copy_(fsdp.tensor({ 1, 2, 3 })):tolist())
    assert.same({ 1, 3, 2, 4 }, fsdp.zeros({ 2, 2 }):copy_(fsdp.tensor({ { 1, 2 }, { 3, 4 } }):t()):tolist())
  end)

  it("every in-place write into an expand()ed view is refused, and nothing is written", function()
    local base = fsdp.zeros({ 1, 3 })
    local e = base:expand({ 2, 3 })
    local ALIAS = "refers to a single memory location"
    H.assert_error(function() e:copy_(fsdp.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })) end, "copy_", ALIAS, "clone()")
    H.assert_error(function() e:copy_(fsdp.tensor({ 1, 2, 3 })) end, "copy_", ALIAS)
    H.assert_error(function() e:fill_(1) end, "fill_", ALIAS)
    H.assert_error(function() e:zero_() end, ALIAS)
    H.assert_error(function() e:add_(1) end, "add_")
    H.assert_error(function() e:add_(fsdp.ones({ 2, 3 })) end, "add_")
    H.assert_error(function() e:mul_(2) end, "mul_")
    H.assert_error(function() e:uniform_() end, "uniform_")
    H.assert_error(function() e:normal_() end, "normal_")
    H.assert_error(function() e[{ ":", 2 }] = 7 end, "fill_", ALIAS)
    H.assert_error(function() e[{ ":", 2 }] = fsdp.tensor({ 7, 8 }) end, "copy_", ALIAS)
    H.assert_error(function() fsdp.zeros({ 3 }):expand({ 4, 3 }):t():copy_(fsdp.ones({ 3, 4 })) end, "copy_", ALIAS)
    H.assert_error(function() fsdp.nn.init.constant_(fsdp.zeros({ 2, 1 }):expand({ 2, 5 }), 1) end, "fill_", ALIAS)
    H.assert_error(function()
      fsdp.meta(function() fsdp.zeros({ 1, 3 }):expand({ 2, 3 }):fill_(1) end)
    end, "fill_", ALIAS)
    assert.same({ 0, 0, 0 }, base:tolist())
    -- a view of it whose elements are distinct is written (into the shared row, as in PyTorch)
    e[2] = 4
    assert.same({ 4, 4, 4 }, base:tolist())
    e[{ 1, 2 }] = 9
    assert.same({ 4, 9, 4 }, base:tolist())
    fsdp.zeros({ 1, 3 }):expand({ 1, 3 }):fill_(1)  -- (expanded to its own shape: no alias)
  end)

  it("views whose elements are distinct memory are still written: narrow, transpose, permute, select", function()
    local x = fsdp.zeros({ 4, 5 })
    x:narrow(2, 2, 3):fill_(1)
    x:t():narrow(1, 5, 1):copy_(fsdp.full({ 1, 4 }, 2))
    x[{ { 1, 2 }, 1 }] = 3
    assert.equal(12 + 8 + 6, x:sum():item())
    local y = fsdp.zeros({ 2, 3, 4 })
    y:permute({ 3, 1, 2 }):narrow(1, 2, 2):fill_(1)
    y:select(2, 1):zero_()
    assert.equal(2 * 2 * 2, y:sum():item())
  end)
end)
