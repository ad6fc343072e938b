#!/usr/bin/python3
"""Golden values of the transformer modules for tests/nn/transformer_spec.lua, produced with PyTorch.

Run with Debian's PyTorch (python3-torch 1.13, CPU):   /usr/bin/python3 tests/golden/gen_transformer.py
Writes tests/golden/transformer.safetensors (float32). For every case <c> (the list CASES below;
tests/nn/transformer_spec.lua builds the same modules from its own copy of the settings):

  <c>.p.<name>    the module's state_dict (PyTorch's names), random values (not the default init,
                  whose zero biases would hide a misplaced bias)
  <c>.x.<input>   the inputs (query/key/value, src, tgt/memory) and float masks; bool masks as
                  <c>.b.<mask>, stored as 0/1 floats (the spec turns them back into bool tensors)
  <c>.y           the output; <c>.w the attention weights (MultiheadAttention with need_weights)
  <c>.r, <c>.rw   random cotangents: loss = sum(y * r) + sum(w * rw)
  <c>.g.<input>   the gradients of the loss for the float inputs
  <c>.gp.<name>   the gradients of the loss for every parameter

PyTorch 1.13 lacks three things the spec checks, built here from 1.13's own pieces:
  - `bias=False` of TransformerEncoderLayer / DecoderLayer and Transformer (PyTorch 2.1): RefLayer
    below, the layer's forward written out with MultiheadAttention(bias=False), Linear(bias=False)
    and a weight-only layer norm under the same names (norm1.weight, no norm1.bias), and
    RefTransformer, the whole model from RefLayers and weight-only final norms (encoder.norm.weight);
    checked against nn.TransformerEncoderLayer / DecoderLayer / nn.Transformer with bias=True,
    where both exist (asserted here)
  - `is_causal` (PyTorch 2.0; Transformer's src_is_causal / tgt_is_causal), a hint that the mask is
    the causal one: the references get the causal mask itself (-inf above the diagonal) as
    attn_mask / src_mask / tgt_mask
  - float key_padding_mask merged with a float attn_mask (2.0 adds them; 1.13 asserts bool): the
    cases use a bool key_padding_mask where 1.13 needs one
"""
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gen import save_safetensors  # noqa: E402

E, H, N, L, S = 8, 2, 3, 5, 4  # embed dim, heads, batch, query length, key length
BOOL_MASKS = ("attn_mask", "mask", "key_padding_mask", "src_mask", "src_key_padding_mask", "tgt_mask", "memory_mask",
              "tgt_key_padding_mask", "memory_key_padding_mask")


def causal(n, m):
    return torch.full((n, m), float("-inf")).triu(1)


def bool_mask(*shape):
    """random True (masked out) entries, never a whole row of keys"""
    m = torch.rand(*shape) < 0.3
    m[..., 0] = False
    return m


def kpm(n, s):
    m = torch.zeros(n, s, dtype=torch.bool)
    m[0, s - 1] = True  # the last key of batch entry 0 is padding
    m[n - 1, s - 2:] = True
    return m


def randomize(m):
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.rand_like(p) - 0.5)
            if "norm" in name and name.endswith("weight"):
                p.add_(1)


class WeightOnlyLayerNorm(nn.Module):
    """PyTorch 2.1's LayerNorm(bias=False): a weight, no bias"""

    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, None, self.eps)


def layer_norm(d, eps, bias):
    """the layers' and the stacks' LayerNorm: PyTorch's, or 2.1's bias=False one"""
    return nn.LayerNorm(d, eps=eps) if bias else WeightOnlyLayerNorm(d, eps)


