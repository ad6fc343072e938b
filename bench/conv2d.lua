-- Conv net block forward + backward: fsdp vs PyTorch (torch.nn.functional.conv2d), same thread count.
--   OPENBLAS_NUM_THREADS=2 OMP_NUM_THREADS=2 luajit bench/conv2d.lua [batch] [rounds]
-- The block is the benchmark model's feature extractor:
--   Conv(1->32, 3x3, pad 1) - ReLU - Conv(32->64, 3x3, pad 1) - ReLU on (batch, 1, 28, 28)
-- Rounds alternate between fsdp and a PyTorch child process so machine noise hits both alike;
-- each side reports the best of its per-round medians. PyTorch is skipped if not importable.
-- On a busy machine, compare single-threaded compute instead of wall time:
--   FSDP_BENCH_CLOCK=cpu OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 luajit bench/conv2d.lua
-- The second convolution goes through Winograd F(2x2, 3x3); FSDP_CONV_ALGO=im2col gives the im2col path
-- for a before/after comparison (FSDP_CONV_ALGO=winograd would force it on the 1-channel layer too).
package.path = "lua/?.lua;lua/?/init.lua;bench/?.lua;" .. package.path
local ffi = require "ffi"
local fsdp = require "fsdp"
local F = fsdp.nn.functional

local U = require "util"
local cpu_clock = os.getenv("FSDP_BENCH_CLOCK") == "cpu"
local function now() return U.seconds(cpu_clock and U.THREAD_CPU or U.MONOTONIC) end
local median = U.median

local N, rounds, runs = tonumber(arg[1]) or 64, tonumber(arg[2]) or 3, 11
local threads = tonumber(os.getenv("OMP_NUM_THREADS") or "") or 2

fsdp.manual_seed(0)
local x = fsdp.randn(N, 1, 28, 28)
local w1, b1 = fsdp.randn(32, 1, 3, 3) * 0.3, fsdp.randn(32) * 0.1
local w2, b2 = fsdp.randn(64, 32, 3, 3) * 0.06, fsdp.randn(64) * 0.1
local params = { w1, b1, w2, b2 }
for i, p in ipairs(params) do params[i] = p:contiguous(); params[i].requires_grad = true end
w1, b1, w2, b2 = unpack(params)

local function step()
  local h = F.conv2d(x, w1, b1, { padding = 1 }):relu()
  local y = F.conv2d(h, w2, b2, { padding = 1 }):relu()
  y:sum():backward()
  for _, p in ipairs(params) do p.grad = nil end
end

local function ours()
  for _ = 1, 2 do step() end
  local t = {}
  for i = 1, runs do
    local t0 = now(); step(); t[i] = now() - t0
  end
  collectgarbage()
  return median(t)
end

local torch_script = ([[
import time, torch
import torch.nn.functional as F
torch.set_num_threads(%d)
torch.manual_seed(0)
x = torch.randn(%d, 1, 28, 28)
w1 = (torch.randn(32, 1, 3, 3) * 0.3).requires_grad_(); b1 = (torch.randn(32) * 0.1).requires_grad_()
w2 = (torch.randn(64, 32, 3, 3) * 0.06).requires_grad_(); b2 = (torch.randn(64) * 0.1).requires_grad_()
ps = [w1, b1, w2, b2]
def step():
    h = F.relu(F.conv2d(x, w1, b1, padding=1))
    y = F.relu(F.conv2d(h, w2, b2, padding=1))
    y.sum().backward()
    for p in ps: p.grad = None
clock = time.thread_time if %s else time.perf_counter
for _ in range(2): step()
ts = []
for _ in range(%d):
    t = clock(); step(); ts.append(clock() - t)
ts.sort()
print(ts[(len(ts) - 1) // 2])
]]):format(threads, N, cpu_clock and "True" or "False", runs)

local function torch_available()
  local p = io.popen("/usr/bin/python3 -c 'import torch' 2>/dev/null && echo yes")
  local r = p:read("*a")
  p:close()
  return r:find("yes") ~= nil
end

local function torch_run()
  local path = os.tmpname()
  local f = assert(io.open(path, "w"))
  f:write(torch_script)
  f:close()
  local p = io.popen("/usr/bin/python3 " .. path .. " 2>&1")
  local out = p:read("*a")
  p:close()
  os.remove(path)
  local v = tonumber(out:match("([%d%.eE%-]+)%s*$"))
  if not v then error("torch run failed: " .. out) end
  return v
end

local has_torch = torch_available()
local best_ours, best_torch = math.huge, math.huge
for r = 1, rounds do
  local o = ours()
  best_ours = math.min(best_ours, o)
  local line = ("round %d: fsdp %7.2f ms"):format(r, o * 1e3)
  if has_torch then
    local t = torch_run()
    best_torch = math.min(best_torch, t)
    line = line .. ("   torch %7.2f ms"):format(t * 1e3)
  end
  print(line)
end
print(("conv block fwd+bwd, batch %d, %d threads, %s time (best of %d round medians)"):format(N, threads,
  cpu_clock and "thread CPU" or "wall", rounds))
print(("  fsdp  %8.2f ms"):format(best_ours * 1e3))
if has_torch then
  print(("  torch %8.2f ms"):format(best_torch * 1e3))
  print(("  ratio fsdp / torch = %.3f  (< 1 means fsdp is faster)"):format(best_ours / best_torch))
else
  print("  (python3 with torch not available: no comparison)")
end
