-- The documents cannot drift: every command in one of the ```sh blocks of README.md and of
-- docs/*.md is run, either here or by .ci/run. A block whose commands all appear as lines of
-- .ci/run (make demo, make test, the benchmarks, the guardrails) is CI's; any other block runs
-- here, as one bash script from the checkout, and must exit 0. So that nothing outside a temporary
-- directory is touched, the script sees HOME, /tmp and /usr/local replaced by directories of its own.
local H = require "helpers"

local function trim(s) return (s:gsub("^%s+", ""):gsub("%s+$", "")) end

-- a document's sh blocks: { first_line = n, commands = { "make demo", ... } }, comments dropped
local function sh_blocks(text)
  local blocks, cur, n = {}, nil, 0
  for line in (text .. "\n"):gmatch("([^\n]*)\n") do
    n = n + 1
    if cur then
      if line:match("^```") then blocks[#blocks + 1] = cur; cur = nil
      else
        local cmd = trim(line:gsub("%s+#%s.*$", ""))
        if cmd ~= "" and not cmd:match("^#") then cur.commands[#cur.commands + 1] = cmd end
      end
    elseif line:match("^```sh%s*$") then
      cur = { first_line = n + 1, commands = {} }
    end
  end
  return blocks
end

-- each line of .ci/run, and each one's command before its first VAR=value argument: `make demo-gpt
-- GPT_STOP_AT=300 ...` (a short form CI runs) counts as the documents' `make demo-gpt`; a make line
-- with several targets (`make -j2 --output-sync=target memcheck asan-check`) as `make memcheck`,
-- `make asan-check`
local function ci_lines()
  local set = {}
  for line in H.read_file(H.root .. "/.ci/run"):gmatch("[^\n]+") do
    line = trim(line)
    set[line] = true
    local head = line:match("^(.-)%s+[%w_]+=%S")
    if head then set[head] = true end
    if line:match("^make%s") then
      for word in line:sub(6):gmatch("%S+") do
        if word:match("^[%w_%-]+$") and not word:match("^%-") then set["make " .. word] = true
        elseif not (word:match("^%-") or word:find("=", 1, true)) then break end  -- a pipe, a redirection
      end
    end
  end
  return set
end

-- runs the block's commands as one bash script; returns exit status and output
local function run_block(block, tmp)
  local home, prefix, scratch = tmp .. "/home", tmp .. "/prefix", tmp .. "/tmp"
  local lines = { "set -e", "unset LUA_PATH LUA_CPATH", ("export HOME=%q"):format(home),
    ("mkdir -p %q %q"):format(home, scratch), ("cd %q"):format(H.root) }
  for _, cmd in ipairs(block.commands) do
    local c = cmd:gsub("([%s=])/tmp([%s/])", "%1" .. scratch .. "%2"):gsub("([%s=])/tmp$", "%1" .. scratch)
      :gsub("/usr/local", prefix)
    lines[#lines + 1] = ("echo %q"):format("+ " .. cmd)
    lines[#lines + 1] = c
  end
  local script = tmp .. "/block.sh"
  local f = assert(io.open(script, "w"))
  f:write(table.concat(lines, "\n"), "\n")
  f:close()
  return H.sh(("bash %q"):format(script), nil, 600)
end

-- README.md, then docs/*.md in name order (paths relative to the checkout)
local function documents()
  local docs = { "README.md" }
  local p = assert(io.popen(("ls %q/docs/*.md 2>/dev/null"):format(H.root)))
  for path in p:read("*a"):gmatch("[^\n]+") do docs[#docs + 1] = path:sub(#H.root + 2) end
  p:close()
  return docs
end

local ci = ci_lines()

describe("the documents' commands", function()
  it("README.md has sh blocks, and .ci/run runs the two commands", function()
    local n = #sh_blocks(H.read_file(H.root .. "/README.md"))
    assert.is_true(n >= 5, "expected the README's sh blocks, found " .. n)
    assert.is_true(ci["make test"] and ci["make demo"], ".ci/run must run `make test` and `make demo`")
  end)

  it("finds docs/*.md", function()
    assert.is_true(#documents() > 1, "expected docs/*.md beside README.md")
  end)

  for _, doc in ipairs(documents()) do
    local blocks = sh_blocks(H.read_file(H.root .. "/" .. doc))

    it(doc .. ": each sh block is either CI's or this spec's", function()
      for _, b in ipairs(blocks) do
        local in_ci = 0
        for _, cmd in ipairs(b.commands) do if ci[cmd] then in_ci = in_ci + 1 end end
        assert(in_ci == 0 or in_ci == #b.commands, ("%s:%d: the block mixes commands .ci/run runs with "
          .. "commands it does not (%s); split it"):format(doc, b.first_line, table.concat(b.commands, "; ")))
      end
    end)

    for _, b in ipairs(blocks) do
      local all_ci = #b.commands > 0
      for _, cmd in ipairs(b.commands) do all_ci = all_ci and ci[cmd] == true end
      if not all_ci then
        it(("runs the block at %s:%d (%s)"):format(doc, b.first_line, table.concat(b.commands, "; ")), function()
          local tmp = H.mkdtemp("fsdp_readme")
          local rc, out = run_block(b, tmp)
          os.execute(("rm -rf %q"):format(tmp))
          assert.are.equal(0, rc, ("%s:%d failed:\n%s"):format(doc, b.first_line, out))
          -- make install into a prefix LuaJIT does not search prints the lines that make it search there
          if table.concat(b.commands, "\n"):find("make install PREFIX=", 1, true) then
            assert.truthy(out:find('export LUA_PATH="' .. tmp .. '/prefix/share/lua/5.1/?.lua', 1, true), out)
            assert.truthy(out:find('export LUA_CPATH="' .. tmp .. '/prefix/lib/lua/5.1/?.so', 1, true), out)
          end
        end)
      end
    end
  end
end)