class RefLayer(nn.Module):
    """TransformerEncoderLayer / DecoderLayer written out (PyTorch 2.1's forward), with a bias switch"""

    def __init__(self, d, h, ff, decoder, act, eps=1e-5, batch_first=False, norm_first=False, bias=True):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, h, dropout=0.0, bias=bias, batch_first=batch_first)
        if decoder:
            self.multihead_attn = nn.MultiheadAttention(d, h, dropout=0.0, bias=bias, batch_first=batch_first)
        self.linear1 = nn.Linear(d, ff, bias=bias)
        self.linear2 = nn.Linear(ff, d, bias=bias)
        self.norm1, self.norm2 = layer_norm(d, eps, bias), layer_norm(d, eps, bias)
        if decoder:
            self.norm3 = layer_norm(d, eps, bias)
        self.decoder, self.act, self.norm_first = decoder, act, norm_first

    def sa(self, attn, x, mem, mask, kpm):
        return attn(x, mem, mem, attn_mask=mask, key_padding_mask=kpm, need_weights=False)[0]

    def ff(self, x):
        return self.linear2(self.act(self.linear1(x)))

    def forward(self, x, mem=None, mask=None, kpm=None, mem_mask=None, mem_kpm=None):
        if self.norm_first:
            h = self.norm1(x)
            x = x + self.sa(self.self_attn, h, h, mask, kpm)
            if self.decoder:
                x = x + self.sa(self.multihead_attn, self.norm2(x), mem, mem_mask, mem_kpm)
            return x + self.ff((self.norm3 if self.decoder else self.norm2)(x))
        x = self.norm1(x + self.sa(self.self_attn, x, x, mask, kpm))
        if self.decoder:
            x = self.norm2(x + self.sa(self.multihead_attn, x, mem, mem_mask, mem_kpm))
        return (self.norm3 if self.decoder else self.norm2)(x + self.ff(x))


class RefStack(nn.Module):
    """TransformerEncoder / Decoder written out: the RefLayers, then the final norm"""

    def __init__(self, layers, norm):
        super().__init__()
        self.layers, self.norm = nn.ModuleList(layers), norm

    def forward(self, x, mem=None, **masks):
        for layer in self.layers:
            x = layer(x, mem, **masks)
        return self.norm(x)


class RefTransformer(nn.Module):
    """nn.Transformer written out (PyTorch 2.1's): RefStacks named encoder and decoder, a bias switch"""

    def __init__(self, d, h, n_enc, n_dec, ff, act, bias=True):
        super().__init__()
        self.encoder = RefStack([RefLayer(d, h, ff, False, act, bias=bias) for _ in range(n_enc)],
                                layer_norm(d, 1e-5, bias))
        self.decoder = RefStack([RefLayer(d, h, ff, True, act, bias=bias) for _ in range(n_dec)],
                                layer_norm(d, 1e-5, bias))

    def forward(self, src, tgt, src_mask=None, tgt_mask=None):
        return self.decoder(tgt, self.encoder(src, mask=src_mask), mask=tgt_mask)


def check_ref_transformer():
    """RefTransformer(bias=True) equals nn.Transformer: the reference for bias=False is trustworthy"""
    torch.manual_seed(8)
    mine = RefTransformer(E, H, 2, 1, 16, F.relu)
    theirs = nn.Transformer(E, H, 2, 1, 16, dropout=0.0)
    randomize(theirs)
    mine.load_state_dict(theirs.state_dict())
    src, tgt = torch.randn(S, N, E), torch.randn(L, N, E)
    a = mine(src, tgt, causal(S, S), causal(L, L))
    b = theirs(src, tgt, causal(S, S), causal(L, L))
    assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()


def check_ref_layer(decoder, norm_first, act):
    """RefLayer(bias=True) equals PyTorch's own layer: the reference for bias=False is trustworthy"""
    torch.manual_seed(7)
    cls = nn.TransformerDecoderLayer if decoder else nn.TransformerEncoderLayer
    mine = RefLayer(E, H, 16, decoder, F.gelu if act == "gelu" else F.relu, norm_first=norm_first)
    theirs = cls(E, H, 16, dropout=0.0, activation=act, norm_first=norm_first)
    randomize(theirs)
    mine.load_state_dict(theirs.state_dict())
    x, mem = torch.randn(L, N, E), torch.randn(S, N, E)
    a = mine(x, mem, mask=causal(L, L)) if decoder else mine(x, mask=causal(L, L))
    b = theirs(x, mem, tgt_mask=causal(L, L)) if decoder else theirs(x, src_mask=causal(L, L))
    assert torch.allclose(a, b, atol=1e-6), (decoder, norm_first, act, (a - b).abs().max())


