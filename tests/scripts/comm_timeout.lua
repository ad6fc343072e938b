-- Rank 1 (or arg[1]) skips a collective (it is busy for 60 s) while the others call all_reduce 'skipped'.
-- Run with a small FSDP_COMM_TIMEOUT: the others must fail within it, naming rank 1; then the
-- job ends (mpirun stops rank 1). Prints "rank R error after T s: <msg>".
local fsdp = require "fsdp"
local ffi = require "ffi"
ffi.cdef "int poll(void* fds, unsigned long nfds, int timeout);"
local r, skipper = fsdp.rank(), tonumber(arg[1] or 1)
fsdp.barrier()
if r == skipper then
  ffi.C.poll(nil, 0, 60000)
  io.write(("rank %d woke up: the job was not stopped\n"):format(r))
  os.exit(0)
end
local t0 = os.time()
local ok, err = pcall(fsdp.all_reduce, fsdp.ones(4), "sum", { tag = "skipped" })
assert(not ok, "all_reduce succeeded without rank " .. skipper)
io.write(("rank %d error after %d s: %s\n"):format(r, os.time() - t0, err))
io.flush()
ffi.C.poll(nil, 0, 1000)  -- let the other failing ranks print before the first exit stops the job
os.exit(1)
