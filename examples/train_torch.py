#!/usr/bin/python3
"""The PyTorch peer of examples/train.lua's pretraining, for the throughput comparison.

Same model (trunk: 2 x Conv3x3(pad 1)-ReLU-MaxPool2, 1-32-64 channels; head: Flatten-Linear(3136, 10)),
same optimizer (Adam lr 1e-3), same global batch (128), same data normalisation; one process,
torch.set_num_threads(2) (the 2 cores fsdprun -n 2 uses).

    /usr/bin/python3 examples/train_torch.py [--limit 6400] [--epochs 1] [--threads 2] [--data DIR]

Prints one line per epoch with samples/s (training only) and test accuracy, and a last line
"torch samples/s: N" for scripts.
"""
import argparse
import gzip
import os
import struct
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

MEAN, STD = 0.2860, 0.3530


def read_idx(path, limit=None):
    with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
        data = f.read()
    magic = struct.unpack(">I", data[:4])[0]
    ndim = magic & 0xFF
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)
    return arr[:limit] if limit else arr


def load(split, data_dir, limit):
    names = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}[split]
    paths = []
    for n in names:
        p = os.path.join(data_dir, n)
        paths.append(p + ".gz" if os.path.exists(p + ".gz") else p)
    x = torch.from_numpy(read_idx(paths[0], limit).astype(np.float32) / 255.0)
    x = ((x - MEAN) / STD).unsqueeze(1).contiguous()  # (N, 1, 28, 28)
    y = torch.from_numpy(read_idx(paths[1], limit).astype(np.int64))
    return x, y


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))


class FashionNet(nn.Module):
    def __init__(self, c1=32, c2=64):
        super().__init__()
        self.trunk = nn.Sequential(block(1, c1), block(c1, c2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(c2 * 7 * 7, 10))

    def forward(self, x):
        return self.head(self.trunk(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--test-limit", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=os.environ.get("FSDP_DATA_DIR", "/usr/share/datasets/fashion-mnist"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    xtr, ytr = load("train", a.data, a.limit)
    xte, yte = load("test", a.data, a.test_limit)
    model = FashionNet()
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    B = a.batch_size
    steps = xtr.shape[0] // B
    print(f"torch {torch.__version__}, {a.threads} threads: {xtr.shape[0]} train / {xte.shape[0]} test images, "
          f"batch {B}, {steps} steps per epoch", flush=True)
    sps = 0.0
    for epoch in range(1, a.epochs + 1):
        g = torch.Generator().manual_seed(a.seed * 1000 + epoch)
        perm = torch.randperm(xtr.shape[0], generator=g)
        model.train()
        t0 = time.perf_counter()
        total = 0.0
        for s in range(steps):
            ix = perm[s * B:(s + 1) * B]
            loss = F.cross_entropy(model(xtr[ix]), ytr[ix])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        dt = time.perf_counter() - t0
        sps = steps * B / dt
        model.eval()
        with torch.no_grad():
            correct = sum((model(xte[i:i + 500]).argmax(1) == yte[i:i + 500]).sum().item()
                          for i in range(0, xte.shape[0], 500))
        print(f"epoch {epoch}  loss {total / steps:.4f}  test acc {correct / xte.shape[0]:.4f}  "
              f"{sps:.0f} samples/s  {dt:.1f}s", flush=True)
    print(f"torch samples/s: {sps:.0f}")


if __name__ == "__main__":
    main()
