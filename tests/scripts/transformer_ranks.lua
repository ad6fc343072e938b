-- nn.TransformerEncoder under FSDP (issue 40): the encoder layers wrapped by class
-- (fsdp.auto_wrap(model, {module_classes = {nn.TransformerEncoderLayer}}), PyTorch's
-- transformer_auto_wrap_policy), trained with Adam and gradient clipping, against one process
-- training the unwrapped model on the global batch (nn.utils.clip_grad_norm_ there,
-- fsdp.clip_grad_norm in the wrapped run). With the argument "seq2seq" the model is an
-- nn.Transformer instead, its encoder and decoder layers wrapped by class
-- ({module_classes = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}}).
--
--   bin/fsdprun -n 2 tests/scripts/transformer_ranks.lua [seq2seq]   (also -n 3, -n 1 = plain luajit)
--   TRANSFORMER_SABOTAGE=lr ...   the wrapped run's learning rate is 1% larger: the checks must FAIL
--
-- Checks (tests/scripts/checks.lua; tests/fsdp/transformer_ranks_spec.lua reads them): the units,
-- per step the mean of the ranks' losses and the clipped norm against the reference's, after the
-- steps the gathered state_dict against the reference's. Tolerances: losses and norms 1e-6 + 1e-5
-- relative (float32 sums in another order: the reference's whole batch against each rank's slice,
-- averaged); parameters 1e-5 + 1e-5 relative, since Adam magnifies rounding in a gradient near its
-- eps: d step / d g = lr eps / (|g| + eps)^2, up to lr / (4 eps) = 250 here (measured: 3.0e-7 to 6.3e-7 at 2
-- ranks, 1.6e-6 at 3, an embed.weight element whose first gradient is 1.07e-5; seq2seq 9.9e-7 at 2
-- ranks, 1.3e-6 at 3, with losses within 1.2e-7 and norms within 1.3e-7; the sabotaged learning
-- rate moves parameters by about 1e-4). The end prints the largest differences (MEASURED).
local fsdp = require "fsdp"
local nn, F = fsdp.nn, fsdp.nn.functional

fsdp.init()
fsdp.comm.set_timeout(tonumber(os.getenv("FSDP_COMM_TIMEOUT") or "") or 60)
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
local C = dofile(here .. "checks.lua")
local R, N = fsdp.rank(), fsdp.world_size()
local GB, T, IN, D, NH, STEPS, MAX_NORM = 12, 6, 5, 8, 2, 4, 0.5  -- (GB: a multiple of 1, 2, 3 and 4)
local ATOL, RTOL, PARAM_ATOL = 1e-6, 1e-5, 1e-5
local sabotage = os.getenv("TRANSFORMER_SABOTAGE") == "lr"
local which = arg[1] or "encoder"

-- a sequence classifier: a linear embedding of (B, T, IN), two post-norm encoder layers (causal,
-- with key padding) and a final norm, the mean over time, a linear head
local Net = nn.Module:extend("EncoderNet")
function Net:__init()
  self.embed = nn.Linear(IN, D)
  local layer = nn.TransformerEncoderLayer(D, NH, { dim_feedforward = 12, dropout = 0, batch_first = true })
  self.encoder = nn.TransformerEncoder(layer, 2, { norm = nn.LayerNorm(D) })
  self.head = nn.Linear(D, 3)
end
function Net:forward(x, kpm)
  local h = self.encoder(self.embed(x), { src_key_padding_mask = kpm, is_causal = true })  -- (B, T, D)
  return self.head(h:mean(2))
end

-- a sequence-to-sequence tagger on nn.Transformer: linear embeddings of the source and the target
-- (B, T, IN), two encoder and two decoder layers (the target causal through
-- generate_square_subsequent_mask, the source's padding masked in the encoder and in the
-- cross-attention), a linear head per target position
local Seq2Seq = nn.Module:extend("Seq2Seq")
function Seq2Seq:__init()
  self.src_embed, self.tgt_embed = nn.Linear(IN, D), nn.Linear(IN, D)
  self.transformer = nn.Transformer(D, NH, 2, 2, 12, 0, { batch_first = true })
  self.head = nn.Linear(D, 3)
end
function Seq2Seq:forward(x, tgt, kpm)
  local h = self.transformer(self.src_embed(x), self.tgt_embed(tgt), { tgt_mask =
    nn.Transformer.generate_square_subsequent_mask(T), src_key_padding_mask = kpm, memory_key_padding_mask = kpm })
  return self.head(h)  -- (B, T, 3)
end

-- the two models: the class, the layer classes wrapped, the units they give, the loss of a batch b
local MODELS = {
  encoder = { cls = Net, wrap = { nn.TransformerEncoderLayer },
    units = { "EncoderNet", "encoder.layers.0", "encoder.layers.1" },
    loss = function(m, b) return F.cross_entropy(m(b.x, b.pad), b.y) end },
  seq2seq = { cls = Seq2Seq, wrap = { nn.TransformerEncoderLayer, nn.TransformerDecoderLayer },
    units = { "Seq2Seq", "transformer.decoder.layers.0", "transformer.decoder.layers.1",
      "transformer.encoder.layers.0", "transformer.encoder.layers.1" },
    loss = function(m, b) return F.cross_entropy(m(b.x, b.tgt, b.pad):reshape(-1, 3), b.y:reshape(-1)) end },
}
local M = assert(MODELS[which], "transformer_ranks.lua: the argument is encoder or seq2seq")
local function build()
  fsdp.manual_seed(21)
  return M.cls()
