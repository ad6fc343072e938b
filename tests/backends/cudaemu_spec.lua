-- The CUDA kernels run, here and in CI, on the CUDA executor (tests/cudaemu): the backend's own .cu
-- files compiled for the CPU, every CUDA thread a fiber, cuBLASLt and cuDNN as host stand-ins
-- written from NVIDIA's documentation. FSDP_CUDA_EMU=1 makes it the "cuda" device, and the suites
-- that know a GPU run through it unchanged:
--   the executor's self-test   the kernel language as a GPU runs it, and every refusal a GPU makes
--   the stand-ins' test        cuBLASLt and cuDNN against independent references
--   tests/ops/ops_spec.lua         the whole op-case table against the CPU, float32 and bf16, with the
--                              tolerances a GPU run uses
--   tests/backends/cuda_spec.lua        the device from a user's side, as on a GPU
--   the FSDP matrix            the wrapped side on it at world sizes 1 and 2, collectives through the
--                              host, and at 2 on the stand-in communicator (world size 4: make
--                              cuda-emu-check, in .ci/run, with the sanitizer runs)
--   examples/train.lua         --device cuda, the CPU run's losses within 1e-3
-- and last, every __global__ kernel of src/backend/cuda must have been launched by one of them.
-- Rerun one by hand, e.g.:  FSDP_CUDA_EMU=1 busted tests/ops/ops_spec.lua
local H = require "helpers"

local LIB = H.root .. "/libfsdp_cudaemu.so"
local BUILD = H.root .. "/build/cudaemu/"
local COVERAGE = os.tmpname()
os.remove(COVERAGE)  -- (the runs append to it)
local ENV = ("FSDP_CUDA_EMU=1 FSDP_CUDA_EMU_LIB=%s FSDP_CUDA_EMU_COVERAGE=%s FSDP_COMM_TIMEOUT=120"):format(LIB,
  COVERAGE)
local BUSTED = "luajit " .. (io.popen("command -v busted"):read("*l") or "busted")

local function built(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end
local have = built(LIB) and built(BUILD .. "selftest") and built(BUILD .. "libs_test")
local it_emu = have and it or pending

-- a spec file through busted on the executor (from the repository root, as `make test` runs it)
local function busted(spec, extra)
  local rc, out = H.sh(("%s -C %s %s %s"):format(BUSTED, H.root, extra or "", spec), ENV .. " OMP_NUM_THREADS=1 "
    .. "OPENBLAS_NUM_THREADS=1", 600)
  local summary = out:match("(%d+ success%a* / %d+ failures? / %d+ errors? / %d+ pending)")
  assert(rc == 0 and summary and summary:find(" / 0 failures / 0 errors", 1, true),
    ("%s on the CUDA executor:\n%s"):format(spec, out:sub(-4000)))
  return summary
end

describe("the CUDA executor (tests/cudaemu)", function()
  if not have then
    pending("libfsdp_cudaemu.so is not built (make cudaemu: it needs g++)")
  end

  it_emu("runs the kernel language as a GPU does and refuses what a GPU refuses (its self-test)", function()
    local rc, out = H.sh(BUILD .. "selftest", nil, 120)
    assert(rc == 0 and out:find("\nselftest OK", 1, true), out)
    -- a reduction without its barrier gives a wrong sum here (a race report under ThreadSanitizer)
    rc, out = H.sh(BUILD .. "selftest race_shared", nil, 60)
    assert(rc == 0 and out:find("race: a reduction without its barrier%s+ok"), out)
  end)

  it_emu("has cuBLASLt and cuDNN stand-ins that compute what NVIDIA documents (their test)", function()
    local rc, out = H.sh(BUILD .. "libs_test", nil, 120)
    assert(rc == 0 and out:find("libs_test OK", 1, true), out:sub(-3000))
  end)

  it_emu("runs the whole op-case table through the CUDA kernels, against the CPU", function()
    print("\n  ops_spec on the CUDA executor: " .. busted("tests/ops/ops_spec.lua"))
  end)

  it_emu("is the device of tests/backends/cuda_spec.lua, as a GPU", function()
    busted("tests/backends/cuda_spec.lua")
  end)

  -- the FSDP matrix with its wrapped side on the executor
  local function matrix(np, plane)
    local rc, out = H.sh(("%s -n %d %s/tests/scripts/fsdp_matrix.lua"):format(H.fsdprun, np, H.root),
      ENV .. " FSDP_MATRIX_DEVICE=cuda" .. (plane and (" FSDP_DEVICE_COMM=" .. plane) or ""), 600)
    out = H.untag(out)
    local summary = out:match("(SUMMARY[^\n]*)")
    assert(rc == 0 and summary and summary:find("failed=0", 1, true), out:sub(-4000))
    print("\n  fsdp matrix on the CUDA executor: " .. summary)
  end
  it_emu("trains the FSDP matrix's wrapped side on it, world size 1", function() matrix(1) end)
  it_emu("trains the FSDP matrix's wrapped side on it, world size 2 (collectives through the host)", function()
    matrix(2, "host")
  end)
  it_emu("trains the FSDP matrix's wrapped side on it, world size 2 (the stand-in communicator)", function()
    matrix(2, "standin")
  end)

  it_emu("trains examples/train.lua --device cuda on it, the CPU run's losses within 1e-3", function()
    busted("tests/tools/examples_spec.lua", "--filter=device.cuda")
  end)

  it_emu("launched every __global__ kernel of src/backend/cuda in the runs above", function()
    local kernels = {}
    for file in io.popen(("ls %s/src/backend/cuda/*.cu"):format(H.root)):lines() do
      local f = assert(io.open(file))
      for decl in f:read("*a"):gmatch("__global__([^%(;]*)%(") do kernels[#kernels + 1] = decl:match("([%w_]+)%s*$") end
      f:close()
    end
    assert(#kernels >= 60, ("only %d __global__ kernels found"):format(#kernels))
    local launched = {}
    local f = io.open(COVERAGE)
    assert(f, "no kernel was launched on the executor")
    for name in f:lines() do launched[name] = true end
    f:close()
    os.remove(COVERAGE)
    local missing = {}
    for _, k in ipairs(kernels) do
      if not launched[k] then missing[#missing + 1] = k end
    end
    assert(#missing == 0, ("%d of %d kernels were never launched (add op cases or runs that reach them): %s")
      :format(#missing, #kernels, table.concat(missing, ", ")))
    print(("\n  %d kernels, every one launched"):format(#kernels))
  end)
end)
