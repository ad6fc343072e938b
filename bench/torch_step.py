#!/usr/bin/python3
"""PyTorch counterpart of bench/step.lua: one model's training step, wall min/median and process
CPU ms per step.   /usr/bin/python3 bench/torch_step.py MODEL [ITERS] [WARMUP] [THREADS] [--profile]"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_models import case  # noqa: E402


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    name = args[0] if args else "mlp"
    iters = int(args[1]) if len(args) > 1 else 20
    warmup = int(args[2]) if len(args) > 2 else 3
    torch.set_num_threads(int(args[3]) if len(args) > 3 else 2)
    model, opt, loss_fn = case(name)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    if "--profile" in sys.argv:
        with torch.autograd.profiler.profile() as prof:
            for _ in range(iters):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        return
    wall, cpu = [], []
    for _ in range(iters):
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append((time.perf_counter() - w0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    wall.sort()
    cpu.sort()
    med = lambda t: t[len(t) // 2] if len(t) % 2 else (t[len(t) // 2 - 1] + t[len(t) // 2]) / 2
    print("%-12s wall min %8.2f med %8.2f   cpu min %8.2f med %8.2f  (ms/step, %d steps, torch)" %
          (name, wall[0], med(wall), cpu[0], med(cpu), iters))


if __name__ == "__main__":
    main()
