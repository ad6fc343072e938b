-- backend/cpu/cpuinfo.c: what make bench reports about the machine. The ISA is one of the three
-- the library knows, OpenBLAS names the kernels it picked, and the FMA peak is a positive rate
-- no faster than 64 flops per cycle at 10 GHz could give (a sanity bound, not a timing test).
local ffi = require "ffi"
local fsdp = require "fsdp"

describe("cpu info", function()
  it("names the ISA and OpenBLAS's kernels, and measures a plausible FMA peak", function()
    local isa = ffi.string(fsdp.C.fsdp_cpu_isa())
    assert.truthy(isa == "avx512f" or isa == "avx2+fma" or isa == "sse2", isa)
    local flags = io.open("/proc/cpuinfo"):read("*a")
    if isa == "avx512f" then assert.truthy(flags:find(" avx512f"), "avx512f reported but not in /proc/cpuinfo") end
    assert.truthy(#ffi.string(fsdp.C.fsdp_cpu_blas_core()) > 0)
    local peak = fsdp.C.fsdp_cpu_fma_peak(0.05)
    assert.truthy(peak > 0.5 and peak < 640, "peak " .. peak .. " GFLOP/s")
  end)

  -- lua/fsdp/init.lua: idle OpenMP threads spin briefly, then sleep; a user's own settings win
  it("sets OpenMP's wait policy before libgomp loads, unless the user set it", function()
    local H = require "helpers"
    for env, want in pairs { ["env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT"] = "passive 10000",
                             ["OMP_WAIT_POLICY=active GOMP_SPINCOUNT=5"] = "active 5" } do
      local rc, out = H.lua([[io.write(os.getenv("OMP_WAIT_POLICY"), " ", os.getenv("GOMP_SPINCOUNT"))]], env)
      assert.equal(0, rc, out)
      assert.equal(want, (out:gsub("%s*__rc=%d+%s*$", "")))
    end
  end)

  -- OpenBLAS runs inside our threads, one each (src/backend/cpu/backend.c): it loads without
  -- workers of its own whatever OPENBLAS_NUM_THREADS says, which processes we start still see
  it("loads OpenBLAS single-threaded and leaves OPENBLAS_NUM_THREADS to the programs it starts", function()
    local H = require "helpers"
    local rc, out = H.lua([[
      local ffi = require "ffi"
      ffi.cdef "int openblas_get_num_threads(void);"
      local blas = ffi.load("openblas")
      local f = io.open("/proc/self/status"); local threads = f:read("*a"):match("Threads:%s*(%d+)"); f:close()
      fsdp.set_num_threads(2)
      local y = fsdp.randn(300, 300):matmul(fsdp.randn(300, 300))
      io.write(("threads=%s blas=%d env=%s child=%s"):format(threads, blas.openblas_get_num_threads(),
        os.getenv("OPENBLAS_NUM_THREADS"), io.popen("echo $OPENBLAS_NUM_THREADS"):read("*l")))]],
      "OPENBLAS_NUM_THREADS=3 OMP_NUM_THREADS=1")
    assert.equal(0, rc, out)
    assert.truthy(out:find("threads=1 blas=1 env=3 child=3", 1, true), out)
  end)

  -- the GEMM library is a rule of the CPU's features, never a timing: every process of a job (a
  -- run and its resume, every rank) computes with the same one, so their bits agree
  it("chooses the GEMM library by a fixed rule of the CPU's features", function()
    local H = require "helpers"
    local out = ""
    for _ = 1, 4 do
      local rc, o = H.lua([[io.write(require("ffi").string(fsdp.C.fsdp_cpu_gemm_backend()), "|")]])
      assert.equal(0, rc, o)
      out = out .. o:gsub("__rc=%d+%s*$", "")
    end
    local isa, core = ffi.string(fsdp.C.fsdp_cpu_isa()), ffi.string(fsdp.C.fsdp_cpu_blas_core())
    local want = isa == "avx512f" and "onednn (AVX-512)"
      or (isa == "avx2+fma" and (core == "Haswell" or core == "Zen")) and ("openblas (AVX2 without AVX-512, OpenBLAS core " .. core .. ")")
      or ("onednn (OpenBLAS core " .. core .. ")")
    assert.equal(string.rep(want .. "|", 4), out)
  end)
end)
