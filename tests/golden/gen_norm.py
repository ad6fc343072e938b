#!/usr/bin/python3
"""Golden values of the normalization layers for tests/nn/norm_spec.lua, produced with PyTorch.

Run with Debian's PyTorch (python3-torch 1.13, CPU):   /usr/bin/python3 tests/golden/gen_norm.py
Writes tests/golden/norm.safetensors (float32 and int64 tensors, names below):

  bn2d.*  BatchNorm2d(3) with random weight/bias, 3 training steps on x.<k> (4, 3, 5, 5): the
          output y.<k>, and for loss = sum(y * r.<k>) the gradients dx.<k>, dw.<k>, db.<k>; after
          the steps running_mean, running_var, num_batches_tracked; then in eval mode the output
          y.eval on x.eval and the gradient dx.eval of sum(y.eval * r.eval)
  bn1d.*  BatchNorm1d(4, momentum=None) (the cumulative average), 3 steps on x.<k> (8, 4): y.<k>,
          then running_mean, running_var, num_batches_tracked
  bn1d3.* BatchNorm1d(3, momentum=0.3, affine=False), 3 steps on x.<k> (5, 3, 6): y.<k>, then the
          running statistics
  gn.*    GroupNorm(3, 6) with random weight/bias on x (2, 6, 3, 3): y, and dx, dw, db of sum(y * r)
  rms.*   RMSNorm(5) with random weight on x (3, 4, 5): PyTorch 1.13 has no nn.RMSNorm, so the
          formula of PyTorch 2.4+: x / sqrt(mean(x^2) + eps) * w, eps = torch.finfo(float32).eps;
          y, and dx, dw of sum(y * r); y_eps for eps = 0.1; y_small on x_small = x / 1000 (where
          the default eps is a tenth of mean(x^2))
"""
import os
import sys

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gen import save_safetensors  # noqa: E402


def grads(y, r, *leaves):
    return torch.autograd.grad((y * r).sum(), leaves)


def bn_steps(out, prefix, bn, shape, steps, with_grads):
    for k in range(1, steps + 1):
        x = torch.randn(*shape) * 2 + 0.5
        x.requires_grad_(True)
        y = bn(x)
        out += [(f"{prefix}.x.{k}", x), (f"{prefix}.y.{k}", y)]
        if with_grads:
            r = torch.randn(*shape)
            dx, dw, db = grads(y, r, x, bn.weight, bn.bias)
            out += [(f"{prefix}.r.{k}", r), (f"{prefix}.dx.{k}", dx), (f"{prefix}.dw.{k}", dw), (f"{prefix}.db.{k}", db)]
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        out.append((f"{prefix}.{name}", getattr(bn, name)))


def main():
    torch.manual_seed(0)
    out = []
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(3) + 0.5)
        bn.bias.copy_(torch.randn(3))
    out += [("bn2d.weight", bn.weight), ("bn2d.bias", bn.bias)]
    bn_steps(out, "bn2d", bn, (4, 3, 5, 5), 3, True)
    bn.eval()
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    r = torch.randn(2, 3, 5, 5)
    y = bn(x)
    (dx,) = grads(y, r, x)
    out += [("bn2d.x.eval", x), ("bn2d.y.eval", y), ("bn2d.r.eval", r), ("bn2d.dx.eval", dx)]

    bn_steps(out, "bn1d", nn.BatchNorm1d(4, momentum=None), (8, 4), 3, False)
    bn_steps(out, "bn1d3", nn.BatchNorm1d(3, momentum=0.3, affine=False), (5, 3, 6), 3, False)

    gn = nn.GroupNorm(3, 6)
    with torch.no_grad():
        gn.weight.copy_(torch.rand(6) + 0.5)
        gn.bias.copy_(torch.randn(6))
    x = torch.randn(2, 6, 3, 3, requires_grad=True)
    r = torch.randn(2, 6, 3, 3)
    y = gn(x)
    dx, dw, db = grads(y, r, x, gn.weight, gn.bias)
    out += [("gn.weight", gn.weight), ("gn.bias", gn.bias), ("gn.x", x), ("gn.r", r), ("gn.y", y), ("gn.dx", dx),
            ("gn.dw", dw), ("gn.db", db)]

    w = (torch.rand(5) + 0.5).requires_grad_(True)
    x = torch.randn(3, 4, 5, requires_grad=True)
    r = torch.randn(3, 4, 5)

    def rms(x, eps):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    y = rms(x, torch.finfo(x.dtype).eps)
    dx, dw = grads(y, r, x, w)
    out += [("rms.weight", w), ("rms.x", x), ("rms.r", r), ("rms.y", y), ("rms.dx", dx), ("rms.dw", dw),
            ("rms.y_eps", rms(x, 0.1))]
    # small values, where the default eps matters: mean(x^2) ~ 1e-6 against eps 1.19e-7
    xs = x.detach() * 1e-3
    out += [("rms.x_small", xs), ("rms.y_small", rms(xs, torch.finfo(xs.dtype).eps))]
    save_safetensors(os.path.join(HERE, "norm.safetensors"), out, {"torch": torch.__version__})
    print("wrote", len(out), "tensors")


if __name__ == "__main__":
    main()
