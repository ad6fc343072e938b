-- Shared test helpers: value comparison and finite-difference gradient checks.
-- Used by every *_spec.lua:  local H = require "helpers"
local ffi = require "ffi"
local fsdp = require "fsdp"

local H = {}

-- the keys of t, sorted
function H.sorted_keys(t)
  local ks = {}
  for k in pairs(t) do ks[#ks + 1] = k end
  table.sort(ks)
  return ks
end

-- sets (value a string) or removes (value nil) an environment variable of this process, for the
-- kernels that read theirs on every call (FSDP_CONV_ALGO, FSDP_CONV_LAYOUT)
pcall(ffi.cdef, "int setenv(const char* name, const char* value, int overwrite);")  -- lua/fsdp may have it
pcall(ffi.cdef, "int unsetenv(const char* name);")
function H.setenv(name, value)
  if value then ffi.C.setenv(name, value, 1) else ffi.C.unsetenv(name) end
end

-- max |a - b| over all elements; a, b tensors or (nested) tables / numbers
local function flat(x)
  if fsdp.is_tensor(x) then return x:tolist() end
  if type(x) == "number" then return { x } end
  local out = {}
  local function walk(t) for _, v in ipairs(t) do if type(v) == "table" then walk(v) else out[#out + 1] = v end end end
  walk(x)
  return out
end
H.flat = flat

function H.max_abs_diff(a, b)
  local fa, fb = flat(a), flat(b)
  assert(#fa == #fb, ("element counts differ: %d vs %d"):format(#fa, #fb))
  local m = 0
  for i = 1, #fa do m = math.max(m, math.abs(fa[i] - fb[i])) end
  return m
end

-- asserts |a - b| <= atol + rtol * |b| elementwise, with a message naming the first element that
-- differs; equal values (infinities included) and NaN against NaN count as matching
function H.assert_close(a, b, atol, rtol, what)
  atol, rtol = atol or 1e-5, rtol or 1e-5
  local fa, fb = flat(a), flat(b)
  if #fa ~= #fb then error(("%s: element counts differ: %d vs %d"):format(what or "assert_close", #fa, #fb), 2) end
  for i = 1, #fa do
    local d = math.abs(fa[i] - fb[i])
    local same = fa[i] == fb[i] or (fa[i] ~= fa[i] and fb[i] ~= fb[i])
    if not same and not (d <= atol + rtol * math.abs(fb[i])) then
      error(("%s: element %d differs: got %.8g, expected %.8g (|diff| %.3g > atol %.1g + rtol %.1g)")
        :format(what or "assert_close", i, fa[i], fb[i], d, atol, rtol), 2)
    end
  end
end

-- asserts max |a - ref| <= tol * max |ref| over two tensors of one shape, in tensor ops (fast on
-- large tensors); `what` names the comparison in the message
function H.assert_rel(a, ref, tol, what)
  local sa, sr = table.concat(a:shape(), "x"), table.concat(ref:shape(), "x")
  if sa ~= sr then error(("%s: shape %s, expected %s"):format(what, sa, sr), 2) end
  local scale = ref:abs():max():item()
  local d = (a - ref):abs():max():item()
  if not (d <= tol * scale) then
    error(("%s: max |diff| %.3g > %.1g * max |ref| %.3g"):format(what, d, tol, scale), 2)
  end
end

-- The spacing of `dtype`'s values around v (a unit in the last place: 8 significant bits for
-- bfloat16, 11 for float16, 24 for float32), for |v| in the normal range
local significant_bits = { bfloat16 = 8, float16 = 11, float32 = 24 }
function H.ulp(v, dtype)
  local bits = assert(significant_bits[dtype], "ulp: not a float dtype")
  if v == 0 then
    return 0
  end
  local _, e = math.frexp(v)  -- |v| in [2^(e-1), 2^e)
  return 2 ^ (e - bits)
end

-- asserts that every element of `got` (a low-precision result) is the exact value `want` rounded
-- once to dtype, from a float32 computation: |got - want| <= ulp(want) / 2 + atol + rtol |want|,
-- atol and rtol being the float32 computation's own error. Rounding twice, or accumulating in
-- the low precision, misses by a unit in some elements. Equal values, and NaN against NaN, match.
function H.assert_rounded_once(got, want, dtype, atol, rtol, what)
  local fa, fb = flat(got), flat(want)
  if #fa ~= #fb then error(("%s: element counts differ: %d vs %d"):format(what or "assert_rounded_once", #fa, #fb), 2) end
  for i = 1, #fa do
    local g, w = fa[i], fb[i]
    local same = g == w or (g ~= g and w ~= w)
    local d = math.abs(g - w)
    local bound = 0.5 * H.ulp(w, dtype) + atol + rtol * math.abs(w)
    if not same and not (d <= bound) then
      error(("%s: element %d is not the %s rounding of the exact value: got %.8g, exact %.8g (|diff| %.3g = %.2f ulp)")
        :format(what or "assert_rounded_once", i, dtype, g, w, d, d / H.ulp(w, dtype)), 2)
    end
  end
end

-- Finite-difference check of autograd.
--   fn(inputs...) -> tensor (any shape); inputs: float32 tensors (those with requires_grad are checked)
-- The scalar checked is sum(fn(...) * w) with fixed random weights w, so every output element
-- matters. Central differences in float32 with step eps; tolerances are float32-appropriate.
function H.gradcheck(fn, inputs, opts)
  opts = opts or {}
  local eps, atol, rtol = opts.eps or 1e-2, opts.atol or 2e-2, opts.rtol or 2e-2
  local out = fn(unpack(inputs))
  local w = fsdp.randn(out:shape())
  local function scalar()
    return fsdp.no_grad(function() return (fn(unpack(inputs)) * w):sum():item() end)
  end
  for _, x in ipairs(inputs) do if fsdp.is_tensor(x) and x.requires_grad then x.grad = nil end end
  local loss = (out * w):sum()
  loss:backward()
  for k, x in ipairs(inputs) do
    if fsdp.is_tensor(x) and x.requires_grad then
      assert(x:is_contiguous() and x.dtype == "float32", "gradcheck: inputs must be contiguous float32")
      local g = x.grad
      assert(g, ("gradcheck: input %d got no gradient"):format(k))
      local analytic = g:tolist()
      local p = ffi.cast("float*", x:data_ptr())
      for i = 0, x:numel() - 1 do
        local orig = p[i]
        p[i] = orig + eps
        local fp = scalar()
        p[i] = orig - eps
        local fm = scalar()
        p[i] = orig
        local numeric = (fp - fm) / (2 * eps)
        local a = analytic[i + 1]
        if math.abs(a - numeric) > atol + rtol * math.abs(numeric) then
          error(("gradcheck: input %d element %d: analytic %.6g vs numeric %.6g"):format(k, i + 1, a, numeric), 2)
        end
      end
    end
  end
  return true
end

-- a float32 tensor from a Lua table with requires_grad set
function H.leaf(data)
  local t = fsdp.tensor(data)
  t.requires_grad = true
  return t
end

function H.randn_leaf(...)
  local t = fsdp.randn(...)
  t.requires_grad = true
  return t
end

-- expects fn to raise an error whose message contains every given fragment (plain find)
function H.assert_error(fn, ...)
  local ok, err = pcall(fn)
  if ok then error("expected an error, but the call succeeded", 2) end
  err = tostring(err)
  for _, frag in ipairs({ ... }) do
    if not err:find(frag, 1, true) then
      error(("error message %q does not mention %q"):format(err, frag), 2)
    end
  end
  return err
end

-- ---- files ------------------------------------------------------------------------------------------
-- the whole file, as bytes
function H.read_file(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end
-- writes bytes s to path (replacing it)
function H.write_file(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end
-- whether path can be opened for reading
function H.exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

-- a new empty directory under /tmp (the caller removes it)
function H.mkdtemp(prefix)
  local p = io.popen(("mktemp -d /tmp/%s.XXXXXX"):format(prefix or "fsdp_test"))
  local d = p:read("*l")
  p:close()
  return d
end

-- ---- running multi-rank scripts ------------------------------------------------------------------
local function abspath(p)
  local f = io.popen(("cd %q && pwd"):format(p))
  local d = f:read("*l")
  f:close()
  return d
end
H.root = abspath((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests") .. "/..")
H.scripts = H.root .. "/tests/scripts/"
H.fsdprun = H.root .. "/bin/fsdprun"

-- fsdprun's output without its rank tags ("[rank 1] ", "[ranks 0-3] " at the start of a line), for
-- specs that read what the ranks printed
function H.untag(out)
  return (("\n" .. out):gsub("\n%[ranks? [%d,%-]+%] ", "\n"):sub(2))
end

-- runs a shell command from /tmp (so nothing depends on the caller's directory) under a hard
-- timeout (seconds, default 120); returns exit status, combined output and elapsed seconds
function H.sh(cmd, env, timeout)
  local t0 = os.time()
  local p = io.popen(("cd /tmp && %s timeout -k 5 %d %s 2>&1; echo \"__rc=$?\""):format(env or "", timeout or 120, cmd))
  local out = p:read("*a")
  p:close()
  return tonumber(out:match("__rc=(%d+)%s*$")), out, os.time() - t0
end

-- runs `code` (Lua, with this checkout's fsdp loaded as `fsdp`) in a child luajit, env ("NAME=value
-- ...") before it; returns exit status and combined output. A crash fails a test, not busted.
function H.lua(code, env, timeout)
  local path = os.tmpname() .. ".lua"
  local f = assert(io.open(path, "w"))
  f:write(("package.path = %q .. package.path\n"):format(H.root .. "/lua/?.lua;" .. H.root .. "/lua/?/init.lua;"))
  f:write(("package.cpath = %q .. package.cpath\n"):format(H.root .. "/?.so;"))
  f:write("local fsdp = require 'fsdp'\n", code, "\n")
  f:close()
  local rc, out = H.sh("luajit " .. path, env, timeout or 60)
  os.remove(path)
  return rc, out
end

-- whether multi-rank runs are possible here (libfsdp_mpi.so built and mpirun installed)
-- runs a check-list script (tests/scripts/checks.lua) at np ranks and asserts every check passed,
-- at least min_checks of them: the failed checks' names and their DETAIL lines make the message
function H.check_script(script, np, args, min_checks)
  local rc, out = H.sh(("%s -n %d %s %s"):format(H.fsdprun, np, H.scripts .. script, args or ""),
    "FSDP_COMM_TIMEOUT=60", 300)
  out = H.untag(out)
  local failed, details = {}, {}
  for name in out:gmatch("CHECK (.-)%s+FAIL\n") do failed[#failed + 1] = name end
  for line in out:gmatch("DETAIL [^\n]*") do details[#details + 1] = line; if #details > 12 then break end end
  assert(#failed == 0, ("%s at world size %d: %d checks failed: %s\n%s"):format(script, np, #failed,
    table.concat(failed, "; "), table.concat(details, "\n")))
  local n = out:match("SUMMARY ws=%d+ checks=(%d+) failed=0")
  assert(n and tonumber(n) >= min_checks, ("%s at world size %d: no clean SUMMARY line:\n%s"):format(script, np,
    out:sub(-3000)))
  assert(rc == 0, out:sub(-3000))
end

function H.has_mpi()
  local f = io.open(H.root .. "/libfsdp_mpi.so", "rb")
  if not f then return false end
  f:close()
  return os.execute("command -v mpirun >/dev/null 2>&1") == 0
end

return H