def record(out, name, module, inputs, run):
    """inputs: list of (name, tensor); run(**inputs) -> y or (y, w). Saves the case."""
    randomize(module)
    for k, t in module.state_dict().items():
        out.append((f"{name}.p.{k}", t))
    leaves = {}
    for k, t in inputs:
        if t.dtype == torch.bool:
            out.append((f"{name}.b.{k}", t.float()))
            leaves[k] = t
        else:
            leaves[k] = t.clone().requires_grad_(t.is_floating_point() and "mask" not in k)
            out.append((f"{name}.x.{k}", t))
    res = run(**leaves)
    y, w = (res if isinstance(res, tuple) else (res, None))
    r = torch.randn_like(y)
    loss = (y * r).sum()
    out += [(f"{name}.y", y), (f"{name}.r", r)]
    if w is not None:
        rw = torch.randn_like(w)
        loss = loss + (w * rw).sum()
        out += [(f"{name}.w", w), (f"{name}.rw", rw)]
    loss.backward()
    for k, t in leaves.items():
        if t.requires_grad:
            out.append((f"{name}.g.{k}", t.grad))
    for k, p in module.named_parameters():
        out.append((f"{name}.gp.{k}", p.grad))


def mha_cases(out):
    x = torch.randn(L, N, E)
    # self-attention (one tensor for query, key and value), weights averaged over the heads
    m = nn.MultiheadAttention(E, H)
    record(out, "mha_self", m, [("query", x)], lambda query: m(query, query, query))
    # batch_first cross-attention, per-head weights, bool attn_mask (L, S) and key_padding_mask
    m = nn.MultiheadAttention(E, H, batch_first=True)
    record(out, "mha_cross_bf", m, [("query", torch.randn(N, L, E)), ("key", torch.randn(N, S, E)),
                                    ("value", torch.randn(N, S, E)), ("attn_mask", bool_mask(L, S)),
                                    ("key_padding_mask", kpm(N, S))],
           lambda query, key, value, attn_mask, key_padding_mask: m(
               query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask, average_attn_weights=False))
    # no weights (F.scaled_dot_product_attention's path), bool masks
    m = nn.MultiheadAttention(E, H)
    record(out, "mha_noweights", m, [("query", torch.randn(L, N, E)), ("key", torch.randn(S, N, E)),
                                     ("value", torch.randn(S, N, E)), ("attn_mask", bool_mask(L, S)),
                                     ("key_padding_mask", kpm(N, S))],
           lambda query, key, value, attn_mask, key_padding_mask: m(
               query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False)[0])
    # a float attn_mask per batch entry and head (N*H, L, S), with and without weights
    fm = torch.randn(N * H, L, S)
    m = nn.MultiheadAttention(E, H)
    record(out, "mha_float3d", m, [("query", torch.randn(L, N, E)), ("key", torch.randn(S, N, E)),
                                   ("value", torch.randn(S, N, E)), ("attn_mask", fm),
                                   ("key_padding_mask", kpm(N, S))],
           lambda query, key, value, attn_mask, key_padding_mask: m(
               query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask))
    # kdim and vdim: separate q/k/v_proj_weight; no biases
    m = nn.MultiheadAttention(E, H, bias=False, kdim=6, vdim=5)
    record(out, "mha_kvdim", m, [("query", torch.randn(L, N, E)), ("key", torch.randn(S, N, 6)),
                                 ("value", torch.randn(S, N, 5))],
           lambda query, key, value: m(query, key, value))
    # is_causal: the causal mask (PyTorch 1.13 has no is_causal)
    m = nn.MultiheadAttention(E, H)
    record(out, "mha_causal", m, [("query", x)], lambda query: m(query, query, query, attn_mask=causal(L, L)))
    # add_bias_kv and add_zero_attn, with masks (padded by one column each)
    m = nn.MultiheadAttention(E, H, add_bias_kv=True, add_zero_attn=True)
    record(out, "mha_biaskv", m, [("query", torch.randn(L, N, E)), ("key", torch.randn(S, N, E)),
                                  ("value", torch.randn(S, N, E)), ("attn_mask", bool_mask(L, S)),
                                  ("key_padding_mask", kpm(N, S))],
           lambda query, key, value, attn_mask, key_padding_mask: m(
               query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask))
    # unbatched (L, E) input, per-head weights
    m = nn.MultiheadAttention(E, H, batch_first=True)
    record(out, "mha_unbatched", m, [("query", torch.randn(L, E)), ("key", torch.randn(S, E)),
                                     ("value", torch.randn(S, E))],
           lambda query, key, value: m(query, key, value, average_attn_weights=False))


