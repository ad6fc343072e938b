-- Every collective's values on every rank, against closed forms (rank r contributes r+1+i).
-- Run by tests/fsdp/comm_spec.lua as `luajit comm_values.lua` (self backend) and `fsdprun -n 2|4`.
-- Prints "rank R/N ok" at the end; any failed check raises (non-zero exit).
local fsdp = require "fsdp"
local ffi = require "ffi"

-- FSDP_VALUES_DEVICE=cuda: every tensor on the cuda device (the test double of one without a GPU),
-- so each collective moves device memory the way FSDP_DEVICE_COMM says
local DEVICE = os.getenv("FSDP_VALUES_DEVICE")
if DEVICE == "cuda" then
  if not fsdp.cuda.is_available() then fsdp._testdev_install() end
  fsdp.set_default_device("cuda")
end
local r, N = fsdp.rank(), fsdp.world_size()
local expect_backend = arg[1] or (N > 1 and "mpi" or "self")
assert(fsdp.comm.backend() == expect_backend, "backend " .. fsdp.comm.backend() .. ", expected " .. expect_backend)
if N > 1 then  -- fsdprun's per-rank environment
  assert(os.getenv("OMP_NUM_THREADS") == "1" and os.getenv("OPENBLAS_NUM_THREADS") == "1", "fsdprun thread env")
  assert(os.getenv("OMPI_MCA_mpi_yield_when_idle") == "1", "fsdprun yield env")
end

