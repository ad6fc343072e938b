-- One model's training step, ours only, for profiling and A/B runs (no PyTorch):
--   luajit bench/step.lua MODEL [ITERS] [WARMUP]      (threads from OMP_NUM_THREADS, default 2)
-- Prints the min and median wall ms per step and the process CPU ms per step. On a shared machine
-- the min over many steps is the closest to the unloaded time; CPU ms shows the work itself.
local root = (arg and arg[0] or ""):match("^(.*)/bench/[^/]*$") or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. root .. "/bench/?.lua;" .. package.path
package.cpath = root .. "/?.so;" .. package.cpath
local ffi = require "ffi"
local fsdp = require "fsdp"
local models = require "models"

local name, iters, warmup = arg[1] or "mlp", tonumber(arg[2] or "20"), tonumber(arg[3] or "3")
fsdp.set_num_threads(tonumber(os.getenv("OMP_NUM_THREADS") or "") or 2)
local U = require "util"
local clock_ms = U.now_ms

local model, opt, loss_fn = models.case(name)
local function step()
  opt:zero_grad()
  local loss = loss_fn()
  loss:backward()
  opt:step()
  return loss
end
for _ = 1, warmup do step() end
collectgarbage("collect")
local wall, cpu = {}, {}
for k = 1, iters do
  local w0, c0 = clock_ms(1), clock_ms(2) -- CLOCK_MONOTONIC, CLOCK_PROCESS_CPUTIME_ID
  step()
  wall[k], cpu[k] = clock_ms(1) - w0, clock_ms(2) - c0
end
table.sort(wall); table.sort(cpu)
local function med(t) local n = #t; return n % 2 == 1 and t[(n + 1) / 2] or (t[n / 2] + t[n / 2 + 1]) / 2 end
print(("%-12s wall min %8.2f med %8.2f   cpu min %8.2f med %8.2f  (ms/step, %d steps)"):format(
  name, wall[1], med(wall), cpu[1], med(cpu), iters))
