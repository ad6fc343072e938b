-- The repository holds sources only: no build output is tracked (git ls-files), so `make` never
-- dirties the tree and nothing built on one machine is installed on another. Outside a git
-- checkout (an unpacked tarball) there is nothing to check.
local H = require "helpers"

local function git(args)
  local p = io.popen(("git -C %q %s 2>/dev/null"):format(H.root, args))
  local out = p:read("*a")
  local ok = p:close()
  return ok and out or nil
end

local tracked = git("ls-files -z")
local in_git = tracked ~= nil and tracked ~= ""

-- what a tracked build output looks like: an ignored path (.gitignore lists every output of
-- make, the tests, the demo and the benchmarks), a compiled object by name, or an ELF file
local function build_outputs()
  local bad = {}
  for path in (git("ls-files -z --cached --ignored --exclude-standard") or ""):gmatch("[^%z]+") do
    bad[#bad + 1] = path .. " (listed in .gitignore)"
  end
  for path in tracked:gmatch("[^%z]+") do
    if path:match("%.so$") or path:match("%.so%.%d") or path:match("%.o$") or path:match("%.a$") then
      bad[#bad + 1] = path .. " (a compiled object)"
    else
      local f = io.open(H.root .. "/" .. path, "rb")
      local magic = f and f:read(4)
      if f then f:close() end
      if magic == "\127ELF" then bad[#bad + 1] = path .. " (an ELF binary)" end
    end
  end
  table.sort(bad)
  return bad
end

-- a copy of the checkout's sources without what make generates: lua/, examples/, src/fsdp.h
local function unbuilt_copy()
  local dir = H.mkdtemp("fsdp_unbuilt")
  assert(os.execute(("mkdir -p %q/src && cp -r %q/lua %q/examples %q/ && cp %q/src/fsdp.h %q/src/ && rm -f %q/lua/fsdp/cdef.lua")
    :format(dir, H.root, H.root, dir, H.root, dir, dir)) == 0)
  return dir
end

-- LuaJIT on only the copy's paths (an installed fsdp elsewhere must not answer)
local function run_isolated(dir, script)
  return H.sh(("luajit %q"):format(dir .. "/" .. script), "LUA_PATH='/nonexistent/?.lua' LUA_CPATH='/nonexistent/?.so'")
end

describe("a checkout that was never built", function()
  it("says to run make when lua/fsdp/cdef.lua is missing", function()
    local dir = unbuilt_copy()
    local rc, out = run_isolated(dir, "examples/mlp.lua")
    os.execute(("rm -rf %q"):format(dir))
    assert.are_not.equal(0, rc)
    assert.truthy(out:find("fsdp is not built: lua/fsdp/cdef.lua (generated from src/fsdp.h) is missing; run `make` in "
      .. dir, 1, true), out)
  end)

  it("says to run make when libfsdp.so is missing", function()
    local dir = unbuilt_copy()
    assert(os.execute(("cp %q/lua/fsdp/cdef.lua %q/lua/fsdp/"):format(H.root, dir)) == 0)
    local rc, out = run_isolated(dir, "examples/mlp.lua")
    os.execute(("rm -rf %q"):format(dir))
    assert.are_not.equal(0, rc)
    assert.truthy(out:find("fsdp is not built: libfsdp.so", 1, true), out)
    assert.truthy(out:find("run `make` in " .. dir, 1, true), out)
  end)
end)

describe("the repository", function()
  it("tracks no build outputs", function()
    if not in_git then return pending("not a git checkout") end
    assert.same({}, build_outputs())
  end)

  it("ignores what make builds", function()
    if not in_git then return pending("not a git checkout") end
    for _, path in ipairs { "libfsdp.so", "libfsdp_mpi.so", "lua/fsdp/cdef.lua", "build/x.o", "build-asan/libfsdp.so",
      "build-memcheck/x.o", "checkpoints/model.safetensors" } do
      assert(git("check-ignore -q " .. path), path .. " is not ignored by .gitignore")
    end
  end)
end)

-- tools/deps.sh on a machine that lacks every package, as a user who is not root: fake dpkg-query
-- (nothing installed), id (uid 1000) and apt-get (records that it ran) come first on PATH
describe("tools/deps.sh without root on a machine without the packages", function()
  local function fake_bin()
    local dir = H.mkdtemp("fsdp_deps")
    local fakes = {
      ["dpkg-query"] = "exit 1",
      id = 'if [ "$1" = -u ]; then echo 1000; else echo "uid=1000"; fi',
      ["apt-get"] = ("touch %q/apt-get-ran; exit 0"):format(dir),
    }
    for name, body in pairs(fakes) do
      local f = assert(io.open(dir .. "/" .. name, "w"))
      f:write("#!/bin/sh\n", body, "\n")
      f:close()
      os.execute(("chmod +x %q"):format(dir .. "/" .. name))
    end
    return dir
  end

  it("prints the one apt-get line and exits 1, for each set", function()
    local dir = fake_bin()
    for _, set in ipairs { "build", "demo", "test", "doc", "ci" } do
      local list = io.popen(("bash %q/tools/deps.sh --list %s"):format(H.root, set)):read("*l")
      local rc, out = H.sh(("bash %q/tools/deps.sh %s"):format(H.root, set), ("PATH=%q:$PATH"):format(dir))
      assert.are.equal(1, rc, out)
      assert.truthy(out:find("sudo apt-get install " .. list, 1, true), out)
    end
    local ran = io.open(dir .. "/apt-get-ran")
    os.execute(("rm -rf %q"):format(dir))
    assert.is_nil(ran, "apt-get ran without root")
  end)

  it("stops make demo, make demo-gpt and make test before anything compiles", function()
    local dir = fake_bin()
    for _, target in ipairs { "demo", "test", "all", "demo-gpt" } do
      local rc, out = H.sh(("make -C %q -B %s"):format(H.root, target), ("PATH=%q:$PATH"):format(dir))
      assert.are_not.equal(0, rc, out)
      assert.truthy(out:find("sudo apt-get install", 1, true), out)
      assert.is_nil(out:find("%f[%w]cc%s+%-"), "compiled before the package check:\n" .. out)
    end
    os.execute(("rm -rf %q"):format(dir))
  end)
end)
