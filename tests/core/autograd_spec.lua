-- The autograd engine: accumulation, graph lifetime, grad mode, hooks, events, callbacks.
local fsdp = require "fsdp"
local H = require "helpers"

describe("autograd engine", function()
  it("computes gradients of a diamond graph and accumulates into .grad across backwards", function()
    local x = H.leaf({ 1, 2, 3 })
    local function f()
      local a = x * 2      -- da/dx = 2
      local b = x * x      -- db/dx = 2x
      return (a + b):sum() -- d/dx = 2 + 2x
    end
    f():backward()
    H.assert_close(x.grad, { 4, 6, 8 }, 0, 0, "first backward")
    f():backward()
    H.assert_close(x.grad, { 8, 12, 16 }, 0, 0, "accumulated")
    x.grad = nil
    assert.is_nil(x.grad)
  end)

  it("uses a leaf twice in one op and sums both contributions", function()
    local x = H.leaf({ 3 })
    local y = x * x
    y:sum():backward()
    H.assert_close(x.grad, { 6 }, 0, 0)
  end)

  it("propagates an explicit gradient for non-scalar outputs and rejects implicit ones", function()
    local x = H.leaf({ 1, 2 })
    local y = x * 3
    H.assert_error(function() y:backward() end, "backward", "(2)")
    y:backward(fsdp.tensor({ 1, 10 }))
    H.assert_close(x.grad, { 3, 30 }, 0, 0)
    H.assert_error(function() (x * 2):backward(fsdp.tensor({ 1, 2, 3 })) end, "backward", "(3)", "(2)")
  end)

  it("frees the graph after backward unless retain_graph is set", function()
    local x = H.leaf({ 1, 2 })
    local y = (x * x):sum()
    y:backward({ retain_graph = true })
    y:backward()
    H.assert_close(x.grad, { 4, 8 }, 0, 0, "two backwards through a retained graph")
    H.assert_error(function() y:backward() end, "second time")
    -- the process keeps working
    local z = (x * 2):sum()
    x.grad = nil
    z:backward()
    H.assert_close(x.grad, { 2, 2 }, 0, 0)
  end)

  it("errors for backward of a tensor that does not require grad", function()
    local x = fsdp.tensor({ 1, 2 })
    H.assert_error(function() (x * 2):sum():backward() end, "does not require grad")
  end)

  it("records nothing under no_grad and restores the mode even after an error", function()
    local x = H.leaf({ 1, 2 })
    local y = fsdp.no_grad(function() return x * 2 end)
    assert.is_false(y.requires_grad)
    assert.is_true(fsdp.is_grad_enabled())
    assert.has_error(function() fsdp.no_grad(function() error("boom") end) end)
    assert.is_true(fsdp.is_grad_enabled())
    assert.is_true((x * 2).requires_grad)
  end)

  it("only lets leaves change requires_grad and only float tensors require grad", function()
    local x = H.leaf({ 1, 2 })
    local y = x * 2
    H.assert_error(function() y.requires_grad = false end, "leaf")
    local i = fsdp.tensor({ 1, 2 }, "int64")
    H.assert_error(function() i.requires_grad = true end, "floating point", "int64")
    assert.is_false(i.requires_grad)
  end)

  it("detects in-place modification of a saved tensor", function()
    local x = H.leaf({ 1, 2 })
    local a = x * 1
    local w = fsdp.tensor({ 5, 6 })
    local y = (a * w):sum()  -- saves w for da
    w:add_(fsdp.tensor({ 1, 1 }))
    H.assert_error(function() y:backward() end, "in-place", "(2)")
    -- refusing in-place writes on leaves that require grad outside no_grad
    H.assert_error(function() x:zero_() end, "in-place", "fsdp.no_grad")
    fsdp.no_grad(function() x:zero_() end)
    H.assert_close(x, { 0, 0 }, 0, 0)
  end)

  it("runs tensor hooks on leaves and non-leaves; a hook may replace the gradient", function()
    local x = H.leaf({ 1, 2 })
    local seen = {}
    local h1 = x:register_hook(function(g) seen[#seen + 1] = g:totable(); return g * 10 end)
    local y = x * 3
    y:register_hook(function(g) seen[#seen + 1] = g:totable() end)
    y:sum():backward()
    assert.same({ { 1, 1 }, { 3, 3 } }, seen)
    H.assert_close(x.grad, { 30, 30 }, 0, 0)
    h1:remove()
    x.grad = nil
    ;(x * 3):sum():backward()
    H.assert_close(x.grad, { 3, 3 }, 0, 0)
    -- an error in a hook is a Lua error and backward leaves the engine usable
    local z = H.leaf({ 1 })
    z:register_hook(function() error("hook failed on purpose") end)
    H.assert_error(function() (z * 2):sum():backward() end, "hook failed on purpose")
    local w = H.leaf({ 2 })
    ;(w * w):sum():backward()
    H.assert_close(w.grad, { 4 }, 0, 0)
  end)

  it("emits engine events in order and runs queued callbacks after the last node", function()
    local a, b = H.leaf({ 1 }), H.leaf({ 2 })
    local log = {}
    local l = fsdp.autograd.add_listener({ "backward_begin", "node_pre", "grad_ready", "backward_end" },
      function(ev, node, t)
        if ev == "backward_begin" then
          fsdp.autograd.queue_callback(function() log[#log + 1] = "callback" end)
        end
        if ev == "grad_ready" then ev = ev .. ":" .. t:item() end
        log[#log + 1] = ev
      end)
    local y = (a * b + a):sum()
    y:backward()
    l:remove()
    assert.equal("backward_begin", log[1])
    assert.equal("backward_end", log[#log])
    assert.equal("callback", log[#log - 1])
    -- each leaf is reported once, after all its contributions (a gets b + 1 = 3, b gets a = 1)
    local ready = {}
    for _, e in ipairs(log) do if e:find("^grad_ready") then ready[#ready + 1] = e end end
    table.sort(ready)
    assert.same({ "grad_ready:1", "grad_ready:2" }, ready)
    H.assert_close(a.grad, { 3 }, 0, 0)
    -- queue_callback outside backward is an error
    H.assert_error(function() fsdp.autograd.queue_callback(function() end) end, "queue_callback")
  end)

  it("runs later nodes first (reverse creation order)", function()
    local x = H.leaf({ 1 })
    local order = {}
    local l = fsdp.autograd.add_listener("node_pre", function(_, node) order[#order + 1] = node end)
    local y = ((x * 2) + 1):sum()
    y:backward()
    l:remove()
    assert.equal(3, #order)
    assert.truthy(order[1]:find("Sum"))
    assert.truthy(order[3]:find("Mul"))
  end)

  it("counts gradient memory exactly", function()
    collectgarbage(); collectgarbage()
    local before = fsdp.memory_stats().grads.current
    local x = H.randn_leaf({ 100, 7 })
    ;(x * 2):sum():backward()
    assert.equal(before + 100 * 7 * 4, fsdp.memory_stats().grads.current)
    x.grad = nil
    collectgarbage(); collectgarbage()
    assert.equal(before, fsdp.memory_stats().grads.current)
  end)
end)
