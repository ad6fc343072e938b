-- Ranks pass tensors of the same bytes but different shapes: rank 1's are transposed. MODE (the
-- first argument) is "broadcast" (a plain broadcast of (2, 3) vs (3, 2)), "wrap" (a conv kernel
-- of (4, 1, 3, 2) vs (4, 1, 2, 3) under fsdp.wrap, which broadcasts rank 0's values) or
-- "wrap_nosync" (the same with sync_module_states = false: no broadcast, a shape check).
-- Every rank must get an error naming the tag, both shapes and both ranks. Prints
-- "rank R error: <msg>".
local fsdp = require "fsdp"
local nn = fsdp.nn
local mode = arg[1]
local r = fsdp.rank()
fsdp.barrier()
local ok, err
if mode == "broadcast" then
  local t = r == 1 and fsdp.zeros(3, 2) or fsdp.zeros(2, 3)
  ok, err = pcall(fsdp.broadcast, t, 0, { tag = "weights" })
else
  local kernel = r == 1 and { 2, 3 } or { 3, 2 }
  local model = nn.Sequential(nn.Conv2d(1, 4, kernel), nn.ReLU())
  ok, err = pcall(fsdp.wrap, model, { sync_module_states = mode ~= "wrap_nosync" })
end
assert(not ok, "the mismatched shapes went through on rank " .. r)
io.write(("rank %d error: %s\n"):format(r, err))
io.flush()
local ffi = require "ffi"
ffi.cdef "int poll(void* fds, unsigned long nfds, int timeout);"
ffi.C.poll(nil, 0, 1000)
