-- Reads a FIFO that has no writer (arg[1]: "load" for fsdp.load, "idx" for a data-set file of
-- fsdp.data.idx, "checkpoint" for a checkpoint
-- directory whose `latest` is the FIFO; arg[2]: the path). Must fail at once with a clear
-- message, never block in open(). Prints "error: <msg>" and exits 1 (0 would mean it loaded).
local fsdp = require "fsdp"
local mode, path = arg[1], arg[2]
local ok, err
if mode == "load" then
  ok, err = pcall(fsdp.load, path)
elseif mode == "idx" then
  ok, err = pcall(require("fsdp.data.idx").read_images, path)
else
  ok, err = pcall(require("fsdp.checkpoint").read, path)
end
io.write(ok and "loaded\n" or ("error: " .. tostring(err) .. "\n"))
os.exit(ok and 0 or 1)
