-- A model larger than one rank's memory: the GPT of examples/gpt_model.lua at about a billion
-- parameters (d 2048, 20 blocks, 16 heads, vocabulary 256, context 64: 1.008e9 parameters, 4.03 GB
-- of float32) trains at 4 ranks, each under an address-space cap (RLIMIT_AS, set by this script
-- on itself after fsdp.init) below the float32 parameters alone. `make bench-big` runs the phases:
--
--   bin/fsdprun -n 4 bench/big_model.lua --save DIR     build on meta, wrap (each rank materialises
--                                                       its pieces), train --steps SGD steps, save_sharded
--   bin/fsdprun -n 4 bench/big_model.lua --eager        the same build done eagerly: out of memory
--   bin/fsdp-consolidate DIR FILE                       the full checkpoint (a tool, uncapped)
--   bin/fsdprun -n 4 bench/big_model.lua --load FILE    meta, wrap, load_state_dict(fsdp.load(FILE))
--   bin/fsdprun -n 4 bench/big_model.lua --load-sharded DIR
--   bin/fsdprun -n 2 bench/big_model.lua --load-sharded DIR   the same checkpoint at another world size
--
-- Each rank prints its peak RSS (VmHWM; reset before a load so the load's own peak shows), the
-- peaks of fsdp.memory_stats() by category, and their ratio to the sharded bound: (parameters +
-- gradients + optimizer state) / N plus the largest unit gathered in float32. A load's peak RSS is
-- compared with the rank's sharded state (its parameter pieces). The optimizer is plain SGD: with
-- AdamW the sharded state per rank at N = 4 is 16 bytes / 4 per parameter, the whole float32 model
-- again, which no cap below it can hold (at N = 8 it is half of it).
local root = (arg and arg[0] or ""):match("^(.*)/bench/[^/]*$") or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. root .. "/bench/?.lua;" .. package.path
local ffi = require "ffi"
local fsdp = require "fsdp"
local U = require "util"
local GPT = dofile(root .. "/examples/gpt_model.lua")

local opts = { layers = 20, dim = 2048, heads = 16, vocab = 256, block = 64, steps = 3, ["cap-gib"] = 3.6,
  save = "", load = "", ["load-sharded"] = "", eager = false }
U.parse_args("bench/big_model.lua", opts, "[--cap-gib G] [--layers L] [--dim D] [--steps S] [--save DIR | --load FILE | "
  .. "--load-sharded DIR] [--eager]", { ["--eager"] = function(o) o.eager = true end })

pcall(ffi.cdef, [[
struct fsdp_bench_rlimit { unsigned long cur, max; };
int setrlimit(int resource, const struct fsdp_bench_rlimit* rlim);
]])
local RLIMIT_AS = 9

fsdp.init()
local R, N = fsdp.rank(), fsdp.world_size()
local GiB = 2 ^ 30
local cap = tonumber(opts["cap-gib"]) * GiB
assert(ffi.C.setrlimit(RLIMIT_AS, ffi.new("struct fsdp_bench_rlimit", cap, cap)) == 0, "setrlimit failed")

local function status_kib(field)
  local f = io.open("/proc/self/status", "r")
  local v = f and tonumber(f:read("*a"):match(field .. ":%s*(%d+)")) or 0
  if f then f:close() end
  return v
end
local function reset_peak_rss()  -- VmHWM back to the current RSS
  local f = io.open("/proc/self/clear_refs", "w")
  if f then f:write("5"); f:close() end
end
local function gib(b) return ("%.2f GiB"):format(b / GiB) end
-- every rank's line, in rank order
local function report(line)
  for r = 0, N - 1 do
    if r == R then io.write(line, "\n"); io.flush() end
    fsdp.barrier()
  end
end
local function say(...) if R == 0 then print(string.format(...)); io.flush() end end

local cfg = { opts.vocab, opts.block, opts.dim, opts.heads, opts.layers }
local function build() return GPT(unpack(cfg)) end
local nparams = 12 * opts.dim ^ 2 * opts.layers  -- (the blocks' matrices; exact count printed below)

say("cpu: %s; %d ranks, cap %s of address space per rank (RLIMIT_AS)", U.cpu_model(), N, gib(cap))

if opts.eager then
  fsdp.manual_seed(0)
  local t0 = U.seconds()
  local ok, err = pcall(build)
  local msg = ok and "built (the cap is not below the model)" or tostring(err):gsub("\n.*", "")
  report(("eager construction of %d blocks of d %d under %s: %s after %.1f s, peak RSS %s"):format(opts.layers, opts.dim,
    gib(cap), ok and "succeeded" or "FAILED", U.seconds() - t0, gib(status_kib("VmHWM") * 1024)))
  report("eager construction's error: " .. msg)
  fsdp.barrier()
  os.exit(ok and 1 or 0)  -- (the benchmark expects the eager build to fail)
end

-- ---- build on meta, wrap: each rank materialises its pieces -------------------------------------------
fsdp.manual_seed(0)
local t0 = U.seconds()
local model = fsdp.meta(build)
nparams = model:num_parameters()
local t1 = U.seconds()
for _, blk in ipairs(model.h:children()) do fsdp.wrap(blk) end
fsdp.wrap(model)
local t2 = U.seconds()
say("GPT: %d blocks, d %d, %d heads, vocabulary %d, context %d: %d parameters (%s of float32)", opts.layers, opts.dim,
  opts.heads, opts.vocab, opts.block, nparams, gib(4 * nparams))
say("built on meta in %.2f s; wrapped (pieces materialised) in %.1f s", t1 - t0, t2 - t1)

local unit_bytes = 4 * (12 * opts.dim ^ 2 + 13 * opts.dim)  -- a block, gathered in float32
local pieces = 0
for _, p in ipairs(model:parameters()) do pieces = pieces + p:to_local():numel() end

local function memory_line(what, bound)
  local s = fsdp.memory_stats()
  local parts, total = {}, 0
  for _, k in ipairs { "params", "grads", "optimizer", "activations", "comm", "other" } do
    parts[#parts + 1] = ("%s %s"):format(k, gib(s[k].peak))
    total = total + s[k].peak
  end
  return ("%s: peak RSS %s (address space %s); counters' peaks %s (sum %s, %.2fx the bound %s)"):format(what,
    gib(status_kib("VmHWM") * 1024), gib(status_kib("VmPeak") * 1024), table.concat(parts, ", "), gib(total),
    total / bound, gib(bound))
end

if opts.load ~= "" or opts["load-sharded"] ~= "" then
  -- ---- load a checkpoint into the wrapped model: each rank reads its pieces --------------------------------
  collectgarbage()
  reset_peak_rss()
  fsdp.reset_peak_memory_stats()
  local before = status_kib("VmRSS") * 1024
  local t = U.seconds()
  local what
  if opts.load ~= "" then
    what = "load_state_dict(fsdp.load(full file))"
    model:load_state_dict(fsdp.load(opts.load))
  else
    what = "load_sharded"
    fsdp.load_sharded(opts["load-sharded"], model)
  end
  collectgarbage()
  local dt = U.seconds() - t
  local peak = status_kib("VmHWM") * 1024
  report(("%s in %.1f s: RSS %s before, peak %s during (+%s); this rank's sharded state (its pieces) %s: "
    .. "peak / sharded state %.2f"):format(what, dt, gib(before), gib(peak), gib(peak - before), gib(4 * pieces),
    peak / (4 * pieces)))
  -- the loaded values: a checksum over every rank's pieces, against the one the saving run printed
  local sum = 0
  for _, p in ipairs(model:parameters()) do sum = sum + p:to_local():to("float32"):abs():sum():item() end
  say("checksum of |parameters| after the load: %.6e", fsdp.all_reduce(fsdp.tensor({ sum }), "sum"):item())
  os.exit(0)
end

-- ---- train --------------------------------------------------------------------------------------------
local opt = fsdp.optim.SGD(model:parameters(), { lr = 1e-3 })
local F = fsdp.nn.functional
fsdp.manual_seed(1 + R)
local T = opts.block
local times = {}
fsdp.reset_peak_memory_stats()
for step = 1, opts.steps do
  local x = fsdp.randint(0, opts.vocab, { 1, T })
  local y = fsdp.randint(0, opts.vocab, { 1, T })
  local s0 = U.seconds()
  opt:zero_grad()
  local loss = F.cross_entropy(model(x):reshape(T, opts.vocab), y:reshape(T))
  loss:backward()
  opt:step()
  local l = fsdp.all_reduce(fsdp.tensor({ loss:item() }), "avg"):item()
  times[step] = U.seconds() - s0
  say("step %d: loss %.4f, %.1f s", step, l, times[step])
end
local bound = (4 * pieces * 2) + unit_bytes  -- parameters + gradients (SGD keeps no state), one unit gathered
report(memory_line(("after %d steps (median %.1f s a step)"):format(opts.steps, U.median(times)), bound))

if opts.save ~= "" then
  fsdp.save_sharded(opts.save, model)
  local sum = 0
  for _, p in ipairs(model:parameters()) do sum = sum + p:to_local():abs():sum():item() end
  say("saved to %s; checksum of |parameters|: %.6e", opts.save, fsdp.all_reduce(fsdp.tensor({ sum }), "sum"):item())
end
