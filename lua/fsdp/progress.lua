--- fsdp.progress: a progress line for loops (tqdm's idea). Rank 0 alone prints.
--
--   local bar = fsdp.progress(#loader, {desc = "epoch 1", unit = "batch"})
--   for xb, yb in loader() do ...; bar:update(1, {loss = l}) end
--   bar:close()                       -- or bar:close("epoch 1  loss 0.31  acc 0.90"): the final line
--   for xb, yb in fsdp.progress.wrap(loader, {desc = "eval"}) do ... end   -- counts and closes itself
--
-- On a terminal: one live line redrawn in place ("\r", at most every 0.25 s) with a bar, the count,
-- the rate, the postfix and the ETA; bin/fsdprun keeps such lines live (it passes its stdout's
-- terminal-ness in FSDP_STDOUT_TTY). Not on a terminal (logs, pipes): a plain line at every 10%.
-- Options: desc, unit ("it"), tty (force true/false), file (anything with :write and :flush;
-- io.stdout), clock (seconds; for tests), mininterval (0.25), every (0.1, the fraction between
-- plain lines), disable (true: print nothing).
-- @module fsdp.progress
local ffi = require "ffi"
local fsdp = require "fsdp"

pcall(ffi.cdef, "int isatty(int);")
local monotonic = fsdp.perf_counter

local M = {}
M.clock = monotonic  -- seconds, monotonic

--- stdout is a terminal: FSDP_STDOUT_TTY (set by bin/fsdprun for its ranks) or isatty(1)
function M.isatty()
  local env = os.getenv("FSDP_STDOUT_TTY")
  if env and env ~= "" then return env == "1" end
  return ffi.C.isatty(1) == 1
end

--- seconds as m:ss or h:mm:ss
function M.hms(s)
  s = math.max(0, math.floor(s + 0.5))
  if s >= 3600 then return ("%d:%02d:%02d"):format(s / 3600, s / 60 % 60, s % 60) end
  return ("%d:%02d"):format(s / 60, s % 60)
end

local function fmt_value(v)
  if type(v) == "number" then
    if v == math.floor(v) and math.abs(v) < 1e15 then return ("%d"):format(v) end
    if math.abs(v) >= 1e-3 and math.abs(v) < 1e6 then return ("%.4f"):format(v) end
    return ("%.3e"):format(v)
  end
  return tostring(v)
end

-- {loss = 0.5, lr = 1e-4} -> "loss 0.5000  lr 1.000e-04" (keys sorted); a string stays as it is
local function fmt_postfix(p)
  if p == nil then return nil end
  if type(p) == "string" then return p end
  local keys = {}
  for k in pairs(p) do keys[#keys + 1] = tostring(k) end
  table.sort(keys)
  local parts = {}
  for i, k in ipairs(keys) do parts[i] = k .. " " .. fmt_value(p[k]) end
  return table.concat(parts, "  ")
end

local Bar = {}
Bar.__index = Bar

local known = { desc = true, unit = true, tty = true, file = true, clock = true, mininterval = true, every = true,
  disable = true }

--- A new progress bar of total steps (nil: unknown).
-- @function new
-- @param total the number of steps, or nil
-- @param opts options table or nil
-- @return a bar
local function new(total, opts)
  if total ~= nil and (type(total) ~= "number" or total < 0 or total ~= total) then
    error(("fsdp.progress: total must be a number >= 0 or nil, got %s"):format(tostring(total)), 3)
  end
  opts = opts or {}
  if type(opts) ~= "table" then error(("fsdp.progress: options must be a table, got a %s"):format(type(opts)), 3) end
  for k in pairs(opts) do
    if not known[k] then error(("fsdp.progress: unknown option %s"):format(tostring(k)), 3) end
  end
  local rank = (package.loaded["fsdp.comm"] and fsdp.comm.is_initialized()) and fsdp.rank() or 0
  local self = setmetatable({
    total = total, desc = opts.desc, unit = opts.unit or "it", n = 0,
    clock = opts.clock or monotonic, file = opts.file or io.stdout,
    mininterval = opts.mininterval or 0.25, every = opts.every or 0.1,
    silent = opts.disable == true or rank ~= 0, closed = false,
  }, Bar)
  if opts.tty == nil then self.tty = not self.silent and M.isatty() else self.tty = opts.tty and true or false end
  self.start = self.clock()
  self.last_draw = -math.huge
  self.next_plain = self.every
  return self
end

--- the text of the line now: "desc [=====   ]  42%  42/100 it  12.3 it/s  loss 0.5  ETA 0:05"
function Bar:line()
  local el = self.clock() - self.start
  local parts = {}
  if self.desc then parts[#parts + 1] = self.desc end
  local rate = el > 0 and self.n / el or 0
  local rate_s = ("%." .. (rate >= 100 and 0 or rate >= 10 and 1 or 2) .. "f"):format(rate)
  if self.total and self.total > 0 then
    local frac = math.min(1, self.n / self.total)
    parts[#parts + 1] = ("[%-24s] %3d%%"):format(("="):rep(math.floor(24 * frac)), math.floor(100 * frac))
    parts[#parts + 1] = ("%s/%s %s"):format(fmt_value(self.n), fmt_value(self.total), self.unit)
  else
    parts[#parts + 1] = ("%s %s"):format(fmt_value(self.n), self.unit)
  end
  parts[#parts + 1] = ("%s %s/s"):format(rate_s, self.unit)
  if self.postfix then parts[#parts + 1] = self.postfix end
  if self.total and self.total > 0 then
    local eta = self.n > 0 and el / self.n * math.max(0, self.total - self.n) or nil
    parts[#parts + 1] = "ETA " .. (eta and M.hms(eta) or "?")
  end
  return table.concat(parts, "  ")
end

function Bar:_write(s)
  self.file:write(s)
  self.file:flush()
end

--- bar:update([n = 1][, postfix]): n more done; postfix a table ({loss = 0.5}) or a string
function Bar:update(n, postfix)
  if type(n) == "table" or type(n) == "string" then n, postfix = 1, n end
  n = n or 1
  if type(n) ~= "number" then error(("progress:update: n must be a number, got a %s"):format(type(n)), 2) end
  self.n = self.n + n
  if postfix ~= nil then self.postfix = fmt_postfix(postfix) end
  if self.silent or self.closed then return end
  local done = self.total ~= nil and self.n >= self.total
  if self.tty then
    local t = self.clock()
    if t - self.last_draw >= self.mininterval or done then
      self:_write("\r" .. self:line() .. "\27[K")
      self.last_draw = t
    end
  elseif self.total and self.total > 0 then
    local frac = self.n / self.total
    if frac >= self.next_plain and not done then
      self:_write(self:line() .. "\n")
      while self.next_plain <= frac do self.next_plain = self.next_plain + self.every end
    end
  end
end

--- Sets the text after the bar.
-- @param postfix a string or a table {name = number} (keys sorted)
function Bar:set_postfix(postfix) self.postfix = fmt_postfix(postfix) end
--- Sets the text before the bar.
-- @param desc a string
function Bar:set_description(desc) self.desc = desc end

--- bar:close([final]): ends the line; `final` (a string) replaces it, else the line as it stands
function Bar:close(final)
  if self.closed then return end
  self.closed = true
  if self.silent then return end
  local text = final or self:line()
  if self.tty then self:_write("\r" .. text .. "\27[K\n") else self:_write(text .. "\n") end
end

--- bar:wrap(iterable): the iterable's values, one update per step, closed at the end; iterable
-- is a DataLoader (or anything callable that returns an iterator), an iterator function or a list
function Bar:wrap(iterable)
  local it
  if type(iterable) == "function" then it = iterable
  elseif type(iterable) == "table" and getmetatable(iterable) == nil then
    local i = 0
    it = function() i = i + 1 return iterable[i] end
  else
    it = iterable()
  end
  return function()
    local r = { it() }
    if r[1] == nil then self:close() return nil end
    self:update(1)
    return unpack(r, 1, table.maxn(r))
  end
end

local function length(x)
  if type(x) == "table" and getmetatable(x) == nil then return #x end
  if type(x) == "userdata" or (type(x) == "table" and type(x.len) == "function") then
    local ok, n = pcall(function() return x:len() end)
    if ok then return n end
  end
  return nil
end

--- fsdp.progress.wrap(iterable, opts): a bar whose total is the iterable's length, wrapped around it
function M.wrap(iterable, opts) return new(length(iterable), opts):wrap(iterable) end
M.new = new

return setmetatable(M, { __call = function(_, total, opts) return new(total, opts) end })
