#!/usr/bin/python3
"""PyTorch half of the fsdp benchmarks: the same models as bench/models.lua.

Times one training step (zero_grad + forward + loss + backward + optimizer step) on fixed random
data and prints one JSON object per model on stdout:
    {"model": "mlp", "ms": 12.3, "times": [...], "threads": 2, "torch": "1.13.0"}

    /usr/bin/python3 bench/torch_models.py [--threads N] [--warmup W] [--iters I] [--models mlp,conv,...]
    /usr/bin/python3 bench/torch_models.py --info     # one JSON object: version, BLAS, oneDNN, CPU ISA

bench/run.lua starts it and puts the numbers beside ours. Keep the models here and in
bench/models.lua identical (sizes, layer order, optimizer settings).
"""
import argparse
import json
import math
import re
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---- models -------------------------------------------------------------------------------------
def mlp():
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))


def small():
    # many small layers: 24 x (Linear(32, 32), LayerNorm(32), ReLU), then Linear(32, 10);
    # the step time is mostly per-op overhead (Python's or Lua's), not arithmetic
    layers = []
    for _ in range(24):
        layers += [nn.Linear(32, 32), nn.LayerNorm(32), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(32, 10))


def convnet():
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


# a small ResNet without BatchNorm (bench/models.lua has none yet): the convolution shapes
class BasicBlock(nn.Module):
    # 3x3 conv (stride s), ReLU, 3x3 conv, plus the input -- through a 1x1 stride-s conv when the
    # shape changes -- then ReLU
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.shortcut = nn.Conv2d(cin, cout, 1, stride=stride) if stride != 1 or cin != cout else None

    def forward(self, x):
        h = self.conv2(self.relu(self.conv1(x)))
        return self.relu(h + (self.shortcut(x) if self.shortcut is not None else x))


def resnet():
    # (B, 3, 56, 56) -> stem 64 @ 56 -> 64 @ 56 -> 128 @ 28 -> 128 @ 28 -> 256 @ 14 -> 256 @ 14 -> 10
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(),
                         BasicBlock(64, 64, 1), BasicBlock(64, 128, 2), BasicBlock(128, 128, 1),
                         BasicBlock(128, 256, 2), BasicBlock(256, 256, 1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10))


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):  # (B, T, d)
        B, T, d = x.shape
        H = self.heads
        q, k, v = self.qkv(x).split(d, dim=2)
        q = q.view(B, T, H, d // H).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, H, d // H).transpose(1, 2)
        v = v.view(B, T, H, d // H).transpose(1, 2)
        if hasattr(F, "scaled_dot_product_attention"):  # torch >= 2.0: the fused kernel, as users write it
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # torch 1.13 has no public F.scaled_dot_product_attention: the usual explicit form
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // H))  # (B, H, T, T)
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
            y = att @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(self.act(self.fc(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab=1000, d=256, heads=4, layers=2, seq=128):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):  # (B, T) int64
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        x = self.ln(self.blocks(x))
        return self.head(x)  # (B, T, vocab)


# the two language models: one builder, two sizes (vocab, width, heads, blocks, sequence, batch)
LM = {
    "transformer": dict(vocab=1000, d=256, heads=4, layers=2, T=128, B=16),
    "gpt": dict(vocab=512, d=384, heads=6, layers=2, T=256, B=8),
}
MODELS = "mlp,conv,transformer,small,resnet,gpt"


# ---- cases: model, optimizer, one batch, loss --------------------------------------------------------
def case(name):
    torch.manual_seed(0)
    if name == "mlp":
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.randn(256, 784), torch.randint(0, 10, (256,))
        loss_fn = lambda: F.cross_entropy(model(x), y)
    elif name == "conv":
        model = convnet()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
        loss_fn = lambda: F.cross_entropy(model(x), y)
    elif name == "resnet":
        model = resnet()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.randn(8, 3, 56, 56), torch.randint(0, 10, (8,))
        loss_fn = lambda: F.cross_entropy(model(x), y)
    elif name in LM:
        c = LM[name]
        vocab, B, T = c["vocab"], c["B"], c["T"]
        model = Transformer(vocab=vocab, d=c["d"], heads=c["heads"], layers=c["layers"], seq=T)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
        x, y = torch.randint(0, vocab, (B, T)), torch.randint(0, vocab, (B, T))
        loss_fn = lambda: F.cross_entropy(model(x).view(B * T, vocab), y.view(B * T))
    elif name == "small":
        model = small()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
        loss_fn = lambda: F.cross_entropy(model(x), y)
    else:
        raise SystemExit(f"torch_models.py: unknown model {name!r} ({MODELS.replace(',', ', ')})")
    return model, opt, loss_fn


def bench(name, warmup, iters):
    model, opt, loss_fn = case(name)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        opt.step()
        return loss

    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        loss = step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times, loss.item()


def info():
    """This torch in brief: version, BLAS, oneDNN version, the ISA its own kernels use."""
    cfg = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", cfg)
    blas = blas.group(1) if blas else "?"
    if blas == "generic":  # the system's libblas.so.3: name the library it resolves to
        torch.ones(64, 64) @ torch.ones(64, 64)
        with open("/proc/self/maps") as f:
            libs = sorted({m.group(1) for m in re.finditer(r"/(lib(?:openblas|blis|mkl)[\w.-]*?\.so)", f.read())})
        blas += " -> " + (", ".join(libs) or "libblas.so.3")
    dnn = re.search(r"MKL-DNN (v[\d.]+)", cfg)
    isa = re.search(r"CPU capability usage: (\w+)", cfg)
    return {"torch": torch.__version__, "blas": blas,
            "onednn": dnn.group(1) if dnn and torch.backends.mkldnn.is_available() else "none",
            "isa": isa.group(1) if isa else "?"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--info", action="store_true", help="print this torch's version and libraries, and exit")
    a = ap.parse_args()
    if a.info:
        print(json.dumps(info()), flush=True)
        return
    torch.set_num_threads(a.threads)
    for name in a.models.split(","):
        ms, times, loss = bench(name, a.warmup, a.iters)
        print(json.dumps({"model": name, "ms": ms, "times": times, "loss": loss,
                          "threads": torch.get_num_threads(), "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
