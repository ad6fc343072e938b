-- make isa-check (tools/isa_check.lua): the built libfsdp.so needs nothing above x86-64-v2 outside
-- the AVX2 and AVX-512 copies of its kernels (src/backend/cpu/cpu.h). It passes on this checkout's
-- library, and on a small library built here for the purpose it fails where it must: a function of
-- a base object compiled for AVX2, an AVX2 copy that uses AVX-512; and passes the same library
-- built right. A library built with -march=native is not portable by design: its check is skipped.
local H = require "helpers"

local function sh_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end
local function check(dir, lib, map)
  return H.sh(("sh -c %s"):format(sh_quote(("cd %s && luajit %s/tools/isa_check.lua %s %s"):format(sh_quote(dir),
    sh_quote(H.root), lib, map))))
end

describe("make isa-check", function()
  it("passes on this checkout's libfsdp.so", function()
    local f = io.open(H.root .. "/libfsdp.so", "rb")
    local native = f:read("*a"):find("-march=native", 1, true)
    f:close()
    if native then return end -- make ARCH=-march=native: for this CPU alone, nothing to prove
    local rc, out = check(H.root, "libfsdp.so", "build/libfsdp.link.map")
    assert.equal(0, rc, out)
    assert.truthy(out:find("isa_check: ok: nothing above x86-64-v2 outside the copies", 1, true), out)
  end)

  -- base.o (one function that sums floats, a loop the compiler vectorizes), k.avx2.o and
  -- k.avx512.o (one vector function each), linked into one library with a link map
  local base_c = [[
float base_sum(const float* x, int n) { float s = 0; for (int i = 0; i < n; i++) s += x[i] * x[i]; return s; }]]
  local avx2_c = [[
#include <immintrin.h>
void k_avx2(float* y, const float* x) { _mm256_storeu_ps(y, _mm256_fmadd_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(y), _mm256_loadu_ps(x))); }]]
  local avx512_c = [[
#include <immintrin.h>
void k_avx512(float* y, const float* x) { _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(y))); }]]
  local function build(base_flags, avx2_flags)
    local d = H.mkdtemp("fsdp_isa")
    H.write_file(d .. "/base.c", base_c)
    H.write_file(d .. "/k.avx2.c", avx2_c)
    H.write_file(d .. "/k.avx512.c", avx512_c)
    local cc = "cc -O3 -ffast-math -fPIC -c"
    local rc, out = H.sh(("sh -c %s"):format(sh_quote(("cd %s && %s -march=x86-64-v2 %s base.c -o base.o && " ..
      "%s -march=x86-64-v2 %s k.avx2.c -o k.avx2.o && %s -march=x86-64-v4 k.avx512.c -o k.avx512.o && " ..
      "cc -shared -o lib.so base.o k.avx2.o k.avx512.o -Wl,-Map=lib.map"):format(sh_quote(d), cc, base_flags, cc,
      avx2_flags, cc))))
    assert.equal(0, rc, out)
    return d
  end

  it("passes a library whose base is x86-64-v2", function()
    local d = build("", "-mavx2 -mfma")
    local rc, out = check(d, "lib.so", "lib.map")
    os.execute(("rm -rf %q"):format(d))
    assert.equal(0, rc, out)
    assert.truthy(out:find("isa_check: ok", 1, true), out)
  end)

  it("fails on a function of the base compiled for AVX2, naming it and its object", function()
    local d = build("-mavx2 -mfma", "-mavx2 -mfma")
    local rc, out = check(d, "lib.so", "lib.map")
    os.execute(("rm -rf %q"):format(d))
    assert.equal(1, rc, out)
    assert.truthy(out:find("isa_check: base_sum in base.o:", 1, true), out)
    assert.truthy(out:find("FAILED: 1 functions", 1, true), out)
  end)

  it("fails on an AVX2 copy that uses AVX-512", function()
    local d = build("", "-mavx2 -mfma")
    -- then k.avx2.o again, with the AVX-512 function under the AVX2 copy's name
    H.write_file(d .. "/k.avx2.c", avx512_c:gsub("k_avx512", "k_avx2"))
    local rc, out = H.sh(("sh -c %s"):format(sh_quote(("cd %s && cc -O3 -fPIC -c -march=x86-64-v2 -mavx512f " ..
      "k.avx2.c -o k.avx2.o && cc -shared -o lib.so base.o k.avx2.o k.avx512.o -Wl,-Map=lib.map"):format(sh_quote(d)))))
    assert.equal(0, rc, out)
    rc, out = check(d, "lib.so", "lib.map")
    os.execute(("rm -rf %q"):format(d))
    assert.equal(1, rc, out)
    assert.truthy(out:find("isa_check: k_avx2 in k.avx2.o:", 1, true), out)
  end)
end)
