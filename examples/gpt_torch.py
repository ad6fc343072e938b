#!/usr/bin/env python3
"""examples/gpt.lua written with PyTorch FSDP2: the same job, flags, output and features (its header says
what the job is), for the validation-loss comparison and the line count of bench/README.md. The same
model, initialisation scheme, corpus, split and crops (the same Park-Miller generator), so only the
random initial weights differ. Needs a current torch (`make bench-deps` puts one in tmp/torch-venv):

    torchrun --nproc-per-node 2 examples/gpt_torch.py     the default run, 2 ranks over gloo
    python examples/gpt_torch.py --help                   every flag
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from tqdm import tqdm


def positive(s):
    if int(s) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {s}")
    return int(s)


p = argparse.ArgumentParser(prog="gpt_torch.py", description="Trains a character-level GPT on the fortunes corpus "
                            "with FSDP2, prints the validation loss every --eval-every steps, checkpoints, and ends "
                            "with a sample of generated text.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
a = p.add_argument
a("--steps", type=positive, default=2000, help="optimizer steps")
a("--batch-size", type=positive, default=16, help="crops per micro-batch, global, split over the ranks")
a("--accum", type=positive, default=2, help="micro-batches per optimizer step (gradient accumulation)")
a("--block", type=positive, default=128, help="context length")
a("--layers", type=positive, default=4, help="transformer blocks")
a("--heads", type=positive, default=6, help="attention heads")
a("--dim", type=positive, default=192, help="embedding width")
a("--untied", action="store_true", help="an LM head weight of its own, untied from wte")
a("--lr", type=float, default=2e-3, help="peak AdamW learning rate, cosine decay to LR/10")
a("--warmup", type=int, default=100, help="linear warmup steps")
a("--weight-decay", type=float, default=0.1, help="AdamW weight decay of the matrices")
a("--clip", type=float, default=1.0, help="clip the global gradient norm to C (0: off)")
a("--eval-every", type=positive, default=100, help="steps between validation evaluations and checkpoints")
a("--eval-iters", type=positive, default=8, help="validation batches of B crops per evaluation")
a("--bf16", action="store_true", help="mixed precision: bf16 compute, fp32 masters and reduction")
a("--seed", type=int, default=0, help="initialisation, crops and sampling")
a("--data", default="/usr/share/games/fortunes", help="the fortunes directory")
a("--limit", type=positive, help="use only the first N bytes of the corpus (CI)")
a("--ckpt", help="checkpoint directory (default ./gpt_ckpt, or the --resume DIR)")
a("--resume", help="continue the run saved in DIR (pass the same training flags)")
a("--stop-at", type=positive, help="stop after step S (checkpointed there when S is a multiple of --eval-every); "
  "--resume then goes on as if the run had never stopped")
a("--sample-len", type=int, default=400, help="characters to generate at the end (0: none)")
a("--temperature", type=float, default=0.8, help="sampling temperature")
a("--top-k", type=positive, default=10, help="sample among the K most likely characters")
a("--prompt", default="\n", help="the text generation starts from")
cfg = p.parse_args()
if cfg.dim % cfg.heads != 0:
    p.error(f"--dim {cfg.dim} is not a multiple of --heads {cfg.heads}")
if cfg.temperature <= 0:
    p.error("--temperature must be positive")
cfg.ckpt = (cfg.ckpt or cfg.resume or "./gpt_ckpt").rstrip("/")

FILES = ["art", "ascii-art", "computers", "cookie", "debian", "definitions", "disclaimer", "drugs",
         "education", "ethnic", "food", "fortunes", "goedel", "humorists", "kids", "knghtbrd", "law", "linux",
         "linuxcookie", "literature", "love", "magic", "medicine", "men-women", "miscellaneous", "news", "paradoxum",
         "people", "perl", "pets", "platitudes", "politics", "pratchett", "riddles", "science", "songs-poems", "sports",
         "startrek", "tao", "translate-me", "wisdom", "work", "zippy"]


def load_corpus(folder, limit):
    parts = []
    for name in FILES:
        try:
            with open(f"{folder}/{name}", "rb") as f:
                parts.append(f.read())
        except OSError:
            sys.exit(f"gpt_torch.py: the corpus file {folder}/{name} is missing: install it with "
                     "`apt-get install fortunes` (or pass --data DIR)")
    return b"".join(parts)[:limit]


class CausalSelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):  # (B, T, d)
        B, T, d = x.shape
        H = self.heads
        q, k, v = (t.reshape(B, T, H, d // H).transpose(1, 2) for t in self.c_attn(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
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
        self.ln_1, self.attn = nn.LayerNorm(d), CausalSelfAttention(d, heads)
        self.ln_2, self.mlp = nn.LayerNorm(d), MLP(d)

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

    def forward(self, idx):  # (B, T) int64 -> logits (B, T, vocab)
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def crop_offsets(seed, step, count, rng):  # a Park-Miller generator, exact (examples/gpt.lua has the same)
    s = (seed * 1000003 + step * 7919 + 12345) % 2147483646 + 1
    out = []
    for _ in range(count):
        s = s * 48271 % 2147483647
        out.append(s % rng)
    return out


def main():
    if "RANK" not in os.environ:  # plain python: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    dist.init_process_group("gloo")
    R, N = dist.get_rank(), dist.get_world_size()
    say = print if R == 0 else lambda *args, **kw: None
    B, K, T = cfg.batch_size, cfg.accum, cfg.block
    if B % N != 0:
        sys.exit(f"gpt_torch.py: --batch-size {B} must be a multiple of the number of ranks ({N})")
    b = B // N

    text = load_corpus(cfg.data, cfg.limit)
    itos = sorted(set(text))
    stoi = {c: i for i, c in enumerate(itos)}
    V, n = len(itos), len(text)
    ids = torch.tensor([stoi[c] for c in text], dtype=torch.int64)
    ntrain = int(n * 0.9)
    splits = {"train": ids[:ntrain], "val": ids[ntrain:]}
    for name, sp in splits.items():
        if len(sp) <= T + 1:
            sys.exit(f"gpt_torch.py: the {name} split ({len(sp)} bytes) is shorter than --block {T} + 1")

    def batch(data, offs):  # inputs (len(offs), T) and next-character targets
        ix = torch.tensor(offs).unsqueeze(1) + torch.arange(T)
        return data[ix], data[ix + 1]
    say(f"corpus: {len(FILES)} fortunes files from {cfg.data}, {n} bytes, vocabulary {V}; "
        f"train {ntrain} / val {n - ntrain}")

    torch.manual_seed(cfg.seed)
    model = GPT(V, T, cfg.dim, cfg.heads, cfg.layers, cfg.untied)
    nparams = sum(q.numel() for q in model.parameters())
    mesh = init_device_mesh("cpu", (N,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cfg.bf16 else None, reduce_dtype=torch.float32)
    for blk in model.h:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    S = torch.optim.lr_scheduler
    warm = max(1, min(cfg.warmup, cfg.steps - 1))
    sched = S.SequentialLR(opt, [S.LinearLR(opt, start_factor=1 / warm, total_iters=warm),
                                 S.CosineAnnealingLR(opt, T_max=max(1, cfg.steps - warm), eta_min=cfg.lr / 10)], [warm])
    say(f"GPT: {cfg.layers} blocks, d {cfg.dim}, {cfg.heads} heads, context {T}, "
        f"{'untied' if cfg.untied else 'tied'} head: {nparams} parameters, {cfg.layers + 1} FSDP units, {N} ranks"
        f"{', bf16 compute' if cfg.bf16 else ''}; torch {torch.__version__}")
    say(f"AdamW lr {cfg.lr:g} (warmup {warm}, cosine to {cfg.lr / 10:g}), weight decay {cfg.weight_decay:g} "
        f"on {len(decay)} matrices; {cfg.steps} steps of {K} x {B} crops of {T} characters")

    def loss_of(x, y):
        return F.cross_entropy(model(x).reshape(b * T, V).float(), y.reshape(b * T))

    def mean_over_ranks(v):
        t = torch.tensor([v])
        dist.all_reduce(t, dist.ReduceOp.AVG)
        return t.item()
    val_offs = crop_offsets(cfg.seed + 7777, 0, B * cfg.eval_iters, len(splits["val"]) - T)

    def evaluate():
        model.eval()
        with torch.no_grad():
            s = sum(loss_of(*batch(splits["val"], val_offs[it * B + R * b:it * B + (R + 1) * b])).item()
                    for it in range(cfg.eval_iters))
        model.train()
        return mean_over_ranks(s / cfg.eval_iters)

    # what a resumed run must share with the saved one (DCP checks the model's shapes)
    resume_keys = ["steps", "batch_size", "accum", "block", "seed", "lr", "warmup", "weight_decay", "clip", "limit"]
    start, curve = 1, []
    if cfg.resume:
        try:
            msd, osd = get_state_dict(model, opt)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=cfg.resume)
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            extra = torch.load(f"{cfg.resume}/extra.pt", weights_only=False)
        except Exception as e:
            sys.exit(f"gpt_torch.py: cannot resume from {cfg.resume}: {e}")
        if not isinstance(extra, dict) or extra.get("job") != "gpt":
            sys.exit(f"gpt_torch.py: cannot resume from {cfg.resume}: not a checkpoint of examples/gpt_torch.py")
        for k in resume_keys:
            if extra["cfg"][k] != getattr(cfg, k):
                sys.exit(f"gpt_torch.py: cannot resume from {cfg.resume}: it was trained with --{k.replace('_', '-')} "
                         f"{extra['cfg'][k]}, not {getattr(cfg, k)}")
        sched.load_state_dict(extra["sched"])
        start, curve = extra["step"] + 1, extra["curve"]
        say(f"resumed from {cfg.resume} after step {extra['step']}")
    for c in curve:
        say(f"step {c[0]:5d}  train loss {c[1]:.6f}  val loss {c[2]:.6f}  lr {c[3]:.3e}")

    t0, tsum, tcount = time.perf_counter(), 0.0, 0
    bar = None
    last = min(cfg.steps, cfg.stop_at or cfg.steps)
    for step in range(start, last + 1):
        if bar is None:  # one live line per evaluation interval, closed by the evaluation's line
            count = min(cfg.eval_every - (step - 1) % cfg.eval_every, last - step + 1)
            bar = tqdm(total=count, desc=f"steps {step}-{step + count - 1}", unit="step", disable=R != 0)
        offs = crop_offsets(cfg.seed, step, K * B, len(splits["train"]) - T)
        lsum = 0.0
        for k in range(K):
            loss = loss_of(*batch(splits["train"], offs[k * B + R * b:k * B + (R + 1) * b])) / K
            loss.backward()
            lsum += loss.item()
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        opt.zero_grad()
        sched.step()
        loss = mean_over_ranks(lsum)
        if math.isnan(loss):
            sys.exit(f"gpt_torch.py: the loss became NaN at step {step} (lower --lr)")
        tsum, tcount = tsum + loss, tcount + 1
        bar.set_postfix(loss=loss)
        bar.update(1)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            c = [step, tsum / tcount, evaluate(), lr]
            tsum, tcount = 0.0, 0
            curve.append(c)
            bar.close()
            bar = None
            say(f"step {c[0]:5d}  train loss {c[1]:.6f}  val loss {c[2]:.6f}  lr {c[3]:.3e}", flush=True)
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=cfg.ckpt)
            if R == 0:
                torch.save({"job": "gpt", "step": step, "curve": curve, "sched": sched.state_dict(),
                            "cfg": {k: getattr(cfg, k) for k in resume_keys}}, f"{cfg.ckpt}/extra.pt")
    if bar is not None:
        bar.close()
    if start <= last:
        dt = time.perf_counter() - t0
        say(f"trained steps {start}-{last} in {dt:.1f} s ({dt / (last - start + 1):.3f} s per step); "
            f"checkpoint {cfg.ckpt}")

    # sampling: every rank runs the same forwards (the units gather) and draws the same characters
    if cfg.sample_len > 0:
        torch.manual_seed(cfg.seed)
        model.eval()
        bad = [ch for ch in cfg.prompt.encode() if ch not in stoi]
        if bad:
            sys.exit(f"gpt_torch.py: --prompt: the character {chr(bad[0])!r} is not in the corpus")
        if not cfg.prompt:
            sys.exit("gpt_torch.py: --prompt must not be empty")
        ctx, kk = [stoi[ch] for ch in cfg.prompt.encode()], min(cfg.top_k, V)
        with torch.no_grad():
            for _ in range(cfg.sample_len):
                logits = model(torch.tensor([ctx[-T:]])).float()[0, -1] / cfg.temperature
                vals, inds = logits.topk(kk)
                ctx.append(inds[torch.multinomial(F.softmax(vals, -1), 1)].item())
        out = bytes(itos[i] for i in ctx[len(cfg.prompt.encode()):]).decode("utf-8", "replace")
        say(f"sample (temperature {cfg.temperature:g}, top-k {kk}, {cfg.sample_len} characters):\n"
            f"{cfg.prompt}{out}\n-- end of sample --")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
