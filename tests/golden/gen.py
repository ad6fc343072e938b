#!/usr/bin/python3
"""Golden reference runs for tests/nn/golden_spec.lua, produced with PyTorch.

Run with Debian's PyTorch (python3-torch, CPU):   /usr/bin/python3 tests/golden/gen.py
(the `safetensors` package is not needed: the format is written by hand below).

For each of three models (mlp, convnet, gpt) it trains 5 steps in float32 and writes:
  tests/golden/<model>_init.safetensors   the initial state_dict (PyTorch names)
  tests/golden/<model>_final.safetensors  the state_dict after 5 optimizer steps
  tests/golden/<model>_data.safetensors   x.<k>, y.<k> for steps k = 1..5 (inputs, int64 targets)
                                          and `losses` (5,) float32: the loss of each step (the
                                          float64 values are also in __metadata__["losses"] as JSON)
The init/final files are plain state_dicts: PyTorch's safetensors.torch.load_file reads them.
Optimizer settings are recorded in the __metadata__ of every file.

As a sanity check it also replays each run in float64 from the same initial weights and
prints how far float32 ends up from it: that is the size of pure rounding noise, and the
tolerance in golden_spec.lua must sit well above it (and well below a real bug).
"""
import json
import math
import os
import struct

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 5


# ---- safetensors, by hand ------------------------------------------------------------------------
def save_safetensors(path, tensors, metadata=None):
    """tensors: list of (name, tensor) in file order; float32 -> F32, int64 -> I64 (the dtypes
    fsdp.load reads; it rejects F64)."""
    codes = {torch.float32: "F32", torch.int64: "I64"}
    header, blobs, offset = {}, [], 0
    for name, t in tensors:
        t = t.detach().contiguous().cpu()
        raw = t.numpy().astype(t.numpy().dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": codes[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def load_safetensors(path):
    """Reader used only to verify what was written."""
    dtypes = {"F32": torch.float32, "I64": torch.int64}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    out = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        t = torch.frombuffer(bytearray(data[b:e]), dtype=dtypes[info["dtype"]])
        out[name] = t.reshape(info["shape"])
    return out, meta


# ---- models ----------------------------------------------------------------------------------------
def make_mlp():
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))


def make_convnet():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(),
        nn.Conv2d(4, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


class Attention(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):                                    # (B, T, C)
        B, T, C = x.shape
        hd = C // self.n_head
        q, k, v = self.qkv(x).split(C, dim=2)                # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)    # (B, nh, T, hd)
        k = k.view(B, T, self.n_head, hd).transpose(1, 2)
        v = v.view(B, T, self.n_head, hd).transpose(1, 2)
        # explicit causal attention (torch 1.13 has no F.scaled_dot_product_attention)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)      # (B, nh, T, T)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = att @ v                                          # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, n_head)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=50, block_size=16, d=32, n_head=4, n_layer=2):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block_size, d)
        self.blocks = nn.Sequential(*[Block(d, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):                                  # (B, T) int64
        B, T = idx.shape
        pos = torch.arange(T)
        x = self.wte(idx) + self.wpe(pos)                    # (B, T, C)
        x = self.blocks(x)
        return self.head(self.ln_f(x))                       # (B, T, vocab)


# ---- runs ------------------------------------------------------------------------------------------
def lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


SPECS = {
    "mlp": dict(
        make=make_mlp,
        data=lambda: (torch.randn(16, 64), torch.randint(0, 10, (16,))),
        loss=F.cross_entropy,
        opt=("SGD", dict(lr=0.1, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=5e-3)),
    ),
    "convnet": dict(
        make=make_convnet,
        data=lambda: (torch.randn(8, 1, 12, 12), torch.randint(0, 10, (8,))),
        loss=F.cross_entropy,
        opt=("Adam", dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)),
    ),
    "gpt": dict(
        make=GPT,
        # next-token targets: y is x shifted by one inside a random sequence of length T+1
        data=lambda: (lambda s: (s[:, :-1].contiguous(), s[:, 1:].contiguous()))(torch.randint(0, 50, (4, 17))),
        loss=lm_loss,
        opt=("AdamW", dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)),
    ),
}


def train(model, batches, loss_fn, opt_name, opt_kw):
    opt = getattr(torch.optim, opt_name)(model.parameters(), **opt_kw)
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    torch.set_num_threads(1)
    for seed, (name, spec) in enumerate(SPECS.items()):
        torch.manual_seed(1234 + seed)
        model = spec["make"]().float()
        if name == "gpt":
            # LayerNorm starts at weight 1, bias 0; perturb so the affine part is exercised at step 1
            with torch.no_grad():
                for m in model.modules():
                    if isinstance(m, nn.LayerNorm):
                        m.weight.add_(0.1 * torch.randn_like(m.weight))
                        m.bias.add_(0.1 * torch.randn_like(m.bias))
        init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        batches = [spec["data"]() for _ in range(STEPS)]
        opt_name, opt_kw = spec["opt"]
        losses = train(model, batches, spec["loss"], opt_name, opt_kw)
        final = model.state_dict()

        # float64 replay from the same start: measures float32 rounding noise
        m64 = spec["make"]().double()
        m64.load_state_dict({k: v.double() for k, v in init.items()})
        b64 = [(x.double() if x.is_floating_point() else x, y) for x, y in batches]
        losses64 = train(m64, b64, spec["loss"], opt_name, opt_kw)
        f64 = m64.state_dict()
        dloss = max(abs(a - b) for a, b in zip(losses, losses64))
        dparam = max((final[k].double() - f64[k]).abs().max().item() for k in final)
        rel = max(((final[k].double() - f64[k]).abs() / (f64[k].abs() + 1e-3)).max().item() for k in final)

        meta = {"model": name, "optimizer": opt_name, "steps": STEPS, "torch": torch.__version__,
                "options": json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in opt_kw.items()})}
        save_safetensors(os.path.join(HERE, f"{name}_init.safetensors"), list(init.items()), meta)
        save_safetensors(os.path.join(HERE, f"{name}_final.safetensors"), list(final.items()), meta)
        data = []
        for k, (x, y) in enumerate(batches, 1):
            data += [(f"x.{k}", x), (f"y.{k}", y)]
        data.append(("losses", torch.tensor(losses, dtype=torch.float32)))
        save_safetensors(os.path.join(HERE, f"{name}_data.safetensors"), data,
                         dict(meta, losses=json.dumps(losses)))

        # read back and verify
        for suffix, ref in (("init", init), ("final", final), ("data", dict(data))):
            got, _ = load_safetensors(os.path.join(HERE, f"{name}_{suffix}.safetensors"))
            assert list(got) == list(ref), (name, suffix)
            for k in ref:
                assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), (name, suffix, k)
        nparams = sum(v.numel() for v in init.values())
        print(f"{name:8s} params {nparams:6d}  losses {' '.join(f'{l:.6f}' for l in losses)}")
        print(f"{'':8s} float32 vs float64: max |dloss| {dloss:.2e}, max |dparam| {dparam:.2e}, "
              f"max rel {rel:.2e}")


if __name__ == "__main__":
    main()
