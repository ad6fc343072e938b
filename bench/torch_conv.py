"""PyTorch's side of bench/conv_shapes.lua: per convolution shape, the median ms of its forward,
input gradient and weight gradient (with bias), timed like ours: a backward alone, its forward
untimed. Reads the shapes as JSON lines
on stdin ({"name", "x": [N, C, H, W], "w": [O, C, kh, kw], "stride", "padding"}), writes one JSON
line per shape, then a last line with torch's version.
    python3 bench/torch_conv.py --threads 2 --runs 7 < shapes.jsonl
"""
import argparse, json, sys, time
import torch
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--runs", type=int, default=7)
a = ap.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)


def median_ms(timed, runs, prepare=lambda: None):
    """the median ms of timed(prepare()) over the runs, after one untimed call (oneDNN's JIT)"""
    timed(prepare())
    ts = []
    for _ in range(runs):
        arg = prepare()
        t = time.perf_counter()
        timed(arg)
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2] * 1e3


for line in sys.stdin:
    s = json.loads(line)
    x, w, b = torch.randn(*s["x"]), torch.randn(*s["w"]) * 0.1, torch.randn(s["w"][0])
    o = dict(stride=s["stride"], padding=s["padding"])
    gy = torch.randn(F.conv2d(x, w, b, **o).shape)

    def fwd(_):
        with torch.no_grad():
            F.conv2d(x, w, b, **o)

    def grad_of(leaves):
        """the backward alone (its forward untimed) of the leaves that want a gradient"""
        for p in leaves:
            p.requires_grad_(True)

        def prepare():
            for p in leaves:
                p.grad = None
            return F.conv2d(x, w, b, **o)
        t = median_ms(lambda y: y.backward(gy), a.runs, prepare)
        for p in leaves:
            p.requires_grad_(False)
        return t

    f = median_ms(fwd, a.runs)
    gx = grad_of([x])
    gw = grad_of([w, b])
    print(json.dumps({"name": s["name"], "fwd": f, "gx": gx, "gw": gw}), flush=True)
print(json.dumps({"version": torch.__version__}))
