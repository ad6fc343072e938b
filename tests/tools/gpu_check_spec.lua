-- tools/gpu_check.sh fits the machine that lends a GPU (issue 40 item 8): that machine returns at
-- most 8 files from $OUT and lends 15 minutes that also pay for its start, so the check writes two
-- files (summary.txt and details.tar.gz, the archive of every stage's output, packed after each
-- stage) and its stage limits add up to at most 300 s. Checked with --dry-run, which writes each
-- stage's command instead of running it.
local H = require "helpers"

describe("tools/gpu_check.sh --dry-run", function()
  local out, work, log
  setup(function()
    out, work = H.mkdtemp("fsdp_gpucheck_out"), H.mkdtemp("fsdp_gpucheck_work")
    local rc
    rc, log = H.sh(("bash %q/tools/gpu_check.sh --dry-run"):format(H.root), ("OUT=%q GPU_CHECK_WORK=%q"):format(out, work))
    assert.are.equal(0, rc, log)
  end)
  teardown(function() os.execute(("rm -rf %q %q"):format(out, work)) end)

  it("leaves two files in $OUT: the summary and one archive", function()
    local p = assert(io.popen(("find %q -type f -printf '%%f\\n' | sort"):format(out)))
    local files = p:read("*a")
    p:close()
    assert.are.equal("details.tar.gz\nsummary.txt\n", files)
  end)

  it("archives every stage's output and the summary", function()
    local _, list = H.sh(("tar -tzf %q/details.tar.gz"):format(out))
    for _, stage in ipairs { "env", "setup", "load", "specs", "sanitize", "demo", "ours", "torch", "summary" } do
      assert.truthy(list:find("./" .. stage .. ".txt", 1, true), stage .. " missing from the archive:\n" .. list)
    end
  end)

  it("keeps its stage limits within 300 s", function()
    local limits = tonumber(log:match("stage limits: (%d+)s"))
    assert.truthy(limits, log)
    assert.is_true(limits <= 300, ("the stage limits add up to %d s"):format(limits))
  end)
end)
