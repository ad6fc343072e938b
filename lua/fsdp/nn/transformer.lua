--- The transformer modules of torch.nn, with PyTorch's arguments, parameter names and numbers:
-- nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.TransformerEncoder,
-- nn.TransformerDecoder and the whole encoder-decoder nn.Transformer (with its static
-- generate_square_subsequent_mask). A state_dict moves both ways between these and PyTorch's modules
-- (`layers.0.self_attn.in_proj_weight`, `layers.0.linear1.weight`, `layers.0.norm1.weight`,
-- `encoder.norm.weight`, ...).
--
-- One attention forward, in four steps (MultiheadAttention:forward):
--   1. project: query, key, value (L, N, E) or (N, L, E) (batch_first) through in_proj_weight
--      (3E, E) -- one GEMM for self-attention -- or q/k/v_proj_weight when kdim/vdim differ
--   2. split heads: (L, N, E) -> (N, H, L, E/H), views where the layout allows
--   3. masks: attn_mask (L, S) or (N*H, L, S) and key_padding_mask (N, S), bool (true: masked out,
--      PyTorch's meaning) or float (added to the scores), become one additive float mask
--      broadcastable to the scores (N, H, L, S)
--   4. attend: F.scaled_dot_product_attention when the weights are not wanted; when they are
--      (need_weights, PyTorch's default) softmax(q k^T / sqrt(E/H) + mask), dropped out, times v --
--      PyTorch's own split, so the weights returned are the ones the output used
-- then the heads are joined and out_proj maps them back to E.
-- @module fsdp.nn.transformer
local fsdp = require "fsdp"
local Module = require "fsdp.nn.module"
local F = require "fsdp.nn.functional"
local init = require "fsdp.nn.init_fns"
local layers = require "fsdp.nn.layers"

local Parameter, is_module = Module.Parameter, Module.is_module
local args_of = F._args
local L = {}

local shape_str = fsdp._shape_str

local function check_p(cls, what, p)
  if type(p) ~= "number" or not (p >= 0 and p <= 1) then
    error(("%s: %s must be a probability in [0, 1], got %s"):format(cls, what, tostring(p)), 4)
  end
  return p
end
local function check_tensor(cls, what, v, optional)
  if v == nil and optional then return end
  if not fsdp.is_tensor(v) then fsdp._arg_error(cls, what, "a tensor", v, 4) end
end

-- whether t is a parameter (its storage counts as one: nn.Parameter's mark), trainable or frozen
local function is_param(t) return fsdp.C.fsdp_tensor_mem_category(t.p) == fsdp.C.FSDP_MEM_PARAMS end

-- a deep copy of module m (PyTorch's copy.deepcopy, as _get_clones uses it): the same classes and
-- settings, parameters and buffers copied into new tensors (trainable ones stay trainable)
local function deepcopy(m, seen)
  local function copy(v)
    if fsdp.is_tensor(v) then
      local key = fsdp._key(v)
      if seen[key] == nil then
        local c
        if fsdp.C.fsdp_tensor_deferred(v.p) ~= 0 then  -- built inside fsdp.meta: no values to copy
          c = fsdp.meta(function() return fsdp.empty(v:shape(), { dtype = v.dtype }) end)
          seen.on_meta = true
        else
          c = fsdp.no_grad(function() return v:detach():clone() end)
        end
        if v.requires_grad or is_param(v) then c = Parameter(c, v.requires_grad) end
        seen[key] = c
      end
      return seen[key]
    end
    if is_module(v) then return deepcopy(v, seen) end
    if type(v) == "table" and getmetatable(v) == nil then
      if seen[v] == nil then
        local t = {}
        seen[v] = t
        for k, x in pairs(v) do t[k] = copy(x) end
      end
      return seen[v]
    end
    return v
  end
  if seen[m] then return seen[m] end
  if rawget(m, "_fsdp_unit") or rawget(m, "_forward_wrapper") then
    error(("%s: cannot copy a module wrapped by fsdp.wrap; build the layers first, then wrap"):format(m.__name), 4)
  end
  local c = setmetatable({}, getmetatable(m))
  seen[m] = c
  for k, v in pairs(m) do rawset(c, k, copy(v)) end
  return c
end

-- ---- MultiheadAttention -------------------------------------------------------------------------------
local MHA = Module:extend("MultiheadAttention")
L.MultiheadAttention = MHA
--- nn.MultiheadAttention(embed_dim, num_heads[, {dropout = 0, bias = true, add_bias_kv = false,
-- add_zero_attn = false, kdim = embed_dim, vdim = embed_dim, batch_first = false}]): PyTorch's
-- multi-head attention. Parameters in_proj_weight (3E, E) (or q_proj_weight (E, E), k_proj_weight
-- (E, kdim), v_proj_weight (E, vdim) when kdim or vdim differ from E), in_proj_bias (3E),
-- out_proj.weight (E, E), out_proj.bias (E), bias_k and bias_v (1, 1, E) with add_bias_kv.
-- @function MultiheadAttention
function MHA:__init(...)
  local cls = "MultiheadAttention"
  local o = args_of(cls, { { "embed_dim" }, { "num_heads" }, { "dropout", 0 }, { "bias", true }, { "add_bias_kv", false },
    { "add_zero_attn", false }, { "kdim", optional = true }, { "vdim", optional = true }, { "batch_first", false } }, ...)
  local E = fsdp._i(o.embed_dim, cls, "embed_dim", nil, 1)
  local H = fsdp._i(o.num_heads, cls, "num_heads", nil, 1)
  if E % H ~= 0 then error(("%s: embed_dim (%d) must be divisible by num_heads (%d)"):format(cls, E, H), 3) end
  self.embed_dim, self.num_heads, self.head_dim = E, H, E / H
  self.kdim = o.kdim == nil and E or fsdp._i(o.kdim, cls, "kdim", nil, 1)
  self.vdim = o.vdim == nil and E or fsdp._i(o.vdim, cls, "vdim", nil, 1)
  self.dropout = check_p(cls, "dropout", o.dropout)
  self.batch_first = fsdp._b(o.batch_first, cls, "batch_first")
  self.add_zero_attn = fsdp._b(o.add_zero_attn, cls, "add_zero_attn")
  local bias, add_bias_kv = fsdp._b(o.bias, cls, "bias"), fsdp._b(o.add_bias_kv, cls, "add_bias_kv")
  self._qkv_same_embed_dim = self.kdim == E and self.vdim == E
  -- (PyTorch's registration order, so named_parameters and FSDP's flat buffers follow it)
  if self._qkv_same_embed_dim then
    self.in_proj_weight = Parameter(fsdp.empty(3 * E, E))
    for _, n in ipairs { "q_proj_weight", "k_proj_weight", "v_proj_weight" } do self:register_parameter(n, nil) end
  else
    self.q_proj_weight = Parameter(fsdp.empty(E, E))
    self.k_proj_weight = Parameter(fsdp.empty(E, self.kdim))
    self.v_proj_weight = Parameter(fsdp.empty(E, self.vdim))
    self:register_parameter("in_proj_weight", nil)
  end
  if bias then self.in_proj_bias = Parameter(fsdp.empty(3 * E)) else self:register_parameter("in_proj_bias", nil) end
  self.out_proj = layers.Linear(E, E, { bias = bias })
  if add_bias_kv then
    self.bias_k = Parameter(fsdp.empty(1, 1, E))
    self.bias_v = Parameter(fsdp.empty(1, 1, E))
  end
  self:reset_parameters()
end
-- PyTorch's _reset_parameters: Xavier-uniform projections, zero biases (out_proj's weight keeps
-- Linear's own init, which runs first), Xavier-normal bias_k and bias_v
function MHA:reset_parameters()
  for _, n in ipairs { "in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight" } do
    if self[n] ~= nil then init.xavier_uniform_(self[n]) end
  end
  if self.in_proj_bias ~= nil then
    init.zeros_(self.in_proj_bias)
    init.zeros_(self.out_proj.bias)
  end
  if self.bias_k ~= nil then
    init.xavier_normal_(self.bias_k)
    init.xavier_normal_(self.bias_v)
  end
end
function MHA:extra_repr()
  return ("embed_dim=%d, num_heads=%d, batch_first=%s"):format(self.embed_dim, self.num_heads,
    self.batch_first and "True" or "False")
end

-- the input projections: q (.., E), k (.., E), v (.., E), each in its input's layout
function MHA:_project(query, key, value)
  local E, b = self.embed_dim, self.in_proj_bias
  local function part(t, i) return t and t:narrow(1, (i - 1) * E + 1, E) end
  if not self._qkv_same_embed_dim then
    return F.linear(query, self.q_proj_weight, part(b, 1)), F.linear(key, self.k_proj_weight, part(b, 2)),
      F.linear(value, self.v_proj_weight, part(b, 3))
  end
  local w = self.in_proj_weight
  if rawequal(query, key) and rawequal(key, value) then  -- self-attention: one GEMM (3E outputs)
    local qkv = F.linear(query, w, b):chunk(3, -1)
    return qkv[1], qkv[2], qkv[3]
  end
  return F.linear(query, part(w, 1), part(b, 1)), F.linear(key, part(w, 2), part(b, 2)),
    F.linear(value, part(w, 3), part(b, 3))
end

-- x (T, N, E) (or (N, T, E) batch_first) -> heads (N, H, T, E/H)
function MHA:_heads(x)
  local s = x:shape()
  local y = x:reshape(s[1], s[2], self.num_heads, self.head_dim)
  if self.batch_first then return y:permute(1, 3, 2, 4) end
  return y:permute(2, 3, 1, 4)
end
-- heads (N, H, L, E/H) -> (L, N, E) (or (N, L, E) batch_first)
function MHA:_join(o)
  local s = o:shape()
  if self.batch_first then return o:permute(1, 3, 2, 4):reshape(s[1], s[3], self.embed_dim) end
  return o:permute(3, 1, 2, 4):reshape(s[3], s[1], self.embed_dim)
end

-- a mask as an additive float mask in dtype (the query's): bool true (masked out) -> -inf, false -> 0;
-- a float mask as it is
local function additive(mask, dtype)
  if mask.dtype == "bool" then
    return fsdp.zeros(mask:shape(), { dtype = dtype, device = mask.device }):masked_fill(mask, -math.huge)
  end
  if mask.dtype == "int64" then error("MultiheadAttention: masks must be bool or float, got int64", 4) end
  return mask.dtype == dtype and mask or mask:to(dtype)
end
-- m (.., S0) with `extra` zero columns appended (keys added by add_bias_kv / add_zero_attn take part)
local function pad_keys(m, extra)
  if extra == 0 then return m end
  local s = m:shape()
  s[#s] = extra
  return fsdp.cat({ m, fsdp.zeros(s, { dtype = m.dtype, device = m.device }) }, -1)
end

-- attn_mask and key_padding_mask as one additive float mask broadcastable to (N, H, L, S), or nil.
-- z: sizes N, L, S0 (keys before add_bias_kv / add_zero_attn), S (after), batched; the query's dtype
function MHA:_mask(attn_mask, key_padding_mask, z)
  local cls, H, m = "MultiheadAttention", self.num_heads, nil
  if attn_mask ~= nil then
    local s = attn_mask:shape()
    if #s == 2 and s[1] == z.L and s[2] == z.S0 then
      m = additive(attn_mask, z.dtype)
    elseif #s == 3 and s[1] == z.N * H and s[2] == z.L and s[3] == z.S0 then
      m = additive(attn_mask, z.dtype):reshape(z.N, H, z.L, z.S0)
    else
      error(("%s: attn_mask of shape %s must be (L, S) = (%d, %d) or (N*num_heads, L, S) = (%d, %d, %d) (query length "
        .. "L, key length S, batch N)"):format(cls, shape_str(attn_mask), z.L, z.S0, z.N * H, z.L, z.S0), 4)
    end
    m = pad_keys(m, z.S - z.S0)
  end
  if key_padding_mask ~= nil then
    local s, want = key_padding_mask:shape(), z.batched and { z.N, z.S0 } or { z.S0 }
    if table.concat(s, ",") ~= table.concat(want, ",") then
      error(("%s: key_padding_mask of shape %s must be %s = (%s)"):format(cls, shape_str(key_padding_mask),
        z.batched and "(N, S)" or "(S)", table.concat(want, ", ")), 4)
    end
    local k = pad_keys(additive(key_padding_mask, z.dtype):reshape(z.N, 1, 1, z.S0), z.S - z.S0)
    m = m and m + k or k
  end
  return m
end

-- checks the inputs' dims and sizes; returns the sizes {N, L, S0, batched}
function MHA:_check(query, key, value)
  local cls = "MultiheadAttention"
  check_tensor(cls, "query", query)
  check_tensor(cls, "key", key)
  check_tensor(cls, "value", value)
  local nd = query:dim()
  if (nd ~= 2 and nd ~= 3) or key:dim() ~= nd or value:dim() ~= nd then
    error(("%s: query %s, key %s and value %s must all be 3-D (batched) or all 2-D (unbatched)"):format(cls,
      shape_str(query), shape_str(key), shape_str(value)), 4)
  end
  for _, e in ipairs { { "query", query, self.embed_dim, "embed_dim" }, { "key", key, self.kdim, "kdim" },
    { "value", value, self.vdim, "vdim" } } do
    if e[2]:size(nd) ~= e[3] then
      error(("%s: %s of shape %s must have %s = %d as its dim %d"):format(cls, e[1], shape_str(e[2]), e[4], e[3], nd), 4)
    end
  end
  local ks, vs, qs = key:shape(), value:shape(), query:shape()
  local seq, batch = self.batch_first and nd == 3 and 2 or 1, self.batch_first and 1 or 2
  if ks[seq] ~= vs[seq] or (nd == 3 and ks[batch] ~= vs[batch]) then
    error(("%s: key %s and value %s must have the same length (dim %d)%s"):format(cls, shape_str(key), shape_str(value),
      seq, nd == 3 and (" and batch size (dim %d)"):format(batch) or ""), 4)
  end
  if nd == 3 and qs[batch] ~= ks[batch] then
    error(("%s: query %s and key %s must have the same batch size (dim %d)"):format(cls, shape_str(query),
      shape_str(key), batch), 4)
  end
  return { N = nd == 3 and qs[batch] or 1, L = qs[seq], S0 = ks[seq], batched = nd == 3 }
end

--- mha(query, key, value[, {key_padding_mask, need_weights = true, attn_mask, average_attn_weights =
-- true, is_causal = false}]) -> output, weights (PyTorch's forward, its positional order too).
-- query (L, N, E) (or (N, L, E) batch_first, or (L, E) unbatched), key (S, N, kdim), value (S, N,
-- vdim); output like query; weights (N, L, S) averaged over the heads, (N, num_heads, L, S) with
-- average_attn_weights = false, nil with need_weights = false. Masks: bool (true: masked out) or
-- float (added to the scores); attn_mask (L, S) or (N*num_heads, L, S), key_padding_mask (N, S).
-- is_causal = true masks the keys after each query (j > i), on top of attn_mask if one is given
-- (PyTorch takes it as a hint that attn_mask is that causal mask, and requires the mask).
-- @function MultiheadAttention:forward
function MHA:forward(query, key, value, ...)
  local cls = "MultiheadAttention"
  local o = args_of(cls, { { "key_padding_mask", optional = true }, { "need_weights", true },
    { "attn_mask", optional = true }, { "average_attn_weights", true }, { "is_causal", false } }, ...)
  local z = self:_check(query, key, value)
  check_tensor(cls, "attn_mask", o.attn_mask, true)
  check_tensor(cls, "key_padding_mask", o.key_padding_mask, true)
  local need_weights = fsdp._b(o.need_weights, cls, "need_weights")
  local average = fsdp._b(o.average_attn_weights, cls, "average_attn_weights")
  local is_causal = fsdp._b(o.is_causal, cls, "is_causal")
  local bdim = self.batch_first and 1 or 2
  local q, k, v = self:_project(query, key, value)
  if not z.batched then  -- (L, E) -> (L, 1, E) (or (1, L, E)); squeezed again at the end
    q, k, v = q:unsqueeze(bdim), k:unsqueeze(bdim), v:unsqueeze(bdim)
  end
  if self.bias_k ~= nil then  -- one more key and value, learned, for every batch entry
    local N, E = z.N, self.embed_dim
    local shape = self.batch_first and { N, 1, E } or { 1, N, E }
    local sdim = self.batch_first and 2 or 1
    k = fsdp.cat({ k, self.bias_k:expand(shape) }, sdim)
    v = fsdp.cat({ v, self.bias_v:expand(shape) }, sdim)
  end
  q, k, v = self:_heads(q), self:_heads(k), self:_heads(v)  -- (N, H, L, hd), (N, H, S, hd)
  if self.add_zero_attn then  -- one more key and value of zeros
    local zs = { z.N, self.num_heads, 1, self.head_dim }
    k = fsdp.cat({ k, fsdp.zeros(zs, { dtype = k.dtype, device = k.device }) }, 3)
    v = fsdp.cat({ v, fsdp.zeros(zs, { dtype = v.dtype, device = v.device }) }, 3)
  end
  z.S, z.dtype = k:size(3), q.dtype
  local mask = self:_mask(o.attn_mask, o.key_padding_mask, z)  -- broadcastable to (N, H, L, S)
  local p = self.training and self.dropout or 0
  local out, weights
  if not need_weights then
    out = F.scaled_dot_product_attention(q, k, v, { attn_mask = mask, dropout_p = p, is_causal = is_causal })
  else
    local scores = q:matmul(k:transpose(3, 4)) * (1 / math.sqrt(self.head_dim))  -- (N, H, L, S)
    if mask ~= nil then scores = scores + mask end
    if is_causal then scores = scores + fsdp.full({ z.L, z.S }, -math.huge, { dtype = q.dtype, device = q.device }):triu(1) end
    weights = F.dropout(F.softmax(scores, -1), p, p > 0)
    out = weights:matmul(v)
    if average then weights = weights:mean(2) end  -- (N, L, S)
    if not z.batched then weights = weights:squeeze(1) end
  end
  out = self.out_proj(self:_join(out))
  if not z.batched then out = out:squeeze(bdim) end
  return out, weights
end

-- ---- the encoder and decoder layers -----------------------------------------------------------------------
local activations = { relu = F.relu, gelu = F.gelu }
local layer_spec = { { "d_model" }, { "nhead" }, { "dim_feedforward", 2048 }, { "dropout", 0.1 }, { "activation", "relu" },
  { "layer_norm_eps", 1e-5 }, { "batch_first", false }, { "norm_first", false }, { "bias", true } }

-- the options the layers and nn.Transformer share, checked in the name of cls (o: args_of's table)
local function layer_options(cls, o)
  local c = { d_model = fsdp._i(o.d_model, cls, "d_model", nil, 1), nhead = fsdp._i(o.nhead, cls, "nhead", nil, 1),
    dim_feedforward = fsdp._i(o.dim_feedforward, cls, "dim_feedforward", nil, 1),
    dropout = check_p(cls, "dropout", o.dropout), layer_norm_eps = fsdp._f(o.layer_norm_eps, cls, "layer_norm_eps"),
    bias = fsdp._b(o.bias, cls, "bias"), batch_first = fsdp._b(o.batch_first, cls, "batch_first"),
    norm_first = fsdp._b(o.norm_first, cls, "norm_first") }
  local act = o.activation
  if type(act) == "string" then
    act = activations[act] or error(("%s: activation should be \"relu\" or \"gelu\", not %q"):format(cls, act), 4)
  elseif type(act) ~= "function" and not is_module(act) then
    fsdp._arg_error(cls, "activation", "\"relu\", \"gelu\", a function or a module", act, 4)
  end
  c.activation = act
  return c
end
-- a layer's (or the stacks' final) LayerNorm over d_model, with the options' eps and bias
local function layer_norm(c) return layers.LayerNorm(c.d_model, { eps = c.layer_norm_eps, bias = c.bias }) end

-- the children both layers share, in PyTorch's order: self_attn, [multihead_attn], linear1, dropout,
-- linear2, norm1, norm2, [norm3], dropout1, dropout2, [dropout3], activation
local function build_layer(self, cls, decoder, ...)
  local c = layer_options(cls, args_of(cls, layer_spec, ...))
  local d, h, p = c.d_model, c.nhead, c.dropout
  local attn = { dropout = p, batch_first = c.batch_first, bias = c.bias }
  self.self_attn = MHA(d, h, attn)
  if decoder then self.multihead_attn = MHA(d, h, attn) end
  self.linear1 = layers.Linear(d, c.dim_feedforward, { bias = c.bias })
  self.dropout = layers.Dropout(p)
  self.linear2 = layers.Linear(c.dim_feedforward, d, { bias = c.bias })
  self.norm_first = c.norm_first
  for i = 1, decoder and 3 or 2 do self["norm" .. i] = layer_norm(c) end
  for i = 1, decoder and 3 or 2 do self["dropout" .. i] = layers.Dropout(p) end
  self.activation = c.activation  -- (a module becomes the child "activation", as in PyTorch)
end

-- x + dropout(linear2(dropout(activation(linear1(x)))))'s second term
local function ff_block(self, x, drop)
  return drop(self.linear2(self.dropout(self.activation(self.linear1(x)))))
end
-- the attention block's term: dropout(attn(x, mem, mem, masks)), its weights not computed
local function attn_block(attn, drop, x, mem, mask, kpm, causal)
  return drop((attn(x, mem, mem, { attn_mask = mask, key_padding_mask = kpm, need_weights = false, is_causal = causal })))
end

local EncoderLayer = Module:extend("TransformerEncoderLayer")
L.TransformerEncoderLayer = EncoderLayer
--- nn.TransformerEncoderLayer(d_model, nhead[, {dim_feedforward = 2048, dropout = 0.1, activation =
-- "relu" | "gelu" | a function or module, layer_norm_eps = 1e-5, batch_first = false, norm_first =
-- false, bias = true}]): self-attention and a feed-forward block, each with a residual connection
-- and a layer norm (after, or before with norm_first). Children self_attn, linear1, dropout,
-- linear2, norm1, norm2, dropout1, dropout2, as PyTorch's.
-- @function TransformerEncoderLayer
function EncoderLayer:__init(...) build_layer(self, "TransformerEncoderLayer", false, ...) end
--- layer(src[, {src_mask, src_key_padding_mask, is_causal = false}]) -> the output, src's shape.
-- @function TransformerEncoderLayer:forward
function EncoderLayer:forward(src, ...)
  local cls = "TransformerEncoderLayer"
  local o = args_of(cls, { { "src_mask", optional = true }, { "src_key_padding_mask", optional = true },
    { "is_causal", false } }, ...)
  check_tensor(cls, "src", src)
  local mask, kpm, causal = o.src_mask, o.src_key_padding_mask, fsdp._b(o.is_causal, cls, "is_causal")
  local x = src
  if self.norm_first then
    local h = self.norm1(x)
    x = x + attn_block(self.self_attn, self.dropout1, h, h, mask, kpm, causal)
    x = x + ff_block(self, self.norm2(x), self.dropout2)
  else
    x = self.norm1(x + attn_block(self.self_attn, self.dropout1, x, x, mask, kpm, causal))
    x = self.norm2(x + ff_block(self, x, self.dropout2))
  end
  return x
end

local DecoderLayer = Module:extend("TransformerDecoderLayer")
L.TransformerDecoderLayer = DecoderLayer
--- nn.TransformerDecoderLayer(d_model, nhead[, options as TransformerEncoderLayer's]): self-attention,
-- attention over the encoder's output (memory) and a feed-forward block. Children self_attn,
-- multihead_attn, linear1, dropout, linear2, norm1, norm2, norm3, dropout1, dropout2, dropout3.
-- @function TransformerDecoderLayer
function DecoderLayer:__init(...) build_layer(self, "TransformerDecoderLayer", true, ...) end
local decoder_fwd_spec = { { "tgt_mask", optional = true }, { "memory_mask", optional = true },
  { "tgt_key_padding_mask", optional = true }, { "memory_key_padding_mask", optional = true },
  { "tgt_is_causal", false }, { "memory_is_causal", false } }
--- layer(tgt, memory[, {tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
-- tgt_is_causal = false, memory_is_causal = false}]) -> the output, tgt's shape.
-- @function TransformerDecoderLayer:forward
function DecoderLayer:forward(tgt, memory, ...)
  local cls = "TransformerDecoderLayer"
  local o = args_of(cls, decoder_fwd_spec, ...)
  check_tensor(cls, "tgt", tgt)
  check_tensor(cls, "memory", memory)
  local tc = fsdp._b(o.tgt_is_causal, cls, "tgt_is_causal")
  local mc = fsdp._b(o.memory_is_causal, cls, "memory_is_causal")
  local x = tgt
  if self.norm_first then
    local h = self.norm1(x)
    x = x + attn_block(self.self_attn, self.dropout1, h, h, o.tgt_mask, o.tgt_key_padding_mask, tc)
    x = x + attn_block(self.multihead_attn, self.dropout2, self.norm2(x), memory, o.memory_mask,
      o.memory_key_padding_mask, mc)
    x = x + ff_block(self, self.norm3(x), self.dropout3)
  else
    x = self.norm1(x + attn_block(self.self_attn, self.dropout1, x, x, o.tgt_mask, o.tgt_key_padding_mask, tc))
    x = self.norm2(x + attn_block(self.multihead_attn, self.dropout2, x, memory, o.memory_mask,
      o.memory_key_padding_mask, mc))
    x = self.norm3(x + ff_block(self, x, self.dropout3))
  end
  return x
end

-- ---- the stacks ----------------------------------------------------------------------------------------------
-- layers: num_layers deep copies of layer (PyTorch's _get_clones), as the ModuleList "layers"; norm
local function build_stack(self, cls, layer_cls, what, ...)
  local o = args_of(cls, { { what }, { "num_layers" }, { "norm", optional = true },
    { "enable_nested_tensor", true, kw = true }, { "mask_check", true, kw = true } }, ...)
  local layer = o[what]
  if not Module.isinstance(layer, layer_cls) and not is_module(layer) then
    fsdp._arg_error(cls, what, "a module (an nn." .. layer_cls.__name .. ")", layer, 3)
  end
  local n = fsdp._i(o.num_layers, cls, "num_layers", nil, 1)
  if o.norm ~= nil and not is_module(o.norm) then fsdp._arg_error(cls, "norm", "a module or nil", o.norm, 3) end
  local copies = {}
  for i = 1, n do
    local seen = {}
    copies[i] = deepcopy(layer, seen)
    if seen.on_meta then  -- each copy records its own initialisation, children first (as PyTorch's
      local mods = copies[i]:modules()  -- to_empty() and reset_parameters() make meta-built layers)
      for j = #mods, 1, -1 do
        if type(mods[j].reset_parameters) == "function" then mods[j]:reset_parameters() end
      end
    end
  end
  self.layers = layers.ModuleList(copies)
  self.num_layers = n
  if o.norm ~= nil then self.norm = o.norm end
end

local Encoder = Module:extend("TransformerEncoder")
L.TransformerEncoder = Encoder
--- nn.TransformerEncoder(encoder_layer, num_layers[, {norm}]): num_layers deep copies of
-- encoder_layer (children layers.0, layers.1, ...; they start with equal weights, as in PyTorch;
-- built inside fsdp.meta each copy records its own initialisation instead, as PyTorch's to_empty()
-- and reset_parameters() give), then norm (a module) if given. enable_nested_tensor and mask_check are accepted; padded
-- positions are computed as the training path does (PyTorch's inference fast path zeroes them).
-- @function TransformerEncoder
function Encoder:__init(...)
  build_stack(self, "TransformerEncoder", EncoderLayer, "encoder_layer", ...)
end
--- encoder(src[, {mask, src_key_padding_mask, is_causal}]) -> the output, src's shape.
-- @function TransformerEncoder:forward
function Encoder:forward(src, ...)
  local cls = "TransformerEncoder"
  local o = args_of(cls, { { "mask", optional = true }, { "src_key_padding_mask", optional = true },
    { "is_causal", optional = true } }, ...)
  check_tensor(cls, "src", src)
  local opts = { src_mask = o.mask, src_key_padding_mask = o.src_key_padding_mask,
    is_causal = fsdp._b(o.is_causal, cls, "is_causal", false) }
  local x = src
  for _, layer in self.layers:ipairs() do x = layer(x, opts) end
  if self.norm ~= nil then x = self.norm(x) end
  return x
end

local Decoder = Module:extend("TransformerDecoder")
L.TransformerDecoder = Decoder
--- nn.TransformerDecoder(decoder_layer, num_layers[, {norm}]): num_layers deep copies of
-- decoder_layer (layers.0, layers.1, ...), then norm if given.
-- @function TransformerDecoder
function Decoder:__init(...)
  build_stack(self, "TransformerDecoder", DecoderLayer, "decoder_layer", ...)
end
--- decoder(tgt, memory[, {tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
-- tgt_is_causal, memory_is_causal}]) -> the output, tgt's shape.
-- @function TransformerDecoder:forward
function Decoder:forward(tgt, memory, ...)
  local cls = "TransformerDecoder"
  local o = args_of(cls, decoder_fwd_spec, ...)
  check_tensor(cls, "tgt", tgt)
  check_tensor(cls, "memory", memory)
  local opts = {}
  for _, e in ipairs(decoder_fwd_spec) do opts[e[1]] = o[e[1]] end
  local x = tgt
  for _, layer in self.layers:ipairs() do x = layer(x, memory, opts) end
  if self.norm ~= nil then x = self.norm(x) end
  return x
end

-- ---- the whole encoder-decoder -------------------------------------------------------------------------
local Transformer = Module:extend("Transformer")
L.Transformer = Transformer
local transformer_spec = { { "d_model", 512 }, { "nhead", 8 }, { "num_encoder_layers", 6 }, { "num_decoder_layers", 6 },
  { "dim_feedforward", 2048 }, { "dropout", 0.1 }, { "activation", "relu" }, { "custom_encoder", optional = true },
  { "custom_decoder", optional = true }, { "layer_norm_eps", 1e-5 }, { "batch_first", false }, { "norm_first", false },
  { "bias", true } }
--- nn.Transformer([d_model = 512, nhead = 8, num_encoder_layers = 6, num_decoder_layers = 6,
-- dim_feedforward = 2048, dropout = 0.1, activation = "relu" | "gelu" | a function or module,
-- custom_encoder, custom_decoder, layer_norm_eps = 1e-5, batch_first = false, norm_first = false,
-- bias = true]) (PyTorch's positional order, or any of them by name in a trailing table): children
-- encoder, an nn.TransformerEncoder of num_encoder_layers encoder layers with a final LayerNorm
-- (encoder.norm), and decoder, an nn.TransformerDecoder of num_decoder_layers decoder layers with
-- one (decoder.norm), or the modules custom_encoder and custom_decoder in their place. Every
-- parameter with more than one dim starts Xavier-uniform (PyTorch's _reset_parameters), so the
-- layers start with distinct weights. The options are checked even where a custom module stands.
-- @function Transformer
function Transformer:__init(...)
  local cls = "Transformer"
  local o = args_of(cls, transformer_spec, ...)
  local c = layer_options(cls, o)
  local n_enc = fsdp._i(o.num_encoder_layers, cls, "num_encoder_layers", nil, 1)
  local n_dec = fsdp._i(o.num_decoder_layers, cls, "num_decoder_layers", nil, 1)
  for _, k in ipairs { "custom_encoder", "custom_decoder" } do
    if o[k] ~= nil and not is_module(o[k]) then fsdp._arg_error(cls, k, "a module or nil", o[k], 3) end
  end
  -- (c, the checked options, names exactly the layers' arguments)
  self.encoder = o.custom_encoder or Encoder(EncoderLayer(c), n_enc, { norm = layer_norm(c) })
  self.decoder = o.custom_decoder or Decoder(DecoderLayer(c), n_dec, { norm = layer_norm(c) })
  self.d_model, self.nhead, self.batch_first = c.d_model, c.nhead, c.batch_first
  self:reset_parameters()
end
--- transformer:reset_parameters(): PyTorch's _reset_parameters, Xavier-uniform for every parameter
-- with more than one dim (custom modules' too); the others keep their layers' init.
-- @function Transformer:reset_parameters
function Transformer:reset_parameters()
  for _, p in ipairs(self:parameters()) do
    if p:dim() > 1 then init.xavier_uniform_(p) end
  end
end

-- PyTorch's checks of src and tgt: both 3-D (batched) or both 2-D, one batch size, d_model features
function Transformer:_check(src, tgt)
  local cls, nd = "Transformer", src:dim()
  if (nd ~= 2 and nd ~= 3) or tgt:dim() ~= nd then
    error(("%s: src %s and tgt %s must both be 3-D (batched) or both 2-D (unbatched)"):format(cls, shape_str(src),
      shape_str(tgt)), 4)
  end
  local b = self.batch_first and 1 or 2
  if nd == 3 and src:size(b) ~= tgt:size(b) then
    error(("%s: src %s and tgt %s must have the same batch size (dim %d)"):format(cls, shape_str(src), shape_str(tgt),
      b), 4)
  end
  for _, e in ipairs { { "src", src }, { "tgt", tgt } } do
    if e[2]:size(nd) ~= self.d_model then
      error(("%s: %s of shape %s must have d_model = %d as its dim %d"):format(cls, e[1], shape_str(e[2]),
        self.d_model, nd), 4)
    end
  end
end

local transformer_fwd_spec = { { "src_mask", optional = true }, { "tgt_mask", optional = true },
  { "memory_mask", optional = true }, { "src_key_padding_mask", optional = true },
  { "tgt_key_padding_mask", optional = true }, { "memory_key_padding_mask", optional = true },
  { "src_is_causal", optional = true }, { "tgt_is_causal", optional = true }, { "memory_is_causal", false } }
--- transformer(src, tgt[, {src_mask, tgt_mask, memory_mask, src_key_padding_mask, tgt_key_padding_mask,
-- memory_key_padding_mask, src_is_causal, tgt_is_causal, memory_is_causal = false}]) -> the
-- decoder's output, tgt's shape (PyTorch's forward, its positional order too). src (S, N, E), tgt
-- (T, N, E) ((N, S, E) and (N, T, E) with batch_first; (S, E) and (T, E) unbatched), E = d_model;
-- masks as the layers take them: src_mask (S, S), tgt_mask (T, T), memory_mask (T, S) or per head
-- (N*nhead, ., .), the key padding masks (N, S), (N, T), (N, S); bool (true: masked out) or float
-- (added). The encoder runs as encoder(src, {mask, src_key_padding_mask, is_causal}) and the decoder
-- as decoder(tgt, memory, {tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
-- tgt_is_causal, memory_is_causal}), custom modules too.
-- @function Transformer:forward
function Transformer:forward(src, tgt, ...)
  local cls = "Transformer"
  local o = args_of(cls, transformer_fwd_spec, ...)
  check_tensor(cls, "src", src)
  check_tensor(cls, "tgt", tgt)
  for i = 1, 6 do check_tensor(cls, transformer_fwd_spec[i][1], o[transformer_fwd_spec[i][1]], true) end
  for i = 7, 9 do fsdp._b(o[transformer_fwd_spec[i][1]], cls, transformer_fwd_spec[i][1]) end
  self:_check(src, tgt)
  local memory = self.encoder(src, { mask = o.src_mask, src_key_padding_mask = o.src_key_padding_mask,
    is_causal = o.src_is_causal })
  return self.decoder(tgt, memory, { tgt_mask = o.tgt_mask, memory_mask = o.memory_mask,
    tgt_key_padding_mask = o.tgt_key_padding_mask, memory_key_padding_mask = o.memory_key_padding_mask,
    tgt_is_causal = o.tgt_is_causal, memory_is_causal = o.memory_is_causal })
end

local float_dtypes = { float32 = true, bfloat16 = true, float16 = true }
--- nn.Transformer.generate_square_subsequent_mask(sz[, {device = "cpu", dtype = "float32"}]) -> the
-- causal mask (sz, sz), PyTorch's static function: -inf above the diagonal (a query never sees a
-- later key), 0 elsewhere; a float mask, added to the scores (tgt_mask, src_mask, attn_mask). dtype
-- a float dtype (float32, bfloat16, float16); device "cpu" or "cuda", as PyTorch's, whatever the default device.
-- @function Transformer.generate_square_subsequent_mask
function Transformer.generate_square_subsequent_mask(...)
  local fn = "Transformer.generate_square_subsequent_mask"
  local o = args_of(fn, { { "sz" }, { "device", "cpu" }, { "dtype", "float32" } }, ...)
  local sz = fsdp._i(o.sz, fn, "sz", nil, 0)
  fsdp._device(o.device, fn, 2)
  local dtype = fsdp._dtype_names[fsdp._dtype(o.dtype, fn)]
  if not float_dtypes[dtype] then
    error(("%s: dtype must be a float dtype (float32, bfloat16 or float16), got %s"):format(fn, dtype), 2)
  end
  return fsdp.full({ sz, sz }, -math.huge, { dtype = dtype, device = o.device }):triu(1)
end

return L
