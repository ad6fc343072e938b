-- fsdp.progress: plain lines when stdout is not a terminal, a live line redrawn with "\r" on one
-- (forced with {tty = true}, or FSDP_STDOUT_TTY=1 as bin/fsdprun passes it), a fake clock for the
-- exact text, wrap() around a DataLoader. Rank 0 alone printing: tests/nn/dataloader_spec.lua's 2-rank run.
local fsdp = require "fsdp"
local H = require "helpers"

-- a file that keeps what is written, and a clock the test moves
local function sink()
  local f = { buf = {} }
  function f:write(s) self.buf[#self.buf + 1] = s end
  function f:flush() end
  function f:text() return table.concat(self.buf) end
  return f
end
local function fake_clock()
  local c = { t = 100 }
  return c, function() return c.t end
end

describe("fsdp.progress", function()
  it("renders the bar, count, rate, postfix and ETA", function()
    local f = sink()
    local c, clock = fake_clock()
    local bar = fsdp.progress(100, { desc = "epoch 1", unit = "img", file = f, clock = clock, tty = false })
    c.t = 105
    bar.n = 50
    bar:set_postfix({ loss = 0.5, lr = 1e-4, step = 7 })
    assert.are.equal("epoch 1  [============            ]  50%  50/100 img  10.0 img/s  loss 0.5000  lr 1.000e-04  step 7  ETA 0:05",
      bar:line())
    -- no total: count and rate only
    local open = fsdp.progress(nil, { file = f, clock = clock, tty = false })
    c.t = 107
    open:update(14)
    assert.are.equal("14 it  7.00 it/s", open:line())  -- 14 in 2 s
    assert.are.equal("1:01:01", require("fsdp.progress").hms(3661))
  end)

  it("prints a plain line at every 10% when not on a terminal, and the final line at close", function()
    local f = sink()
    local c, clock = fake_clock()
    local bar = fsdp.progress(20, { desc = "d", file = f, clock = clock, tty = false })
    for _ = 1, 20 do
      c.t = c.t + 1
      bar:update(1, { loss = 1 })
    end
    local out = f:text()
    assert.is_nil(out:find("\r", 1, true), "no carriage return")
    local lines = {}
    for l in out:gmatch("([^\n]*)\n") do lines[#lines + 1] = l end
    assert.are.equal(9, #lines, out)  -- 10% ... 90%; 100% is the closing line
    assert.is_truthy(lines[1]:find("^d  %[==  +%]  10%%  2/20 it"), lines[1])
    assert.is_truthy(lines[9]:find(" 90%%  18/20 it"), lines[9])
    bar:close("d done")
    assert.are.equal("d done\n", f.buf[#f.buf])
    bar:close("again")
    assert.are.equal("d done\n", f.buf[#f.buf], "close twice writes once")
  end)

  it("redraws one live line on a terminal, at most every mininterval, and ends it at close", function()
    local f = sink()
    local c, clock = fake_clock()
    local bar = fsdp.progress(10, { desc = "t", file = f, clock = clock, tty = true })
    for i = 1, 10 do
      c.t = c.t + 0.1  -- four updates fit in 0.25 s: a draw every third update
      bar:update(1)
      if i == 1 then assert.are.equal(1, #f.buf, "the first update draws") end
    end
    local out = f:text()
    assert.is_nil(out:find("\n", 1, true), "one line, redrawn")
    local draws = select(2, out:gsub("\r", ""))
    assert.is_true(draws >= 3 and draws <= 5, draws .. " draws: " .. out)
    assert.is_truthy(out:find("\rt  %[========================%] 100%%  10/10 it  10.0 it/s  ETA 0:00\27%[K$"), out)
    bar:close()
    assert.is_truthy(f:text():find("\27%[K\n$"))
    local g = sink()
    local b2 = fsdp.progress(10, { file = g, clock = clock, tty = true })
    b2:update(3)
    b2:close("final words")
    assert.are.equal("\rfinal words\27[K\n", g.buf[#g.buf])
  end)

  it("disable = true prints nothing", function()
    local f = sink()
    local bar = fsdp.progress(5, { file = f, tty = false, disable = true })
    for _ = 1, 5 do bar:update() end
    bar:close("x")
    assert.are.equal("", f:text())
  end)

  it("wrap() counts a DataLoader's batches and closes itself", function()
    local f = sink()
    local ds = fsdp.data.TensorDataset(fsdp.arange(10))
    local loader = fsdp.data.DataLoader(ds, { batch_size = 3 })
    local seen = {}
    for b in fsdp.progress.wrap(loader, { desc = "w", file = f, tty = false }) do seen[#seen + 1] = b:numel() end
    assert.are.same({ 3, 3, 3, 1 }, seen)
    local last = f.buf[#f.buf]
    assert.is_truthy(last:find("^w  %[=+%] 100%%  4/4 it"), last)
    -- a list works too
    local g = sink()
    local n = 0
    for v in fsdp.progress.wrap({ 5, 6 }, { file = g, tty = false }) do n = n + v end
    assert.are.equal(11, n)
  end)

  it("follows FSDP_STDOUT_TTY (what bin/fsdprun passes) when tty is not given", function()
    local code = "local b = fsdp.progress(2, {desc = 'env'}) b:update(1) b:update(1) b:close()"
    local rc, out = H.lua(code, "FSDP_STDOUT_TTY=1")
    assert.are.equal(0, rc, out)
    assert.is_truthy(out:find("\renv  [", 1, true), out)
    rc, out = H.lua(code, "FSDP_STDOUT_TTY=0")
    assert.are.equal(0, rc, out)
    assert.is_nil(out:find("\r", 1, true), out)
    assert.is_truthy(out:find("env  [========================] 100%", 1, true), out)
  end)

  it("rejects bad arguments", function()
    H.assert_error(function() fsdp.progress(-1) end, "fsdp.progress", "total")
    H.assert_error(function() fsdp.progress(5, { dsc = "x" }) end, "fsdp.progress", "unknown option dsc")
    H.assert_error(function() fsdp.progress(5, { tty = false, file = sink() }):update(true) end, "update", "number")
  end)
end)
