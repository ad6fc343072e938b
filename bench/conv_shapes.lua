-- Convolution shapes people train, each pass alone: forward, input gradient, weight gradient (with
-- the bias gradient), ours against PyTorch's on the same machine and thread count, in one run.
--   OPENBLAS_NUM_THREADS=2 OMP_NUM_THREADS=2 luajit bench/conv_shapes.lua [--rounds R] [--runs K]
--       [--python /usr/bin/python3] [--python2 PATH|none]   (python2: a second PyTorch; by default
--       tmp/torch-venv/bin/python when it exists: bench/util.lua, U.torches, as for bench/run.lua)
-- A backward pass is timed alone: an untimed forward, then the timed backward of the leaves that
-- want a gradient (x for the input gradient; w and b for the weight gradient), on both sides.
-- Each round runs ours, then each PyTorch, over all shapes; the table shows each side's best round
-- median and the ratio ours / (the faster PyTorch) per pass. GFLOP/s counts 2*N*O*OH*OW*C*kh*kw.
local root = (arg and arg[0] or ""):match("^(.*)/bench/[^/]*$") or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. root .. "/bench/?.lua;" .. package.path
local fsdp = require "fsdp"
local F = fsdp.nn.functional
local U = require "util"
local json = require "fsdp.json"

local opts = { rounds = 3, runs = 7, threads = tonumber(os.getenv("OMP_NUM_THREADS") or "") or 2,
  python = "/usr/bin/python3", python2 = "auto" }
U.parse_args("bench/conv_shapes.lua", opts, "[--rounds R] [--runs K] [--python PATH] [--python2 PATH|none]")
fsdp.set_num_threads(opts.threads)

-- the shapes of issue 14: the RGB stem at 224 and at 64, 3x3 layers at 56/28/14, stride 2, 1x1
local shapes = {
  { name = "stem 3-64 @224", x = { 8, 3, 224, 224 }, w = { 64, 3, 3, 3 }, stride = 1, padding = 1 },
  { name = "stem 3-64 @64", x = { 32, 3, 64, 64 }, w = { 64, 3, 3, 3 }, stride = 1, padding = 1 },
  { name = "3x3 64-64 @56", x = { 8, 64, 56, 56 }, w = { 64, 64, 3, 3 }, stride = 1, padding = 1 },
  { name = "3x3 128-128 @28", x = { 8, 128, 28, 28 }, w = { 128, 128, 3, 3 }, stride = 1, padding = 1 },
  { name = "3x3 256-256 @14", x = { 8, 256, 14, 14 }, w = { 256, 256, 3, 3 }, stride = 1, padding = 1 },
  { name = "3x3 s2 64-128 @56", x = { 8, 64, 56, 56 }, w = { 128, 64, 3, 3 }, stride = 2, padding = 1 },
  { name = "1x1 64-256 @56", x = { 8, 64, 56, 56 }, w = { 256, 64, 1, 1 }, stride = 1, padding = 0 },
  { name = "1x1 s2 64-128 @56", x = { 8, 64, 56, 56 }, w = { 128, 64, 1, 1 }, stride = 2, padding = 0 },
}
local passes = { "fwd", "gx", "gw" }

-- the median ms of timed(prepare()) over the runs, after one untimed call
local function median_ms(timed, prepare)
  prepare = prepare or function() end
  timed(prepare())
  local t = {}
  for i = 1, opts.runs do
    local arg = prepare()
    local t0 = U.now_ms(); timed(arg); t[i] = U.now_ms() - t0
  end
  return U.median(t)
end

local function ours(s)
  fsdp.manual_seed(0)
  local x, w, b = fsdp.randn(unpack(s.x)), fsdp.randn(unpack(s.w)) * 0.1, fsdp.randn(s.w[1])
  local o = { stride = s.stride, padding = s.padding }
  local gy = fsdp.randn(unpack(F.conv2d(x, w, b, o):shape()))
  local r = {}
  r.fwd = median_ms(function() F.conv2d(x, w, b, o) end)
  local function grad_of(leaves)
    for _, l in ipairs(leaves) do l.requires_grad = true end
    local t = median_ms(function(y) y:backward(gy) end, function()
      for _, l in ipairs(leaves) do l.grad = nil end
      return F.conv2d(x, w, b, o)
    end)
    for _, l in ipairs(leaves) do l.requires_grad = false end
    return t
  end
  r.gx = grad_of { x }
  r.gw = grad_of { w, b }
  collectgarbage()
  return r
