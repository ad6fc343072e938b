-- Child process of tests/hostile/hostile_spec.lua: every public function of fsdp, fsdp.nn (layers, init,
-- Module methods), fsdp.F, fsdp.optim (optimizers, schedulers), fsdp.data, the tensor methods and
-- the file and checkpoint functions, called with bad values for each argument in turn: nil, wrong
-- types, NaN and infinities, fractional, negative and huge integers, lists with holes, strings
-- with a NUL byte, cyclic tables; plus wrong dtypes and shapes where an op has a rule for them.
--   luajit tests/scripts/hostile.lua ROOT list       -> "CASE<tab>i<tab>want<tab>frag1|frag2<tab>name"
--   luajit tests/scripts/hostile.lua ROOT run FIRST  -> runs cases FIRST..n, one line each
-- Before each case it prints "START i", after it "RES i OK" or "RES i ERR <message>"; a crash
-- shows as a START without its RES (the spec then reruns from the next case). At the end it
-- checks that the process still computes: "ALIVE <(fsdp.ones(2) + 1):sum():item()>".
-- A public function without an entry here is a failing case ("no case list").
local ROOT, mode, first = arg[1], arg[2], tonumber(arg[3] or 1)
package.path = ROOT .. "/lua/?.lua;" .. ROOT .. "/lua/?/init.lua;" .. ROOT .. "/tests/?.lua;" .. package.path
package.cpath = ROOT .. "/?.so;" .. package.cpath
local fsdp = require "fsdp"
local H = require "helpers"
local F, nn, optim = fsdp.F, fsdp.nn, fsdp.optim
local S = optim.lr_scheduler
local tmp = os.getenv("HOSTILE_TMP") or os.tmpname() .. ".d"
os.execute("mkdir -p " .. tmp)

-- ---- valid inputs --------------------------------------------------------------------------------
local function x23() return fsdp.randn(2, 3) end
local function leaf23() return fsdp.randn(2, 3):requires_grad_() end
local function scalar_loss() return (fsdp.randn(3):requires_grad_() * 2):sum() end
local function x32() return fsdp.randn(3, 2) end
local function idx() return fsdp.tensor({ 0, 1 }, "int64") end
local function img() return fsdp.randn(1, 2, 4, 4) end
local function seq4() return fsdp.randn(3, 2, 4) end  -- (L, N, E) for the transformer modules
local function cw() return fsdp.randn(3, 2, 3, 3) end
local function one() return fsdp.ones(1) end
local function qkv() return fsdp.randn(1, 2, 4) end
local function mask23() return fsdp.randn(2, 3):gt(0) end
local function gidx() return fsdp.tensor({ { 0 }, { 2 } }, "int64") end
local function probs3() return fsdp.ones(3) end

