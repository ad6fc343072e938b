-- Ranks disagree on how device tensors move: rank 1 stages them through the host
-- (FSDP_DEVICE_COMM=host) where the others use the stand-in communicator (the test double of
-- NCCL, on the test double of a GPU). The first device collective must fail on every rank with
-- a mismatch naming both ways, never hang. Prints "rank R error: <msg>".
local fsdp = require "fsdp"
local ffi = require "ffi"
ffi.cdef "int setenv(const char* name, const char* value, int overwrite);"
if not fsdp.cuda.is_available() then fsdp._testdev_install() end
local r, N = fsdp.rank(), fsdp.world_size()
ffi.C.setenv("FSDP_DEVICE_COMM", r == 1 and "host" or "standin", 1)
fsdp.barrier()
local ok, err = pcall(fsdp.all_reduce, fsdp.ones({ 4 }, { device = "cuda" }), "sum", { tag = "grads" })
assert(not ok, "the mismatched collective succeeded on rank " .. r)
io.write(("rank %d error: %s\n"):format(r, err))
io.flush()
ffi.cdef "int poll(void* fds, unsigned long nfds, int timeout);"
ffi.C.poll(nil, 0, 1000)  -- the first rank to exit stops the job: give the others time to print
