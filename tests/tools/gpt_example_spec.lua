-- The second job in CI: examples/gpt.lua, tiny (one block of width 32, 30 steps on the first 400 kB
-- of the fortunes text), on 1 and 2 ranks: the loss falls, 2 ranks train on the same global batch
-- as 1 (losses equal within float32 rounding), --bf16 trains close to float32, a run stopped at step
-- 20 and resumed is bit-identical to the uninterrupted one, sampling prints the requested number of
-- characters and draws the same ones for the same weights and seed; expected errors (no corpus, bad
-- flags) are one message. Needs Debian's `fortunes` package (tools/deps.sh's demo set; .ci/run
-- installs it).
local H = require "helpers"

local gpt = H.root .. "/examples/gpt.lua"
local corpus = "/usr/share/games/fortunes"
local TINY = "--layers 1 --dim 32 --heads 2 --block 16 --batch-size 8 --accum 2 --limit 400000 --eval-iters 4 "
  .. "--steps 30 --eval-every 10 --warmup 5 --lr 0.003 --sample-len 60 --prompt Q"

local tmp = H.mkdtemp("fsdp_gpt")
local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
-- runs gpt.lua on n ranks (--ckpt @x, --resume @x: the directory x under tmp); returns the untagged output (stdout and stderr) and the exit status
local function run(n, args)
  args = args:gsub("%-%-(%a+) @(%w+)", function(flag, dir) return ("--%s %s/%s"):format(flag, tmp, dir) end)
  local rc, out = H.sh(("%s -n %d %s %s"):format(q(H.fsdprun), n, q(gpt), args), "FSDP_STDOUT_TTY=0 FSDP_COMM_TIMEOUT=60", 120)
  return H.untag((out:gsub("__rc=%d+%s*$", ""))), rc
end
-- the evaluation lines: { {step=, train=, val=, line=}, ... }, and the sample's text
local function parse(out)
  local curve = {}
  for l in out:gmatch("[^\n]+") do
    local s, tr, v = l:match("^step%s+(%d+)  train loss ([%d.]+)  val loss ([%d.]+)")
    if s then curve[#curve + 1] = { step = tonumber(s), train = tonumber(tr), val = tonumber(v), line = l } end
  end
  return curve, out:match("characters%):\n(.-)\n%-%- end of sample %-%-")
end

describe("examples/gpt.lua", function()
  local have = io.open(corpus .. "/fortunes", "rb")
  if have then have:close() end
  it("has the fortunes corpus", function()
    assert(have, "no " .. corpus .. "/fortunes: install it with `apt-get install fortunes` (.ci/run does); this spec cannot run without it")
  end)
  if not have then return end

  local out1, rc1 = run(1, TINY .. " --ckpt @one")
  local c1, s1 = parse(out1)

  it("trains: the validation loss falls, and prints a sample of the requested length", function()
    assert.are.equal(0, rc1, out1)
    assert.are.equal(3, #c1, out1)
    assert.are.same({ 10, 20, 30 }, { c1[1].step, c1[2].step, c1[3].step })
    for i = 2, 3 do assert.is_true(c1[i].val < c1[i - 1].val and c1[i].train < c1[i - 1].train, out1) end
    assert.is_true(c1[3].val < c1[1].val - 0.3, out1)
    assert.is_true(c1[1].val < 4.5, out1) -- below ln(vocabulary ~ 100) = 4.6 after 10 steps
    assert.truthy(s1, out1)
    assert.are.equal(1 + 60, #s1, out1) -- the prompt and 60 characters
    assert.are.equal("Q", s1:sub(1, 1))
  end)

  it("trains on 2 ranks exactly what 1 rank trains on (losses within float32 rounding)", function()
    local out2, rc2 = run(2, TINY .. " --ckpt @two")
    assert.are.equal(0, rc2, out2)
    local c2 = parse(out2)
    assert.are.equal(#c1, #c2, out2)
    for i = 1, #c1 do
      assert.is_true(math.abs(c1[i].val - c2[i].val) < 2e-5 and math.abs(c1[i].train - c2[i].train) < 2e-5,
        ("1 rank: %s\n2 ranks: %s"):format(c1[i].line, c2[i].line))
    end
  end)

  it("trains with --bf16 (bf16 compute, float32 masters): close to float32, not the same numbers", function()
    local out, rc = run(2, TINY .. " --ckpt @bf16 --bf16 --sample-len 0")
    assert.are.equal(0, rc, out)
    local c = parse(out)
    assert.are.equal(#c1, #c, out)
    local same = true
    for i = 1, #c1 do
      assert.is_true(math.abs(c1[i].val - c[i].val) < 0.05, ("float32: %s\nbf16: %s"):format(c1[i].line, c[i].line))
      same = same and c1[i].line == c[i].line
    end
    assert.is_false(same, "--bf16 trained exactly as float32: the option is not applied")
  end)

  it("resumes exactly: stopped at step 20 and resumed, the run is the uninterrupted one, sample included", function()
    local outa, rca = run(1, TINY .. " --ckpt @part --stop-at 20 --sample-len 0")
    assert.are.equal(0, rca, outa)
    local ca = parse(outa)
    assert.are.equal(2, #ca, outa)
    assert.are.same({ c1[1].line, c1[2].line }, { ca[1].line, ca[2].line })
    local outb, rcb = run(1, TINY .. " --resume @part")
    assert.are.equal(0, rcb, outb)
    assert.truthy(outb:find("resumed from " .. tmp .. "/part after step 20", 1, true), outb)
    local cb, sb = parse(outb)
    assert.are.equal(3, #cb, outb) -- the saved curve, then step 30
    for i = 1, 3 do assert.are.equal(c1[i].line, cb[i].line) end
    assert.are.equal(s1, sb) -- the same weights and seed draw the same characters
  end)

  it("samples the same text for the same weights and seed, another at another temperature", function()
    local args = TINY .. " --resume @one" -- a finished run: nothing to train, only the sample
    local outc, outd = run(1, args), run(1, args)
    local oute = run(1, args .. " --temperature 2 --top-k 50")
    local _, sc = parse(outc)
    local _, sd = parse(outd)
    local _, se = parse(oute)
    assert.truthy(sc and se, outc .. oute)
    assert.are.equal(s1, sc)
    assert.are.equal(sc, sd)
    assert.are.equal(61, #se)
    assert.are_not.equal(sc, se)
    local outf = run(1, args .. " --seed 1")
    assert.truthy(outf:find("it was trained with --seed 0, not 1", 1, true), outf) -- not a resume of another run
  end)

  it("names the package when the corpus is missing, and rejects bad flags", function()
    local out, rc = run(1, TINY .. " --data /nonexistent")
    assert.are.equal(1, rc, out)
    assert.truthy(out:find("apt-get install fortunes", 1, true), out)
    out, rc = run(1, "--dim 30 --heads 4")
    assert.are.equal(2, rc, out)
    assert.truthy(out:find("--dim 30 is not a multiple of --heads 4", 1, true), out)
    out, rc = run(1, "--bogus")
    assert.are.equal(2, rc, out)
  end)

  teardown(function() os.execute("rm -rf " .. q(tmp)) end)
end)