local function check_list(got, want, what)
  got = fsdp.is_tensor(got) and got:tolist() or got
  assert(#got == #want, ("%s on rank %d: %d elements, expected %d"):format(what, r, #got, #want))
  for i = 1, #want do
    if math.abs(got[i] - want[i]) > 1e-6 * math.max(1, math.abs(want[i])) then
      error(("%s on rank %d: element %d is %.9g, expected %.9g"):format(what, r, i, got[i], want[i]), 2)
    end
  end
end

local function contrib(rank, n, dtype)  -- rank's input: rank+1+i, i = 0..n-1
  local t = {}
  for i = 0, n - 1 do t[#t + 1] = rank + 1 + i end
  return fsdp.tensor(t, dtype)
end

fsdp.comm.reset_stats()
local ag_bytes, bc_bytes = 0, 0

-- ---- all_gather: every dtype, explicit out, allocated out, non-contiguous in, in-place -------------
for _, dt in ipairs { "float32", "bfloat16", "float16", "int64" } do
  local k = 5
  local out = fsdp.zeros({ N * k }, { dtype = dt })
  fsdp.all_gather(out, contrib(r, k, dt), { tag = "ag." .. dt })
  local want = {}
  for j = 0, N - 1 do for i = 0, k - 1 do want[#want + 1] = j + 1 + i end end
  assert(out.dtype == dt)
  check_list(out, want, "all_gather " .. dt)
  ag_bytes = ag_bytes + N * k * ({ float32 = 4, bfloat16 = 2, float16 = 2, int64 = 8 })[dt]
end
do  -- allocated out keeps the trailing dims: (2, 3) per rank -> (2N, 3)
  local x = contrib(r, 6):view(2, 3)
  local g = fsdp.all_gather(x)
  local s = g:shape()
  assert(s[1] == 2 * N and s[2] == 3, "all_gather(x) shape")
  local want = {}
  for j = 0, N - 1 do for i = 0, 5 do want[#want + 1] = j + 1 + i end end
  check_list(g:reshape(-1), want, "all_gather allocated")
  ag_bytes = ag_bytes + N * 24
end
do  -- a transposed input is gathered in logical order
  local x = contrib(r, 6):view(2, 3):t()  -- (3, 2): r+1, r+4, r+2, r+5, r+3, r+6
  local out = fsdp.zeros(N * 6)
  fsdp.all_gather(out, x)
  local want = {}
  for j = 0, N - 1 do for _, i in ipairs { 0, 3, 1, 4, 2, 5 } do want[#want + 1] = j + 1 + i end end
  check_list(out, want, "all_gather non-contiguous")
  ag_bytes = ag_bytes + N * 24
end
do  -- in place: the input is this rank's slot of the output (how FSDP gathers a flat parameter)
  local k = 1000
  local out = fsdp.zeros(N * k)
  out:narrow(1, r * k + 1, k):copy_(contrib(r, k))
  fsdp.all_gather(out, out:narrow(1, r * k + 1, k), { tag = "inplace" })
  local want = {}
  for j = 0, N - 1 do for i = 0, k - 1 do want[#want + 1] = j + 1 + i end end
  check_list(out, want, "all_gather in place")
  ag_bytes = ag_bytes + N * k * 4
end

-- ---- reduce_scatter: sum/avg/max x both algorithms, small and ring-sized chunks -----------------
local rs_bytes = 0
for _, algo in ipairs { 0, 1 } do
  fsdp.comm.set_reduce_scatter_algo(algo)
  for _, k in ipairs { 3, 4097 } do
    local inp = contrib(r, N * k)
    for _, op in ipairs { "sum", "avg", "max" } do
      local out = fsdp.full({ k }, -7)
      fsdp.reduce_scatter(out, inp, op, { tag = "rs" })
      rs_bytes = rs_bytes + N * k * 4
      local want = {}
      for i = 0, k - 1 do
        local e = r * k + i  -- element index in the full buffer; rank j holds j+1+e
        local sum = N * e + N * (N + 1) / 2
        want[#want + 1] = op == "sum" and sum or op == "avg" and sum / N or N + e
      end
      check_list(out, want, ("reduce_scatter %s algo %d k %d"):format(op, algo, k))
    end
  end
end
do  -- in place: out is this rank's chunk of the input buffer
  local k = 1001
  for _, algo in ipairs { 0, 1 } do
    fsdp.comm.set_reduce_scatter_algo(algo)
    local buf = contrib(r, N * k)
    local out = buf:narrow(1, r * k + 1, k)
    fsdp.reduce_scatter(out, buf, "sum", { tag = "rs.inplace" })
    rs_bytes = rs_bytes + N * k * 4
    local want = {}
    for i = 0, k - 1 do want[#want + 1] = N * (r * k + i) + N * (N + 1) / 2 end
    check_list(out, want, "reduce_scatter in place, algo " .. algo)
  end
end
fsdp.comm.set_reduce_scatter_algo(0)
do  -- both algorithms agree on random data, bit for bit up to summation order
  fsdp.manual_seed(100 + r)
  local inp = fsdp.randn(N * 777)
  local a, b = fsdp.zeros(777), fsdp.zeros(777)
  fsdp.reduce_scatter(a, inp, "sum")
  fsdp.comm.set_reduce_scatter_algo(1)
  fsdp.reduce_scatter(b, inp, "sum")
  fsdp.comm.set_reduce_scatter_algo(0)
  rs_bytes = rs_bytes + 2 * N * 777 * 4
  local ta, tb = a:tolist(), b:tolist()
  for i = 1, #ta do assert(math.abs(ta[i] - tb[i]) <= 1e-5 * (1 + math.abs(tb[i])), "ring vs reduce_scatter_block") end
  -- and the reference: the sum of every rank's random input, regenerated here
  local ref = fsdp.zeros(N * 777)
  for j = 0, N - 1 do fsdp.manual_seed(100 + j); ref = ref + fsdp.randn(N * 777) end
  check_list(a, ref:narrow(1, r * 777 + 1, 777):tolist(), "reduce_scatter random")
end

-- ---- all_reduce and broadcast ---------------------------------------------------------------------
local ar_bytes = 0
for _, op in ipairs { "sum", "avg", "max" } do
  local t = fsdp.tensor({ 1, 2, 3, 4 }) * (r + 1)
  assert(fsdp.all_reduce(t, op) == t, "all_reduce returns its tensor")
  ar_bytes = ar_bytes + 16
  local want = {}
  for i = 1, 4 do
    want[i] = op == "sum" and i * N * (N + 1) / 2 or op == "avg" and i * (N + 1) / 2 or i * N
  end
  check_list(t, want, "all_reduce " .. op)
end
-- max keeps a NaN from any rank, as torch.max over every rank's values does (MPI_MAX dropped rank
-- 1's NaN against rank 0's number; an inf-norm clip_grad_norm then came out finite)
for nan_rank = 0, N - 1 do
  local t = fsdp.tensor { r == nan_rank and 0 / 0 or r + 1, 5 }
  fsdp.all_reduce(t, "max")
  ar_bytes = ar_bytes + 8
  local v = t:tolist()
  assert(v[1] ~= v[1] and v[2] == 5, ("all_reduce max with a NaN on rank %d: rank %d got %s, %s"):format(nan_rank, r,
    tostring(v[1]), tostring(v[2])))
  for _, algo in ipairs { 0, 1 } do
    fsdp.comm.set_reduce_scatter_algo(algo)
    local inp = contrib(r, N * 2):view(N, 2)
    if r == nan_rank then inp:select(2, 1):fill_(0 / 0) end
    local out = fsdp.zeros(2)
    fsdp.reduce_scatter(out, inp:view(-1), "max")
    rs_bytes = rs_bytes + N * 2 * 4
    local o = out:tolist()
    assert(o[1] ~= o[1] and o[2] == N + 2 * r + 1, ("reduce_scatter max algo %d with a NaN on rank %d: rank %d got %s, %s")
      :format(algo, nan_rank, r, tostring(o[1]), tostring(o[2])))
  end
  fsdp.comm.set_reduce_scatter_algo(0)
end
for root = 0, N - 1 do
  for _, dt in ipairs { "float32", "int64", "bfloat16", "float16" } do
    local t = r == root and contrib(10 * root, 3, dt) or fsdp.full({ 3 }, -1, { dtype = dt })
    fsdp.broadcast(t, root, { tag = "bc" })
    bc_bytes = bc_bytes + 3 * ({ float32 = 4, bfloat16 = 2, float16 = 2, int64 = 8 })[dt]
    check_list(t, { 10 * root + 1, 10 * root + 2, 10 * root + 3 }, "broadcast " .. dt .. " from " .. root)
  end
end
fsdp.barrier()

-- ---- async: several outstanding works, compute in between, waited in issue order -------------------
do
  local k = 65536
  local ins, outs, works = {}, {}, {}
  for j = 1, 4 do
    ins[j] = fsdp.full({ k }, 100 * j + r)
    outs[j] = fsdp.zeros(N * k)
    works[j] = fsdp.all_gather(outs[j], ins[j], { tag = "prefetch." .. j, async = true })
  end
  local g = fsdp.full({ N * k }, r + 1)
  local gs = fsdp.zeros(k)
  local wrs = fsdp.reduce_scatter(gs, g, "sum", { tag = "grads", async = true })
  local war = fsdp.all_reduce(fsdp.ones(8), "sum", { async = true })
  local m = fsdp.randn(128, 128)
  for _ = 1, 5 do m = (m:matmul(m) / 128):tanh() end  -- compute while the comm thread works
  for j = 1, 4 do
    assert(works[j]:wait() == outs[j], "wait returns the output")
    assert(works[j]:is_completed())
    local o = outs[j]
    for src = 0, N - 1 do
      local v = o:narrow(1, src * k + 1, k)
      assert((v - (100 * j + src)):abs():max():item() == 0, "async all_gather value")
    end
  end
  wrs:wait()
  assert((gs - N * (N + 1) / 2):abs():max():item() == 0, "async reduce_scatter")
  check_list(war:wait(), { N, N, N, N, N, N, N, N }, "async all_reduce")
  ag_bytes = ag_bytes + 4 * N * k * 4
  rs_bytes = rs_bytes + N * k * 4
  ar_bytes = ar_bytes + 32
end

-- ---- stats ---------------------------------------------------------------------------------------
local s = fsdp.comm_stats()
assert(s.all_gather.count == 4 + 3 + 4, "all_gather count " .. s.all_gather.count)
assert(s.all_gather.bytes == ag_bytes, ("all_gather bytes %d, expected %d"):format(s.all_gather.bytes, ag_bytes))
assert(s.reduce_scatter.count == 2 * 2 * 3 + 2 * N + 2 + 2 + 1, "reduce_scatter count " .. s.reduce_scatter.count)
assert(s.reduce_scatter.bytes == rs_bytes, ("reduce_scatter bytes %d, expected %d"):format(s.reduce_scatter.bytes, rs_bytes))
assert(s.all_reduce.count == 4 + N and s.all_reduce.bytes == ar_bytes, "all_reduce stats")
assert(s.broadcast.count == 4 * N and s.broadcast.bytes == bc_bytes, "broadcast stats")
assert(s.barrier.count == 1 and s.barrier.bytes == 0, "barrier stats")

-- ---- bad arguments are Lua errors naming the op and shapes; the communicator keeps working -----
local ok, err = pcall(fsdp.all_gather, fsdp.zeros(N * 4 + 1), fsdp.zeros(4), { tag = "bad" })
assert(not ok and err:find("all_gather 'bad'", 1, true) and err:find("(" .. (N * 4 + 1) .. ")", 1, true), err)
ok, err = pcall(fsdp.reduce_scatter, fsdp.zeros(3), fsdp.zeros(N * 3, { dtype = "int64" }))
assert(not ok and err:find("reduce_scatter") and err:find("int64"), err)
ok, err = pcall(fsdp.broadcast, fsdp.zeros(3), N)
assert(not ok and err:find("root " .. N .. " is not a rank"), err)
ok, err = pcall(fsdp.all_reduce, fsdp.zeros(3), "median")
assert(not ok and err:find('unknown op "median"'), err)
local t = fsdp.full({ 2 }, r + 1)
fsdp.all_reduce(t, "sum")
check_list(t, { N * (N + 1) / 2, N * (N + 1) / 2 }, "all_reduce after errors")

io.write(("rank %d/%d ok\n"):format(r, N))
