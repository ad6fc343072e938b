#!/usr/bin/python3
"""Golden learning rates for tests/nn/optim_sched_spec.lua, from torch.optim.lr_scheduler.

Run with Debian's PyTorch (python3-torch):   /usr/bin/python3 tests/golden/gen_lr_schedulers.py

Writes tests/golden/lr_schedulers.json: for each case, the learning rate of every parameter group
(and the momentum or beta1 where OneCycleLR cycles it) after construction and after each step,
as 17 significant digits. The optimizer: two parameter groups (lr 0.1 and 0.05), SGD with
momentum 0.9 unless a case says Adam. The case definitions are mirrored in the spec.
"""
import json
import math
import os

import torch
from torch.optim import lr_scheduler as S

HERE = os.path.dirname(os.path.abspath(__file__))


def optimizer(kind):
    p1, p2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    groups = [{"params": [p1], "lr": 0.1}, {"params": [p2], "lr": 0.05}]
    if kind == "adam":
        return torch.optim.Adam(groups, lr=0.1, betas=(0.9, 0.999))
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


PLATEAU_METRICS = [1.0, 0.9, 0.95, 0.94, 0.93, 0.92, 0.5, 0.6, 0.6, 0.6, 0.6, 0.49, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7]

CASES = {
    "LambdaLR": (20, "sgd", lambda o: S.LambdaLR(o, lambda e: 0.95 ** e)),
    "StepLR": (12, "sgd", lambda o: S.StepLR(o, 3, gamma=0.5)),
    "MultiStepLR": (12, "sgd", lambda o: S.MultiStepLR(o, [2, 5, 5, 8], gamma=0.3)),
    "ExponentialLR": (10, "sgd", lambda o: S.ExponentialLR(o, 0.9)),
    "CosineAnnealingLR": (25, "sgd", lambda o: S.CosineAnnealingLR(o, 7, eta_min=0.001)),
    "LinearLR": (8, "sgd", lambda o: S.LinearLR(o, start_factor=0.25, end_factor=1.0, total_iters=4)),
    "OneCycleLR": (20, "sgd", lambda o: S.OneCycleLR(o, max_lr=[0.5, 0.2], total_steps=21)),
    "OneCycleLR_three_phase_linear_adam": (30, "adam", lambda o: S.OneCycleLR(
        o, max_lr=0.4, epochs=5, steps_per_epoch=7, pct_start=0.25, anneal_strategy="linear",
        three_phase=True, div_factor=10.0, final_div_factor=100.0)),
    "SequentialLR": (15, "sgd", lambda o: S.SequentialLR(
        o, [S.LinearLR(o, start_factor=0.1, total_iters=3), S.CosineAnnealingLR(o, T_max=10)], milestones=[3])),
    "ReduceLROnPlateau": (len(PLATEAU_METRICS), "sgd", lambda o: S.ReduceLROnPlateau(
        o, mode="min", factor=0.5, patience=2, threshold=0.01, cooldown=1)),
}


def momenta(o):
    return [g["betas"][0] if "betas" in g else g["momentum"] for g in o.param_groups]


out = {"torch": torch.__version__, "cases": {}}
for name, (steps, kind, make) in CASES.items():
    o = optimizer(kind)
    s = make(o)
    lrs, moms = [[g["lr"] for g in o.param_groups]], [momenta(o)]
    for k in range(steps):
        o.step()
        if name == "ReduceLROnPlateau":
            s.step(PLATEAU_METRICS[k])
        else:
            s.step()
        lrs.append([g["lr"] for g in o.param_groups])
        moms.append(momenta(o))
    out["cases"][name] = {"lrs": [[float("%.17g" % v) for v in row] for row in lrs],
                          "momenta": [[float("%.17g" % v) for v in row] for row in moms]}

with open(os.path.join(HERE, "lr_schedulers.json"), "w") as f:
    json.dump(out, f, indent=0, sort_keys=True)
    f.write("\n")
print("wrote tests/golden/lr_schedulers.json (torch %s, %d cases)" % (torch.__version__, len(CASES)))
