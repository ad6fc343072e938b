#!/usr/bin/python3
"""Golden values for tests/nn/conv_layers_spec.lua, from torch.nn.functional.

Run with Debian's PyTorch (python3-torch):   /usr/bin/python3 tests/golden/gen_conv_layers.py

Writes tests/golden/conv_layers.json: for each case its inputs (x, w, b: shapes and float32 values
from a seeded generator), its options, the output y and the gradients of sum(y * gy) for a seeded
gy. Values are float32 written with 9 significant digits (they read back exactly). Cases: grouped and
depthwise conv2d with and without bias, conv_transpose2d with stride, padding, output_padding,
groups and dilation, and embedding with padding_idx.
"""
import json
import os

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))


def flat(t):
    return [float("%.9g" % v) for v in t.detach().reshape(-1).tolist()]


def tensor(t):
    return {"shape": list(t.shape), "values": flat(t)}


CONV = [
    # name, op, x shape, w shape, bias, options
    ("conv2d groups 2", "conv2d", (2, 4, 5, 5), (6, 2, 3, 3), True, {"padding": 1, "groups": 2}),
    ("conv2d depthwise x2, stride 2, no bias", "conv2d", (1, 4, 6, 6), (8, 1, 3, 3), False,
     {"stride": 2, "padding": 1, "groups": 4}),
    ("conv_transpose2d stride 2, padding 1, output_padding 1", "conv_transpose2d", (2, 3, 4, 4), (3, 2, 3, 3), True,
     {"stride": 2, "padding": 1, "output_padding": 1}),
    ("conv_transpose2d groups 2, dilation 2, no bias", "conv_transpose2d", (1, 4, 3, 5), (4, 3, 2, 3), False,
     {"stride": [1, 2], "padding": [0, 1], "groups": 2, "dilation": 2}),
    ("conv_transpose2d output_padding below dilation", "conv_transpose2d", (1, 2, 4, 4), (2, 2, 3, 3), True,
     {"dilation": 2, "output_padding": 1}),
    ("conv_transpose2d 1x1 stride 2", "conv_transpose2d", (1, 4, 3, 3), (4, 5, 1, 1), True,
     {"stride": 2, "output_padding": 1}),
    ("conv_transpose2d depthwise", "conv_transpose2d", (2, 3, 5, 4), (3, 1, 3, 3), True,
     {"padding": 1, "groups": 3}),
]


def conv_case(i, name, op, xs, ws, bias, o):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(xs, generator=g, requires_grad=True)
    w = torch.randn(ws, generator=g, requires_grad=True)
    b = torch.randn(ws[1] * o.get("groups", 1) if op == "conv_transpose2d" else ws[0], generator=g,
                    requires_grad=True) if bias else None
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in o.items()}
    y = getattr(F, op)(x, w, b, **kw)
    gy = torch.randn(y.shape, generator=g)
    (y * gy).sum().backward()
    c = {"name": name, "op": op, "options": o, "x": tensor(x), "w": tensor(w), "y": tensor(y), "gy": tensor(gy),
         "gx": tensor(x.grad), "gw": tensor(w.grad)}
    if bias:
        c["b"], c["gb"] = tensor(b), tensor(b.grad)
    return c


def embedding_case():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(5, 3, generator=g, requires_grad=True)
    idx = torch.tensor([[1, 4, 2], [4, 0, 1]])
    y = F.embedding(idx, w, padding_idx=-1)
    gy = torch.randn(y.shape, generator=g)
    (y * gy).sum().backward()
    return {"name": "embedding padding_idx -1", "w": tensor(w), "idx": idx.reshape(-1).tolist(),
            "idx_shape": list(idx.shape), "padding_idx": -1, "y": tensor(y), "gy": tensor(gy), "gw": tensor(w.grad)}


def main():
    out = {"conv": [conv_case(i, *c) for i, c in enumerate(CONV)], "embedding": embedding_case()}
    with open(os.path.join(HERE, "conv_layers.json"), "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
