--- fsdp.autograd: Lua access to the C engine's gradient hooks, events and end-of-backward callbacks.
-- FSDP itself hooks the engine in C; these are for users and tests. One C callback per kind
-- dispatches to Lua functions by id, so no per-hook ffi callbacks are created.
-- @module fsdp.autograd
local ffi = require "ffi"
local fsdp = require "fsdp"
local C = fsdp.C

local autograd = {}

-- The tables below are shared by every copy of this module in the process: C keeps one queue of
-- freed hooks and one of freed regions, and a test runner that loads modules afresh per file (busted)
-- makes several copies, any of which may drain those queues -- it must find every entry. So they
-- live in the Lua registry, with one counter for the ctx ids.
local reg = debug.getregistry()
local S = reg["fsdp.autograd"] or { hooks = {}, hook_ctx = {}, listeners = {}, callbacks = {}, regions = {}, next_ctx = 0 }
reg["fsdp.autograd"] = S
local hooks = S.hooks          -- ctx -> fn(grad) -> replacement or nil
local hook_ctx = S.hook_ctx    -- C hook id -> ctx, to drop hooks[ctx] when the C hook dies with its tensor
local listeners = S.listeners  -- id -> fn(event_name, node_name, tensor)
local callbacks = S.callbacks  -- queued Lua callbacks for the running backward
local function new_ctx()
  S.next_ctx = S.next_ctx + 1
  return S.next_ctx
end

local function set_error(msg) C.fsdp_set_error(tostring(msg)) end

local hook_cb = ffi.cast("fsdp_grad_hook_fn", function(grad, ctx, err)
  local fn = hooks[tonumber(ffi.cast("intptr_t", ctx))]
  if not fn then return nil end
  C.fsdp_tensor_retain(grad)
  local ok, r = pcall(fn, fsdp._wrap(grad))
  if not ok then set_error("tensor hook: " .. tostring(r)); err[0] = 1; return nil end
  if r == nil then return nil end
  if not fsdp.is_tensor(r) then set_error("tensor hook: must return a tensor or nil"); err[0] = 1; return nil end
  C.fsdp_tensor_retain(r.p)
  return r.p
end)

-- A hook's Lua function lives until remove() or until its tensor (a leaf, or a non-leaf's graph
-- node) is freed: C queues the ids of hooks freed with their tensor, and fsdp._hooks_freed drops
-- their functions (and the closures of checkpointed regions C freed: drop_freed_regions below).
-- Tensor finalizers, fsdp._release and backward call it when a queue is not empty, so a function
-- is unreferenced in the same collection that frees its tensor.
local freed_ids = ffi.new("int64_t[64]")
local freed_pending = C.fsdp_hooks_freed_pending()
local drop_freed_regions
local function hooks_freed()
  drop_freed_regions()
  while freed_pending[0] > 0 do
    local n = C.fsdp_hooks_take_freed(freed_ids, 64)
    for i = 0, n - 1 do
      local id = tonumber(freed_ids[i])
      local ctx = hook_ctx[id]
      if ctx then
        hooks[ctx] = nil
        hook_ctx[id] = nil
      end
    end
  end
