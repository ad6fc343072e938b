-- Collective bandwidth: fsdp's all_gather and reduce_scatter (ring, the default, and
-- MPI_Reduce_scatter_block as algorithm 1) against raw MPI_Allgather / MPI_Reduce_scatter_block,
-- at 2 and 4 ranks, 64 KB .. 64 MB full buffers.
--
--   luajit bench/comm.lua [--ranks 2,4] [--sizes 65536,...]     (needs mpicc/mpirun; run `make` first)
--
-- The timing loop is bench/comm_bench.c (built here with mpicc against libfsdp.so): one MPI job
-- per rank count runs ours and the raw MPI calls interleaved, round after round, so machine
-- noise hits both alike. Each fsdp call is issued and waited, so it includes the queue, the
-- thread hand-off and the collective check. Bus bandwidth = full buffer bytes / time * (N-1)/N
-- (what each rank sends and receives), in GB/s, from the slowest rank's time, median of rounds.
-- Ratios > 1 mean the first-named is faster.
local root = (arg and arg[0] or ""):match("^(.*)/bench/[^/]*$") or "."

-- ---- driver ------------------------------------------------------------------------------------------
local opts = { ranks = "2,4", sizes = "65536,262144,1048576,4194304,16777216,67108864" }
local i = 1
while i <= #arg do
  local key = arg[i]:match("^%-%-(%w+)$")
  if key and opts[key] and arg[i + 1] then opts[key] = arg[i + 1]; i = i + 2
  else io.stderr:write("usage: luajit bench/comm.lua [--ranks 2,4] [--sizes 65536,...]\n"); os.exit(2) end
end
local sizes = {}
for s in opts.sizes:gmatch("%d+") do sizes[#sizes + 1] = s end

local function sh(cmd)
  local p = io.popen(cmd .. " 2>&1")
  local out = p:read("*a")
  local ok = p:close()
  return out, ok
end

local exe = root .. "/build/bench_comm"
local out, ok = sh(("mkdir -p %q && mpicc -O3 -march=native -I%q %q -o %q -L%q -lfsdp -Wl,-rpath,%q")
  :format(root .. "/build", root .. "/src", root .. "/bench/comm_bench.c", exe, root, root))
if not ok then io.stderr:write("bench/comm.lua: cannot build bench/comm_bench.c (run make first?):\n" .. out); os.exit(1) end
local as_root = sh("id -u"):match("^0") and " --allow-run-as-root" or ""

local function gbs(bytes, sec, N) return bytes / sec * (N - 1) / N / 1e9 end
local function human(b)
  b = tonumber(b)
  return b >= 2 ^ 20 and ("%d MB"):format(b / 2 ^ 20) or ("%d KB"):format(b / 2 ^ 10)
end

for n in opts.ranks:gmatch("%d+") do
  local N = tonumber(n)
  local text = sh(("OMPI_MCA_mpi_yield_when_idle=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 mpirun -n %d "
    .. "--oversubscribe --bind-to none%s %s %s"):format(N, as_root, exe, table.concat(sizes, " ")))
  local res, order = {}, {}
  for case, bytes, sec in text:gmatch("([%w_]+) (%d+) ([%d.e-]+)") do
    if not res[bytes] then res[bytes] = {}; order[#order + 1] = bytes end
    res[bytes][case] = tonumber(sec)
  end
  print(("\n%d ranks: bus bandwidth in GB/s (full buffer size; slowest rank, median of 5 rounds)"):format(N))
  print(("%-6s | %8s %8s %6s | %8s %8s %8s %7s %7s"):format("size", "AG ours", "AG MPI", "ours/", "RS ring",
    "RS block", "RSB MPI", "ring/", "ring/"))
  print(("%-6s | %8s %8s %6s | %8s %8s %8s %7s %7s"):format("", "", "", "MPI", "(ours)", "(ours)", "", "block", "RSB MPI"))
  if #order == 0 then print("failed:\n" .. text) end
  for _, bytes in ipairs(order) do
    local t = res[bytes]
    local b = tonumber(bytes)
    print(("%-6s | %8.2f %8.2f %6.2f | %8.2f %8.2f %8.2f %7.2f %7.2f"):format(human(b), gbs(b, t.ours_ag, N),
      gbs(b, t.raw_ag, N), t.raw_ag / t.ours_ag, gbs(b, t.ours_ring, N), gbs(b, t.ours_block, N),
      gbs(b, t.raw_block, N), t.ours_block / t.ours_ring, t.raw_block / t.ours_ring))
  end
end
