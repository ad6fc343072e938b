-- Bad input must give a clear error, never a crash, a wrong result or a silent fallback
-- (issue 13, items 2, 6 and 9). Probes that crashed before run in a child process, so a crash
-- fails the test instead of killing busted.
local fsdp = require "fsdp"
local H = require "helpers"
local nn, F, optim = fsdp.nn, fsdp.F, fsdp.optim

-- runs `code` (Lua, with fsdp loaded) in a child luajit; returns exit status and output
local function child(code)
  local path = os.tmpname() .. ".lua"
  local f = assert(io.open(path, "w"))
  f:write(("package.path = %q .. package.path\n"):format(H.root .. "/lua/?.lua;" .. H.root .. "/lua/?/init.lua;"))
  f:write(("package.cpath = %q .. package.cpath\n"):format(H.root .. "/?.so;"))
  f:write("local fsdp = require 'fsdp'\n", code, "\n")
  f:close()
  local rc, out = H.sh("luajit " .. path, nil, 60)
  os.remove(path)
  return rc, out
end

-- `expr` (a Lua expression) must raise an error mentioning each fragment, in a child process
local function child_error(expr, ...)
  local rc, out = child(("local ok, err = pcall(function() return %s end)\n"
    .. "print(ok and 'NO ERROR' or 'ERROR: ' .. tostring(err))"):format(expr))
  assert.equal(0, rc, ("%s: the child process died (exit %s):\n%s"):format(expr, tostring(rc), out))
  assert.truthy(out:find("ERROR: ", 1, true) and not out:find("NO ERROR", 1, true),
    ("%s: expected an error, got:\n%s"):format(expr, out))
  for _, frag in ipairs({ ... }) do
    assert.truthy(out:find(frag, 1, true), ("%s: error does not mention %q:\n%s"):format(expr, frag, out))
  end
end

describe("shape arithmetic that overflows int64", function()
  it("zeros with 2^64 elements is refused, naming the shape", function()
    child_error("fsdp.zeros{2^32, 2^32}", "shape (4294967296, 4294967296)", "too large")
  end)
  it("zeros whose byte count overflows is refused", function()
    child_error("fsdp.zeros{2^61, 4}", "too large")
    child_error("fsdp.zeros{2^62}", "too large")
  end)
  it("zeros{1e30} reports a too-large size, not a negative one", function()
    local err = H.assert_error(function() fsdp.zeros { 1e30 } end, "too large", "position 1")
    assert.falsy(err:find("negative", 1, true), err)
    H.assert_error(function() fsdp.zeros { 2, -1 } end, "negative")
    H.assert_error(function() fsdp.zeros { 0 / 0 } end, "integer")
    H.assert_error(function() fsdp.zeros { 1 / 0 } end, "too large")
  end)
  it("view and reshape of an empty tensor to an overflowing shape are refused", function()
    child_error("fsdp.zeros{0}:view{2^32, 2^32}", "view", "too large")
    child_error("fsdp.zeros{0}:reshape{2^32, 2^32}", "reshape", "too large")
  end)
  it("expand to an overflowing shape is refused", function()
    child_error("fsdp.ones{1, 1}:expand{2^32, 2^32}:sum():item()", "expand", "too large")
    child_error("fsdp.ones{1}:expand{2^62}:sum():item()", "expand", "too large")
  end)
  it("narrow whose start + length overflows is refused", function()
    child_error("fsdp.zeros{4}:narrow(1, 2, 2^62 * 2 - 1):sum():item()", "narrow", "out of bounds")
    child_error("fsdp.zeros{4}:narrow(1, 2^62, 2^62):sum():item()", "narrow", "out of bounds")
  end)
  it("shapes at the limit still work", function()
    assert.same({ 0, 2 ^ 40 }, fsdp.zeros { 0, 2 ^ 40 }:shape())
    assert.equal(0, fsdp.zeros { 0 }:view { 0, 2 ^ 40 }:numel())
    assert.equal(6, fsdp.ones { 1, 3 }:expand { 2, 3 }:sum():item())
  end)
end)

describe("in-place ops whose source overlaps the destination", function()
  it("copy_ of a tensor's own transpose", function()
    local a = fsdp.tensor { { 1, 2 }, { 3, 4 } }
    a:copy_(a:t())
    assert.same({ 1, 3, 2, 4 }, a:tolist())
  end)
  it("copy_ of a shifted view of itself, both directions", function()
    local x = fsdp.arange(1, 6, "float32")
    x:narrow(1, 2, 4):copy_(x:narrow(1, 1, 4))
    assert.same({ 1, 1, 2, 3, 4 }, x:tolist())
    local y = fsdp.arange(1, 6, "float32")
    y:narrow(1, 1, 4):copy_(y:narrow(1, 2, 4))
    assert.same({ 2, 3, 4, 5, 5 }, y:tolist())
  end)
  it("add_ of a shifted view of itself, both directions", function()
    local x = fsdp.arange(1, 6, "float32")
    x:narrow(1, 2, 4):add_(x:narrow(1, 1, 4))
    assert.same({ 1, 3, 5, 7, 9 }, x:tolist())
    local y = fsdp.arange(1, 6, "float32")
    y:narrow(1, 1, 4):add_(y:narrow(1, 2, 4))
    assert.same({ 3, 5, 7, 9, 5 }, y:tolist())
  end)
  it("add_ of a tensor's own transpose", function()
    local a = fsdp.tensor { { 1, 2 }, { 3, 4 } }
    a:add_(a:t())
    assert.same({ 2, 5, 5, 8 }, a:tolist())
  end)
  it("add_ and copy_ of the tensor itself and of disjoint views", function()
    local a = fsdp.tensor { 1, 2, 3 }
    a:add_(a)
    assert.same({ 2, 4, 6 }, a:tolist())
    local x = fsdp.arange(1, 5, "float32")
    x:narrow(1, 3, 2):copy_(x:narrow(1, 1, 2))
    assert.same({ 1, 2, 1, 2 }, x:tolist())
  end)
end)