end

-- the global batch of step k: x (GB, T, IN), y (GB) (seq2seq: a target tgt (GB, T, IN) and y (GB,
-- T)), the padding mask pad (GB, T): every third sequence ends in two padding positions
local function batch(k)
  fsdp.manual_seed(500 + k)
  local b = { x = fsdp.randn(GB, T, IN) }
  if which == "seq2seq" then
    b.tgt, b.y = fsdp.randn(GB, T, IN), fsdp.randint(0, 3, { GB, T })
  else
    b.y = fsdp.randint(0, 3, { GB })
  end
  local pad = fsdp.zeros(GB, T)
  for i = 1, GB, 3 do pad[{ i, { T - 1, T } }] = 1 end
  b.pad = pad:ne(0)
  return b
end
-- this rank's rows of every tensor of a batch
local function rows(b)
  local n, r = GB / N, {}
  for k, t in pairs(b) do r[k] = t:narrow(1, R * n + 1, n):contiguous() end
  return r
end

local function close(a, b, atol) return math.abs(a - b) <= (atol or ATOL) + RTOL * math.abs(b) end

local ref, model = build(), build()
fsdp.auto_wrap(model, { module_classes = M.wrap })
-- Adam's eps 1e-5, not 1e-8: the key part of in_proj_bias gets a gradient that is zero but for
-- rounding (a constant added to every score of a row leaves the softmax as it is), measured about
-- 1e-10 here against 1e-2..1e-1 for the other parameters; with eps 1e-8 Adam turns that noise into
-- steps of about 1e-2 lr whose sign depends on the order of the sums (ranks or not), with 1e-5 into
-- at most 1e-7 per step. Every other gradient is a thousandfold above eps, where the two agree.
local ref_opt = fsdp.optim.Adam(ref:parameters(), { lr = 1e-2, eps = 1e-5 })
local opt = fsdp.optim.Adam(model:parameters(), { lr = sabotage and 1.01e-2 or 1e-2, eps = 1e-5 })

C.check("units: " .. table.concat(M.units, ", "), function(fail)
  local got = {}
  for path in pairs(fsdp.unit_states(model)) do got[#got + 1] = path end
  table.sort(got)
  if table.concat(got, ",") ~= table.concat(M.units, ",") then fail("units " .. table.concat(got, ",")) end
end)

local worst_loss, worst_norm = 0, 0  -- (the largest differences from the reference, printed at the end)
for k = 1, STEPS do
  local b = batch(k)
  local ref_loss = M.loss(ref, b)
  ref_opt:zero_grad()
  ref_loss:backward()
  local ref_norm = nn.utils.clip_grad_norm_(ref:parameters(), MAX_NORM)
  ref_opt:step()

  local loss = M.loss(model, rows(b))
  opt:zero_grad()
  loss:backward()
  local norm = fsdp.clip_grad_norm(model, MAX_NORM)
  opt:step()

  C.check(("step %d: the ranks' mean loss and the clipped norm are the reference's"):format(k), function(fail)
    local t = fsdp.tensor({ loss:item() })
    if N > 1 then fsdp.all_reduce(t, "avg") end
    local a, b = t:item(), ref_loss:item()
    if not close(a, b) then fail(("loss %.9g, reference %.9g"):format(a, b)) end
    local n, rn = fsdp.is_tensor(norm) and norm:item() or norm, fsdp.is_tensor(ref_norm) and ref_norm:item() or ref_norm
    worst_loss, worst_norm = math.max(worst_loss, math.abs(a - b)), math.max(worst_norm, math.abs(n - rn))
    if not close(n, rn) then fail(("norm %.9g, reference %.9g"):format(n, rn)) end
    if not (rn > MAX_NORM) then fail(("the norm %.3g does not clip (max_norm %g)"):format(rn, MAX_NORM)) end
    if not fsdp.all_idle() then fail("units not idle after the step") end
  end)
end

C.check("after the steps: the gathered state_dict is the reference's (names and values)", function(fail)
  local sd, rsd = model:state_dict(), ref:state_dict()
  local worst = 0
  for name, t in pairs(rsd) do
    local u = sd[name]
    if not u then
      fail("missing " .. name)
    else
      local a, b = u:contiguous():view(-1):tolist(), t:contiguous():view(-1):tolist()
      for i = 1, #b do
        worst = math.max(worst, math.abs(a[i] - b[i]))
        if not close(a[i], b[i], PARAM_ATOL) then
          fail(("%s[%d]: %.9g, reference %.9g"):format(name, i, a[i], b[i]))
          break
        end
      end
    end
  end
  for name in pairs(sd) do if not rsd[name] then fail("extra key " .. name) end end
  if R == 0 then
    print(("MEASURED %s ws=%d max |param diff| %.3g, |loss diff| %.3g, |norm diff| %.3g"):format(which, N, worst,
      worst_loss, worst_norm))
  end
end)

C.finish()
