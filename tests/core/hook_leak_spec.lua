-- t:register_hook(fn): the Lua function lives as long as the hook's tensor (or until remove()),
-- not for the rest of the process. Each hook here captures 1 MiB; 100 of them left behind would
-- keep 100 MiB alive after a full collection.
local fsdp = require "fsdp"

local MiB = 1024 * 1024

local function full_gc()
  collectgarbage()
  collectgarbage()
end

-- a distinct 1 MiB string (string.rep of one byte would be interned once per byte value)
local function big_string(i) return ("%08d"):format(i) .. string.rep("x", MiB - 8) end

describe("tensor hooks", function()
  it("die with their leaf tensor (100 hooks capturing 1 MiB strings)", function()
    full_gc()
    local before = collectgarbage("count")
    for i = 1, 100 do
      local t = fsdp.randn(2):requires_grad_()
      local big = big_string(i)
      t:register_hook(function() local _ = #big end)
    end
    full_gc()
    local grown = (collectgarbage("count") - before) / 1024
    assert.is_true(grown < 8, ("%.1f MiB still alive after dropping 100 hooked tensors"):format(grown))
  end)

  it("die with their graph for non-leaf tensors (hooks capturing 1 MiB tables)", function()
    full_gc()
    local before = collectgarbage("count")
    for _ = 1, 100 do
      local x = fsdp.randn(2):requires_grad_()
      local h = x * 2
      local big = {}
      for j = 1, MiB / 8 do big[j] = j end  -- 128 Ki numbers: 1 MiB of array
      h:register_hook(function() local _ = #big end)
      local loss = h:sum()
      local _ = loss
    end
    full_gc()
    local grown = (collectgarbage("count") - before) / 1024
    assert.is_true(grown < 8, ("%.1f MiB still alive after dropping 100 hooked graphs"):format(grown))
  end)

  it("still fire while their tensor lives, even when no handle to it is left", function()
    local x = fsdp.randn(3):requires_grad_()
    local fired = {}
    x:register_hook(function(g) fired[#fired + 1] = "leaf " .. g:numel() end)
    local h = x * 2
    h:register_hook(function(g) fired[#fired + 1] = "mid " .. g:numel() end)
    local loss = h:sum()
    h = nil  -- the graph still holds h's node, and with it the hook
    full_gc()
    loss:backward()
    assert.same({ "mid 3", "leaf 3" }, fired)
  end)

  it("stop firing after remove(), which may be called after the tensor is gone", function()
    local x = fsdp.randn(3):requires_grad_()
    local n = 0
    local handle = x:register_hook(function() n = n + 1 end)
    ;(x * 2):sum():backward()
    assert.equal(1, n)
    handle:remove()
    ;(x * 2):sum():backward()
    assert.equal(1, n)
    local y = fsdp.randn(3):requires_grad_()
    local h2 = y:register_hook(function() n = n + 1 end)
    y = nil
    full_gc()
    h2:remove()  -- harmless
    handle:remove()
  end)
end)
