-- The CUDA backend from a machine's point of view (backend/cuda/load.c, fsdp.cuda): without a GPU
-- every question has an answer and every use of "cuda" a named reason; libfsdp_cuda.so, built
-- wherever nvcc is, loads here and has every entry of the device table. Then the device-generic
-- paths (moves between devices, factories, Module:to, autograd across a move, memory counters)
-- run on the test double of a GPU (backend/testdev): the CPU's kernels on memory the host cannot
-- touch, so a path that reads device memory on the host faults instead of passing by luck.
-- tests/ops/ops_spec.lua runs the whole op-case table on it. On a machine with a GPU the first group
-- checks the real device instead, and the test double is not installed.
local fsdp = require "fsdp"
local ffi = require "ffi"
local H = require "helpers"
local C = fsdp.C

local has_driver = pcall(ffi.load, "libcuda.so.1")
local has_nvcc = os.execute("command -v nvcc >/dev/null 2>&1") == 0
-- FSDP_CUDA_EMU=1: the CUDA executor (tests/cudaemu, the CUDA backend's own kernels on the CPU)
-- is the device, as a GPU would be (tests/backends/cudaemu_spec.lua runs this spec so)
local emu = os.getenv("FSDP_CUDA_EMU") == "1"

describe("fsdp.cuda without a GPU", function()
  if has_driver or emu then
    it("has a driver or the executor here: the questions answer for it", function()
      assert.is_true(fsdp.cuda.device_count() >= 0)
      if fsdp.cuda.is_available() then assert.equal("", fsdp.cuda.why_not()) end
    end)
    return
  end
  -- (once a spec installed the test double in this process, "cuda" works: nothing left to refuse)
  if C.fsdp_device_has_backend(1) ~= 0 then
    pending("the test double is installed in this process already")
    return
  end
  it("says why not: no driver", function()
    assert.is_false(fsdp.cuda.is_available())
    assert.matches("^no NVIDIA driver %(.*libcuda%.so%.1", fsdp.cuda.why_not())
    assert.equal(0, fsdp.cuda.device_count())
    assert.same({ "cpu" }, fsdp.backends())
  end)
  it("refuses the device with that reason, in every form", function()
    local t = fsdp.ones(2, 3)
    local why = fsdp.cuda.why_not():gsub("%p", "%%%0")
    for name, f in pairs {
      to = function() return t:to("cuda") end,
      to_table = function() return t:to { device = "cuda" } end,
      cuda = function() return t:cuda() end,
      factory = function() return fsdp.zeros(2, { device = "cuda" }) end,
      randn = function() return fsdp.randn(2, { device = "cuda" }) end,
      default = function() fsdp.set_default_device("cuda") end,
      module = function() return fsdp.nn.Linear(2, 2):to("cuda") end,
      pin_memory = function() return t:pin_memory() end,  -- (pinned host memory is the GPU backend's)
    } do
      local ok, err = pcall(f)
      assert.is_false(ok, name)
      assert.matches('device "cuda" is not available: ' .. why, tostring(err), 1, false, name)
    end
    assert.equal("cpu", fsdp.get_default_device())
    assert.has_error(function() fsdp.cuda.synchronize() end)
    assert.is_false(t:is_pinned())
  end)
  it("keeps unknown devices apart from missing ones", function()
    local ok, err = pcall(function() return fsdp.ones(2):to { device = "gpu" } end)
    assert.is_false(ok)
    assert.matches('unknown device "gpu"', err)
    ok, err = pcall(function() return fsdp.ones(2):to("gpu") end)
    assert.is_false(ok)
    assert.matches('"gpu" is neither a device %("cpu", "cuda"%) nor a dtype', err)
    ok, err = pcall(fsdp.memory_stats, "tpu")
    assert.is_false(ok)
    assert.matches('unknown device "tpu"', err)
  end)
end)

describe("libfsdp_cuda.so", function()
  it("is built where nvcc is, loads without a GPU, and has every entry of the device table", function()
    local rc = C.fsdp_cuda_check_library()
    local err = rc ~= 0 and ffi.string(C.fsdp_last_error()) or ""
    if has_nvcc then
      assert.equal(0, rc, err)
    else
      assert.matches("libfsdp_cuda%.so is missing", err)
    end
  end)
  it("names the library it could not load", function()
    local rc, out = H.lua([[
      local fsdp = require "fsdp"
      print(fsdp.C.fsdp_cuda_check_library(), require("ffi").string(fsdp.C.fsdp_last_error()))]],
      "FSDP_CUDA_EMU=0 FSDP_CUDA_LIB=/nonexistent/libfsdp_cuda.so")
    assert.equal(0, rc, out)
    assert.matches("%-1\tlibfsdp_cuda%.so is missing or cannot load %(/nonexistent/libfsdp_cuda%.so", out)
  end)
end)

-- the rest runs on the "cuda" device: the real one where there is a GPU, the test double elsewhere;
-- the double computes with the CPU's kernels, so there results must match the CPU bit for bit, on a
-- GPU within float32 tolerance
local real_gpu = fsdp.cuda.is_available()
local function same_numbers(want, got, what)
  if not real_gpu then return assert.same(want, got, what) end
  H.assert_close(got, want, 1e-5, 1e-4, what)
end

describe(real_gpu and (emu and "the CUDA executor" or "the GPU") or "the test double of a GPU (backend/testdev)", function()
  if not real_gpu then fsdp._testdev_install() end
  local nn = fsdp.nn

  it("moves tensors both ways, values intact, and a move to where it is returns it", function()
    local x = fsdp.randn(3, 4)
    local d = x:to("cuda")
    assert.equal("cuda", d.device)
    assert.equal("cpu", x.device)
    assert.same(x:tolist(), d:tolist())              -- a host read goes through the device's copy
    assert.same(x:tolist(), d:cpu():tolist())
    assert.is_true(rawequal(d, d:to("cuda")))
    assert.matches("device=cuda", tostring(d))
    local v = x:t():to("cuda")                        -- a strided view arrives contiguous
    assert.same(x:t():tolist(), v:tolist())
    local i = fsdp.tensor({ 3, 1, 2 }, "int64"):cuda()
    assert.same({ 3, 1, 2 }, i:tolist())
    assert.equal("int64", i.dtype)
  end)

  -- pinned host memory (the device table's host_alloc: cudaMallocHost; the executor's and the double's
  -- plain host memory): CPU tensors, counted in the CPU's categories and in fsdp_memory_pinned_bytes
  local function pinned_bytes() return tonumber(C.fsdp_memory_pinned_bytes()) end
  it("pins CPU tensors: exact copies, views pinned too, moved as any CPU tensor, freed when dropped", function()
    collectgarbage()
    local x = fsdp.randn(6, 5)
    local b0, a0 = pinned_bytes(), fsdp.memory_stats().activations.current
    local p = x:t():pin_memory()                      -- a strided view arrives contiguous
    assert.is_true(p:is_pinned())
    assert.is_false(x:is_pinned())
    assert.equal("cpu", p.device)
    assert.is_true(p:is_contiguous())
    assert.same(x:t():tolist(), p:tolist())
    assert.equal(6 * 5 * 4, pinned_bytes() - b0)
    assert.equal(6 * 5 * 4, fsdp.memory_stats().activations.current - a0)  -- (host memory: the CPU's counters)
    assert.is_true(p:narrow(1, 2, 3):is_pinned())    -- views share the pinned storage, as in PyTorch
    assert.is_true(p[2]:is_pinned())
    assert.is_false(p:clone():is_pinned())            -- an op's output is ordinary memory
    assert.equal(p:data_ptr(), p:pin_memory():data_ptr())  -- pinned already: itself
    local d = p:to("cuda")
    assert.equal("cuda", d.device)
    assert.same(x:t():tolist(), d:tolist())
    assert.is_false(d:cpu():is_pinned())
    for _, dt in ipairs { "int64", "bfloat16", "bool" } do
      local y = x:gt(0):to(dt)
      assert.same(y:tolist(), y:pin_memory():tolist(), dt)
    end
    local g = fsdp.randn(4):requires_grad_()          -- differentiable, as a move
    local gp = g:pin_memory()
    assert.is_true(gp.requires_grad)
    gp:mul(3):sum():backward()
    assert.same({ 3, 3, 3, 3 }, g.grad:tolist())
    H.assert_error(function() return d:pin_memory() end, "pin_memory: only CPU tensors can be pinned",
      "float32 (5, 6) is on cuda")
    p, d, g, gp = nil, nil, nil, nil
    collectgarbage()
    collectgarbage()
    assert.equal(b0, pinned_bytes())                  -- freed through host_free: nothing left pinned
    assert.equal(a0, fsdp.memory_stats().activations.current)
  end)

  it("DataLoader pin_memory = true pins every CPU tensor of each batch, with 0 and 2 workers", function()
    local data = fsdp.data
    local xs, ys = fsdp.randn(10, 3), fsdp.arange(10)
    local samples = {}
    for i = 1, 10 do samples[i] = { x = xs[i], nested = { y = ys[i], tag = "s" .. i } } end
    local function batches(opts)
      local out = {}
      for a, b in data.DataLoader(data.TensorDataset(xs, ys), opts)() do out[#out + 1] = { a, b } end
      for batch in data.DataLoader(samples, opts)() do out[#out + 1] = { batch.x, batch.nested.y, batch.nested.tag } end
      return out
    end
    local b0 = pinned_bytes()
    local plain = batches { batch_size = 4 }
    for _, nw in ipairs { 0, 2 } do
      local got = batches { batch_size = 4, num_workers = nw, pin_memory = true }
      assert.equal(#plain, #got)
      for i, b in ipairs(got) do
        for j, v in ipairs(b) do
          if fsdp.is_tensor(v) then
            assert.is_true(v:is_pinned(), ("workers %d, batch %d, value %d"):format(nw, i, j))
            assert.is_false(plain[i][j]:is_pinned())
            assert.same(plain[i][j]:tolist(), v:tolist())
            assert.same(plain[i][j]:tolist(), v:to("cuda"):tolist())
          else
            assert.same(plain[i][j], v)
          end
        end
      end
      got = nil
      collectgarbage()
      collectgarbage()
      assert.equal(b0, pinned_bytes(), "pinned bytes left after the batches went, workers " .. nw)
    end
  end)

  it("makes tensors there: factories with {device=} and the default device", function()
    assert.same({ { 0, 0 }, { 0, 0 } }, fsdp.zeros(2, 2, { device = "cuda" }):totable())
    assert.equal("cuda", fsdp.ones(3, { device = "cuda" }).device)
    fsdp.manual_seed(7)
    local a = fsdp.randn(5)
    fsdp.manual_seed(7)
    local b = fsdp.randn(5, { device = "cuda" })
    assert.equal("cuda", b.device)
    assert.same(a:tolist(), b:tolist())               -- one RNG stream: the same draws on either device
    fsdp.set_default_device("cuda")
    local ok, err = pcall(function()
      local z = fsdp.empty(2)
      local l = nn.Linear(3, 2)
      assert.equal("cuda", z.device)
      assert.equal("cuda", l.weight.device)
      assert.equal("cuda", fsdp.zeros_like(z).device)
      local v = fsdp.tensor({ 1, 2, 3 })  -- as torch.tensor: on the default device too
      assert.equal("cuda", v.device)
      assert.same({ 1, 2, 3 }, v:tolist())
      assert.equal("cpu", fsdp.tensor({ 1 }, { device = "cpu" }).device)
      assert.equal("int64", fsdp.tensor({ 1 }, { dtype = "int64" }).dtype)
    end)
    fsdp.set_default_device("cpu")
    assert(ok, err)
    assert.equal("cpu", fsdp.empty(2).device)
  end)

  it("names both devices when an op mixes them", function()
    local ok, err = pcall(function() return fsdp.ones(2, 3) + fsdp.ones(2, 3, { device = "cuda" }) end)
    assert.is_false(ok)
    assert.matches("tensors on different devices %(%(2, 3%) on cpu, %(2, 3%) on cuda%)", err)
  end)

  it("sends gradients back across a move", function()
    local x = fsdp.randn(3, 4):requires_grad_()
    local y = (x:cuda() * 3):sum()
    y:backward()
    assert.equal("cpu", x.grad.device)
    assert.same(fsdp.full({ 3, 4 }, 3):tolist(), x.grad:tolist())
  end)

  it("Module:to keeps parameters and trains exactly as on the CPU, with exact memory counters", function()
    local function model()
      fsdp.manual_seed(3)
      return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 3))
    end
    local function train(m, device)
      local opt = fsdp.optim.AdamW(m:parameters(), { lr = 1e-2 })
      fsdp.manual_seed(11)
      local x, t = fsdp.randn(5, 6, { device = device }), fsdp.tensor({ 0, 2, 1, 1, 0 }, "int64"):to(device)
      local losses = {}
      for _ = 1, 3 do
        opt:zero_grad()
        local loss = fsdp.nn.functional.cross_entropy(m(x), t)
        loss:backward()
        opt:step()
        losses[#losses + 1] = loss:item()
      end
      return losses
    end
    local cpu = model()
    local want = train(cpu, "cpu")
    local dev = model()
    local w = dev:parameters()[1]
    collectgarbage("collect") -- (earlier tests' tensors there go now, not between the two readings)
    collectgarbage("collect")
    local before = fsdp.memory_stats("cuda").params.current
    dev:to("cuda")
    assert.is_true(rawequal(w, dev:parameters()[1]))
    local bytes = 0
    for _, p in ipairs(dev:parameters()) do
      assert.equal("cuda", p.device)
      bytes = bytes + p:numel() * 4
    end
    assert.equal(before + bytes, fsdp.memory_stats("cuda").params.current)
    same_numbers(want, train(dev, "cuda"), "losses")
    for i, p in ipairs(dev:parameters()) do same_numbers(cpu:parameters()[i]:tolist(), p:tolist(), "parameter " .. i) end
    dev:to("cpu")
    assert.equal(before, fsdp.memory_stats("cuda").params.current)
  end)

  it("trains FSDP units (nested, one frozen parameter) there exactly as on the CPU, one rank", function()
    local function run(device)
      fsdp.manual_seed(1)
      local m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
      m:to(device)
      m:children()[1].bias.requires_grad = false
      fsdp.wrap(m:children()[3])
      m = fsdp.wrap(m)
      local opt = fsdp.optim.SGD(m:parameters(), { lr = 0.1, momentum = 0.9 })
      fsdp.manual_seed(2)
      local x = fsdp.randn(6, 8, { device = device })
      local t = fsdp.tensor({ 0, 1, 2, 3, 0, 1 }, "int64"):to(device)
      local losses = {}
      for i = 1, 3 do
        opt:zero_grad()
        local loss = nn.functional.cross_entropy(m(x), t)
        loss:backward()
        opt:step()
        losses[i] = loss:item()
      end
      local sd = {}
      for k, v in pairs(m:state_dict()) do sd[k] = v:tolist() end
      return losses, sd
    end
    local want, want_sd = run("cpu")
    local got, got_sd = run("cuda")
    same_numbers(want, got, "losses")
    for k, v in pairs(want_sd) do same_numbers(v, got_sd[k], k) end
  end)

  -- CPU offload: the matrix (tests/scripts/fsdp_matrix.lua, offload/* cases on the device) checks
  -- training against the reference; here, what a user gets wrong
  it("refuses CPU offload for parameters already on the cpu, and half an offload, saying why", function()
    H.assert_error(function() fsdp.wrap(nn.Linear(3, 2), { offload = true }) end,
      "fsdp.wrap 'Linear': offload keeps the shards on the CPU while the unit computes on a GPU, but its parameters "
      .. "are on the cpu; move the model to the GPU first")
    H.assert_error(function() fsdp.wrap(nn.Linear(3, 2):to("cuda"), { offload = { params = true } }) end,
      "fsdp.wrap: offload = {params, grads, optimizer} go together")
    H.assert_error(function() fsdp.wrap(nn.Linear(3, 2):to("cuda"), { offload = { param = true } }) end,
      "fsdp.wrap: unknown offload part \"param\" (params, grads, optimizer)")
    H.assert_error(function() fsdp.wrap(nn.Linear(3, 2):to("cuda"), { offload = "yes" }) end,
      "fsdp.wrap: offload must be true/false or {params = true, grads = true, optimizer = true}")
    -- and goes on: an offloaded unit trains, its pieces on the cpu
    local m = fsdp.wrap(nn.Linear(3, 2):to("cuda"), { offload = true })
    local loss = m(fsdp.ones(4, 3, { device = "cuda" })):sum()
    loss:backward()
    assert.equal("cuda", loss.device)
    assert.equal("cpu", m.weight.device)
    assert.equal("cpu", m.weight.grad.device)
    assert.same({ 4, 4, 4, 4, 4, 4 }, m.weight.grad:tolist())
  end)

  it("saves and loads checkpoints of models there: plain and sharded (FSDP), into models there", function()
    local function model()
      fsdp.manual_seed(3)
      return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    end
    local dir = H.mkdtemp("cuda-ckpt")
    local m = model():to("cuda")
    fsdp.save(dir .. "/m.safetensors", m:state_dict())
    local back = fsdp.load(dir .. "/m.safetensors")
    local m2 = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)):to("cuda")
    m2:load_state_dict(back) -- host tensors into device parameters
    for k, v in pairs(m:state_dict()) do
      assert.equal("cpu", back[k].device)
      assert.same(v:tolist(), m2:state_dict()[k]:tolist(), k)
    end
    local function wrapped()
      local f = model():to("cuda")
      fsdp.wrap(f:children()[1])
      return fsdp.wrap(f)
    end
    local f = wrapped()
    local opt = fsdp.optim.Adam(f:parameters(), { lr = 0.01 })
    local x = fsdp.randn(3, 4, { device = "cuda" })
    opt:zero_grad()
    f(x):sum():backward()
    opt:step()
    fsdp.save_sharded(dir .. "/sharded", f, opt)
    local g = wrapped()
    local opt2 = fsdp.optim.Adam(g:parameters(), { lr = 0.01 })
    fsdp.load_sharded(dir .. "/sharded", g, opt2)
    same_numbers(f(x):tolist(), g(x):tolist(), "outputs after the load")
    os.execute("rm -rf '" .. dir .. "'")
  end)

  if not real_gpu then
    -- the double counts the host's waits on the device (fsdp_testdev_syncs): what a GPU would wait for
    it("never waits for the device inside a training step: losses, gradients and checks stay there", function()
      local function waits(model, x, y, loss_fn)
        model:to("cuda")
        local opt = fsdp.optim.AdamW(model:parameters(), { lr = 1e-3 })
        x, y = x:to("cuda"), y:to("cuda")
        local function step()
          opt:zero_grad()
          local loss = loss_fn(model(x), y)
          loss:backward()
          opt:step()
          return loss
        end
        step()
        local s0 = C.fsdp_testdev_syncs()
        local loss = step()
        local s1 = C.fsdp_testdev_syncs()
        local v = loss:item()
        return tonumber(s1 - s0), tonumber(C.fsdp_testdev_syncs() - s1), v
      end
      fsdp.manual_seed(5)
      local F = nn.functional
      local cases = {
        { "mse", nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), fsdp.randn(4, 6), fsdp.randn(4, 3),
          F.mse_loss },
        { "cross entropy (a target check)", nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)),
          fsdp.randn(4, 6), fsdp.tensor({ 0, 2, 1, 0 }, "int64"), F.cross_entropy },
        { "embedding + nll (an index and a target check)", nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3)),
          fsdp.tensor({ 1, 7, 3 }, "int64"), fsdp.tensor({ 0, 2, 1 }, "int64"), F.nll_loss },
      }
      for _, c in ipairs(cases) do
        local step, item, v = waits(c[2], c[3], c[4], c[5])
        assert.same({ 0, 1 }, { step, item }, c[1] .. ": waits in the step, in item()")
        assert.is_true(v == v, c[1])
      end
    end)
  end

  -- (on every device: the double's checks, a GPU's and the executor's check kernels with the
  -- device's error slot, backend/cuda/cuda_util.h)
  do
    it("reports a bad index or target found on the device at the next wait, naming the op; then goes on", function()
      local F = nn.functional
      local emb = nn.Embedding(5, 3):to("cuda")
      local y = emb(fsdp.tensor({ 1, 7, 2 }, "int64"):cuda()) -- the check runs on the device: no error yet
      H.assert_error(function() return y:sum():item() end, "embedding: index value 7 is out of range for 5 embeddings",
        "(found on the device)")
      assert.equal(3 * 2, #emb(fsdp.tensor({ 1, 2 }, "int64"):cuda()):tolist())  -- the device works on
      local x = fsdp.randn(3, 4, { device = "cuda" })
      local loss = F.cross_entropy(x, fsdp.tensor({ 0, 9, 1 }, "int64"):cuda())
      H.assert_error(function() return loss:item() end, "cross_entropy: target value 9 is out of range for 4 classes")
      local _ = x:index_select(1, fsdp.tensor({ 0, 5 }, "int64"):cuda())
      H.assert_error(function() fsdp.cuda.synchronize() end,
        "index_select: index 5 is out of range for dim 1 of size 3")
      fsdp.cuda.synchronize()
      assert.same(x:cpu():index_select(1, fsdp.tensor({ 2, 0 }, "int64")):tolist(),
        x:index_select(1, fsdp.tensor({ 2, 0 }, "int64"):cuda()):tolist())
    end)
  end

  if real_gpu then return end
  it("runs out of memory with a message: what was asked, what is in use per category, what is cached", function()
    local rc, out = H.lua([[
      local fsdp = require "fsdp"
      fsdp._testdev_install()
      local keep = fsdp.nn.Linear(256, 256):to("cuda")            -- 257 KiB of params there
      local ok, err = pcall(fsdp.zeros, 4 * 1024 * 1024, { device = "cuda" })  -- 16 MiB in an 8 MiB arena
      print(ok, err)
      print(fsdp.zeros(4, { device = "cuda" }):sum():item())       -- and the process goes on]], "FSDP_TESTDEV_MIB=8")
    assert.equal(0, rc, out)
    assert.matches("false\t.*alloc: out of memory allocating 16777216 bytes %(16%.0 MiB%) on cuda; in use there: "
      .. "params 0%.3 MiB, grads 0%.0 MiB, optimizer 0%.0 MiB, activations 0%.0 MiB, comm 0%.0 MiB, other 0%.0 MiB; "
      .. "cached: [%d.]+ MiB", out)
    assert.matches("\n0\n", out)
  end)

  it("faults, naming it, when the host reads device memory directly (the check can fail)", function()
    local rc, out = H.lua([[
      local fsdp, ffi = require "fsdp", require "ffi"
      fsdp._testdev_install()
      local d = fsdp.ones(4, { device = "cuda" })
      io.stdout:write("through the table: ", d:sum():item(), "\n"); io.stdout:flush()
      local p = ffi.cast("float*", fsdp.C.fsdp_tensor_data(d.p))
      print("read directly: ", p[0])]])
    assert.matches("through the table: 4\n", out)
    assert.matches("testdev: the host touched device memory outside the device table", out)
    assert.not_matches("read directly", out)
    assert.not_equal(0, rc)
  end)
end)
