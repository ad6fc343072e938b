-- The runs of one ISA level and their comparison across levels, in one place for
-- tests/backends/portable_spec.lua (every level this CPU has) and tools/isa_emu.sh (the AVX-512
-- copy, run on an emulated AVX-512 CPU under Bochs, against the lower copies run here).
--
-- A level's run is two dumps, written by children started under FSDP_CPU_ISA=<level>:
--   ops   the op-case table's CPU runs (tests/ops/ops_spec.lua under FSDP_OP_DUMP)
--   wide  tests/scripts/isa_wide_cases.lua: shapes wide enough for every copy's vector loops and
--         micro-kernels (the op table's shapes are mostly shorter than one AVX-512 vector),
--         attention at the 8x16/8x32 tiles, the norms, the optimizers
-- A dump is Lua, one `case{index=..., name=..., out1={dtype=..., v, v, ...}, grad2={...}}` line
-- per case: every output and gradient with its dtype and every value.
-- Two levels' dumps must hold the same cases, the same dtypes, and values within the tolerance of
-- two backends (ops_spec's backend_grad_tol, 1e-4 absolute + 1e-4 relative, for float32; a
-- bfloat16 or float16 value may also be one unit in the last place apart; integers and booleans
-- exact).
local M = {}

M.names = { sse2 = "sse2", avx2 = "avx2+fma", avx512f = "avx512f" }  -- what fsdp_cpu_isa() says
M.dumps = { "ops", "wide" }

-- one case's line: outs a list of tensors, grads a table input index -> tensor
function M.case_line(index, name, outs, grads)
  local function list(t)
    -- 9 significant digits tell float32 values apart (equal values print alike, and the text is
    -- within half a float32 unit of the value) and keep the dumps short: the Bochs guest writes
    -- and parses them at emulated speed. int64 keeps 17.
    local fmt = t.dtype == "int64" and "%.17g" or "%.9g"
    local vals = {}
    for k, v in ipairs(t:tolist()) do
      vals[k] = v ~= v and "0/0" or v == math.huge and "1/0" or v == -math.huge and "-1/0" or fmt:format(v)
    end
    return ("{dtype=%q,%s}"):format(t.dtype, table.concat(vals, ","))
  end
  local parts = {}
  for k, o in ipairs(outs) do parts[#parts + 1] = ("out%d=%s"):format(k, list(o)) end
  local keys = {}
  for i in pairs(grads) do keys[#keys + 1] = i end
  table.sort(keys)
  for _, i in ipairs(keys) do parts[#parts + 1] = ("grad%d=%s"):format(i, list(grads[i])) end
  return ("case{index=%d,name=%q,%s}\n"):format(index, name, table.concat(parts, ","))
end

-- a dump file -> its cases by index
function M.read(file)
  local cases = {}
  local chunk = assert(loadfile(file))
  setfenv(chunk, { case = function(c) cases[c.index] = c end })
  chunk()
  return cases
end

local function sh_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

-- runs `cmd` in `root` with `env` before it, under a timeout; returns exit status and output
local function run(root, cmd, env, timeout)
  local p = io.popen(("cd %s && %s timeout -k 5 %d %s 2>&1; echo \"__rc=$?\""):format(sh_quote(root), env, timeout, cmd))
  local out = p:read("*a")
  p:close()
  return tonumber(out:match("__rc=(%d+)%s*$")), out
end

-- writes level's two dumps into dir (dir/<level>.ops, dir/<level>.wide) from children run in the
-- checkout `root`; returns nil, or an error message with the failing child's output
function M.run_level(root, level, dir, timeout)
  local env = ("FSDP_CPU_ISA=%s OMP_NUM_THREADS=1"):format(level)
  local ops, wide = ("%s/%s.ops"):format(dir, level), ("%s/%s.wide"):format(dir, level)
  os.remove(ops)
  os.remove(wide)
  local rc, out = run(root, "busted --filter=against.the.CPU.cpu: tests/ops/ops_spec.lua",
    env .. " FSDP_OP_DUMP=" .. sh_quote(ops), timeout or 300)
  if rc ~= 0 or not out:find(" 0 failures / 0 errors", 1, true) then
    return ("%s: the op-case table failed (exit %s):\n%s"):format(level, tostring(rc), out:sub(-3000))
  end
  rc, out = run(root, "luajit tests/scripts/isa_wide_cases.lua " .. sh_quote(wide), env, timeout or 300)
  if rc ~= 0 then return ("%s: isa_wide_cases.lua failed (exit %s):\n%s"):format(level, tostring(rc), out:sub(-3000)) end
  return nil
end

-- reads level's two dumps from dir: { ops = cases, wide = cases }
function M.read_level(level, dir)
  local run_ = {}
  for _, d in ipairs(M.dumps) do run_[d] = M.read(("%s/%s.%s"):format(dir, level, d)) end
  return run_
end

local ulp = { bfloat16 = 2 ^ -7, float16 = 2 ^ -10 }

-- got's cases against want's (two dumps of one kind): { cases = n compared, max_abs, max_rel (|diff|
-- over max(|want|, 1e-30)), worst = where max_abs is, failures = list of messages }
function M.compare(got, want, what)
  local r = { cases = 0, max_abs = 0, max_rel = 0, worst = "-", failures = {} }
  local function fail(msg) r.failures[#r.failures + 1] = what .. ": " .. msg end
  local indices = {}
  for index in pairs(want) do indices[#indices + 1] = index end
  table.sort(indices)
  for _, index in ipairs(indices) do
    local w, g = want[index], got[index]
    r.cases = r.cases + 1
    if not g then
      fail(("case %d (%s) did not run"):format(index, w.name))
    else
      for key, wv in pairs(w) do
        if type(wv) == "table" then
          local gv = g[key]
          local where = ("%s, %s"):format(w.name, key)
          if not gv then
            fail(where .. " is missing")
          elseif gv.dtype ~= wv.dtype or #gv ~= #wv then
            fail(("%s: %s of %d values, expected %s of %d"):format(where, tostring(gv.dtype), #gv, wv.dtype, #wv))
          else
            local exact = wv.dtype == "int64" or wv.dtype == "bool"
            local atol = exact and 0 or 1e-4
            local rtol = atol + (ulp[wv.dtype] or 0)
            for i = 1, #wv do
              local a, b = gv[i], wv[i]
              local d = math.abs(a - b)
              local same = a == b or (a ~= a and b ~= b)
              if not same then
                if d ~= d then d = math.huge end
                if d > r.max_abs then r.max_abs, r.worst = d, ("%s [%d]"):format(where, i) end
                r.max_rel = math.max(r.max_rel, d / math.max(math.abs(b), 1e-30))
                if not (d <= atol + rtol * math.abs(b)) then
                  fail(("%s: element %d differs: got %.8g, expected %.8g (|diff| %.3g > atol %.1g + rtol %.1g)")
                    :format(where, i, a, b, d, atol, rtol))
                  break  -- one message per output: the first element that differs
                end
              end
            end
          end
        end
      end
    end
  end
  return r
end

-- a comparison's summary line
function M.summary(r, what)
  return ("%s: %d cases, max |diff| %.3g (%s), max rel %.3g, %d failures"):format(what, r.cases, r.max_abs,
    r.worst, r.max_rel, #r.failures)
end

return M
