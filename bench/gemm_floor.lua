-- The GEMM floor of a training step: the step's Linear-layer GEMMs (bench/models.lua linear_gemms:
-- forward, input grad, weight grad), each timed alone through fsdp's own GEMM call on one thread
-- (fsdp_cpu_sgemm: the library fsdp chose, oneDNN or OpenBLAS, as backend/cpu/linalg.c calls it),
-- summed and divided by the thread count. That is the step's time if everything but those GEMMs
-- were free and the threads shared them perfectly, packing included (OpenBLAS packs either way);
-- attention's products, the optimizer and all elementwise work count as zero.
-- So no implementation on this OpenBLAS runs a step faster, and floor/torch bounds ours/torch from
-- below. (When all cores run GEMMs at once, as in a step, each core's sgemm is typically 5-15% slower
-- than alone -- shared L3 and memory, lower boost clock -- so the true bound is higher still. On a
-- shared virtual machine the clock itself moves by 10% or more between runs: compare floor and
-- steps measured in the same run.)
--   luajit bench/gemm_floor.lua [mlp,transformer,gpt] [threads]
-- As a module: require("gemm_floor").floor_ms(name, threads) -> ms, GFLOP (nil for conv, whose
-- convolutions are not Linears).
if arg and arg[0] and arg[0]:match("gemm_floor%.lua$") then -- run as a script: find the repo's modules
  local root = arg[0]:match("^(.*)/bench/[^/]*$") or "."
  package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. root .. "/bench/?.lua;" .. package.path
  package.cpath = root .. "/?.so;" .. package.cpath
end
local ffi = require "ffi"
local fsdp = require "fsdp"
local G = {}
local models = require "models"
local U = require "util"

pcall(ffi.cdef, [[
void openblas_set_num_threads(int n);
int openblas_get_num_threads(void);
]])
local blas = ffi.load("openblas")
-- the library fsdp runs its GEMMs on (backend/cpu/linalg.c)
local backend = ffi.string(fsdp.C.fsdp_cpu_gemm_backend())
G.library = backend:match("^onednn") and "oneDNN" or "OpenBLAS"


-- a GEMM's operands: A (M, K) or, transposed, (K, M); B (K, N) or (N, K); C (M, N)
local function operands(g)
  local ta, tb, M, N, K = g[1], g[2], g[3], g[4], g[5]
  local A, B, C = ffi.new("float[?]", M * K), ffi.new("float[?]", K * N), ffi.new("float[?]", M * N)
  for i = 0, M * K - 1, 7 do A[i] = (i % 13) * 0.01 end
  for i = 0, K * N - 1, 5 do B[i] = (i % 11) * 0.01 end
  return { ta and 1 or 0, tb and 1 or 0, M, N, K, A, ta and M or K, B, tb and K or N, C }
end
-- C += op(A) op(B) (beta 1: no zeroing pass; the floor counts the product alone)
local function gemm(o)
  fsdp.C.fsdp_cpu_sgemm(o[1], o[2], o[3], o[4], o[5], 1, o[6], o[7], o[8], o[9], 1, o[10], o[4])
end

local function step_list(name)
  fsdp.manual_seed(0)
  local model = models.case(name)
  return models.linear_gemms(name, model)
end

-- seconds: the sum over the list of each GEMM's best of reps single-thread runs
local function time_list(ops, reps)
  local total = 0
  for _, o in ipairs(ops) do
    gemm(o) -- untimed
    local best = math.huge
    for _ = 1, reps do
      local t0 = U.seconds()
      gemm(o)
      best = math.min(best, U.seconds() - t0)
    end
    total = total + best
  end
  return total
end

-- each distinct GEMM of the step alone, one thread: list of {ta, tb, M, N, K, count, gflops}
function G.per_gemm(name, reps)
  local list = step_list(name)
  if not list then return nil end
  local saved_omp = fsdp.C.fsdp_get_num_threads()
  fsdp.set_num_threads(1)
  local rows, seen = {}, {}
  for _, g in ipairs(list) do
    local key = table.concat({ tostring(g[1]), tostring(g[2]), g[3], g[4], g[5] }, " ")
    if seen[key] then
      seen[key][6] = seen[key][6] + 1
    else
      local o = operands(g)
      local t = time_list({ o }, reps or 5)
      local row = { g[1], g[2], g[3], g[4], g[5], 1, 2 * g[3] * g[4] * g[5] / t * 1e-9 }
      seen[key] = row
      rows[#rows + 1] = row
    end
  end
  fsdp.set_num_threads(saved_omp)
  return rows
end

function G.floor_ms(name, threads, reps)
  local list = step_list(name)
  if not list then return nil end
  reps = reps or 5
  local saved = blas.openblas_get_num_threads()
  local saved_omp = fsdp.C.fsdp_get_num_threads()
  fsdp.set_num_threads(1)  -- OpenBLAS and OpenMP (oneDNN's threads) alike
  local ops, flop = {}, 0
  for _, g in ipairs(list) do
    ops[#ops + 1] = operands(g)
    flop = flop + 2 * g[3] * g[4] * g[5]
  end
  local total = time_list(ops, reps)
  fsdp.set_num_threads(saved_omp)
  blas.openblas_set_num_threads(saved)
  return total * 1e3 / threads, flop * 1e-9
end

if arg and arg[0] and arg[0]:match("gemm_floor%.lua$") then
  local names = arg[1] or "mlp,transformer,gpt"
  local threads = tonumber(arg[2] or os.getenv("OMP_NUM_THREADS") or "") or 2
  for name in names:gmatch("[^,]+") do
    local ms, gflop = G.floor_ms(name, threads)
    if ms then
      print(("%-12s GEMM floor %8.2f ms on %d thread(s): %.2f GFLOP of Linear GEMMs at %.1f GFLOPS per thread")
        :format(name, ms, threads, gflop, gflop / (ms * threads) * 1e3))
    else
      print(("%-12s no Linear GEMMs to count"):format(name))
    end
  end
end

return G
