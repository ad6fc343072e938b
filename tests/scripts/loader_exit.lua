-- tests/nn/dataloader_workers_spec.lua: a DataLoader with 2 workers, left in the middle of an epoch
-- in one of the ways a program ends; the workers' pids go to PIDFILE first, and the spec checks
-- that none of them outlives this process.
--   luajit tests/scripts/loader_exit.lua exit|exit_close|error|sigterm|sigint|sigkill PIDFILE
local ffi = require "ffi"
local fsdp = require "fsdp"
pcall(ffi.cdef, "int getpid(void);")
pcall(ffi.cdef, "int kill(int pid, int sig);")
local mode, pidfile = arg[1], arg[2]
local Ids = fsdp.data.Dataset:extend("Ids")
function Ids:len() return 40 end
function Ids:get(i)
  if i > 8 then  -- busy for long: a worker lives on only if nothing kills it
    local t0 = os.clock()
    while os.clock() - t0 < 20 do end
  end
  return i
end
local loader = fsdp.data.DataLoader(Ids(), { batch_size = 2, num_workers = 2 })
-- two iterators in the middle of their epochs: one left by break (its workers wait for the GC),
-- one still running
for _ in loader() do break end
local it = loader()
it()
-- this process's children, from /proc (the workers: luajit, as this process; not ls)
local f = assert(io.open(pidfile, "w"))
local ls = io.popen("ls /proc")
for d in ls:lines() do
  local st = d:match("^%d+$") and io.open("/proc/" .. d .. "/stat")
  if st then
    local ppid = tonumber(st:read("*a"):match("%) %a (%d+)"))
    st:close()
    local comm = io.open("/proc/" .. d .. "/comm")
    if ppid == ffi.C.getpid() and comm and comm:read("*l") == "luajit" then f:write(d, "\n") end
    if comm then comm:close() end
  end
end
ls:close()
f:close()
if mode == "exit" then os.exit(0)
elseif mode == "exit_close" then os.exit(0, true)
elseif mode == "error" then error("an error in the main process")
elseif mode == "sigterm" then ffi.C.kill(ffi.C.getpid(), 15)
elseif mode == "sigint" then ffi.C.kill(ffi.C.getpid(), 2)
elseif mode == "sigkill" then ffi.C.kill(ffi.C.getpid(), 9) end
-- (SIGINT under luajit: "interrupted!" is raised at the next instruction)
while true do end
