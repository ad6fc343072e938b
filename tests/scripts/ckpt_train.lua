-- Multi-rank phases of tests/fsdp/checkpoint_spec.lua (run by bin/fsdprun -n N):
--   first  DIR OUT      train 3 steps, save_sharded, record the gathered state, train 3 more
--                       (also an unwrapped reference on the global batch); rank 0 writes OUT/first.lua
--   resume DIR OUT TAG  fresh model (other seed), load_sharded, train 3 steps; OUT/resume_TAG.lua
--   crash  DIR OUT      train 1 step, save (gen 1), train 1 step, save again and die (kill -9)
--                       after the rank files are written, before `latest`
local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."
package.path = here .. "/?.lua;" .. package.path
local fsdp = require "fsdp"
local K = require "ckpt_model"

fsdp.init()
local R, N = fsdp.rank(), fsdp.world_size()
local phase, dir, out, tag = arg[1], arg[2], arg[3], arg[4]

local function dump(path, t)
  local function ser(v)
    if type(v) == "number" then return ("%.17g"):format(v) end
    if type(v) == "string" then return ("%q"):format(v) end
    if type(v) == "boolean" then return tostring(v) end
    local parts = {}
    for k, x in pairs(v) do
      parts[#parts + 1] = "[" .. (type(k) == "number" and tostring(k) or ("%q"):format(k)) .. "] = " .. ser(x)
    end
    return "{" .. table.concat(parts, ", ") .. "}"
  end
  local f = assert(io.open(path, "w"))
  f:write("return ", ser(t), "\n")
  f:close()
end

if phase == "first" then
  local ref = K.build(0)
  local m = K.wrap(K.build(0))
  local ro, o = K.optimizer(ref), K.optimizer(m)
  local res = { before = {}, after = {}, ref = {}, idle = true }
  for s = 1, 3 do
    local st = fsdp.get_rng_state()
    res.before[s] = K.step(m, o, R, N)
    fsdp.set_rng_state(st)
    res.ref[s] = K.step(ref, ro, 0, 1)
    res.idle = res.idle and fsdp.all_idle()
  end
  res.gen = fsdp.save_sharded(dir, m, o, { step = 3, note = "after 3 steps", lr = 0.02 })
  local sd = m:state_dict()
  if R == 0 then fsdp.save(out .. "/sd_at_save.safetensors", sd) end
  for s = 4, 6 do
    local st = fsdp.get_rng_state()
    res.after[s - 3] = K.step(m, o, R, N)
    fsdp.set_rng_state(st)
    res.ref[s] = K.step(ref, ro, 0, 1)
    res.idle = res.idle and fsdp.all_idle()
  end
  res.ref_diff = K.sd_diff(m:state_dict(), ref:state_dict())
  local final = m:state_dict()
  if R == 0 then
    fsdp.save(out .. "/sd_final.safetensors", final)
    dump(out .. "/first.lua", res)
  end
elseif phase == "resume" then
  local m = K.wrap(K.build(7))
  local o = K.optimizer(m)
  local saved = fsdp.load(out .. "/sd_at_save.safetensors")
  local res = { losses = {}, idle = true, world = N }
  res.before_diff = K.sd_diff(m:state_dict(), saved)  -- the fresh model differs
  local extra = fsdp.load_sharded(dir, m, o)
  res.extra = extra
  res.load_diff = K.sd_diff(m:state_dict(), saved)
  for s = 1, 3 do
    res.losses[s] = K.step(m, o, R, N)
    res.idle = res.idle and fsdp.all_idle()
  end
  res.final_diff = K.sd_diff(m:state_dict(), fsdp.load(out .. "/sd_final.safetensors"))
  if R == 0 then dump(("%s/resume_%s.lua"):format(out, tag), res) end
elseif phase == "crash" then
  local m = K.wrap(K.build(0))
  local o = K.optimizer(m)
  K.step(m, o, R, N)
  fsdp.save_sharded(dir, m, o, { step = 1 })
  local sd = m:state_dict()
  if R == 0 then fsdp.save(out .. "/sd_gen1.safetensors", sd) end
  K.step(m, o, R, N)
  require("fsdp.checkpoint")._crash_at, require("fsdp.checkpoint")._crash_kill = "before_latest", true
  fsdp.save_sharded(dir, m, o, { step = 2 })
  error("not reached: the save should have killed this process")
else
  error("ckpt_train.lua: unknown phase " .. tostring(phase))
end