def layer_cases(out):
    FF = 16
    # post-norm, relu, bool src_mask and src_key_padding_mask
    m = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0)
    record(out, "enc_post_relu", m, [("src", torch.randn(L, N, E)), ("src_mask", bool_mask(L, L)),
                                     ("src_key_padding_mask", kpm(N, L))],
           lambda src, src_mask, src_key_padding_mask: m(src, src_mask, src_key_padding_mask))
    # pre-norm, gelu, batch_first, a float src_mask, layer_norm_eps
    m = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, activation="gelu", batch_first=True, norm_first=True,
                                   layer_norm_eps=1e-3)
    record(out, "enc_pre_gelu_bf", m, [("src", torch.randn(N, L, E)), ("src_mask", torch.randn(L, L))],
           lambda src, src_mask: m(src, src_mask))
    # bias=False (PyTorch 2.1) and is_causal: RefLayer with the causal mask
    m = RefLayer(E, H, FF, False, F.relu, bias=False)
    record(out, "enc_nobias_causal", m, [("src", torch.randn(L, N, E))], lambda src: m(src, mask=causal(L, L)))
    # decoder, post-norm: every mask (tgt_mask bool causal-like, memory_mask float, both padding masks)
    m = nn.TransformerDecoderLayer(E, H, FF, dropout=0.0)
    record(out, "dec_post", m, [("tgt", torch.randn(L, N, E)), ("memory", torch.randn(S, N, E)),
                                ("tgt_mask", bool_mask(L, L)), ("memory_mask", torch.randn(L, S)),
                                ("tgt_key_padding_mask", kpm(N, L)), ("memory_key_padding_mask", kpm(N, S))],
           lambda tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask: m(
               tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask))
    # decoder, pre-norm, gelu, batch_first, tgt_is_causal (the causal mask), memory padding
    m = nn.TransformerDecoderLayer(E, H, FF, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
    record(out, "dec_pre_gelu_bf_causal", m, [("tgt", torch.randn(N, L, E)), ("memory", torch.randn(N, S, E)),
                                              ("memory_key_padding_mask", kpm(N, S))],
           lambda tgt, memory, memory_key_padding_mask: m(
               tgt, memory, tgt_mask=causal(L, L), memory_key_padding_mask=memory_key_padding_mask))
    # decoder bias=False (RefLayer)
    m = RefLayer(E, H, FF, True, F.relu, bias=False)
    record(out, "dec_nobias", m, [("tgt", torch.randn(L, N, E)), ("memory", torch.randn(S, N, E))],
           lambda tgt, memory: m(tgt, memory))
    # the stacks: 2 layers (made distinct by randomize) and a final norm
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF, dropout=0.0), 2, norm=nn.LayerNorm(E),
                                enable_nested_tensor=False)
    record(out, "encoder_norm", enc, [("src", torch.randn(L, N, E)), ("mask", bool_mask(L, L)),
                                      ("src_key_padding_mask", kpm(N, L))],
           lambda src, mask, src_key_padding_mask: enc(src, mask, src_key_padding_mask))
    dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, FF, dropout=0.0), 2, norm=nn.LayerNorm(E))
    record(out, "decoder_norm", dec, [("tgt", torch.randn(L, N, E)), ("memory", torch.randn(S, N, E)),
                                      ("memory_key_padding_mask", kpm(N, S))],
           lambda tgt, memory, memory_key_padding_mask: dec(
               tgt, memory, tgt_mask=causal(L, L), memory_key_padding_mask=memory_key_padding_mask))


