-- fsdp.autograd: Lua access to the C engine's gradient hooks, events and end-of-backward callbacks.
-- FSDP itself hooks the engine in C; these are for users and tests. One C callback per kind
-- dispatches to Lua functions by id, so no per-hook ffi callbacks are created.
local ffi = require "ffi"
local fsdp = require "fsdp"
local C = fsdp.C

local autograd = {}

local hooks = {}      -- ctx -> fn(grad) -> replacement or nil
local hook_ctx = {}   -- C hook id -> ctx, to drop hooks[ctx] when the C hook dies with its tensor
local listeners = {}  -- id -> fn(event_name, node_name, tensor)
local callbacks = {}  -- queued Lua callbacks for the running backward
local next_ctx = 0

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
-- their functions. Tensor finalizers, fsdp._release and backward call it when the queue is not
-- empty, so a function is unreferenced in the same collection that frees its tensor.
local freed_ids = ffi.new("int64_t[64]")
local freed_pending = C.fsdp_hooks_freed_pending()
function fsdp._hooks_freed()
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

-- t:register_hook(fn): fn(grad) runs when t's gradient is computed; returning a tensor replaces it.
-- Returns a handle with :remove().
function autograd.register_hook(t, fn)
  local p = fsdp._t(t, "register_hook")
  fsdp._fn(fn, "register_hook", "fn")
  fsdp._hooks_freed()
  next_ctx = next_ctx + 1
  local ctx = next_ctx
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

-- autograd.add_listener({"node_pre", "grad_ready"}, fn) -> handle with :remove()
-- fn(event, node_name, tensor) runs for each engine event in the list.
function autograd.add_listener(events, fn)
  local mask = 0
  for _, name in ipairs(type(events) == "table" and events or { events }) do
    local b = event_bits[name]
    if not b then error("add_listener: unknown event " .. tostring(name), 2) end
    mask = bit.bor(mask, b)
  end
  next_ctx = next_ctx + 1
  local ctx = next_ctx
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

-- only while backward runs: fn() runs after the last node, before backward_end
function autograd.queue_callback(fn)
  next_ctx = next_ctx + 1
  callbacks[next_ctx] = fn
  if C.fsdp_queue_callback(callback_cb, ffi.cast("void*", next_ctx)) ~= 0 then
    callbacks[next_ctx] = nil
    fsdp._raise(2)
  end
end

return autograd
