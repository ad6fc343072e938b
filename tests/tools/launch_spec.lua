-- bin/fsdprun, the launcher (issue 18 items 3-5): its help, the mpirun command each option makes
-- (--dry-run), rank-tagged output whose lines arrive whole, the same error of several ranks shown
-- once, the exit status of the rank that failed first, a job stopped by `timeout` leaving no rank
-- behind, the TCP transport (what carries ranks between machines) forced on loopback, the node-local
-- rank, and a script given torchrun's variables without an MPI launcher.
local H = require "helpers"

local script = H.scripts .. "launch_lines.lua"
local function run(args, env, timeout)
  return H.sh(("%s %s"):format(H.fsdprun, args), env, timeout)
end
local function dry(args, env)
  local rc, out = run("--dry-run " .. args .. " x.lua", env)
  assert.equal(0, rc, out)
  return out
end

describe("fsdprun", function()
  it("explains itself: --help lists every option and knob and exits 0", function()
    local rc, out = run("--help")
    assert.equal(0, rc, out)
    for _, s in ipairs { "-n, --np N", "--nproc-per-node P", "--nnodes M", "--hosts a:2,b:2", "--hostfile F",
      "--mpi-args ARGS... --", "--no-tag-output", "--tag-output", "--dry-run", "-h, --help", "OPENBLAS_NUM_THREADS",
      "OMP_NUM_THREADS", "FSDP_COMM_TIMEOUT", "FSDP_TRACE", "FSDP_DEVICE_COMM", "FSDP_CUDA_DEVICE",
      "FSDPRUN_MPIRUN_ARGS", "LUAJIT", "srun --mpi=pmix", "examples:" } do
      assert.truthy(out:find(s, 1, true), "--help lacks " .. s .. ":\n" .. out)
    end
    rc, out = run("--frobnicate x.lua")
    assert.equal(2, rc, out)
    assert.truthy(out:find("fsdprun: unknown option '--frobnicate'", 1, true), out)
  end)

  it("maps its options onto mpirun", function()
    local out = dry("-n 2")
    assert.truthy(out:find("^mpirun %-n 2 %-%-oversubscribe"), out)
    assert.truthy(out:find("--tag-output", 1, true), out)  -- the collector puts the tagged pieces together
    out = dry("--hosts a:2,b:2")
    assert.truthy(out:find("-n 4 ", 1, true) and out:find("--host a:2,b:2", 1, true), out)
    out = dry("--nnodes 2 --nproc-per-node 3 --hosts a,b")
    assert.truthy(out:find("-n 6 ", 1, true) and out:find("--map-by ppr:3:node", 1, true), out)
    local d = H.mkdtemp("fsdprun_hosts")
    local f = assert(io.open(d .. "/hosts", "w"))
    f:write("# two nodes\nnode1 slots=4\nnode2 slots=4\n")
    f:close()
    out = dry("--hostfile " .. d .. "/hosts")
    assert.truthy(out:find("-n 8 ", 1, true) and out:find("--hostfile " .. d .. "/hosts", 1, true), out)
    os.execute("rm -rf '" .. d .. "'")
    out = dry("-n 2 --mpi-args --mca btl self,tcp --")
    assert.truthy(out:find("--mca btl self,tcp", 1, true), out)
    out = dry("--no-tag-output -n 2")
    assert.falsy(out:find("--tag-output", 1, true), out)
    -- inside a Slurm allocation: its task count
    out = dry("", "SLURM_JOB_ID=7 SLURM_NTASKS=5 SLURM_JOB_NUM_NODES=2")
    assert.truthy(out:find("^mpirun %-n 5 "), out)
    -- one rank, nothing else: plain luajit
    out = dry("")
    assert.falsy(out:find("mpirun", 1, true), out)
  end)

  it("refuses what cannot work, saying why", function()
    local cases = {
      { "--nnodes 2 x.lua", "--nnodes 2 needs the hosts: --hosts a,b,... or --hostfile F" },
      { "--nnodes 3 --hosts a,b x.lua", "--nnodes 3 but only 2 host(s) named" },
      { "-n 5 --nnodes 2 --nproc-per-node 2 --hosts a,b x.lua", "-n 5 disagrees with --nnodes 2 x --nproc-per-node 2" },
      { "-n 0 x.lua", "-n needs a positive integer, got '0'" },
      { "--hosts a:0 x.lua", "--hosts slots of 'a' needs a positive integer, got '0'" },
      { "--mpi-args --mca btl tcp x.lua", "--mpi-args: end the mpirun options with a lone --" },
      { "--hostfile /no/such/file x.lua", "--hostfile: cannot read '/no/such/file'" },
      { "", "no script to run" },
    }
    for _, c in ipairs(cases) do
      local rc, out = run(c[1])
      assert.equal(2, rc, c[1] .. ":\n" .. out)
      assert.truthy(out:find("fsdprun: " .. c[2], 1, true), c[1] .. ":\n" .. out)
    end
  end)

  describe("over MPI", function()
    if not H.has_mpi() then
      it("needs mpirun", function() pending("no mpirun or libfsdp_mpi.so") end)
      return
    end

    it("tags every rank's lines, each whole, even when written in pieces", function()
      local rc, out = run("-n 3 " .. script .. " lines 200")
      assert.equal(0, rc, out)
      local n = {}
      for line in out:gmatch("[^\n]+") do
        if not line:find("^__rc=") then
          local r, r2 = line:match("^%[rank (%d)%] L (%d) %d+ " .. ("x"):rep(60) .. "$")
          assert(r and r == r2, "a line that is not one rank's whole line: " .. line)
          n[r] = (n[r] or 0) + 1
        end
      end
      for r = 0, 2 do assert.equal(200, n[tostring(r)], out:sub(1, 2000)) end
      rc, out = run("-n 2 --no-tag-output " .. script .. " ranks")
      assert.equal(0, rc, out)
      assert.truthy(out:find("\nrank 1 local 1/2 world 2", 1, true) or out:find("^rank 1 local 1/2 world 2"), out)
    end)

    it("shows the same error of every rank once, says the failing rank's error again at the end, and exits with "
      .. "that rank's status", function()
      local rc, out = run("-n 4 " .. script .. " fail")
      assert.equal(1, rc, out)
      local err = "matmul: shapes %(2, 3%) and %(4, 5%) cannot be multiplied"
      local _, n = out:gsub("%[ranks 0%-3%] [^\n]*" .. err, "")
      assert.equal(1, n, out)
      -- the last two lines: the error message (without luajit's prefix), then the rank and status
      local r1, r2 = out:match("\nfsdprun: rank (%d)'s error: [^\n]*%.lua:%d+: " .. err .. "[^\n]*"
        .. "\nfsdprun: rank (%d) failed first %(exit status 1%); the job was stopped\n")
      assert.truthy(r1 and r1 == r2, out)
      assert.falsy(out:find("mpirun detected that one or more processes exited", 1, true), out)
      rc, out = run("-n 3 " .. script .. " exit 2 7")
      assert.equal(7, rc, out)
      assert.truthy(out:find("fsdprun: rank 2 failed first (exit status 7)", 1, true), out)
    end)

    it("leaves no rank behind when `timeout` stops the job", function()
      local id = tostring(os.time()) .. tostring(math.random(1000, 9999))
      local rc, out = H.sh(("timeout -s TERM 4 %s -n 2 %s sleep %s"):format(H.fsdprun, script, id), nil, 60)
      assert.equal(124, rc, out)
      os.execute("sleep 1")
      -- (the bracket keeps the pattern from matching this pgrep's own shell)
      local p = io.popen(("pgrep -f 'launch_lines[.]lua sleep %s' | wc -l"):format(id))
      local left = tonumber(p:read("*a"))
      p:close()
      assert.equal(0, left, "ranks still running after the job was stopped")
    end)

    it("gives each rank its node-local rank and the node's rank count", function()
      local rc, out = run("-n 3 " .. script .. " ranks")
      assert.equal(0, rc, out)
      for r = 0, 2 do assert.truthy(out:find(("[rank %d] rank %d local %d/3 world 3"):format(r, r, r), 1, true), out) end
    end)

    it("trains over OpenMPI's TCP transport (what carries ranks between machines), forced on loopback", function()
      local tcp = "--mpi-args --mca btl self,tcp --mca btl_tcp_if_include lo -- "
      local rc, out, secs = run("-n 2 " .. tcp .. H.scripts .. "comm_values.lua")
      assert.equal(0, rc, out)
      assert.truthy(out:find("rank 0/2 ok", 1, true) and out:find("rank 1/2 ok", 1, true), out)
      local rc2, out2, secs2 = run("-n 2 " .. tcp .. H.scripts .. "param_shape.lua", nil, 240)
      assert.equal(0, rc2, out2)
      assert.truthy(out2:find("param_shape OK rank 1", 1, true), out2)
      print(("\nTCP transport on loopback: every collective's values %d s, FSDP AdamW against one process %d s"):format(secs, secs2))
      -- the transport list is obeyed: without tcp (and without shared memory) the ranks cannot meet
      rc = run("-n 2 --mpi-args --mca btl self -- " .. H.scripts .. "comm_values.lua")
      assert.is_not.equal(0, rc)
    end)

    -- Two machines on this one (tests/scripts/two_nodes.sh): network namespaces joined by a veth
    -- pair, a hostname each, mpirun starting the second node's daemon as it would over ssh. Two
    -- ranks per node: shared memory within a node, TCP between the nodes.
    it("runs ranks on two machines (two network namespaces here): every collective and the FSDP matrix", function()
      local can = os.execute("[ \"$(id -u)\" = 0 ] && command -v ip >/dev/null && command -v unshare >/dev/null") == 0
      if not can then pending("needs root, ip (iproute2) and unshare") return end
      local n = math.random(10, 250)
      local nodes = H.scripts .. "two_nodes.sh"
      local rc, out = H.sh(("sh %s down %d; sh %s up %d"):format(nodes, n, nodes, n))
      if rc ~= 0 then pending("cannot make network namespaces here: " .. out) return end
      local hosts = ("--hosts 10.77.%d.1:2,10.77.%d.2:2 "):format(n, n)
      local function on_nodes(what, timeout)
        return H.sh(("%s run %d %s %s%s"):format(nodes, n, H.fsdprun, hosts, what), "FSDP_COMM_TIMEOUT=60", timeout)
      end
      local ok, err = pcall(function()
        local rc1, out1 = on_nodes(script .. " ranks")
        assert.equal(0, rc1, out1)
        for r = 0, 3 do
          assert.truthy(out1:find(("rank %d local %d/2 world 4"):format(r, r % 2), 1, true), out1)
        end
        local rc2, out2, s2 = on_nodes(H.scripts .. "comm_values.lua")
        assert.equal(0, rc2, out2)
        for r = 0, 3 do assert.truthy(out2:find(("rank %d/4 ok"):format(r), 1, true), out2) end
        local rc3, out3, s3 = on_nodes(H.scripts .. "fsdp_matrix.lua", 300)
        assert.equal(0, rc3, out3:sub(-3000))
        assert.truthy(out3:match("SUMMARY ws=4 cases=%d+ failed=0"), out3:sub(-3000))
        print(("\ntwo nodes x 2 ranks (TCP between them): every collective's values %d s, the FSDP matrix %d s")
          :format(s2, s3))
      end)
      H.sh(("sh %s down %d"):format(nodes, n))
      assert(ok, err)
    end)
  end)
end)

describe("a script started with torchrun's variables but no MPI launcher", function()
  it("stops with what to run instead, never as a silent world of 1", function()
    local env = ("LUA_PATH='%s/lua/?.lua;%s/lua/?/init.lua;;' LUA_CPATH='%s/?.so;;'"):format(H.root, H.root, H.root)
    local rc, out = H.sh("luajit " .. script .. " ranks", env .. " RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 MASTER_ADDR=10.0.0.1")
    assert.is_not.equal(0, rc)
    assert.truthy(out:find("fsdp.init: WORLD_SIZE=2 RANK=1 LOCAL_RANK=1 MASTER_ADDR=10.0.0.1 say this process is one of "
      .. "several, but no MPI launcher started it", 1, true), out)
    assert.truthy(out:find("fsdprun -n 2 script.lua", 1, true), out)
    -- a world of one said so explicitly is fine
    rc, out = H.sh("luajit " .. script .. " ranks", env .. " RANK=0 WORLD_SIZE=1")
    assert.equal(0, rc, out)
    assert.truthy(out:find("rank 0 local 0/1 world 1", 1, true), out)
  end)
end)