end

-- one PyTorch round over all shapes: name -> {fwd, gx, gw}, and its version (nil, why on failure)
local function torch_round(python)
  local inp = os.tmpname()
  local f = assert(io.open(inp, "w"))
  for _, s in ipairs(shapes) do f:write(json.encode(s), "\n") end
  f:close()
  local p = io.popen(("OMP_WAIT_POLICY=passive %s %s --threads %d --runs %d < %s 2>&1")
    :format(U.shell_quote(python), U.shell_quote(root .. "/bench/torch_conv.py"), opts.threads, opts.runs, inp))
  local out = p:read("*a")
  p:close()
  os.remove(inp)
  local res, version = {}, nil
  for line in out:gmatch("[^\n]+") do
    local ok, v = pcall(json.decode, line)
    if ok and type(v) == "table" then
      if v.version then version = v.version else res[v.name] = v end
    end
  end
  if not version then return nil, out:sub(-400) end
  return res, version
end

-- the torches that answered (bench/util.lua: Debian's, and PyPI's in tmp/torch-venv)
local torches = {}
for _, t in ipairs(U.torches(root, opts)) do
  if t.version then torches[#torches + 1] = { python = t.python, version = t.version, best = {} } end
end

local best = {}
local function keep_min(into, name, r)
  into[name] = into[name] or {}
  for _, k in ipairs(passes) do
    if r[k] and (not into[name][k] or r[k] < into[name][k]) then into[name][k] = r[k] end
  end
end
for round = 1, opts.rounds do
  io.stderr:write(("  conv shapes, round %d\n"):format(round))
  for _, s in ipairs(shapes) do keep_min(best, s.name, ours(s)) end
  for _, t in ipairs(torches) do
    local res, v = torch_round(t.python)
    if not res then error(("%s bench/torch_conv.py failed: %s"):format(t.python, v)) end
    t.version = v
    for name, r in pairs(res) do keep_min(t.best, name, r) end
  end
end

local function flops(s)
  local N, O, OH, OW
  N, O = s.x[1], s.w[1]
  OH = math.floor((s.x[3] + 2 * s.padding - s.w[3]) / s.stride) + 1
  OW = math.floor((s.x[4] + 2 * s.padding - s.w[4]) / s.stride) + 1
  return 2 * N * O * OH * OW * s.x[2] * s.w[3] * s.w[4]
end

local hdr = ("%-19s %-4s %9s %7s"):format("shape", "pass", "fsdp ms", "GF/s")
for _, t in ipairs(torches) do hdr = hdr .. ("  %14s"):format("torch " .. t.version:sub(1, 8)) end
print(("\nConvolution passes alone, %d threads, best of %d round medians of %d runs"):format(opts.threads,
  opts.rounds, opts.runs))
print(hdr .. (#torches > 0 and "  fsdp/faster" or ""))
local slower, total = 0, 0
for _, s in ipairs(shapes) do
  for _, k in ipairs(passes) do
    local ms = best[s.name][k]
    local line = ("%-19s %-4s %9.2f %7.0f"):format(s.name, k, ms, flops(s) / (ms * 1e6))
    local fastest = math.huge
    for _, t in ipairs(torches) do
      local tm = t.best[s.name] and t.best[s.name][k]
      line = line .. ("  %14s"):format(tm and ("%.2f"):format(tm) or "-")
      if tm and tm < fastest then fastest = tm end
    end
    if fastest < math.huge then
      local ratio = ms / fastest
      total = total + 1
      if ratio >= 1 then slower = slower + 1 end
      line = line .. ("  %10.2f%s"):format(ratio, ratio >= 1 and " !" or "")
    end
    print(line)
  end
end
if #torches == 0 then print("(no python with torch found: ours only)")
else print(("%d of %d passes not faster than the faster PyTorch (marked !)"):format(slower, total)) end
