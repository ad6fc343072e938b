-- The convolutions of a training step, layer by layer: each Conv2d of a bench model (bench/models.lua)
-- timed alone through our ops on one thread -- the forward (F.conv2d, bias included), the input
-- gradient and the weight gradient (its backward through autograd, with only that one operand
-- asking for a gradient; the bias gradient is left out) -- min of 5 runs each. A pass costs
-- 2 N O OH OW (C / groups) kh kw FLOP; its rate on one thread, as a fraction of the probed FMA peak
-- per core, says how close our convolutions come to the machine (the GEMM floor's per-layer table
-- does the same for the Linear GEMMs, bench/gemm_floor.lua). A layer whose input is the data batch
-- has no input gradient in a step, and none is timed.
--   luajit bench/conv_floor.lua [--models conv,resnet] [--threads 2] [--peak GFLOPS] [--steps conv=MS,resnet=MS]
-- --threads divides the one-thread sum (the step's convolutions if its threads shared them
-- perfectly), --steps puts that beside the step times, --peak is the FMA peak to compare with
-- (measured here unless given). bench/run.lua runs it after the GEMM floor.
--
-- It runs in a process of its own, on one thread from the start: oneDNN fixes a convolution
-- primitive's thread count when the primitive is created, and fsdp keeps the primitives it made,
-- so in a process that already ran the model at 2 threads the "one-thread" forward would run on 2.
local root = (arg and arg[0] or ""):match("^(.*)/bench/[^/]*$") or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. root .. "/bench/?.lua;" .. package.path
package.cpath = root .. "/?.so;" .. package.cpath
local fsdp = require "fsdp"
local models = require "models"
local U = require "util"
local F = fsdp.nn.functional

local opts = { models = "conv,resnet", threads = 2, peak = 0, steps = "" }
U.parse_args("bench/conv_floor.lua", opts, "[--models conv,resnet] [--threads N] [--peak GFLOPS] [--steps conv=MS,...]")
fsdp.set_num_threads(1) -- before any convolution primitive exists
local REPS = 5

-- the model's Conv2d layers as one forward pass meets them: { conv = module, x = input shape,
-- data = true when the input needs no gradient (the data batch) }
local function conv_layers(name)
  fsdp.manual_seed(0)
  local model, _, loss_fn = models.case(name)
  local found, hooks = {}, {}
  for _, m in ipairs(model:modules()) do
    if m.in_channels and m.kernel_size and m.weight then
      hooks[#hooks + 1] = m:register_forward_hook(function(mod, args)
        found[#found + 1] = { conv = mod, x = args[1]:shape(), data = not args[1].requires_grad }
      end)
    end
  end
  loss_fn()
  for _, h in ipairs(hooks) do h.remove() end
  return found
end

-- seconds: the best of REPS runs of fn, after one untimed run
local function best_of(fn)
  fn()
  local best = math.huge
  for _ = 1, REPS do
    local t0 = U.seconds()
    fn()
    best = math.min(best, U.seconds() - t0)
  end
  return best
end

-- one layer's three passes, timed alone: seconds for forward, input grad (nil for the data
-- layer) and weight grad, and the FLOP of one pass
local function time_layer(layer)
  local m = layer.conv
  local o = { stride = m.stride, padding = m.padding, dilation = m.dilation, groups = m.groups }
  local x = fsdp.randn(unpack(layer.x))
  local w, b = m.weight:detach(), m.bias and m.bias:detach() or nil
  local y = F.conv2d(x, w, b, o)
  local s = y:shape()
  local flop = 2 * s[1] * s[2] * s[3] * s[4] * (layer.x[2] / m.groups) * m.kernel_size[1] * m.kernel_size[2]
  local gy = fsdp.randn(unpack(s))
  local fwd = best_of(function() F.conv2d(x, w, b, o) end)
  -- t (the input or the weight) alone asks for a gradient; backward keeps the graph for the next run
  local function grad_of(t)
    t.requires_grad = true
    local out = F.conv2d(x, w, b, o)
    local sec = best_of(function()
      out:backward(gy, { retain_graph = true })
      t.grad = nil
    end)
    t.requires_grad = false
    return sec
  end
  local gx = not layer.data and grad_of(x) or nil
  local gw = grad_of(w)
  collectgarbage("collect")
  return fwd, gx, gw, flop
