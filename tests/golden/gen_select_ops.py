#!/usr/bin/python3
"""Golden values for tests/ops/select_ops_spec.lua: torch.sort (stable), torch.topk, torch.gather and
torch.Tensor.scatter_add on inputs with many ties (values in steps of 0.5); topk also on distinct values.

Run with Debian's PyTorch (python3-torch):   /usr/bin/python3 tests/golden/gen_select_ops.py

Writes tests/golden/select_ops.json: a list of cases, each with the op, its arguments (dims
1-based as the Lua API takes them; index values 0-based), the flat inputs with their shapes and
the flat outputs (values as 17 significant digits, indices as integers).
"""
import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def flat(t):
    return [float(v) if t.is_floating_point() else int(v) for v in t.reshape(-1).tolist()]


def arr(t):
    return {"shape": list(t.shape), "data": flat(t)}


def main():
    g = torch.Generator().manual_seed(19)
    x = torch.round(torch.randn(5, 6, generator=g) * 2) / 2  # steps of 0.5: ties
    x3 = torch.round(torch.randn(2, 3, 4, generator=g) * 2) / 2
    cases = []
    for t in (x, x3):
        for d in range(t.dim()):
            for desc in (False, True):
                v, i = torch.sort(t, dim=d, descending=desc, stable=True)
                cases.append({"op": "sort", "x": arr(t), "dim": d + 1, "descending": desc,
                              "values": flat(v), "indices": flat(i)})
    # topk: the order of tied values is unspecified in PyTorch (its partial sort's); the spec compares
    # indices exactly on distinct values (xd), and on ties checks that they pick the values
    xd = torch.randperm(30, generator=g).reshape(5, 6).float() / 4
    for t, ties in ((x, True), (xd, False)):
        for d, k, largest in ((1, 3, True), (1, 2, False), (0, 4, True), (0, 1, False)):
            v, i = torch.topk(t, k, dim=d, largest=largest, sorted=True)
            cases.append({"op": "topk", "x": arr(t), "k": k, "dim": d + 1, "largest": largest, "ties": ties,
                          "values": flat(v), "indices": flat(i)})
    for d in range(3):
        shape = [2, 3, 4]
        shape[d] = 5
        idx = torch.randint(0, x3.shape[d], shape, generator=g)
        idx_small = idx.narrow((d + 1) % 3, 0, 2)  # smaller than the input in another dim too
        for ix in (idx, idx_small):
            cases.append({"op": "gather", "x": arr(x3), "dim": d + 1, "index": arr(ix),
                          "values": flat(torch.gather(x3, d, ix))})
            src = torch.round(torch.randn(ix.shape, generator=g) * 4) / 4
            cases.append({"op": "scatter_add", "x": arr(x3), "dim": d + 1, "index": arr(ix), "src": arr(src),
                          "values": flat(x3.scatter_add(d, ix, src))})
    with open(os.path.join(HERE, "select_ops.json"), "w") as f:
        json.dump(cases, f, indent=None, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
