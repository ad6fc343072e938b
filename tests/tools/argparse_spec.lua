-- fsdp.argparse: Python argparse's names and behaviour for a training script's flags -- values by
-- type, defaults, switches, choices, --flag=value, positionals, the help text, and a usage error
-- (exit status 2, "prog: msg") for every bad command line; examples/train.lua and gpt.lua use it.
local H = require "helpers"
local fsdp = require "fsdp"
local argparse = fsdp.argparse

local function parser()
  local p = argparse.ArgumentParser { prog = "t.lua", description = "Trains.", exit_on_error = false }
  p:add_argument("--epochs", { type = "int", default = 8, min = 0, metavar = "N", help = "epochs (default 8)" })
  p:add_argument("--batch-size", { type = "int", default = 64, min = 1, help = "global batch" })
  p:add_argument("--lr", { type = "float", default = 1e-3, help = "learning rate\nsecond line" })
  p:add_argument("--device", { choices = { "cpu", "cuda" }, default = "cpu" })
  p:add_argument("--summary", { action = "store_true", help = "print the plan" })
  p:add_argument("--resume", { metavar = "DIR" })
  p:add_argument("data", { nargs = "?", help = "a directory" })
  return p
end

describe("fsdp.argparse", function()
  it("gives defaults, typed values by dest (dashes made underscores), switches and --flag=value", function()
    local a = parser():parse_args {}
    assert.same({ epochs = 8, batch_size = 64, lr = 1e-3, device = "cpu", summary = false }, a)
    a = parser():parse_args { "--epochs", "3", "--batch-size=32", "--lr", "0.5", "--summary", "--device", "cuda",
      "--resume", "ck", "dir" }
    assert.same({ epochs = 3, batch_size = 32, lr = 0.5, device = "cuda", summary = true, resume = "ck", data = "dir" }, a)
    assert.equal("number", type(a.epochs))
  end)

  it("refuses a bad command line with a message that names the flag", function()
    local cases = {
      { { "--epochs", "two" }, "t.lua: --epochs expects an integer, got 'two'" },
      { { "--epochs", "1.5" }, "t.lua: --epochs expects an integer, got '1.5'" },
      { { "--lr", "fast" }, "t.lua: --lr expects a number, got 'fast'" },
      { { "--device", "tpu" }, "t.lua: --device expects cpu or cuda, got 'tpu'" },
      { { "--batch-size", "0" }, "t.lua: --batch-size must be at least 1, got 0" },
      { { "--epochs" }, "t.lua: --epochs needs a value" },
      { { "--summary=yes" }, "t.lua: --summary takes no value" },
      { { "--bogus" }, "t.lua: unknown flag --bogus" },
      { { "a", "b" }, "t.lua: unexpected argument 'b'" },
    }
    for _, c in ipairs(cases) do H.assert_error(function() parser():parse_args(c[1]) end, c[2]) end
    local p = argparse.ArgumentParser { prog = "t.lua", exit_on_error = false }
    p:add_argument("src")
    p:add_argument("--out", { required = true })
    H.assert_error(function() p:parse_args { "--out", "x" } end, "t.lua: the argument src is required")
    H.assert_error(function() p:parse_args { "s" } end, "t.lua: the flag --out is required")
    assert.same({ src = "s", out = "x" }, p:parse_args { "s", "--out", "x" })
  end)

  it("writes the help from the arguments, continuation lines indented", function()
    local help = parser():format_help()
    assert.truthy(help:find("usage: t.lua [flags] [data]\n\nTrains.\n\n", 1, true), help)
    assert.truthy(help:find("\n  %-%-lr LR +learning rate\n +second line\n"), help)
    assert.truthy(help:find("\n  %-%-summary +print the plan\n"), help)
    assert.truthy(help:find("\n  %-h, %-%-help +this text\n"), help)
    -- one column for every help text: two spaces past the widest entry
    local col = help:match("\n(  %-%-epochs N +)epochs")
    assert.equal(#"  --batch-size BATCH_SIZE" + 2, #col, help)
  end)

  it("ends each help with the flag's default under formatter_class = ArgumentDefaultsHelpFormatter", function()
    local p = argparse.ArgumentParser { prog = "t.lua", formatter_class = argparse.ArgumentDefaultsHelpFormatter }
    p:add_argument("--steps", { type = "int", default = 2000, help = "optimizer steps" })
    p:add_argument("--lr", { type = "float", default = 2e-3, help = "peak rate\ncosine decay" })
    p:add_argument("--prompt", { default = "\n", help = "start text" })
    p:add_argument("--bf16", { action = "store_true", help = "bf16 compute" })
    p:add_argument("--resume", { help = "a directory" })
    p:add_argument("--seed", { type = "int", default = 0 })
    local help = p:format_help()
    assert.truthy(help:find("\n  %-%-steps STEPS +optimizer steps %(default: 2000%)\n"), help)
    assert.truthy(help:find("\n  %-%-lr LR +peak rate\n +cosine decay %(default: 0.002%)\n"), help)
    assert.truthy(help:find("start text (default: \\n)\n", 1, true), help)
    assert.truthy(help:find("\n  %-%-bf16 +bf16 compute %(default: false%)\n"), help)
    assert.truthy(help:find("\n  %-%-resume RESUME +a directory\n"), help)
    assert.truthy(help:find("\n  %-%-seed SEED +%(default: 0%)\n"), help)
    assert.falsy(parser():format_help():find("default:", 1, true)) -- the plain formatter adds nothing
    assert.has_error(function() argparse.ArgumentParser { formatter_class = "RawTextHelpFormatter" } end,
      "ArgumentParser: formatter_class must be argparse.ArgumentDefaultsHelpFormatter, got RawTextHelpFormatter")
  end)

  it("rejects a malformed declaration, naming the argument", function()
    local p = argparse.ArgumentParser { prog = "t.lua" }
    H.assert_error(function() p:add_argument("--x", { typ = "int" }) end, 'add_argument("--x"): unknown option typ')
    H.assert_error(function() p:add_argument("--x", { type = "integer" }) end, "type must be \"int\", \"float\", \"str\" or a function")
    H.assert_error(function() p:add_argument("-x") end, "flags are spelled --name")
    p:add_argument("--x")
    H.assert_error(function() p:add_argument("--x") end, "--x is added twice")
  end)

  it("exits 2 on a usage error and 0 after --help, in a script", function()
    local code = [[
      local p = fsdp.argparse.ArgumentParser { prog = "s.lua" }
      p:add_argument("--n", { type = "int", default = 1, help = "how many" })
      local a = p:parse_args(arg)
      print("n=" .. a.n)]]
    local path = os.tmpname() .. ".lua"
    local f = assert(io.open(path, "w"))
    f:write(("package.path = %q .. package.path\n"):format(H.root .. "/lua/?.lua;" .. H.root .. "/lua/?/init.lua;"))
    f:write(("package.cpath = %q .. package.cpath\n"):format(H.root .. "/?.so;"))
    f:write("local fsdp = require 'fsdp'\n", code, "\n")
    f:close()
    local rc, out = H.sh("luajit " .. path .. " --n x")
    assert.equal(2, rc, out)
    assert.truthy(out:find("s.lua: --n expects an integer, got 'x'\n(see --help)", 1, true), out)
    rc, out = H.sh("luajit " .. path .. " --help")
    assert.equal(0, rc, out)
    assert.truthy(out:find("  --n N", 1, true), out)
    rc, out = H.sh("luajit " .. path .. " --n=3")
    assert.equal(0, rc, out)
    assert.truthy(out:find("n=3", 1, true), out)
    os.remove(path)
  end)
end)