end

-- each distinct conv layer of the model, in order: { x = shape, conv = module, count, fwd, gx,
-- gw (seconds, gx nil for the data layer), flop (one pass) }; nil for a model without convolutions
local function per_conv(name)
  local layers = conv_layers(name)
  if #layers == 0 then return nil end
  local rows, seen = {}, {}
  for _, l in ipairs(layers) do
    local m = l.conv
    local pad = type(m.padding) == "table" and table.concat(m.padding, ",") or m.padding
    local key = table.concat({ table.concat(l.x, "x"), m.out_channels, m.kernel_size[1], m.kernel_size[2],
      m.stride[1], m.stride[2], pad, tostring(l.data) }, " ")
    if seen[key] then
      seen[key].count = seen[key].count + 1
    else
      local row = { x = l.x, conv = m, count = 1 }
      row.fwd, row.gx, row.gw, row.flop = time_layer(l)
      seen[key] = row
      rows[#rows + 1] = row
    end
  end
  return rows
end

local function rate(flop, sec) return flop / sec * 1e-9 end

-- "123.4 GFLOP/s  45%" for one pass, "-" where none is timed
local function cell(flop, sec, peak)
  if not sec then return ("%20s"):format("-") end
  local r = rate(flop, sec)
  return ("%6.1f GFLOP/s %3.0f%%"):format(r, 100 * r / peak)
end

-- the table: per model a summary line, then each distinct layer's three passes
local function report(names, threads, peak, steps)
  local header = false
  for _, name in ipairs(names) do
    local list = per_conv(name)
    if list and not header then
      header = true
      print("\nConvolutions: each conv layer alone through fsdp.F.conv2d and its backward on one thread (min of 5),")
      print("  per pass (2 N O OH OW C kh kw FLOP) its GFLOP/s and % of the FMA peak above")
    end
    if list then
      local flop, sec = 0, 0
      for _, l in ipairs(list) do
        flop = flop + l.count * (l.gx and 3 or 2) * l.flop
        sec = sec + l.count * (l.fwd + (l.gx or 0) + l.gw)
      end
      local step = steps[name] and (" of the %.2f ms step"):format(steps[name]) or ""
      print(("  %-12s %.2f GFLOP of convolutions per step: %.2f ms on one thread = %.1f GFLOP/s = %.0f%% of peak;"
        .. " / %d threads = %.2f ms%s"):format(name, flop * 1e-9, sec * 1e3, rate(flop, sec), 100 * rate(flop, sec) / peak, threads,
          sec * 1e3 / threads, step))
      print(("      %-34s %-3s  %20s  %20s  %20s"):format("N x C x H x W -> O kxk/stride", "", "forward", "input grad",
        "weight grad"))
      for _, l in ipairs(list) do
        local m = l.conv
        local shape = ("%3d x %3d x %3d x %3d -> %3d %dx%d/%d"):format(l.x[1], l.x[2], l.x[3], l.x[4], m.out_channels,
          m.kernel_size[1], m.kernel_size[2], m.stride[1])
        print(("      %-34s x%-2d  %s  %s  %s"):format(shape, l.count, cell(l.flop, l.fwd, peak), cell(l.flop, l.gx, peak),
          cell(l.flop, l.gw, peak)))
      end
    end
  end
end

local names, steps = {}, {}
for name in opts.models:gmatch("[^,]+") do names[#names + 1] = name end
for name, ms in opts.steps:gmatch("([%w_]+)=([%d%.eE+-]+)") do steps[name] = tonumber(ms) end
report(names, opts.threads, opts.peak > 0 and opts.peak or fsdp.C.fsdp_cpu_fma_peak(0.3), steps)
