"""PyTorch's side of the single-GPU benchmark (issue 15 item 8; tools/gpu_check.sh runs it): a
GPT-2 124M-shaped model (12 layers, d 768, 12 heads, T 1024, vocab 50304) trained in bf16
(autocast), fused AdamW, SDPA (flash) attention, eager. Prints one JSON line per measurement:
tokens/s, MFU against the GPU's bf16 peak and against a large bf16 GEMM measured in the same run,
and the peak memory. --fsdp2 also runs it under FSDP2 (fully_shard per block and at the root) as
one process: what PyTorch FSDP costs on top of eager.

MFU counts (6 N + 6 L d T) FLOPs per token, N the parameters without the position embedding
(issue 15's formula; PaLM's counts 12 L d T for attention, so this reads lower).
  python3 bench/torch_gpt2.py [--config gpt2|1b] [--batch 8] [--steps 10] [--fsdp2 [--offload] [--no-eager]]
                              [--peak-tflops 989]
"""
import argparse, json, math, os, time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(s, d, h):
        super().__init__()
        s.h = h
        s.ln1, s.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        s.qkv, s.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        s.fc, s.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(s, x):
        B, T, D = x.shape
        q, k, v = s.qkv(s.ln1(x)).split(D, dim=2)
        q, k, v = (t.view(B, T, s.h, D // s.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + s.proj(y.transpose(1, 2).reshape(B, T, D))
        return x + s.out(F.gelu(s.fc(s.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(s, L=12, d=768, h=12, T=1024, V=50304):
        super().__init__()
        s.tok, s.pos = nn.Embedding(V, d), nn.Embedding(T, d)
        s.blocks = nn.ModuleList(Block(d, h) for _ in range(L))
        s.ln = nn.LayerNorm(d)
        s.head = nn.Linear(d, V, bias=False)
        s.head.weight = s.tok.weight  # tied, as GPT-2
        for m in s.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(s, idx, tgt):
        x = s.tok(idx) + s.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in s.blocks:
            x = b(x)
        return F.cross_entropy(s.head(s.ln(x)).float().view(-1, s.head.out_features), tgt.view(-1))


def gemm_tflops(n=8192, reps=20):
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


CONFIGS = {"gpt2": dict(L=12, d=768, h=12, name="gpt2-124M"), "1b": dict(L=24, d=2048, h=16, name="gpt-1.3B")}


def run(args, fsdp2, gemm):
    torch.manual_seed(0)
    c = CONFIGS[args.config]
    L, d, T, V = c["L"], c["d"], 1024, 50304
    model = GPT(L, d, c["h"], T, V).cuda()
    if fsdp2:
        from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy, OffloadPolicy
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        off = CPUOffloadPolicy() if args.offload else OffloadPolicy()
        for b in model.blocks:
            fully_shard(b, mp_policy=mp, offload_policy=off)
        fully_shard(model, mp_policy=mp, offload_policy=off)
    # (offloaded parameters live on the CPU: the fused CUDA kernel does not apply there)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=not (fsdp2 and args.offload))
    n_params = sum(p.numel() for p in model.parameters()) - T * d
    idx = torch.randint(0, V, (args.batch, T), device="cuda")
    tgt = torch.randint(0, V, (args.batch, T), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        if fsdp2:
            loss = model(idx, tgt)
        else:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(idx, tgt)
        loss.backward()
        opt.step()
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    tok_s = args.batch * T / dt
    flops_tok = 6 * n_params + 6 * L * d * T
    achieved = tok_s * flops_tok / 1e12
    return {
        "model": c["name"], "mode": ("fsdp2 (1 GPU)" + (" +offload" if args.offload else "")) if fsdp2 else "eager",
        "batch": args.batch, "T": T,
        "ms_per_step": round(dt * 1e3, 2), "tokens_per_s": round(tok_s), "model_tflops": round(achieved, 1),
        "mfu_vs_peak": round(achieved / args.peak_tflops, 3), "mfu_vs_gemm": round(achieved / gemm, 3),
        "gemm_tflops_bf16_8192": round(gemm, 1), "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "loss": round(loss.item(), 3), "params": n_params, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--fsdp2", action="store_true")
    ap.add_argument("--config", choices=sorted(CONFIGS), default="gpt2")
    ap.add_argument("--offload", action="store_true", help="FSDP2 with CPUOffloadPolicy (the eager run stays on the GPU)")
    ap.add_argument("--no-eager", action="store_true", help="only the FSDP2 run")
    ap.add_argument("--peak-tflops", type=float, default=989.0)  # H100/H200 SXM dense bf16
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    gemm = gemm_tflops()
    if not args.no_eager:
        print(json.dumps(run(args, False, gemm)), flush=True)
    if args.fsdp2:
        import torch.distributed as dist
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        dist.init_process_group("nccl", rank=0, world_size=1)
        try:
            print(json.dumps(run(args, True, gemm)), flush=True)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
