-- Hostile input (issue 39): every public function of fsdp, fsdp.nn (layers, init, Module methods),
-- fsdp.F, fsdp.optim (optimizers and schedulers), fsdp.data, the tensor methods, the file and
-- checkpoint functions and the collectives, called with bad values for each argument in turn (nil,
-- wrong types, NaN and infinities, fractional, negative and huge integers, lists with holes, NUL in
-- strings, cyclic tables) and with values an op's rules refuse (dtypes, shapes, classes, indices).
-- Each must give a clean Lua error naming the function (and the argument), or a result that is
-- right; never a crash, a hang or a silent result. A public function without an entry in
-- tests/scripts/hostile.lua fails here. The cases run in child processes, so a crash fails the
-- test instead of killing busted: when a child dies, the next child starts after the case that
-- killed it.
local H = require "helpers"

local script = H.root .. "/tests/scripts/hostile.lua"

local function run_all()
  local _, listing = H.sh(("luajit %s %s list"):format(script, H.root))
  local cases = {}
  for i, want, frags, name in listing:gmatch("CASE\t(%d+)\t([^\t]+)\t([^\t]*)\t([^\n]*)") do
    local fr = {}
    for f in frags:gmatch("[^|]+") do fr[#fr + 1] = f end
    cases[tonumber(i)] = { want = want, frags = fr, name = name }
  end
  assert(#cases > 0, listing)
  local first, alive = 1, nil
  while first <= #cases do
    local rc, out = H.sh(("luajit %s %s run %d"):format(script, H.root, first), nil, 120)
    local last = first - 1
    for i, res, msg in out:gmatch("RES (%d+) (%u+) ?([^\n]*)") do
      i = tonumber(i)
      cases[i].res, cases[i].msg = res, msg
      last = i
    end
    alive = out:match("ALIVE (%S+)")
    if last < #cases then
      local c = cases[last + 1]
      c.res = (rc == 124 or rc == 137) and "HANG" or "CRASH"
      c.msg = out:match(".*START %d+\n(.-)%s*__rc=%d+%s*$") or out:sub(-120)
    end
    first = last + 2
  end
  return cases, alive
end

describe("hostile input", function()
  local cases, alive
  setup(function() cases, alive = run_all() end)

  it("give clean Lua errors naming the function and argument: no crash, hang or silent result", function()
    local counts = { cases = #cases, clean = 0, ok = 0, crash = 0, hang = 0, silent = 0, unclear = 0, unexpected = 0 }
    local bad = {}
    for i, c in ipairs(cases) do
      local kind
      if c.res == "CRASH" then kind = "crash"
      elseif c.res == "HANG" then kind = "hang"
      elseif c.want == "ok" then kind = c.res == "OK" and "ok" or "unexpected"
      elseif c.res == "OK" then kind = "silent"
      else
        kind = "clean"
        for _, f in ipairs(c.frags) do  -- (in any case: "Module" names a module argument)
          if not c.msg:lower():find(f:lower(), 1, true) then kind = "unclear" end
        end
      end
      counts[kind] = counts[kind] + 1
      if kind ~= "clean" and kind ~= "ok" then
        bad[#bad + 1] = ("  %d %s [%s]: %s"):format(i, c.name, kind, (c.msg or ""):sub(1, 200))
      end
    end
    local summary = ("calls %d, clean errors %d, correct results %d, crashes %d, hangs %d, silent wrong results %d, "
      .. "unclear errors %d, unexpected errors %d"):format(counts.cases, counts.clean,
      counts.ok, counts.crash, counts.hang, counts.silent, counts.unclear, counts.unexpected)
    print("\nhostile input: " .. summary)
    assert(#bad == 0, summary .. "\n" .. table.concat(bad, "\n"))
  end)

  it("leave the process working", function()
    assert.equal("4", alive)
  end)
end)
