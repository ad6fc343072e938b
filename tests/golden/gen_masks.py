#!/usr/bin/python3
"""Golden values for tests/core/tensor_index_spec.lua, from PyTorch (Debian's python3-torch, float32).

Run:   /usr/bin/python3 tests/golden/gen_masks.py

Writes tests/golden/masks.json: for each case, the inputs, the forward output and the gradient of
sum(out * w) for each float input (w given), as 17 significant digits -- where, masked_fill, clamp
at and between its bounds, minimum/maximum with ties, min with ties (values, indices, gradient),
abs (its gradient at 0 is 0), cumsum, tril, triu, comparisons and the sum of a bool tensor. And tests/golden/bool.safetensors:
a bool tensor (safetensors dtype "BOOL", one byte per element as torch.bool stores it), written by
hand as tests/golden/gen.py does (the `safetensors` package is not needed).
"""
import json
import os
import struct

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def t(v, dtype=torch.float32):
    return torch.tensor(v, dtype=dtype)


def leaf(v):
    return torch.tensor(v, dtype=torch.float32, requires_grad=True)


def val(x):
    if x.dtype == torch.bool:
        return x.tolist()
    return x.double().tolist() if x.dim() > 0 else float(x)


def case(name, out, w, inputs, extra=None):
    """out: the op's output; w: weights of the same shape; inputs: list of (name, leaf or None)"""
    (out * w).sum().backward()
    c = {"out": val(out.detach()), "w": val(w), "grads": {}}
    for n, x in inputs:
        c[n] = val(x.detach())
        if x.requires_grad:
            c["grads"][n] = val(x.grad)
    c.update(extra or {})
    CASES[name] = c


CASES = {}

cond = t([[True, False, True], [False, False, True]], torch.bool)
x, y = leaf([[1.5, -2.0, 3.25], [0.5, 4.0, -1.0]]), leaf([7.0, -8.5, 9.0])
w23 = t([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]])
case("where", torch.where(cond, x, y), w23, [("x", x), ("y", y)], {"cond": cond.tolist()})

x = leaf([[1.5, -2.0, 3.25], [0.5, 4.0, -1.0]])
mask = t([True, False, True], torch.bool)
case("masked_fill", x.masked_fill(mask, -1.5), w23, [("x", x)], {"mask": mask.tolist(), "value": -1.5})

x = leaf([-1.0, -0.5, -0.25, 0.0, 0.5, 1.0, 2.0])
w7 = t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
case("clamp", x.clamp(-0.5, 0.5), w7, [("x", x)], {"min": -0.5, "max": 0.5})
x = leaf([-1.0, -0.5, -0.25, 0.0, 0.5, 1.0, 2.0])
case("clamp_min", x.clamp(min=0.0), w7, [("x", x)], {"min": 0.0})

for name, fn in (("maximum", torch.maximum), ("minimum", torch.minimum)):
    a, b = leaf([1.0, 2.0, 3.0, -1.0, 0.5]), leaf([1.0, 0.0, 5.0, -1.0, 0.75])
    case(name, fn(a, b), t([1.0, -2.0, 3.0, 4.0, -5.0]), [("a", a), ("b", b)])

x = leaf([[3.0, 1.0, 1.0], [2.0, 2.0, 5.0]])
v, i = x.min(dim=1)
case("min_dim", v, t([1.0, -2.0]), [("x", x)], {"indices": i.tolist()})
x = leaf([[3.0, 1.0, 1.0], [2.0, 1.0, 5.0]])
case("min_all", x.min(), t(2.0), [("x", x)])

x = leaf([-2.0, -0.5, 0.0, 0.5, 3.0])
case("abs", x.abs(), t([1.0, 2.0, 3.0, 4.0, 5.0]), [("x", x)])

x = leaf([[1.0, -2.0, 3.5], [0.25, 4.0, -1.5]])
case("cumsum", x.cumsum(1), w23, [("x", x)], {"dim": 2})

m = leaf([[float(4 * r + c + 1) for c in range(4)] for r in range(3)])
w34 = t([[float((r * 4 + c) % 5 - 2) for c in range(4)] for r in range(3)])
case("tril", m.tril(-1), w34, [("x", m)], {"k": -1})
m = leaf([[float(4 * r + c + 1) for c in range(4)] for r in range(3)])
case("triu", m.triu(1), w34, [("x", m)], {"k": 1})

a, b = t([[1.0, 2.0, 3.0], [3.0, 2.0, float("nan")]]), t([3.0, 2.0, 1.0])
COMPARE = {"a": [[1.0, 2.0, 3.0], [3.0, 2.0, "nan"]], "b": val(b)}
for op in ("lt", "le", "gt", "ge", "eq", "ne"):
    COMPARE[op] = getattr(a, op)(b).tolist()
COMPARE["gt_sum"] = int(a.gt(b).sum())
COMPARE["gt_sum_dtype"] = str(a.gt(b).sum().dtype)
COMPARE["to_bool"] = t([0.0, -0.0, 1.5, float("nan"), -2.0]).bool().tolist()
CASES["compare"] = COMPARE

with open(os.path.join(HERE, "masks.json"), "w") as f:
    json.dump(CASES, f, indent=1, sort_keys=True)
    f.write("\n")

# ---- a bool tensor as safetensors --------------------------------------------------------------
mask = t([[True, False, True], [False, False, True]], torch.bool)
raw = mask.numpy().tobytes()
assert len(raw) == 6 and set(raw) <= {0, 1}
header = {"mask": {"dtype": "BOOL", "shape": [2, 3], "data_offsets": [0, len(raw)]}}
h = json.dumps(header, separators=(",", ":")).encode("utf-8")
h += b" " * (-len(h) % 8)
with open(os.path.join(HERE, "bool.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(h)))
    f.write(h)
    f.write(raw)
print("wrote masks.json and bool.safetensors")
