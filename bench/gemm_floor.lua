-- The GEMM floor of a training step: the step's Linear-layer GEMMs (bench/models.lua linear_gemms:
-- forward, input grad, weight grad), each timed alone through raw OpenBLAS sgemm on one thread,
-- summed and divided by the thread count. That is the step's time if everything but those GEMMs
-- were free and the threads shared them perfectly, packing included (OpenBLAS packs either way);
-- attention's products, the optimizer and all elementwise work count as zero. So no
-- implementation on top of this OpenBLAS runs a step faster, and floor/torch bounds ours/torch
-- from below.
--   luajit bench/gemm_floor.lua [mlp,transformer] [threads]
-- As a module: require("gemm_floor").floor_ms(name, threads) -> ms, GFLOP (nil for conv).
local ffi = require "ffi"
local fsdp = require "fsdp"
local models = require "models"
local U = require "util"

pcall(ffi.cdef, [[
void cblas_sgemm(int order, int transa, int transb, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc);
void openblas_set_num_threads(int n);
int openblas_get_num_threads(void);
]])
local blas = ffi.load("openblas")
local RowMajor, NoTrans, Trans = 101, 111, 112

local G = {}

-- min over reps of one GEMM's time on one OpenBLAS thread, seconds
local function time_gemm(ta, tb, M, N, K, reps)
  local A = ffi.new("float[?]", M * K, 0)
  local B = ffi.new("float[?]", K * N, 0)
  local C = ffi.new("float[?]", M * N, 0)
  for i = 0, M * K - 1, 7 do A[i] = (i % 13) * 0.01 end
  for i = 0, K * N - 1, 5 do B[i] = (i % 11) * 0.01 end
  local lda, ldb = ta and M or K, tb and K or N
  local best = math.huge
  for _ = 1, reps + 1 do -- the first call is untimed
    local t0 = U.seconds()
    blas.cblas_sgemm(RowMajor, ta and Trans or NoTrans, tb and Trans or NoTrans, M, N, K, 1, A, lda, B, ldb, 1, C, N)
    local t = U.seconds() - t0
    if _ > 1 and t < best then best = t end
  end
  return best
end

function G.floor_ms(name, threads, reps)
  fsdp.manual_seed(0)
  local model = models.case(name)
  local list = models.linear_gemms(name, model)
  if not list then return nil end
  local saved = blas.openblas_get_num_threads()
  blas.openblas_set_num_threads(1)
  time_gemm(false, false, 64, 1024, 384, 1) -- a wide GEMM first: see src/cpu_linalg.c openblas_warm_thread
  local total, flop = 0, 0
  for _, g in ipairs(list) do
    total = total + time_gemm(g[1], g[2], g[3], g[4], g[5], reps or 5)
    flop = flop + 2 * g[3] * g[4] * g[5]
  end
  blas.openblas_set_num_threads(saved)
  return total * 1e3 / threads, flop * 1e-9
end

if arg and arg[0] and arg[0]:match("gemm_floor%.lua$") then
  local names = arg[1] or "mlp,transformer"
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
