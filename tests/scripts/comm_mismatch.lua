-- Ranks disagree: rank 1 calls reduce_scatter tag 'B' where every other rank calls all_gather
-- tag 'A'. Every rank must get the error naming both (no hang), and later collectives fail at
-- once with the same message. Prints "rank R error: <msg>" and "rank R later: <msg>".
local fsdp = require "fsdp"
local r, N = fsdp.rank(), fsdp.world_size()
fsdp.barrier()
local ok, err
if r == 1 then
  ok, err = pcall(fsdp.reduce_scatter, fsdp.zeros(4), fsdp.zeros(4 * N), "sum", { tag = "B" })
else
  ok, err = pcall(fsdp.all_gather, fsdp.zeros(4 * N), fsdp.zeros(4), { tag = "A" })
end
assert(not ok, "the mismatched collective succeeded on rank " .. r)
io.write(("rank %d error: %s\n"):format(r, err))
ok, err = pcall(fsdp.all_reduce, fsdp.ones(2))
assert(not ok, "a collective after the mismatch succeeded on rank " .. r)
io.write(("rank %d later: %s\n"):format(r, err))
io.flush()
-- the first rank to exit stops the job (the communicator is broken, so it skips MPI_Finalize):
-- give the others time to print
local ffi = require "ffi"
ffi.cdef "int poll(void* fds, unsigned long nfds, int timeout);"
ffi.C.poll(nil, 0, 1000)
