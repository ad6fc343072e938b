#!/usr/bin/python3
"""PyTorch DDP peer of bench/fsdp_speed.lua: the same models trained on N ranks over gloo.

    /usr/bin/python3 bench/ddp_torch.py [--world 2] [--models conv,transformer] [--warmup 3] [--iters 10]
                                        [--timeout 120] [--fifo DIR]

Spawns `--world` processes (torch.multiprocessing, MASTER_ADDR=127.0.0.1, a free port), each with
torch.set_num_threads(1), wraps the model in DistributedDataParallel (gloo) and times one training
step (zero_grad + forward + loss + backward + optimizer step) on a fixed random batch per rank.
Each step starts after a barrier; the step time is the slowest rank's. Prints one JSON object
per model on stdout:
    {"model": "conv", "ms": 12.3, "times": [...], "world": 2, "batch": 32, "loss": 2.30, "torch": "1.13.0"}

Models (bench/torch_models.py, identical to bench/models.lua and bench/fsdp_models.lua):
  conv         Conv(1,32,3,pad 1)-ReLU-Conv(32,64,3,pad 1)-ReLU-AdaptiveAvgPool(1)-Flatten-Linear(64,10),
               28x28, batch 32 per rank, Adam lr 1e-3
  transformer  d 256, 4 heads, 2 blocks, seq 128, vocab 1000, batch 8 per rank, AdamW lr 3e-4 wd 0.01
"""
import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_models  # noqa: E402  (F2's single-process models)

BATCH = {"conv": 32, "transformer": 8}


def build(name, rank):
    torch.manual_seed(0)
    if name == "conv":
        model = torch_models.convnet()
        opt_fn = lambda ps: torch.optim.Adam(ps, lr=1e-3)
        torch.manual_seed(1 + rank)
        B = BATCH[name]
        x, y = torch.randn(B, 1, 28, 28), torch.randint(0, 10, (B,))
        loss_fn = lambda m: F.cross_entropy(m(x), y)
    elif name == "transformer":
        vocab, T = 1000, 128
        model = torch_models.Transformer(vocab=vocab, d=256, heads=4, layers=2, seq=T)
        opt_fn = lambda ps: torch.optim.AdamW(ps, lr=3e-4, weight_decay=0.01)
        torch.manual_seed(1 + rank)
        B = BATCH[name]
        x, y = torch.randint(0, vocab, (B, T)), torch.randint(0, vocab, (B, T))
        loss_fn = lambda m: F.cross_entropy(m(x).view(B * T, vocab), y.view(B * T))
    else:
        raise SystemExit(f"ddp_torch.py: unknown model {name!r} (conv, transformer)")
    return model, opt_fn, loss_fn


def worker(rank, world, port, a, queue):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    # a lost peer is an error after a while, not a hang (gloo's default is 30 minutes)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=a.timeout))
    # paired mode (--fifo DIR, driven by bench/fsdp_speed.lua): every step waits for the driver's token
    # on DIR/go.<rank> and answers on DIR/done.<rank>, so ours and DDP alternate step by step
    go = done = None
    if a.fifo:
        go = os.open(os.path.join(a.fifo, f"go.{rank}"), os.O_RDONLY)
        done = os.open(os.path.join(a.fifo, f"done.{rank}"), os.O_WRONLY)

    def token_wait():
        if go is not None and os.read(go, 1) != b"g":
            raise SystemExit("ddp_torch.py: the driver went away")

    def token_done():
        if done is not None:
            os.write(done, b"d")

    keep = []  # DDP objects live until os._exit (see below)
    for name in a.models.split(","):
        model, opt_fn, loss_fn = build(name, rank)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        keep.append(ddp)
        opt = opt_fn(ddp.parameters())

        def step():
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp)
            loss.backward()
            opt.step()
            return loss

        times = []
        t = torch.zeros(1)
        for it in range(a.warmup + a.iters):
            token_wait()
            dist.barrier()
            t0 = time.perf_counter()
            loss = step()
            t[0] = (time.perf_counter() - t0) * 1e3
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's step
            token_done()
            if it >= a.warmup:
                times.append(float(t[0]))
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        if rank == 0:
            queue.put({"model": name, "ms": statistics.median(times), "times": times, "world": world,
                       "batch": BATCH[name], "loss": float(lt) / world, "threads": torch.get_num_threads(),
                       "torch": torch.__version__})
    # torch 1.13 can deadlock tearing down DDP's reducer and the gloo group (a gloo thread waits for
    # the GIL the destructor holds): the results are queued, so leave without the teardown
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--models", default="conv,transformer")
    ap.add_argument("--timeout", type=int, default=120, help="seconds a rank waits for its peers")
    ap.add_argument("--fifo", default="", help="directory of go.<rank>/done.<rank> FIFOs (paired mode)")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(worker, args=(a.world, free_port(), a, queue), nprocs=a.world, join=True)
    while not queue.empty():
        print(json.dumps(queue.get()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
