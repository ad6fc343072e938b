-- The portable path: FSDP_CPU_ISA=sse2 installs the base copy of every kernel (compiled for
-- x86-64-v2, plain-C micro-kernels: src/backend/cpu/cpu.h) and caps oneDNN at SSE4.1, as on a CPU
-- without AVX2. The op-case table and the convolution paths run again in a child under that cap and
-- must pass as they do on the full ISA. Then every level this CPU has (sse2, avx2, avx512f where
-- present): each child reports the copy whose tables its device table holds, runs the op-case
-- table's CPU runs and the wide cases (tests/scripts/isa_wide_cases.lua: vector loops, attention's
-- tiles, norms, optimizers), and their outputs and gradients agree across the levels within the
-- tolerance of two backends (tests/backends/isa_levels.lua, which tools/isa_emu.sh uses to compare
-- the AVX-512 copy run under Bochs with the lower ones). Also: a bad FSDP_CPU_ISA and a missing shared library
-- give messages that say what to do.
package.path = "lua/?.lua;lua/?/init.lua;tests/?.lua;" .. package.path
local H = require "helpers"
local fsdp = require "fsdp"

local function sh_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end
-- a shell command line that runs the Lua code in the checkout's root
local function lua_cmd(code) return "sh -c " .. sh_quote(("cd %s && luajit -e %s"):format(sh_quote(H.root), sh_quote(code))) end

describe("the portable path (FSDP_CPU_ISA=sse2)", function()
  it("reports the cap, runs the GEMMs through oneDNN and caps oneDNN's ISA", function()
    local code = [[
      package.path = "lua/?.lua;lua/?/init.lua;" .. package.path
      local ffi = require "ffi"; local fsdp = require "fsdp"
      local y = fsdp.randn(64, 64):matmul(fsdp.randn(64, 64))  -- the first GEMM picks the library
      ffi.cdef "int dnnl_get_effective_cpu_isa(void);"
      local dnnl = ffi.load("libdnnl.so.2")
      print(("isa=%s gemm=%s dnnl_isa=%d"):format(ffi.string(fsdp.C.fsdp_cpu_isa()),
        ffi.string(fsdp.C.fsdp_cpu_gemm_backend()), dnnl.dnnl_get_effective_cpu_isa()))]]
    local rc, out = H.sh(lua_cmd(code), "FSDP_CPU_ISA=sse2")
    assert.equal(0, rc, out)
    assert.truthy(out:find("isa=sse2 gemm=onednn (FSDP_CPU_ISA)", 1, true), out)
    -- dnnl_cpu_isa_sse41 is 0x1 in oneDNN 2.x; any wider ISA has more bits
    assert.equal("1", out:match("dnnl_isa=(%d+)"), out)
  end)

  it("passes the op-case table, the convolution paths and Winograd", function()
    local rc, out = H.sh("sh -c " .. sh_quote(("cd %s && busted tests/ops/ops_spec.lua tests/backends/conv_paths_spec.lua " ..
      "tests/backends/winograd_spec.lua"):format(sh_quote(H.root))), "FSDP_CPU_ISA=sse2 OMP_NUM_THREADS=1", 600)
    assert.equal(0, rc, out:sub(-3000))
    assert.truthy(out:find(" 0 failures / 0 errors", 1, true), out:sub(-3000))
  end)

  it("refuses an ISA it does not know, naming the ones it does", function()
    local rc, out = H.sh(lua_cmd([[package.path = "lua/?.lua;lua/?/init.lua;" .. package.path; require "fsdp"]]),
      "FSDP_CPU_ISA=avx3")
    assert.is_not.equal(0, rc)
    assert.truthy(out:find("FSDP_CPU_ISA=avx3: expected sse2, avx2 or avx512f", 1, true), out)
  end)
end)

