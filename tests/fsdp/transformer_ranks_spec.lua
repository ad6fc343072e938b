-- nn.TransformerEncoder wrapped by class (fsdp.auto_wrap with module_classes =
-- {nn.TransformerEncoderLayer}) trains with Adam and gradient clipping exactly like one process:
-- tests/scripts/transformer_ranks.lua at 1, 2 and 3 ranks (losses, clipped norms, the gathered
-- state_dict against the unwrapped model on the global batch), and with a 1% larger learning rate on
-- the wrapped side it must fail. The same for nn.Transformer at 2 ranks, its encoder and decoder
-- layers wrapped by class (the script's argument seq2seq). Golden values against PyTorch:
-- tests/nn/transformer_spec.lua.
-- Rerun one world size by hand:  bin/fsdprun -n 3 tests/scripts/transformer_ranks.lua [seq2seq]
local H = require "helpers"

describe("nn.TransformerEncoder and nn.Transformer under FSDP against one process", function()
  local it_mpi = H.has_mpi() and it or pending
  it("world size 1", function() H.check_script("transformer_ranks.lua", 1, nil, 6) end)
  it_mpi("world size 2", function() H.check_script("transformer_ranks.lua", 2, nil, 6) end)
  it_mpi("world size 3 (uneven pieces)", function() H.check_script("transformer_ranks.lua", 3, nil, 6) end)
  it_mpi("nn.Transformer, encoder and decoder layers wrapped by class, world size 2", function()
    H.check_script("transformer_ranks.lua", 2, "seq2seq", 6)
  end)
  it_mpi("fails when the wrapped run's learning rate is 1% larger", function()
    local rc, out = H.sh(("%s -n 2 %stransformer_ranks.lua"):format(H.fsdprun, H.scripts),
      "FSDP_COMM_TIMEOUT=60 TRANSFORMER_SABOTAGE=lr", 300)
    out = H.untag(out)
    assert(rc ~= 0, "the sabotaged run exited with status 0")
    assert(out:find("CHECK after the steps[^\n]*FAIL"), out:sub(-2000))
    assert(out:find("CHECK step 4[^\n]*FAIL"), out:sub(-2000))
  end)
end)
