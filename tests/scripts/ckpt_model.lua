-- The model, optimizer and data of the sharded-checkpoint tests (tests/fsdp/checkpoint_spec.lua,
-- tests/scripts/ckpt_train.lua): nested units (one owning no parameters of its own), a NO_SHARD
-- unit, a frozen parameter, sizes that leave padded and empty pieces at 2 and 4 ranks, AdamW with
-- two parameter groups. The global batch is drawn from the shared RNG on every rank.
local fsdp = require "fsdp"
local nn = fsdp.nn

local K = { B = 8, IN = 8, CLASSES = 5 }

-- other = true: a different model (another hidden size), for the mismatch errors
function K.build(seed, other)
  fsdp.manual_seed(seed)
  local h = other and 10 or 12
  local m = nn.Sequential(nn.Linear(K.IN, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, h), nn.ReLU()),
                          nn.Linear(h, K.CLASSES))
  m["0"].bias.requires_grad = false
  return m
end

-- FSDP_CKPT_SHARDING=hybrid:G wraps the sharded units with hybrid sharding (shard groups of G)
function K.wrap(m)
  local g = (os.getenv("FSDP_CKPT_SHARDING") or ""):match("^hybrid:(%d+)$")
  local o = g and { sharding = "hybrid", shard_group_size = tonumber(g) } or nil
  fsdp.wrap(m["2"]["0"], o)
  fsdp.wrap(m["2"], o)
  fsdp.wrap(m["3"], { sharding = "none" })
  fsdp.wrap(m, o)
  return m
end

function K.optimizer(m)
  local decay, no_decay = {}, {}
  for name, p in m:named_parameters() do
    if name:find("weight$") then decay[#decay + 1] = p else no_decay[#no_decay + 1] = p end
  end
  return fsdp.optim.AdamW({ { params = decay, weight_decay = 0.1 }, { params = no_decay, weight_decay = 0 } },
                          { lr = 0.02, betas = { 0.85, 0.99 } })
end

-- one training step on this rank's slice of a fresh global batch; returns the global mean loss
function K.step(m, opt, rank, world)
  local x, y = fsdp.randn { K.B, K.IN }, fsdp.randint(0, K.CLASSES, { K.B })
  local n = K.B / world
  local xs, ys = x:narrow(1, rank * n + 1, n), y:narrow(1, rank * n + 1, n)
  local loss = fsdp.F.cross_entropy(m(xs), ys)
  opt:zero_grad()
  loss:backward()
  opt:step()
  local t = fsdp.tensor({ loss:item() })
  if world > 1 then fsdp.all_reduce(t, "avg") end
  return t:item()
end

-- max |a - b| over two state dicts with the same keys (error naming a key that is missing)
function K.sd_diff(a, b)
  local d = 0
  for k, t in pairs(a) do
    local u = b[k]
    if not u then error("state dict lacks " .. k) end
    local x, y = t:reshape(-1):tolist(), u:reshape(-1):tolist()
    if #x ~= #y then error(("%s: %d vs %d elements"):format(k, #x, #y)) end
    for i = 1, #x do d = math.max(d, math.abs(x[i] - y[i])) end
  end
  for k in pairs(b) do if not a[k] then error("state dict has an unexpected " .. k) end end
  return d
end

return K
