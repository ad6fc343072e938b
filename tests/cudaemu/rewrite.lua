-- tests/cudaemu/rewrite.lua -- turns a .cu file of the CUDA backend into C++ that g++ compiles
-- against the CUDA executor (emu.h), keeping every line where it was (a #line names the .cu file,
-- so compiler messages, __FILE__ and the executor's errors point into the original):
--   kernel<<<grid, block[, shmem[, stream]]>>>(args)  ->  FSDP_EMU_LAUNCH(kernel, grid, block...)(args)
--   __shared__ T name[dims];                          ->  FSDP_EMU_SHARED(T, name, [dims]);
--   extern __shared__ T name[];                       ->  FSDP_EMU_EXTERN_SHARED(T, name);
-- Anything else the executor would have to parse is refused with the line, so a new construct
-- fails the build here rather than compiling into something else.
--
--   luajit tests/cudaemu/rewrite.lua src/backend/cuda/elem.cu build/cudaemu/elem.cc
local src, dst = arg[1], arg[2]
if not src or not dst then
  io.stderr:write("usage: luajit tests/cudaemu/rewrite.lua IN.cu OUT.cc\n")
  os.exit(2)
end
local f = assert(io.open(src, "rb"))
local text = f:read("*a")
f:close()

local function fail(pos, what)
  local line = select(2, text:sub(1, pos):gsub("\n", "")) + 1
  io.stderr:write(("%s:%d: cudaemu rewrite: %s\n"):format(src, line, what))
  os.exit(1)
end

-- launches: the configuration between <<< and >>> is one line (a newline inside would be refused)
local out = text:gsub("([%w_]+)(%s*)<<<(.-)>>>", function(kernel, space, config)
  if config:find("\n") then return nil end
  return ("FSDP_EMU_LAUNCH(%s,%s %s)"):format(kernel, space, config)
end)
local stray = out:find("<<<", 1, true) or out:find(">>>", 1, true)
if stray then fail(stray, "a launch the rewrite does not understand (its <<<...>>> must be on one line)") end

-- shared memory declarations
out = out:gsub("extern%s+__shared__%s+([^;]-)%s*([%w_]+)%s*%[%s*%]%s*;", function(ty, name)
  return ("FSDP_EMU_EXTERN_SHARED(%s, %s);"):format(ty, name)
end)
out = out:gsub("__shared__%s+([^;]-);", function(decl)
  local dims = ""
  while true do
    local head, d = decl:match("^(.-)%s*(%b[])$")
    if not head then break end
    dims = d .. dims
    decl = head
  end
  local ty, name = decl:match("^(.-)%s*([%w_]+)$")
  if not ty or ty == "" or decl:find(",", 1, true) or decl:find("=", 1, true) then return nil end
  return ("FSDP_EMU_SHARED(%s, %s, %s);"):format(ty, name, dims)
end)
local left = out:find("__shared__", 1, true)
if left then
  local stop = out:find("\n", left, true) or #out
  fail(left, "a __shared__ declaration the rewrite does not understand: " .. out:sub(left, stop - 1)
    .. " (one variable per declaration, no initializer)")
end

local o = assert(io.open(dst, "wb"))
o:write(('#line 1 "%s"\n'):format(src), out)
o:close()