def transformer_cases(out):
    """nn.Transformer (the tfm_ cases): one or two layers a stack, src of length S, tgt of length L"""
    FF = 12
    square = nn.Transformer.generate_square_subsequent_mask
    # near the defaults: post-norm, relu, two encoder layers and one decoder layer, no masks
    m = nn.Transformer(E, H, 2, 1, FF, dropout=0.0)
    record(out, "tfm_default", m, [("src", torch.randn(S, N, E)), ("tgt", torch.randn(L, N, E))],
           lambda src, tgt: m(src, tgt))
    # batch_first, layer_norm_eps, a float src_mask and a bool memory_mask
    m = nn.Transformer(E, H, 1, 1, FF, dropout=0.0, layer_norm_eps=1e-3, batch_first=True)
    record(out, "tfm_bf", m, [("src", torch.randn(N, S, E)), ("tgt", torch.randn(N, L, E)),
                              ("src_mask", torch.randn(S, S)), ("memory_mask", bool_mask(L, S))],
           lambda src, tgt, src_mask, memory_mask: m(src, tgt, src_mask=src_mask, memory_mask=memory_mask))
    # pre-norm, gelu, a source padding mask (the memory's too)
    m = nn.Transformer(E, H, 1, 1, FF, dropout=0.0, activation="gelu", norm_first=True)
    record(out, "tfm_pre_gelu", m, [("src", torch.randn(S, N, E)), ("tgt", torch.randn(L, N, E)),
                                    ("src_key_padding_mask", kpm(N, S)), ("memory_key_padding_mask", kpm(N, S))],
           lambda src, tgt, src_key_padding_mask, memory_key_padding_mask: m(
               src, tgt, src_key_padding_mask=src_key_padding_mask,
               memory_key_padding_mask=memory_key_padding_mask))
    # every mask: the causal ones from generate_square_subsequent_mask (saved: the spec compares its
    # own), a float memory_mask and the three key padding masks
    m = nn.Transformer(E, H, 1, 1, FF, dropout=0.0)
    record(out, "tfm_masks", m, [("src", torch.randn(S, N, E)), ("tgt", torch.randn(L, N, E)),
                                 ("src_mask", square(S)), ("tgt_mask", square(L)), ("memory_mask", torch.randn(L, S)),
                                 ("src_key_padding_mask", kpm(N, S)), ("tgt_key_padding_mask", kpm(N, L)),
                                 ("memory_key_padding_mask", kpm(N, S))],
           lambda src, tgt, src_mask, tgt_mask, memory_mask, src_key_padding_mask, tgt_key_padding_mask,
           memory_key_padding_mask: m(src, tgt, src_mask, tgt_mask, memory_mask, src_key_padding_mask,
                                      tgt_key_padding_mask, memory_key_padding_mask))
    # custom_encoder (gelu, no final norm) and custom_decoder (pre-norm, two layers, a final norm)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, activation="gelu"), 1,
                                enable_nested_tensor=False)
    dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, FF, dropout=0.0, norm_first=True), 2,
                                norm=nn.LayerNorm(E))
    m = nn.Transformer(E, H, custom_encoder=enc, custom_decoder=dec)
    record(out, "tfm_custom", m, [("src", torch.randn(S, N, E)), ("tgt", torch.randn(L, N, E)),
                                  ("tgt_key_padding_mask", kpm(N, L))],
           lambda src, tgt, tgt_key_padding_mask: m(src, tgt, tgt_key_padding_mask=tgt_key_padding_mask))
    # bias=False (PyTorch 2.1) with src_is_causal and tgt_is_causal: RefTransformer, the causal masks
    m = RefTransformer(E, H, 1, 1, FF, F.relu, bias=False)
    record(out, "tfm_nobias_causal", m, [("src", torch.randn(S, N, E)), ("tgt", torch.randn(L, N, E))],
           lambda src, tgt: m(src, tgt, causal(S, S), causal(L, L)))


def main():
    for decoder in (False, True):
        for norm_first in (False, True):
            check_ref_layer(decoder, norm_first, "gelu" if norm_first else "relu")
    check_ref_transformer()
    torch.manual_seed(0)
    out = []
    mha_cases(out)
    layer_cases(out)
    transformer_cases(out)
    path = os.path.join(HERE, "transformer.safetensors")
    save_safetensors(path, out, {"torch": torch.__version__})
    print("wrote", len(out), "tensors,", os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