end
reg["fsdp.hooks_freed"] = hooks_freed  -- (what every copy's fsdp._hooks_freed calls: fsdp/init.lua)
fsdp._hooks_freed = hooks_freed

--- t:register_hook(fn): fn(grad) runs when t's gradient is computed; returning a tensor replaces it.
-- Returns a handle with :remove().
function autograd.register_hook(t, fn)
  local p = fsdp._t(t, "register_hook")
  fsdp._fn(fn, "register_hook", "fn")
  fsdp._hooks_freed()
  local ctx = new_ctx()
  local id = C.fsdp_tensor_register_hook(p, hook_cb, ffi.cast("void*", ctx))
  if id < 0 then fsdp._raise(2) end
  local key = tonumber(id)
  hooks[ctx] = fn
  hook_ctx[key] = ctx
  return {
    remove = function()
      C.fsdp_remove_hook(id)
      hooks[ctx] = nil
      hook_ctx[key] = nil
    end,
  }
end

local event_names = {
  [1] = "backward_begin", [2] = "node_pre", [4] = "node_post", [8] = "grad_ready", [16] = "backward_end",
}
local event_bits = {}
for bit, name in pairs(event_names) do event_bits[name] = bit end
autograd.events = event_bits

local listener_cb = ffi.cast("fsdp_listener_fn", function(ev, node, tensor, ctx)
  local fn = listeners[tonumber(ffi.cast("intptr_t", ctx))]
  if not fn then return 0 end
  local t = nil
  if tensor ~= nil then C.fsdp_tensor_retain(tensor); t = fsdp._wrap(tensor) end
  local ok, e = pcall(fn, event_names[ev], node ~= nil and ffi.string(C.fsdp_node_name(node)) or nil, t)
  if not ok then set_error("autograd listener: " .. tostring(e)); return 1 end
  return 0
end)

--- autograd.add_listener({"node_pre", "grad_ready"}, fn) -> handle with :remove()
-- fn(event, node_name, tensor) runs for each engine event in the list.
function autograd.add_listener(events, fn)
  local mask = 0
  for _, name in ipairs(type(events) == "table" and events or { events }) do
    local b = event_bits[name]
    if not b then error("add_listener: unknown event " .. tostring(name), 2) end
    mask = bit.bor(mask, b)
  end
  local ctx = new_ctx()
  listeners[ctx] = fn
  local id = C.fsdp_autograd_add_listener(mask, listener_cb, ffi.cast("void*", ctx))
  if id < 0 then listeners[ctx] = nil; fsdp._raise(2) end
  return { remove = function() C.fsdp_autograd_remove_listener(id); listeners[ctx] = nil end }
end

local callback_cb = ffi.cast("fsdp_callback_fn", function(ctx)
  local k = tonumber(ffi.cast("intptr_t", ctx))
  local fn = callbacks[k]
  callbacks[k] = nil
  local ok, e = pcall(fn)
  if not ok then set_error("queued callback: " .. tostring(e)); return 1 end
  return 0
end)

-- ---- activation checkpointing ------------------------------------------------------------------------
-- fsdp.checkpoint(fn, ...) -> fn(...)'s results, like torch.utils.checkpoint.checkpoint: the graph
-- fn builds keeps no activations (the core's region, src/core/autograd.c), and backward, at the
-- first node that needs one, runs fn on the same arguments again -- with the RNG as it was, so
-- dropout draws the same -- and takes what that run saves. Memory: the region's inputs instead of
-- everything inside it; time: one more forward of fn. fn must run the same ops both times.
-- Inside fsdp.wrap's units this works both ways: a unit resharded after forward gathers again for
-- the rerun, and a unit may checkpoint parts of its own forward (or all of it: wrap's
-- {checkpoint = true}). Without grad mode fn simply runs.
local regions = S.regions  -- ctx -> the closure that reruns a region's forward, until C frees the region
local rerun_cb = ffi.cast("fsdp_recompute_fn", function(ctx)
  local f = regions[tonumber(ffi.cast("intptr_t", ctx))]
  if not f then set_error("checkpoint: the region's function is gone"); return -1 end
  local res = { pcall(f) }
  if not res[1] then set_error("checkpoint: running the forward again for backward: " .. tostring(res[2])); return -1 end
  -- the rerun's own graph, outputs and the activations it did not save are not used: they go now
  for i = 2, #res do if fsdp.is_tensor(res[i]) then fsdp._release(res[i]) end end
  res = nil
  fsdp._collect()
  return 0
end)
local freed_regions = ffi.new("void*[64]")
function drop_freed_regions()
  repeat
    local n = C.fsdp_checkpoint_take_freed(freed_regions, 64)
    for i = 0, n - 1 do regions[tonumber(ffi.cast("intptr_t", freed_regions[i]))] = nil end
  until n < 64
end
local function pack(...) return { n = select("#", ...), ... } end
--- Activation checkpointing: runs fn(...) keeping only its inputs, reruns it in backward (fsdp.checkpoint).
-- @param fn a function of tensors
-- @param ... its arguments
function autograd.checkpoint(fn, ...)
  local mt = getmetatable(fn)
  if type(fn) ~= "function" and not (mt and mt.__call) then
    error(("checkpoint: expected a function (or a module) to run, got %s"):format(type(fn)), 2)
  end
  drop_freed_regions()
  local k, args = new_ctx(), pack(...)
  regions[k] = function() return fn(unpack(args, 1, args.n)) end
  local began = C.fsdp_checkpoint_begin(rerun_cb, ffi.cast("void*", k))
  if began ~= 1 then
    regions[k] = nil
    if began < 0 then fsdp._raise(2) end
    return fn(...)
  end
  local res = pack(pcall(fn, ...))
  C.fsdp_checkpoint_end()
  if not res[1] then error(res[2], 0) end
  -- no node holds the activations made inside: only their (dead) handles did, so a collection
  -- frees them now rather than when the allocation pressure calls one
  fsdp._collect()
  return unpack(res, 2, res.n)
end
--- Whether a checkpointed forward is being rerun now (in backward).
function autograd.checkpoint_rerunning() return C.fsdp_checkpoint_rerunning() ~= 0 end

--- only while backward runs: fn() runs after the last node, before backward_end
function autograd.queue_callback(fn)
  local ctx = new_ctx()
  callbacks[ctx] = fn
  if C.fsdp_queue_callback(callback_cb, ffi.cast("void*", ctx)) ~= 0 then
    callbacks[ctx] = nil
    fsdp._raise(2)
  end
end

return autograd
