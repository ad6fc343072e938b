#!/usr/bin/python3
"""The PyTorch peer of examples/gpt.lua, for the validation-loss comparison: the same model (nanoGPT's
blocks and names, tied head unless --untied), initialisation scheme (N(0, 0.02), residual projections
N(0, 0.02 / sqrt(2 L)), zero biases), corpus and split, the very same training and validation crops
(the same Park-Miller generator), AdamW with the same two parameter groups, warmup + cosine schedule
(SequentialLR of LinearLR and CosineAnnealingLR), accumulation and clipping. One process,
torch.set_num_threads(2). Only the random initial weights differ (PyTorch's generator).

    /usr/bin/python3 examples/gpt_torch.py [the same flags as examples/gpt.lua: --steps 2000 ...]

Prints "step N  train loss X  val loss Y  lr Z" every --eval-every steps, as gpt.lua does.
"""
import argparse
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

FILES = ["art", "ascii-art", "computers", "cookie", "debian", "definitions", "disclaimer", "drugs",
         "education", "ethnic", "food", "fortunes", "goedel", "humorists", "kids", "knghtbrd", "law", "linux",
         "linuxcookie", "literature", "love", "magic", "medicine", "men-women", "miscellaneous", "news", "paradoxum",
         "people", "perl", "pets", "platitudes", "politics", "pratchett", "riddles", "science", "songs-poems", "sports",
         "startrek", "tao", "translate-me", "wisdom", "work", "zippy"]


def crop_offsets(seed, step, count, rng):
    s = (seed * 1000003 + step * 7919 + 12345) % 2147483646 + 1
    out = []
    for _ in range(count):
        s = s * 48271 % 2147483647
        out.append(s % rng)
    return out


class CausalSelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, d = x.shape
        H = self.heads
        q, k, v = (t.reshape(B, T, H, d // H).transpose(1, 2) for t in self.c_attn(x).split(d, dim=2))
        if hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # torch < 2.0
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // H)
            mask = torch.ones(T, T, dtype=torch.bool).tril()
            y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(B, T, d))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(d), CausalSelfAttention(d, heads), nn.LayerNorm(d), MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab, block, d, heads, layers, untied):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if not untied:
            self.lm_head.weight = self.wte.weight
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    m.weight.normal_(0, 0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    m.bias.zero_()
            for b in self.h:
                b.attn.c_proj.weight.normal_(0, 0.02 / math.sqrt(2 * layers))
                b.mlp.c_proj.weight.normal_(0, 0.02 / math.sqrt(2 * layers))

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--steps", type=int, default=2000); a("--batch-size", type=int, default=16); a("--accum", type=int, default=2)
    a("--block", type=int, default=128); a("--layers", type=int, default=4); a("--heads", type=int, default=6)
    a("--dim", type=int, default=192); a("--untied", action="store_true"); a("--lr", type=float, default=2e-3)
    a("--warmup", type=int, default=100); a("--weight-decay", type=float, default=0.1)
    a("--clip", type=float, default=1.0); a("--eval-every", type=int, default=100); a("--eval-iters", type=int, default=8)
    a("--seed", type=int, default=0); a("--data", default="/usr/share/games/fortunes"); a("--limit", type=int)
    a("--threads", type=int, default=2)
    o = p.parse_args()
    torch.set_num_threads(o.threads)
    torch.manual_seed(o.seed)
    parts = []
    for name in FILES:
        try:
            with open(f"{o.data}/{name}", "rb") as f:
                parts.append(f.read())
        except OSError:
            sys.exit(f"gpt_torch.py: the corpus file {o.data}/{name} is missing: install it with `apt-get install fortunes`")
    text = b"".join(parts)[:o.limit]
    itos = sorted(set(text))
    stoi = {c: i for i, c in enumerate(itos)}
    ids = torch.tensor([stoi[c] for c in text], dtype=torch.int64)
    V, n, T, B, K = len(itos), len(text), o.block, o.batch_size, o.accum
    ntrain = int(n * 0.9)
    train, val = ids[:ntrain], ids[ntrain:]

    def batch(data, offs):
        ix = torch.tensor(offs).unsqueeze(1) + torch.arange(T)
        return data[ix], data[ix + 1]

    model = GPT(V, T, o.dim, o.heads, o.layers, o.untied)
    params = list(model.parameters())
    decay = [q for q in params if q.dim() >= 2]
    no_decay = [q for q in params if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=o.lr, betas=(0.9, 0.95))
    S = torch.optim.lr_scheduler
    warm = max(1, min(o.warmup, o.steps - 1))
    sched = S.SequentialLR(opt, [S.LinearLR(opt, start_factor=1 / warm, total_iters=warm),
                                 S.CosineAnnealingLR(opt, T_max=max(1, o.steps - warm), eta_min=o.lr / 10)], [warm])
    print(f"torch {torch.__version__}: GPT {o.layers} blocks, d {o.dim}, {o.heads} heads, context {T}, "
          f"{sum(q.numel() for q in params)} parameters; vocabulary {V}, train {ntrain} / val {n - ntrain}", flush=True)
    val_offs = crop_offsets(o.seed + 7777, 0, B * o.eval_iters, len(val) - T)

    def evaluate():
        model.eval()
        with torch.no_grad():
            s = sum(F.cross_entropy(model(x).reshape(B * T, V), y.reshape(B * T)).item()
                    for x, y in (batch(val, val_offs[i * B:(i + 1) * B]) for i in range(o.eval_iters)))
        model.train()
        return s / o.eval_iters

    t0, tsum, tcount = time.time(), 0.0, 0
    for step in range(1, o.steps + 1):
        offs = crop_offsets(o.seed, step, K * B, len(train) - T)
        lsum = 0.0
        for k in range(K):
            x, y = batch(train, offs[k * B:(k + 1) * B])
            loss = F.cross_entropy(model(x).reshape(B * T, V), y.reshape(B * T)) / K
            loss.backward()
            lsum += loss.item()
        if o.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, o.clip)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        tsum, tcount = tsum + lsum, tcount + 1
        if step % o.eval_every == 0 or step == o.steps:
            print(f"step {step:5d}  train loss {tsum / tcount:.6f}  val loss {evaluate():.6f}  lr {lr:.3e}", flush=True)
            tsum, tcount = 0.0, 0
    print(f"trained {o.steps} steps in {time.time() - t0:.1f} s ({(time.time() - t0) / o.steps:.3f} s per step)")


if __name__ == "__main__":
    main()