describe("every ISA level this CPU has", function()
  local L = require "backends.isa_levels"  -- the runs and their comparison, shared with tools/isa_emu.sh
  local own = require("ffi").string(fsdp.C.fsdp_cpu_isa())
  local levels = own == "avx512f" and { "sse2", "avx2", "avx512f" } or own == "avx2+fma" and { "sse2", "avx2" } or { "sse2" }

  it("installs the copy of each level asked for (fsdp_cpu_isa reads the device table)", function()
    for _, level in ipairs(levels) do
      local rc, out = H.sh(lua_cmd([[package.path = "lua/?.lua;lua/?/init.lua;" .. package.path
        io.write("isa=", require("ffi").string(require("fsdp").C.fsdp_cpu_isa()))]]), "FSDP_CPU_ISA=" .. level)
      assert.equal(0, rc, out)
      assert.truthy(out:find("isa=" .. L.names[level], 1, true), level .. ": " .. out)
    end
  end)

  it("runs the op-case table and the wide cases under each, the levels agreeing with each other", function()
    if #levels < 2 then return end  -- one level: nothing to compare
    local dir = H.mkdtemp("fsdp_isa_levels")
    local runs = {}
    for _, level in ipairs(levels) do
      local err = L.run_level(H.root, level, dir)
      assert(not err, err)
      runs[level] = L.read_level(level, dir)
    end
    os.execute(("rm -rf %q"):format(dir))
    local top = levels[#levels]
    local n = 0
    for _ in pairs(runs[top].ops) do n = n + 1 end
    assert.truthy(n > 500, "only " .. n .. " cases ran")
    for li = 1, #levels - 1 do
      for _, d in ipairs(L.dumps) do
        local what = ("%s against %s, %s"):format(levels[li], top, d)
        local r = L.compare(runs[levels[li]][d], runs[top][d], what)
        assert(#r.failures == 0, table.concat(r.failures, "\n"))
      end
    end
  end)
end)

describe("the AVX2 cap (FSDP_CPU_ISA=avx2)", function()
  local has_avx = require("ffi").string(fsdp.C.fsdp_cpu_isa()):find("avx") ~= nil
  -- oneDNN has no Winograd without AVX-512; there 3x3 layers of 32 to 256 channels run ours
  -- (backend/cpu/linalg.c, winograd_over_onednn), others and FSDP_CONV_ALGO=direct run oneDNN's
  local code = [[
    package.path = "lua/?.lua;lua/?/init.lua;tests/?.lua;" .. package.path
    local fsdp = require "fsdp"; local H = require "helpers"; local F = fsdp.nn.functional
    local function run(C, O, algo)
      H.setenv("FSDP_CONV_ALGO", algo)
      fsdp.manual_seed(3)
      local x, w, b = fsdp.randn(2, C, 10, 10):requires_grad_(), fsdp.randn(O, C, 3, 3):requires_grad_(), fsdp.randn(O):requires_grad_()
      local before = fsdp.C.fsdp_cpu_onednn_conv_passes(fsdp.C.FSDP_F32)
      local y = F.conv2d(x, w, b, { padding = 1 })
      y:backward(fsdp.randn(2, O, 10, 10))
      return { y = y, x = x.grad, w = w.grad, b = b.grad }, tonumber(fsdp.C.fsdp_cpu_onednn_conv_passes(fsdp.C.FSDP_F32) - before)
    end
    for _, c in ipairs { { 64, 64 }, { 128, 96 }, { 32, 64 }, { 256, 256 }, { 16, 64 }, { 512, 256 } } do
      local ref = run(c[1], c[2], "im2col")
      local got, passes = run(c[1], c[2], nil)
      local _, direct = run(c[1], c[2], "direct")
      for _, k in ipairs { "y", "x", "w", "b" } do H.assert_rel(got[k], ref[k], 1e-4, k .. " at " .. c[1] .. "->" .. c[2]) end
      print(("%d->%d onednn=%d direct=%d"):format(c[1], c[2], passes, direct))
    end]]

  it("runs 3x3 layers of 32 to 256 channels through our Winograd, others through oneDNN", function()
    if not has_avx then return end -- no AVX2: no such cap to take
    local rc, out = H.sh(lua_cmd(code), "FSDP_CPU_ISA=avx2 OMP_NUM_THREADS=1")
    assert.equal(0, rc, out)
    for _, want in ipairs { "64->64 onednn=0 direct=3", "128->96 onednn=0 direct=3", "32->64 onednn=0 direct=3",
      "256->256 onednn=0 direct=3", "16->64 onednn=3 direct=3", "512->256 onednn=3 direct=3" } do
      assert.truthy(out:find(want, 1, true), want .. " in:\n" .. out)
    end
  end)

  it("passes the fast paths: attention's 6x16 tiles, the 4x24 kernel, our Winograd at 2 threads", function()
    if not has_avx then return end
    local rc, out = H.sh("sh -c " .. sh_quote(("cd %s && busted tests/backends/fast_paths_spec.lua"):format(sh_quote(H.root))),
      "FSDP_CPU_ISA=avx2 OMP_NUM_THREADS=1", 300)
    assert.equal(0, rc, out:sub(-3000))
    assert.truthy(out:find(" 0 failures / 0 errors", 1, true), out:sub(-3000))
  end)
end)

describe("a missing shared library", function()
  it("names the Debian package that provides it", function()
    local hint = fsdp._missing_library_hint
    local m = "libdnnl.so.2: cannot open shared object file: No such file or directory"
    assert.truthy(hint(m):find("install the Debian package libdnnl-dev", 1, true), hint(m))
    m = "comm init: cannot load the mpi backend (libmpi.so.40: cannot open shared object file: No such file)"
    assert.truthy(hint(m):find("libmpi.so.40 is missing: install the Debian package libopenmpi-dev", 1, true))
    assert.equal("some other error", hint("some other error"))
  end)

  it("says so when the MPI backend's libmpi is gone", function()
    -- a backend library linked against a libmpi that no longer exists
    local d = H.mkdtemp("fsdp_nolib")
    local rc, out = H.sh("sh -c " .. sh_quote(("cd %s && echo 'int MPI_Fake(void){return 0;}' > m.c && " ..
      "cc -shared -fPIC -o libmpi.so.99 -Wl,-soname,libmpi.so.99 m.c && " ..
      "echo 'int MPI_Fake(void); int f(void){return MPI_Fake();}' > b.c && " ..
      "cc -shared -fPIC -o libback.so b.c ./libmpi.so.99 && rm libmpi.so.99"):format(sh_quote(d))))
    assert.equal(0, rc, out)
    rc, out = H.sh(lua_cmd([[package.path = "lua/?.lua;lua/?/init.lua;" .. package.path
      local fsdp = require "fsdp"; fsdp.init("mpi")]]), ("FSDP_MPI_LIB=%s/libback.so"):format(d))
    os.execute(("rm -rf %q"):format(d))
    assert.is_not.equal(0, rc)
    assert.truthy(out:find("libmpi.so.99 is missing: install the Debian package libopenmpi-dev", 1, true), out)
  end)
end)
