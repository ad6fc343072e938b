-- Files that are not regular files (a FIFO with no writer) are refused at once with a clear
-- message by every reader of the library: fsdp.load, data-set files and a checkpoint's `latest`. Each read runs in
-- a child process under a timeout, so a hang fails the test instead of blocking it.
local H = require "helpers"

local dir = H.mkdtemp("fsdp_fifo")
local env = "LUA_PATH='" .. H.root .. "/lua/?.lua;" .. H.root .. "/lua/?/init.lua;;' LUA_CPATH='" .. H.root .. "/?.so;;'"
local luajit = "luajit " .. H.scripts .. "load_fifo.lua"

local function run(mode, path)
  local t0 = tonumber(io.popen("date +%s.%N"):read("*l"))
  local rc, out = H.sh(("%s %s '%s'"):format(luajit, mode, path), env, 3)
  local dt = tonumber(io.popen("date +%s.%N"):read("*l")) - t0
  return rc, out, dt
end

describe("reading a FIFO with no writer", function()
  teardown(function() os.execute("rm -rf '" .. dir .. "'") end)

  it("fsdp.load refuses it within a second", function()
    local fifo = dir .. "/model.safetensors"
    assert.equal(0, os.execute("mkfifo '" .. fifo .. "'"))
    local rc, out, dt = run("load", fifo)
    assert.equal(1, rc, out)  -- 124: timeout killed a blocked open()
    assert.truthy(out:find("'" .. fifo .. "' is not a regular file (a FIFO)", 1, true), out)
    assert.truthy(dt < 1, ("took %.2f s"):format(dt))
  end)

  it("data-set files (fsdp.data.idx) refuse it within a second", function()
    local fifo = dir .. "/train-images-idx3-ubyte.gz"
    assert.equal(0, os.execute("mkfifo '" .. fifo .. "'"))
    local rc, out, dt = run("idx", fifo)
    assert.equal(1, rc, out)
    assert.truthy(out:find(fifo .. " is a FIFO, not a data file", 1, true), out)
    assert.truthy(dt < 1, ("took %.2f s"):format(dt))
  end)

  it("checkpoint reads refuse a FIFO `latest` within a second", function()
    local ck = dir .. "/ckpt"
    os.execute("mkdir -p '" .. ck .. "'")
    assert.equal(0, os.execute("mkfifo '" .. ck .. "/latest'"))
    local rc, out, dt = run("checkpoint", ck)
    assert.equal(1, rc, out)
    assert.truthy(out:find("'" .. ck .. "/latest' is not a regular file (a FIFO)", 1, true), out)
    assert.truthy(dt < 1, ("took %.2f s"):format(dt))
  end)
end)