-- The bad values for an argument of each kind (those a kind accepts are left out):
--   T  a tensor           T?  a tensor or nil         TN  a tensor or a number
--   FN a function         TB? a tensor, nil or an options table
--   N  a number (NaN is one)     N?  a number or nil (a default)
--   F  a finite number           F?  a finite number or nil
--   I  an integer >= 0 (a count) I?  the same or nil        Z / Z?  an integer of either sign (or nil)
--   D?  a dim (1-based; nil: the method's default)   DL? a dim, a list of dims or nil
--   DO? a dim, an options table or nil   O? an options table or nil
--   SH  a shape a new tensor gets (a list or sizes)  SV  a shape a view takes (-1 inferred)
--   S   a name (dtype, device, mode): a string      S? the same or nil
--   P   a path                                       X?  a table that is written out (JSON) or nil
--   M   a Module                                     OPT an optimizer
local bad_values = {
  T = { "nil", "number", "string", "table" },
  ["T?"] = { "number", "string", "list" },  -- (an empty {} after the tensors is an empty options table)
  TN = { "nil", "string", "table" },
  ["TB?"] = { "number", "string" },
  FN = { "nil", "number", "string", "table" },
  N = { "nil", "string", "table" },
  ["N?"] = { "string", "table" },
  F = { "nil", "string", "table", "nan", "inf" },
  ["F?"] = { "string", "table", "nan", "inf" },
  I = { "nil", "string", "table", "nan", "inf", "frac", "huge", "neg" },
  ["I?"] = { "string", "table", "nan", "inf", "frac", "huge", "neg" },
  Z = { "nil", "string", "table", "nan", "inf", "frac", "huge" },
  ["Z?"] = { "string", "table", "nan", "inf", "frac", "huge" },
  ["D?"] = { "string", "table", "nan", "frac", "huge", "zero" },
  ["DL?"] = { "string", "nan", "frac", "zero", "hole" },       -- a dim, a list of dims or nil
  ["DO?"] = { "string", "nan", "frac", "zero" },       -- a dim, an options table or nil
  ["O?"] = { "number", "string" },  -- an options table or nil
  SH = { "string", "nan", "frac", "huge", "neg", "hole" },
  SV = { "string", "nan", "frac", "huge", "hole" },
  S = { "nil", "number", "table", "nul", "bogus" },
  ["S?"] = { "number", "table", "nul", "bogus" },
  P = { "nil", "number", "table", "nul" },
  ["X?"] = { "number", "string", "cyclic" },
  M = { "nil", "number", "string", "table" },
  OPT = { "nil", "number", "string", "table" },
  ["OPT?"] = { "number", "string", "table" },
  ["I+"] = { "nil", "string", "table", "nan", "inf", "frac", "huge", "neg", "zero" },  -- an integer >= 1
  ["I+?"] = { "string", "table", "nan", "inf", "frac", "huge", "neg", "zero" },
  IL = { "nil", "number", "string", "hole", "lnan", "lfrac", "lneg" },  -- a list of integers >= 0
  L = { "nil", "number", "string", "hole" },                            -- a list (of anything)
  DS = { "nil", "string", "nan", "frac", "neg" },                     -- a data set, a list of samples or a length
  TT = { "nil", "number", "string", "notensor", "cyclic" },             -- a table of tensors
  ["B?"] = { "number", "string", "table" },                             -- a boolean or nil
}
-- a bad value of a kind; `valid` is the argument's valid value (a NUL string extends it)
local function bad_value(kind, valid)
  if kind == "number" then return 1 elseif kind == "string" then return "s" elseif kind == "table" then return {}
  elseif kind == "list" then return { 1 } elseif kind == "nan" then return 0 / 0 elseif kind == "inf" then return math.huge
  elseif kind == "frac" then return 1.5 elseif kind == "huge" then return 1e30 elseif kind == "neg" then return -1
  elseif kind == "zero" then return 0 elseif kind == "hole" then return { 1, nil, 1 }
  elseif kind == "nul" then return tostring(valid) .. "\0x" elseif kind == "bogus" then return "bogus"
  elseif kind == "cyclic" then local t = { a = 1 }; t.self = t; return t
  elseif kind == "lnan" then return { 0 / 0 } elseif kind == "lfrac" then return { 1.5 } elseif kind == "lneg" then return { -1 }
  elseif kind == "notensor" then return { a = 1 } end
  return nil  -- "nil"
end
local values = setmetatable({}, { __index = function(_, k) return bad_value(k) end })

-- ---- tensor methods: self maker, then each argument as {kind, name, valid value maker} ----------------
-- (an argument without a kind is not a tensor argument and keeps its valid value)
local function v(x) return function() return x end end
local methods = {
  dim = { x23 }, numel = { x23 }, shape = { x23 }, size = { x23, { "D?", "dim", v(1) } },
  stride = { x23, { "D?", "dim", v(1) } }, is_contiguous = { x23 }, data_ptr = { x23 }, version = { x23 },
  item = { one }, tolist = { x23 }, totable = { x23 }, tostring = { x23 },
  backward = { scalar_loss, { "TB?", "gradient", v(nil) } },
  register_hook = { leaf23, { "FN", "fn", v(function() end) } },
  detach = { x23 }, to_local = { x23 }, requires_grad_ = { leaf23 }, zero_ = { x23 }, fill_ = { x23, { "N", "value", v(2) } },
  copy_ = { x23, { "T", "src", x23 } }, add_ = { x23, { "TN", "other", x23 }, { "N?", "alpha", v(1) } },
  mul_ = { x23, { "N", "value", v(2) } },
  uniform_ = { x23, { "F?", "from", v(0) }, { "F?", "to", v(1) } },
  normal_ = { x23, { "F?", "mean", v(0) }, { "F?", "std", v(1) } },
  add = { x23, { "TN", "other", x23 } }, sub = { x23, { "TN", "other", x23 } },
  mul = { x23, { "TN", "other", x23 } }, div = { x23, { "TN", "other", x23 } },
  pow = { x23, { nil, "exponent", v(2) } }, eq = { x23, { "TN", "other", x23 } },
  neg = { x23 }, exp = { x23 }, log = { x23 }, sqrt = { x23 }, abs = { x23 }, tanh = { x23 },
  sigmoid = { x23 }, relu = { x23 }, gelu = { x23 },
  sum = { x23 }, mean = { x23 }, max = { x23 }, argmax = { x23 },
  matmul = { x23, { "T", "other", x32 } }, bmm = { function() return fsdp.randn(1, 2, 3) end,
    { "T", "other", function() return fsdp.randn(1, 3, 2) end } },
  view = { x23, { "SV", "shape", v(6) } }, reshape = { x23, { "SV", "shape", v(6) } },
  view_as = { x23, { "T", "other", x32 } }, expand = { one, { "SV", "shape", v(3) } },
  expand_as = { one, { "T", "other", x23 } }, flatten = { x23 },
  transpose = { x23, { "D?", "dim0", v(1), frag = "dim" }, { "D?", "dim1", v(2), frag = "dim" } }, t = { x23 },
  permute = { x23, { "D?", "dims", v(2), frag = "dim" }, { "D?", "dims", v(1), frag = "dim" } },
  unsqueeze = { x23, { "D?", "dim", v(1) } },
  squeeze = { one, { "DL?", "dim", v(1) } }, contiguous = { x23 }, clone = { x23 },
  narrow = { x23, { "D?", "dim", v(1) }, { "Z", "start", v(1) }, { "I", "length", v(1) } },
  index_select = { x23, { "D?", "dim", v(1) }, { "T", "index", idx } },
  to = { x23, { "S", "dtype", v("float32") } }, cpu = { x23 }, cuda = { x23 }, pin_memory = { x23 }, is_pinned = { x23 },
  float = { x23 }, long = { x23 },
  bfloat16 = { x23 }, half = { x23 }, softmax = { x23, { "D?", "dim", v(1) } },
  log_softmax = { x23, { "D?", "dim", v(1) } },
  ne = { x23, { "TN", "other", x23 } }, lt = { x23, { "TN", "other", x23 } }, le = { x23, { "TN", "other", x23 } },
  gt = { x23, { "TN", "other", x23 } }, ge = { x23, { "TN", "other", x23 } },
  where = { x23, { "T", "condition", mask23 }, { "TN", "other", x23 } },
  masked_fill = { x23, { "T", "mask", mask23 }, { "N", "value", v(0) } },
  clamp = { x23, { "N?", "min", v(0) }, { "N?", "max", v(1) } },
  minimum = { x23, { "TN", "other", x23 } }, maximum = { x23, { "TN", "other", x23 } },
  min = { x23 }, cumsum = { x23, { "D?", "dim", v(1) } },
  tril = { x23, { "Z?", "diagonal", v(0) } }, triu = { x23, { "Z?", "diagonal", v(0) } },
  select = { x23, { "D?", "dim", v(1) }, { "Z", "index", v(1) } }, bool = { x23 },
  topk = { x23, { "I", "k", v(1) }, { "DO?", "dim", v(1) } }, sort = { x23, { "DO?", "dim", v(1) } },
  argsort = { x23, { "DO?", "dim", v(1) } },
  gather = { x23, { "D?", "dim", v(2) }, { "T", "index", gidx } },
  scatter_add = { x23, { "D?", "dim", v(2) }, { "T", "index", gidx }, { "T", "src", x23 } },
  multinomial = { probs3, { "I", "num_samples", v(1) }, { "O?", "options", v(nil) } },
  split = { x23, { "I", "split_size_or_sections", v(1) }, { "D?", "dim", v(1) } },
  chunk = { x23, { "I", "chunks", v(2) }, { "D?", "dim", v(1) } },
  tile = { x23, { "I", "repeats", v(2), ok = { table = true } } },  -- (tile{}: the tensor, as PyTorch's tile(()))
  ["repeat"] = { x23, { "I", "repeats", v(2) }, { "I", "repeats", v(2) } },
}

-- ---- functions: each argument as {kind, name, valid value maker} -------------------------------------------
local fsdp_fns = {
  zeros_like = { { "T", "input", x23 } }, ones_like = { { "T", "input", x23 } },
  cat = { { "T?", "tensors[2]", x23, list = true } },  -- {x, nil} is {x}
  stack = { { "T?", "tensors[2]", x23, list = true } },
  multinomial = { { "T", "probs", probs3 }, { "N", "num_samples", v(1) }, { "O?", "options", v(nil) } },
  no_grad = { { "FN", "fn", v(function() end) } },
  meta = { { "FN", "fn", v(function() end) } },
  tensor = { { nil, "data", v({ 1, 2 }) }, { "S?", "dtype", v("float32"), ok = { table = true } } },  -- ({}: no options)
  empty = { { "SH", "size", v({ 2, 3 }), frag = "shape", says = { string = false } } }, zeros = { { "SH", "size", v({ 2, 3 }), frag = "shape", says = { string = false } } },
  ones = { { "SH", "size", v({ 2, 3 }), frag = "shape", says = { string = false } } }, randn = { { "SH", "size", v({ 2, 3 }), frag = "shape", says = { string = false } } },
  rand = { { "SH", "size", v({ 2, 3 }), frag = "shape", says = { string = false } } },
  full = { { "SH", "size", v({ 2, 3 }), frag = "shape", says = { string = false } }, { "N", "fill_value", v(2) }, { "S?", "dtype", v("float32"), ok = { table = true } } },
  randint = { { "Z", "low", v(0) }, { "Z", "high", v(5) }, { "SH", "size", v({ 2 }), frag = "shape" } },
  randperm = { { "I", "n", v(4) } },
  arange = { { "F", "start", v(0), says = { ["nil"] = "argument" } }, { "F", "end", v(4), says = { ["nil"] = "argument" } },
    { "F?", "step", v(1), says = { string = "dtype" } } },  -- (a string in the last place is a dtype)
  manual_seed = { { "Z", "seed", v(3) } }, get_rng_state = {},
  set_rng_state = { { "T", "state", function() return fsdp.get_rng_state() end } },
  set_num_threads = { { "I", "n", v(1) } },
  is_grad_enabled = {}, set_grad_enabled = {}, memory_stats = {}, reset_peak_memory_stats = {},
  backends = {}, is_tensor = {}, set_default_device = { { "S", "device", v("cpu") } }, get_default_device = {},
  perf_counter = {},
  where = { { "T", "condition", mask23 }, { "TN", "input", x23 }, { "TN", "other", x23 } },
  minimum = { { "TN", "input", x23 }, { "TN", "other", x23 } },
  maximum = { { "TN", "input", x23 }, { "TN", "other", x23 } },
  tril = { { "T", "input", x23 }, { "N?", "diagonal", v(0) } }, triu = { { "T", "input", x23 }, { "N?", "diagonal", v(0) } },
}
-- fsdp/comm.lua's collectives (init, all_reduce, ...) are covered by comm_spec, fsdp.exit by script_exit_spec
local comm_fns = { init = true, rank = true, world_size = true, local_rank = true, local_world_size = true,
  barrier = true, all_reduce = true, broadcast = true,
  all_gather = true, reduce_scatter = true, comm_stats = true, comm_device_plane = true, save = true, load = true,
  exit = true }  -- every call of fsdp.exit ends the process

local F_fns = {
  linear = { { "T", "input", x23 }, { "T", "weight", function() return fsdp.randn(4, 3) end },
    { "T?", "bias", v(nil) } },
  conv2d = { { "T", "input", img }, { "T", "weight", cw }, { "T?", "bias", v(nil) } },
  relu = { { "T", "input", x23 } }, tanh = { { "T", "input", x23 } }, sigmoid = { { "T", "input", x23 } },
  silu = { { "T", "input", x23 }, { "B?", "inplace", v(false), ok = { table = true } } },
  gelu = { { "T", "input", x23 } }, softmax = { { "T", "input", x23 }, { "D?", "dim", v(1) } },
  log_softmax = { { "T", "input", x23 }, { "D?", "dim", v(1) } },
  cross_entropy = { { "T", "input", x23 }, { "T", "target", idx } },
  nll_loss = { { "T", "input", x23 }, { "T", "target", idx } },
  mse_loss = { { "T", "input", x23 }, { "T", "target", x23 } },
  layer_norm = { { "T", "input", x23 }, { "I+", "normalized_shape", v(3) }, { "T?", "weight", v(nil) },
    { "T?", "bias", v(nil) } },
  embedding = { { "T", "input", idx }, { "T", "weight", x32 } },
  dropout = { { "T", "input", x23 } },
  batch_norm = { { "T", "input", x23 }, { "T?", "running_mean", function() return fsdp.zeros(3) end },
    { "T?", "running_var", function() return fsdp.ones(3) end }, { "T?", "weight", v(nil) }, { "T?", "bias", v(nil) },
    { "B?", "training", v(false), ok = { table = true } } },  -- ({}: the options)
  sync_batch_norm = { { "T", "input", x23 }, { "T?", "running_mean", function() return fsdp.zeros(3) end },
    { "T?", "running_var", function() return fsdp.ones(3) end }, { "T?", "weight", v(nil) }, { "T?", "bias", v(nil) },
    { "B?", "training", v(false), ok = { table = true } } },  -- ({}: the options)
  group_norm = { { "T", "input", x23 }, { "I+", "num_groups", v(3) }, { "T?", "weight", v(nil) },
    { "T?", "bias", v(nil) }, { "F?", "eps", v(1e-5), ok = { table = true } } },
  rms_norm = { { "T", "input", x23 }, { "I+", "normalized_shape", v(3) }, { "T?", "weight", v(nil) },
    { "F?", "eps", v(1e-5), ok = { table = true } } },
  max_pool2d = { { "T", "input", img }, { "I+", "kernel_size", v(2) } },
  avg_pool2d = { { "T", "input", img }, { "I+", "kernel_size", v(2) } },
  adaptive_avg_pool2d = { { "T", "input", img }, { "I+", "output_size", v(1) } },
  flatten = { { "T", "input", x23 } },
  scaled_dot_product_attention = { { "T", "query", qkv }, { "T", "key", qkv }, { "T", "value", qkv },
    { "TB?", "attn_mask", v(nil) } },
  conv_transpose2d = { { "T", "input", img }, { "T", "weight", function() return fsdp.randn(2, 3, 3, 3) end },
    { "T?", "bias", v(nil) } },
  dropout2d = { { "T", "input", img } },
}

-- ---- cases ----------------------------------------------------------------------------------------------
-- each: { name = shown name, fn = function() ... end, want = "error" | "ok" | "lr",
--         frags = fragments the error message must contain }
local cases = {}
local function add(name, fn, want, frags) cases[#cases + 1] = { name = name, fn = fn, want = want, frags = frags } end

local sorted_keys = H.sorted_keys

-- the cases of one function f(args...) whose arguments are described by `spec`: each entry
-- { kind, name, valid value maker, list = (the value goes inside a list), ok = {kind = true, ...}
-- (bad values this argument takes), frag = (what the message names instead of the argument),
-- says = { kind = what it names for that bad value instead (false: the function only) } }
local function says(s, kind)
  local w = s.says and s.says[kind]
  if w == nil and s[1] == "M" then return s.frag or "module" end  -- ("expected an nn.Module")
  if w == nil then return s.frag or s[2] end
  return w or nil
end
local function arg_cases(label, fname, f, spec, self_maker)
  local function valid_args()
    local a = {}
    for i, s in ipairs(spec) do
      local val = s[3]()
      if s.list then val = { x23(), val } end
      a[i] = val
    end
    return a
  end
  for i, s in ipairs(spec) do
    if s[1] then
      for _, kind in ipairs(bad_values[s[1]]) do
        if not (s.ok and s.ok[kind]) then
          add(("%s %s=%s"):format(label, s[2], kind), function()
            local a = valid_args()
            if s.list then a[i][2] = bad_value(kind, a[i][2]) else a[i] = bad_value(kind, a[i]) end
            if self_maker then return f(self_maker(), unpack(a, 1, #spec)) end
            return f(unpack(a, 1, #spec))
          end, "error", { fname, says(s, kind) })
        end
      end
    end
  end
end

local Tmethods = fsdp.Tensor.methods
for _, name in ipairs(sorted_keys(Tmethods)) do
  local spec = methods[name]
  if not spec then
    add("x:" .. name .. " (no case list)", function() error("add tensor method " .. name .. " to bad_args.lua") end,
      "ok")
  else
    local f, self_maker = Tmethods[name], spec[1]
    local rest = { unpack(spec, 2) }
    local function valid_rest()
      local a = {}
      for i, s in ipairs(rest) do a[i] = s[3]() end
      return a
    end
    add(("x.%s() (nil self)"):format(name), function() return f(nil, unpack(valid_rest(), 1, #rest)) end,
      "error", { name, "did you mean x:" .. name .. "()" })
    for _, kind in ipairs { "number", "string", "table" } do
      add(("x.%s(%s) (self)"):format(name, kind), function() return f(values[kind], unpack(valid_rest(), 1, #rest)) end,
        "error", { name, "self" })
    end
    arg_cases("x:" .. name, name, f, rest, self_maker)
  end
end

-- the operators, with a bad value on either side
for _, op in ipairs { { "add", function(a, b) return a + b end }, { "sub", function(a, b) return a - b end },
                      { "mul", function(a, b) return a * b end }, { "div", function(a, b) return a / b end } } do
  for _, kind in ipairs { "nil", "string", "table" } do
    add(("x %s %s"):format(op[1], kind), function() return op[2](x23(), values[kind]) end, "error", { op[1] })
    add(("%s %s x"):format(kind, op[1]), function() return op[2](values[kind], x23()) end, "error", { op[1] })
  end
end
for _, kind in ipairs { "nil", "string", "table" } do
  add("x ^ " .. kind, function() return x23() ^ values[kind] end, "error", { "pow" })
end
for _, kind in ipairs { "string", "table" } do
  add("x.grad = " .. kind, function() local t = leaf23(); t.grad = values[kind] end, "error", { "grad" })
end
add("x.grad = 1", function() local t = leaf23(); t.grad = 1 end, "error", { "grad" })
add("released handle", function() local t = x23(); fsdp._release(t); return t:sum() end, "error", { "sum", "released" })

for _, name in ipairs(sorted_keys(fsdp)) do
  local f = fsdp[name]
  if type(f) == "function" and name:sub(1, 1) ~= "_" and not comm_fns[name] then
    local spec = fsdp_fns[name]
    if not spec then add("fsdp." .. name .. " (no case list)", function() error("add fsdp." .. name) end, "ok")
    else arg_cases("fsdp." .. name, name, f, spec) end
  end
end
for _, kind in ipairs { "nil", "number", "string" } do
  add("fsdp.cat(" .. kind .. ")", function() return fsdp.cat(values[kind]) end, "error", { "cat", "tensors" })
end

for _, name in ipairs(sorted_keys(F)) do
  local f = F[name]
  if type(f) == "function" and name:sub(1, 1) ~= "_" then
    local spec = F_fns[name]
    if not spec then add("F." .. name .. " (no case list)", function() error("add F." .. name) end, "ok")
    else arg_cases("F." .. name, name, f, spec) end
  end
end

-- ---- layers: constructor arguments, then forward inputs --------------------------------------------------
-- class -> { constructor args (valid), positions that must be numbers (or pairs), forward input makers,
-- defaults = true where a nil constructor argument takes its default }
local layers = {
  Linear = { { 3, 4 }, { 1, 2 }, { x23 } },
  Conv2d = { { 2, 3, 3 }, { 1, 2, 3 }, { img } },
  ReLU = { {}, {}, { x23 } }, Tanh = { {}, {}, { x23 } }, Sigmoid = { {}, {}, { x23 } }, GELU = { {}, {}, { x23 } },
  SiLU = { {}, {}, { x23 } },
  Identity = { {}, {}, nil },
  Softmax = { { 1 }, { 1 }, { x23 } }, LogSoftmax = { { 1 }, { 1 }, { x23 } },
  Flatten = { {}, {}, { x23 } }, Dropout = { {}, {}, { x23 } },
  MaxPool2d = { { 2 }, { 1 }, { img } }, AvgPool2d = { { 2 }, { 1 }, { img } },
  AdaptiveAvgPool2d = { { 1 }, { 1 }, { img } },
  LayerNorm = { { 3 }, { 1 }, { x23 } }, Embedding = { { 3, 2 }, { 1, 2 }, { idx } },
  BatchNorm1d = { { 3 }, { 1 }, { x23 } }, BatchNorm2d = { { 2 }, { 1 }, { img } },
  SyncBatchNorm = { { 2 }, { 1 }, { img } }, _BatchNorm = { { 3 }, { 1 }, { x23 } },
  GroupNorm = { { 1, 3 }, { 1, 2 }, { x23 } }, RMSNorm = { { 3 }, { 1 }, { x23 } },
  CrossEntropyLoss = { {}, {}, { x23, idx } }, NLLLoss = { {}, {}, { x23, idx } }, MSELoss = { {}, {}, { x23, x23 } },
  Sequential = { nil, {}, { x32 } }, ModuleList = { nil, {}, nil }, ModuleDict = { nil, {}, nil },
  ConvTranspose2d = { { 2, 3, 3 }, { 1, 2, 3 }, { img } }, Dropout2d = { {}, {}, { img } },
  MultiheadAttention = { { 4, 2 }, { 1, 2 }, { seq4, seq4, seq4 } },
  TransformerEncoderLayer = { { 4, 2, 8 }, { 1, 2 }, { seq4 } },
  TransformerDecoderLayer = { { 4, 2, 8 }, { 1, 2 }, { seq4, seq4 } },
  TransformerEncoder = { { nn.TransformerEncoderLayer(4, 2, 8), 2 }, { 2 }, { seq4 } },
  TransformerDecoder = { { nn.TransformerDecoderLayer(4, 2, 8), 2 }, { 2 }, { seq4, seq4 } },
  -- (every argument has a default: nil is no bad value; the last one is left out, {} there is the options)
  Transformer = { { 4, 2, 1, 1, 8 }, { 1, 2, 3, 4 }, { seq4, seq4 }, defaults = true },
}
local layer_names = {}
for k, cls in pairs(nn) do
  if type(cls) == "table" and nn.is_module ~= cls and k ~= "Module" and k ~= "functional" and k ~= "init"
     and getmetatable(cls) and rawget(cls, "__name") then
    layer_names[#layer_names + 1] = k
  end
end
table.sort(layer_names)
for _, name in ipairs(layer_names) do
  local spec, cls = layers[name], nn[name]
  if not spec then add("nn." .. name .. " (no case list)", function() error("add nn." .. name) end, "ok")
  else
    local ctor, numeric, inputs = spec[1] or {}, spec[2], spec[3]
    local function make()
      if name == "Sequential" then return cls(nn.Linear(2, 3)) end
      if name == "ModuleList" then return cls({ nn.Linear(2, 3) }) end
      if name == "ModuleDict" then return cls({ { "a", nn.Linear(2, 3) } }) end
      return cls(unpack(ctor))
    end
    for _, pos in ipairs(numeric) do
      local dim_arg = name == "Softmax" or name == "LogSoftmax"  -- (a dim: -1 is the last)
      for _, kind in ipairs { "nil", "string", "table", "nan", "inf", "frac", "huge", "neg" } do
        if not (dim_arg and kind == "neg") and not (spec.defaults and kind == "nil") then
          add(("nn.%s(arg %d = %s)"):format(name, pos, kind), function()
            local a = { unpack(ctor) }
            a[pos] = bad_value(kind)
            return cls(unpack(a, 1, #ctor))
          end, "error", { name })
        end
      end
    end
    if name == "Sequential" or name == "ModuleList" or name == "ModuleDict" then
      for _, kind in ipairs { "number", "string" } do
        add(("nn.%s(%s)"):format(name, kind), function() return cls(values[kind]) end, "error", { name })
      end
    end
    if inputs then
      for i = 1, #inputs do
        for _, kind in ipairs(bad_values.T) do
          add(("nn.%s forward input %d = %s"):format(name, i, kind), function()
            local m = make()
            local a = {}
            for j, mk in ipairs(inputs) do a[j] = mk() end
            a[i] = values[kind]
            return m(unpack(a, 1, #inputs))
          end, "error", { name == "Sequential" and "Linear" or name })
        end
      end
    end
  end
end

-- ---- optimizers --------------------------------------------------------------------------------------------
local function params() return { fsdp.randn(2):requires_grad_() } end
for _, name in ipairs { "SGD", "Adam", "AdamW" } do
  local cls = optim[name]
  for _, p in ipairs { { "nil", nil }, { "number", 1 }, { "string", "s" }, { "empty table", {} },
                       { "{1}", { 1 } }, { "{\"s\"}", { "s" } }, { "{{}}", { {} } }, { "{{params = 1}}", { { params = 1 } } } } do
    add(("optim.%s(params = %s)"):format(name, p[1]), function() return cls(p[2], { lr = 0.1 }) end, "error",
      { name, "param" })
  end
  local bad_opts = { { "lr", "s" }, { "lr", {} }, { "weight_decay", "s" }, { "maximize", "s" } }
  if name == "SGD" then
    bad_opts[#bad_opts + 1] = { "momentum", "s" }
    bad_opts[#bad_opts + 1] = { "dampening", {} }
    bad_opts[#bad_opts + 1] = { "nesterov", 1 }
  else
    bad_opts[#bad_opts + 1] = { "eps", "s" }
    bad_opts[#bad_opts + 1] = { "betas", "s" }
    bad_opts[#bad_opts + 1] = { "betas", { "a", 0.9 } }
    bad_opts[#bad_opts + 1] = { "amsgrad", "s" }
  end
  for _, o in ipairs(bad_opts) do
    add(("optim.%s({%s = %s})"):format(name, o[1], type(o[2])), function()
      return cls(params(), { [o[1]] = o[2] })
    end, "error", { name, o[1] == "betas" and "beta" or o[1] })
  end
  add(("optim.%s(params, \"s\")"):format(name), function() return cls(params(), "s") end, "error", { name })
  add(("optim.%s(params, 0.1)"):format(name), function()
    local opt = cls(params(), 0.1)
    if opt.param_groups[1].lr ~= 0.1 then error("lr is " .. tostring(opt.param_groups[1].lr)) end
  end, "ok")
end

-- ---- the rest of the public surface, one table per namespace: name -> argument specs (as above)
-- (an entry `false` names a function that takes no argument a hostile call can get wrong)
local function model() return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)) end
local function sgd() return optim.SGD(model():parameters(), 0.1) end
local cur_opt  -- (a scheduler's optimizer: made by its first argument, used by SequentialLR's list)
local function opt_maker() cur_opt = optim.SGD({ fsdp.randn(2):requires_grad_() }, { lr = 0.1, momentum = 0.9 }); return cur_opt end
local function ds() return fsdp.data.TensorDataset(fsdp.randn(6, 2), fsdp.arange(6)) end
local file = tmp .. "/t.safetensors"
fsdp.save(file, { a = fsdp.ones(2) })
local ckdir = tmp .. "/ck"
fsdp.save_sharded(ckdir, model())

local surface = {
  { "optim.lr_scheduler", S, {
    LRScheduler = false,  -- (the base class)
    LambdaLR = { { "OPT", "optimizer", opt_maker }, { "FN", "lr_lambda", v(function() return 1 end) } },
    StepLR = { { "OPT", "optimizer", opt_maker }, { "I+", "step_size", v(2) }, { "F?", "gamma", v(0.1), ok = { table = true } } },
    MultiStepLR = { { "OPT", "optimizer", opt_maker }, { "IL", "milestones", v({ 2, 4 }) }, { "F?", "gamma", v(0.1), ok = { table = true } } },
    ExponentialLR = { { "OPT", "optimizer", opt_maker }, { "F", "gamma", v(0.9) } },
    CosineAnnealingLR = { { "OPT", "optimizer", opt_maker }, { "I+", "T_max", v(10) }, { "F?", "eta_min", v(0), ok = { table = true } } },
    LinearLR = { { "OPT", "optimizer", opt_maker }, { "F?", "start_factor", v(0.5) }, { "F?", "end_factor", v(1) },
      { "I+?", "total_iters", v(5), ok = { table = true } } },
    OneCycleLR = { { "OPT", "optimizer", opt_maker }, { "F", "max_lr", v(0.1) }, { "I+?", "total_steps", v(10), ok = { table = true } } },
    SequentialLR = { { "OPT", "optimizer", opt_maker },
      { "L", "schedulers", function() return { S.LinearLR(cur_opt), S.StepLR(cur_opt, 2) } end },
      { "IL", "milestones", v({ 3 }), says = { lneg = "milestones[1]", lnan = "milestones[1]", lfrac = "milestones[1]" } } },
    ReduceLROnPlateau = { { "OPT", "optimizer", opt_maker }, { "O?", "options", v(nil), frag = "mode" } },  -- (its first is mode)
  } },
  { "data", fsdp.data, {
    Dataset = false, Sampler = false,  -- (base classes)
    TensorDataset = { { "T", "tensors", function() return fsdp.randn(4, 2) end, frag = "argument 1" } },
    DataLoader = { { "DS", "dataset", ds }, { "O?", "options", v(nil) } },
    SequentialSampler = { { "DS", "dataset", ds } },  -- (a number is a length)
    RandomSampler = { { "DS", "dataset", ds }, { "O?", "options", v(nil) } },
    DistributedSampler = { { "DS", "dataset", ds }, { "O?", "options", v(nil) } },
    default_collate = { { "L", "samples", function() return { fsdp.ones(2), fsdp.ones(2) } end } },
    randperm = { { "I", "n", v(4) }, { "I", "seed", v(1) } },
    get_worker_info = false,
  } },
  { "nn.utils", nn.utils, {
    clip_grad_norm_ = { { "L", "parameters", function() local m = model(); m(x23()):sum():backward(); return m:parameters() end,
      says = { number = "parameters" } }, { "F", "max_norm", v(1), ok = { inf = true } } },
    clip_grad_value_ = { { "L", "parameters", function() return model():parameters() end }, { "F", "clip_value", v(1), ok = { inf = true } } },
    parameters_to_vector = { { "L", "parameters", function() return model():parameters() end } },
    vector_to_parameters = { { "T", "vec", function() return fsdp.zeros(46) end },
      { "L", "parameters", function() return model():parameters() end } },
  } },
  { "nn.init", nn.init, {
    uniform_ = { { "T", "tensor", x23 }, { "F?", "a", v(0) }, { "F?", "b", v(1) } },
    normal_ = { { "T", "tensor", x23 }, { "F?", "mean", v(0) }, { "F?", "std", v(1) } },
    constant_ = { { "T", "tensor", x23 }, { "N", "val", v(2) } },
    ones_ = { { "T", "tensor", x23 } }, zeros_ = { { "T", "tensor", x23 } },
    xavier_uniform_ = { { "T", "tensor", x23 }, { "F?", "gain", v(1) } },
    xavier_normal_ = { { "T", "tensor", x23 }, { "F?", "gain", v(1) } },
    kaiming_uniform_ = { { "T", "tensor", x23 }, { "O?", "options", v(nil), ok = { number = true } } },
    kaiming_normal_ = { { "T", "tensor", x23 }, { "O?", "options", v(nil), ok = { number = true } } },
    calculate_gain = { { "S", "nonlinearity", v("relu") }, { "F?", "param", v(nil) } },
  } },
  { "fsdp (files, checkpoints, FSDP)", fsdp, {
    save = { { "P", "path", v(tmp .. "/s.safetensors") }, { "TT", "tensors", function() return { a = fsdp.ones(2) } end,
      ok = { notensor = true }, frag = "table of name", says = { cyclic = "contains itself" } },
      { "X?", "metadata", v(nil) } },  -- (a table of plain values is saved too: {a = 1})
    load = { { "P", "path", v(file) }, { "O?", "options", v(nil), frag = "opts" } },
    save_sharded = { { "P", "dir", v(tmp .. "/ss") }, { "M", "model", model }, { "OPT?", "optimizer", v(nil) },
      { "X?", "extra", v(nil) } },
    load_sharded = { { "P", "dir", v(ckdir) }, { "M", "model", model }, { "OPT?", "optimizer", v(nil) } },
    wrap = { { "M", "module", model }, { "O?", "options", v(nil) } },
    auto_wrap = { { "M", "module", model }, { "O?", "options", v(nil) } },
    clip_grad_norm = { { "M", "model", model, ok = { table = true } }, { "F", "max_norm", v(1), ok = { inf = true } },
      { "F?", "norm_type", v(2), ok = { inf = true, table = true } } },
    -- (a list of parameters is a model too; inf: the max norm, and no clipping; a table there: the options)
    clip_grad_value = { { "M", "model", model, ok = { table = true } }, { "F", "clip_value", v(1), ok = { inf = true } } },
    summary = { { "M", "model", model }, { "O?", "options", v(nil) } },
    reset_parameters = { { "M", "model", model } },
    unit_states = { { "M", "model", model } },
    all_idle = {},
    checkpoint = { { "FN", "fn", v(function(x) return x end), frag = "function" } },
  } },
  { "nn.Transformer", nn.Transformer, {
    generate_square_subsequent_mask = { { "I", "sz", v(3) }, { "S?", "device", v("cpu") },
      { "S?", "dtype", v("float32"), ok = { table = true } } },  -- ({} in the last place: the options)
    forward = false, reset_parameters = false,  -- (its methods: the layer loop above)
  } },
  { "checkpoint", require "fsdp.checkpoint", {
    save_sharded = false, load_sharded = false,  -- (fsdp.save_sharded and fsdp.load_sharded, above)
    read = { { "P", "dir", v(ckdir) } },
    consolidate = { { "P", "dir", v(ckdir) }, { "P", "out", v(tmp .. "/c.safetensors") } },
  } },
}
for _, ns in ipairs(surface) do
  local label, mod, specs = ns[1], ns[2], ns[3]
  local names = {}
  for k, f in pairs(mod) do
    if type(k) == "string" and k:sub(1, 1) ~= "_" and (type(f) == "function" or type(f) == "table" and getmetatable(f)) then
      names[#names + 1] = k
    end
  end
  if mod == fsdp then names = {} for k in pairs(specs) do names[#names + 1] = k end end  -- (fsdp's own: above)
  table.sort(names)
  for _, name in ipairs(names) do
    local spec = specs[name]
    if spec == nil then
      add(label .. "." .. name .. " (no case list)", function() error("add " .. label .. "." .. name .. " to hostile.lua") end, "ok")
    elseif spec then
      arg_cases(label .. "." .. name, name, function(...) return mod[name](...) end, spec)
    end
  end
end
-- the public names fsdp gives on first use (its __index): each one above or in the tables before
for _, name in ipairs(fsdp._lazy_names()) do
  local known = fsdp_fns[name] or comm_fns[name]
  for _, ns in ipairs(surface) do known = known or (ns[2] == fsdp and ns[3][name] ~= nil) end
  if not known and type(fsdp[name]) == "function" then
    add("fsdp." .. name .. " (no case list)", function() error("add fsdp." .. name .. " to hostile.lua") end, "ok")
  end
end

-- Module methods, on a Linear (a wrapped model's are FSDP's: param_access_spec)
local module_methods = {
  add_module = { { "S", "name", v("extra"), ok = { nul = true, bogus = true } }, { "M", "module", function() return nn.ReLU() end } },
  register_module = { { "S", "name", v("extra"), ok = { nul = true, bogus = true } }, { "M", "module", function() return nn.ReLU() end } },
  register_buffer = { { "S", "name", v("buf"), ok = { nul = true, bogus = true } }, { "T?", "tensor", x23 } },
  register_parameter = { { "S", "name", v("par"), ok = { nul = true, bogus = true } }, { "T?", "param", leaf23 } },
  apply = { { "FN", "fn", v(function() end) } },
  register_forward_hook = { { "FN", "hook", v(function() end) } },
  register_forward_pre_hook = { { "FN", "hook", v(function() end) } },
  no_sync = { { "FN", "fn", v(function() end), frag = "not wrapped" } },  -- (on a module without units)
  summon_full_params = { { "FN", "fn", v(function() end) }, { "O?", "options", v(nil) } },
  load_state_dict = { { "TT", "state_dict", function() return nn.Linear(3, 4):state_dict() end,
    says = { notensor = "Unexpected key", cyclic = "Unexpected key" } },
    { "B?", "strict", v(true), ok = { table = true } } },  -- ({}: the options {strict = ...})
  to = { { "S", "dtype or device", v("float32"), frag = "to" } },
  to_empty = { { "O?", "options", v({ device = "cpu" }), says = { string = "device" } } },
  train = { { "B?", "mode", v(true) } }, requires_grad_ = { { "B?", "requires_grad", v(true) } },
  zero_grad = { { "B?", "set_to_none", v(true) } },
  named_parameters = { { "B?", "recurse", v(true) } }, parameters = { { "B?", "recurse", v(true) } },
  named_buffers = { { "B?", "recurse", v(true) } }, buffers = { { "B?", "recurse", v(true) } },
  named_modules = { { "S?", "prefix", v("") , ok = { nul = true, bogus = true } } },
  state_dict = { { "O?", "options", v(nil) } },
  -- no arguments, or class-level helpers (Module.extend, new, is, isinstance, is_module, Parameter: nn_spec)
  children = false, named_children = false, modules = false, eval = false, cpu = false, float = false, half = false,
  bfloat16 = false, num_parameters = false, extra_repr = false, forward = false, extend = false, new = false, is = false,
  isinstance = false, is_module = false, Parameter = false,
}
for _, name in ipairs(sorted_keys(nn.Module)) do
  local f = nn.Module[name]
  if type(f) == "function" and name:sub(1, 1) ~= "_" then
    local spec = module_methods[name]
    if spec == nil then add("Module:" .. name .. " (no case list)", function() error("add Module:" .. name) end, "ok")
    elseif spec then arg_cases("Module:" .. name, name, f, spec, function() return nn.Linear(3, 4) end) end
  end
end

-- every optimizer class has its cases (the loops above and below name them)
for _, name in ipairs(sorted_keys(optim)) do
  if type(optim[name]) == "table" and name ~= "Optimizer" and name ~= "lr_scheduler"
     and name ~= "SGD" and name ~= "Adam" and name ~= "AdamW" then
    add("optim." .. name .. " (no case list)", function() error("add optim." .. name .. " to hostile.lua") end, "ok")
  end
end

-- numbers that must be in range for an optimizer (PyTorch's "Invalid learning rate: -1")
for _, name in ipairs { "SGD", "Adam", "AdamW" } do
  local opts = { { "lr", 0 / 0 }, { "lr", -1 }, { "lr", math.huge }, { "weight_decay", -1 }, { "weight_decay", 0 / 0 } }
  if name == "SGD" then
    opts[#opts + 1] = { "momentum", -1 }
    opts[#opts + 1] = { "dampening", 0 / 0 }
  else
    opts[#opts + 1] = { "eps", -1 }
    opts[#opts + 1] = { "betas", { 1.5, 0.9 } }
    opts[#opts + 1] = { "betas", { 0.9, 0 / 0 } }
    opts[#opts + 1] = { "betas", { 0.9 } }
  end
  for _, o in ipairs(opts) do
    add(("optim.%s({%s = %s})"):format(name, o[1], type(o[2]) == "table" and "{...}" or tostring(o[2])), function()
      return optim[name]({ fsdp.randn(2):requires_grad_() }, { [o[1]] = o[2] })
    end, "error", { name, o[1] == "betas" and "beta" or o[1] })
  end
end

-- ---- rules an op has for its tensors' dtypes, shapes and values: an error, or the right result ----
local function rule(name, fn, frags) add("rule: " .. name, fn, "error", frags) end
-- (a result that must be right: fn raises when it is not)
local function right(name, fn) add("right: " .. name, fn, "ok") end
local function i64(t) return fsdp.tensor(t, "int64") end
rule("Dropout(1.5)", function() return nn.Dropout(1.5) end, { "Dropout", "p" })
rule("Dropout(-0.1)", function() return nn.Dropout(-0.1) end, { "Dropout", "p" })
rule("Dropout(nan)", function() return nn.Dropout(0 / 0) end, { "Dropout", "p" })
rule("F.dropout(x, 1.5)", function() return F.dropout(x23(), 1.5, true) end, { "dropout", "p" })
rule("cross_entropy class 5 of 3", function() return F.cross_entropy(x23(), i64 { 0, 5 }) end, { "cross_entropy", "5" })
rule("cross_entropy class -2", function() return F.cross_entropy(x23(), i64 { 0, -2 }) end, { "cross_entropy", "-2" })
rule("nll_loss class 3 of 3", function() return F.nll_loss(x23(), i64 { 3, 0 }) end, { "nll_loss", "3" })
rule("cross_entropy float target of another shape", function() return F.cross_entropy(x23(), fsdp.ones(2)) end,
  { "cross_entropy", "target" })
rule("embedding index 3 of 3", function() return F.embedding(i64 { 3 }, x32()) end, { "embedding", "3" })
rule("embedding float input", function() return F.embedding(fsdp.ones(2), x32()) end, { "embedding", "int64" })
rule("index_select float index", function() return x23():index_select(1, fsdp.ones(1)) end, { "index_select", "int64" })
rule("gather float index", function() return x23():gather(2, fsdp.ones(2, 1)) end, { "gather", "int64" })
rule("gather index 3 of 3", function() return x23():gather(2, i64 { { 3 }, { 0 } }) end, { "gather", "3" })
rule("scatter_add index out of range", function() return x23():scatter_add(2, i64 { { 5 }, { 0 } }, x23()) end,
  { "scatter_add", "5" })
rule("matmul (2, 3) @ (2, 3)", function() return x23():matmul(x23()) end, { "matmul", "(2, 3)" })
rule("bmm batch 1 vs 2", function() return fsdp.randn(1, 2, 3):bmm(fsdp.randn(2, 3, 2)) end, { "bmm" })
rule("linear weight (4, 2) for 3 features", function() return F.linear(x23(), fsdp.randn(4, 2)) end, { "linear" })
rule("conv2d in-channels 3 vs 2", function() return F.conv2d(fsdp.randn(1, 3, 4, 4), cw()) end, { "conv2d" })
rule("mse_loss (2, 3) vs (3, 2)", function() return F.mse_loss(x23(), x32()) end, { "mse_loss" })
rule("masked_fill float mask", function() return x23():masked_fill(x23(), 0) end, { "masked_fill", "mask" })
rule("where float condition", function() return fsdp.where(x23(), x23(), x23()) end, { "where", "condition" })
rule("multinomial negative probs", function() return fsdp.tensor { 0.5, -0.1 }:multinomial(1) end, { "multinomial" })
rule("multinomial all zero", function() return fsdp.zeros(3):multinomial(1) end, { "multinomial" })
rule("multinomial NaN probs", function() return fsdp.tensor { 0.5, 0 / 0 }:multinomial(1) end, { "multinomial" })
rule("item of 2 elements", function() return fsdp.ones(2):item() end, { "item" })
rule("x[3] of size 2", function() return x23()[3] end, { "index", "3" })
rule("x[0] (1-based)", function() return x23()[0] end, { "index", "0" })
rule("x[1.5]", function() return x23()[1.5] end, { "index", "1.5" })
rule("x[3] = 1 of size 2", function() local t = x23(); t[3] = 1 end, { "index", "3" })
rule("view (3, 3) of 6", function() return x23():view(3, 3) end, { "view", "(3, 3)" })
rule("view of a transpose", function() return x23():t():view(6) end, { "view" })
rule("view two -1", function() return x23():view(-1, -1) end, { "view", "-1" })
rule("silu of int64", function() return F.silu(i64 { 1, 2 }) end, { "silu", "int64" })
rule("softmax of int64", function() return i64 { 1, 2 }:softmax(1) end, { "softmax", "int64" })
rule("backward of 2 elements", function() return (fsdp.randn(2):requires_grad_() * 2):backward() end, { "backward" })
rule("backward without grad", function() return fsdp.randn(2):sum():backward() end, { "backward" })
rule("requires_grad_ on int64", function() return i64 { 1 }:requires_grad_() end, { "requires_grad", "int64" })
rule("DataLoader batch_size 0", function() return fsdp.data.DataLoader(ds(), { batch_size = 0 }) end, { "DataLoader", "batch_size" })
rule("DataLoader batch_size 1.5", function() return fsdp.data.DataLoader(ds(), { batch_size = 1.5 }) end,
  { "DataLoader", "batch_size" })
rule("DataLoader batch_size nan", function() return fsdp.data.DataLoader(ds(), { batch_size = 0 / 0 }) end,
  { "DataLoader", "batch_size" })
rule("DataLoader unknown option", function() return fsdp.data.DataLoader(ds(), { batchsize = 2 }) end, { "DataLoader", "batchsize" })
rule("DataLoader num_workers -1", function() return fsdp.data.DataLoader(ds(), { num_workers = -1 }) end, { "DataLoader", "num_workers" })
rule("DataLoader prefetch_factor without workers", function() return fsdp.data.DataLoader(ds(), { prefetch_factor = 2 }) end,
  { "DataLoader", "prefetch_factor" })
rule("TensorDataset rows 6 vs 5", function() return fsdp.data.TensorDataset(fsdp.ones(6), fsdp.ones(5)) end,
  { "TensorDataset", "6" })
rule("DistributedSampler rank 2 of 2", function() return fsdp.data.DistributedSampler(ds(), { num_replicas = 2, rank = 2 }) end,
  { "DistributedSampler", "rank" })
rule("ReduceLROnPlateau:step(nil)", function() return S.ReduceLROnPlateau(sgd()):step() end, { "ReduceLROnPlateau", "metric" })
-- (PyTorch promotes mixed dtypes; here they are an error naming both)
rule("cat of float32 and int64", function() return fsdp.cat({ fsdp.tensor { 1.5 }, i64 { 2 } }) end, { "cat", "int64" })
rule("int64 + float32", function() return i64 { 2 } + fsdp.tensor { 0.5 } end, { "add", "int64" })
rule("auto_wrap module_classes = {3}", function() return fsdp.auto_wrap(model(), { module_classes = { 3 } }) end,
  { "auto_wrap", "module_classes[1]" })
rule("auto_wrap module_classes with a hole", function()
  return fsdp.auto_wrap(model(), { module_classes = { nn.Linear, nil, nn.ReLU } })
end, { "auto_wrap", "module_classes has a hole" })
rule("auto_wrap min_params = NaN", function() return fsdp.auto_wrap(model(), { min_params = 0 / 0 }) end,
  { "auto_wrap", "min_params" })
rule("to int64 of 1e30", function() return fsdp.tensor { 1, 1e30 }:to("int64") end, { "to", "element 2" })
rule("to int64 of NaN", function() return fsdp.tensor { 0 / 0 }:long() end, { "to", "int64" })
rule("int64 fill_(1e30)", function() return fsdp.zeros({ 2 }, "int64"):fill_(1e30) end, { "fill_", "int64" })
rule("fsdp.tensor({-1e30}, int64)", function() return fsdp.tensor({ -1e30 }, "int64") end, { "int64" })
rule("copy_ (3, 2) into (2, 3)", function() return fsdp.zeros(2, 3):copy_(fsdp.ones(3, 2)) end, { "copy_", "(3, 2)" })
rule("copy_ into an expanded view", function() return fsdp.zeros(1, 3):expand(2, 3):copy_(fsdp.ones(2, 3)) end,
  { "copy_" })
rule("fill_ of an expanded view", function() return fsdp.zeros(1, 3):expand(2, 3):fill_(1) end, { "fill_" })
rule("set_rng_state{0, 0, 0, 0}", function() return fsdp.set_rng_state { 0, 0, 0, 0 } end, { "set_rng_state" })
rule("set_num_threads(100000)", function() return fsdp.set_num_threads(100000) end, { "set_num_threads", "100000" })
right("int64 fill_(2.5) truncates toward zero, as PyTorch", function()
  assert(fsdp.zeros({ 2 }, "int64"):fill_(-2.5):tolist()[1] == -2)
end)
right("zeros(2, 3, nil): a nil after the last entry", function() assert(fsdp.zeros(2, 3, nil):numel() == 6) end)
right("tile{}: the tensor", function() assert(x23():tile({}):numel() == 6) end)
right("clip_grad_norm(model, math.huge): the norm, no clipping", function()
  local m = model()
  m(fsdp.randn(2, 3)):sum():backward()
  local before = m[1].weight.grad:clone()
  local n = fsdp.clip_grad_norm(m, math.huge)
  assert(n > 0 and (m[1].weight.grad - before):abs():max():item() == 0)
end)
right("manual_seed(-1) is manual_seed(2^64 - 1)", function()
  fsdp.manual_seed(-1); local a = fsdp.randn(3):tolist()
  fsdp.manual_seed(2 ^ 64 - 2 ^ 11); fsdp.manual_seed(-1); local b = fsdp.randn(3):tolist()
  assert(a[1] == b[1] and a[3] == b[3])
end)

-- ---- the collectives (fsdp/comm.lua), in this one process: world size 1 --------------------------
local comm_specs = {
  init = { { "S?", "backend", v(nil), ok = { nul = false } } },
  -- (a table in op's or src's place is the options; all_gather(input) allocates the output)
  all_reduce = { { "T", "tensor", x23 }, { "S?", "op", v("sum"), ok = { table = true } } },
  broadcast = { { "T", "tensor", x23 }, { "Z?", "src", v(0), ok = { table = true } } },
  all_gather = { { "T", "out", function() return fsdp.zeros(2, 3) end }, { "T", "input", x23, ok = { ["nil"] = true, table = true } } },
  reduce_scatter = { { "T", "out", function() return fsdp.zeros(2, 3) end }, { "T", "input", x23 },
    { "S?", "op", v("sum"), ok = { table = true } } },
}
for _, name in ipairs(sorted_keys(comm_fns)) do
  if comm_specs[name] then arg_cases("fsdp." .. name, name, function(...) return fsdp[name](...) end, comm_specs[name]) end
end

-- ---- dims and positions in the user's 1-based count (the C layer's 0-based dims never show) ------------
local function dim_case(name, fn, frags) add("1-based: " .. name, fn, "error", frags) end
dim_case("narrow(2, 0, 3)", function() return x23():narrow(2, 0, 3) end, { "narrow", "start 0 (1-based)", "dim 2 of size 3" })
dim_case("narrow(3, 1, 1)", function() return x23():narrow(3, 1, 1) end,
  { "narrow", "dimension 3 out of range for a tensor with 2 dims (1-based" })
dim_case("transpose(1, 3)", function() return x23():transpose(1, 3) end, { "transpose", "dimension 3 out of range" })
dim_case("permute(1, 1)", function() return x23():permute(1, 1) end, { "permute", "dim 1 repeats" })
dim_case("permute(1, 3)", function() return x23():permute(1, 3) end, { "permute", "dimension 3 out of range" })
dim_case("sum(3)", function() return x23():sum(3) end, { "sum", "dimension 3 out of range" })
dim_case("softmax(-3)", function() return x23():softmax(-3) end, { "softmax", "dimension -3 out of range" })
dim_case("cat sizes", function() return fsdp.cat({ x23(), fsdp.randn(3, 3) }, 2) end,
  { "cat", "except in dim 2", "tensor 2 has shape (3, 3) and tensor 1 has (2, 3)" })
dim_case("cat(3)", function() return fsdp.cat({ x23(), x23() }, 3) end, { "cat", "dimension 3 out of range" })
dim_case("index_select(3)", function() return x23():index_select(3, idx()) end, { "index_select", "dimension 3 out of range" })
dim_case("index_select value", function() return x23():index_select(2, fsdp.tensor({ 5 }, "int64")) end,
  { "index_select", "index 5 (at position 1)", "dim 2 of size 3" })
dim_case("expand", function() return x23():expand(3, 3) end, { "expand", "existing size 2 at dim 1" })
dim_case("squeeze(3)", function() return x23():squeeze(3) end, { "squeeze", "dimension 3 out of range" })
dim_case("flatten(2, 1)", function() return x23():flatten(2, 1) end, { "flatten", "start_dim 2 comes after end_dim 1" })
dim_case("max(3)", function() return x23():max(3) end, { "max", "dimension 3 out of range" })
dim_case("broadcast", function() return x23() + x32() end, { "add", "cannot be broadcast (dim 1: 2 vs 3)" })
dim_case("F.softmax dim", function() return F.softmax(x23(), 3) end, { "softmax", "dimension 3 out of range" })

-- ---- run -----------------------------------------------------------------------------------------------
if mode == "list" then
  for i, c in ipairs(cases) do
    print(("CASE\t%d\t%s\t%s\t%s"):format(i, c.want, table.concat(c.frags or {}, "|"), c.name))
  end
  os.exit(0)
end
io.stdout:setvbuf("no")
for i = first, #cases do
  local c = cases[i]
  io.write(("START %d\n"):format(i))
  local ok, err = pcall(c.fn)
  if ok then
    io.write(("RES %d OK\n"):format(i))
  else
    io.write(("RES %d ERR %s\n"):format(i, (tostring(err):gsub("\n", " "))))
  end
  if i % 50 == 0 then collectgarbage() end
end
collectgarbage()
io.write(("ALIVE %s\n"):format(tostring((fsdp.ones(2) + 1):sum():item())))
