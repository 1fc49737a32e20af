"""Fused linear cross-entropy against the unfused ``F.cross_entropy(x @ W.T)``, on the GPU (issue 6),
and against Liger-Kernel's fused loss where liger_kernel is importable.

    python -m slideformer.bench.loss            # the issue's cases; one JSON line each
    python -m slideformer.bench.loss --chunks 4096,16384   # also the fused loss at these chunk sizes

Each case times forward + backward (CUDA events, median of several runs after warm-up) and records
the peak memory allocated above the inputs, gradients included. (Older loss files measured it above
the inputs plus the previous run's gradients: Liger's peak there comes out near zero, since it computes
its gradients in the forward, in place of the ones it frees.)
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch

from ..kernels import fused_linear_cross_entropy, reference_linear_cross_entropy

CASES = [(v, h, t) for v in (151936, 128256) for h in (2560, 4096) for t in (16384, 65536)]


def measure(fn, reset, reps: int = 5) -> tuple[float, int]:
    """(median seconds of ``fn``, its peak bytes above what is allocated after ``reset``)."""
    fn()
    reset()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def liger_loss():
    """Liger-Kernel's fused linear cross-entropy with our argument order, or None where not installed."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda x, w, lab: loss(w, x, lab)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="", help="comma-separated token chunk sizes to time besides the default")
    args = ap.parse_args(argv)
    systems = [("unfused", reference_linear_cross_entropy), ("fused", fused_linear_cross_entropy)]
    systems += [(f"fused_c{c}", functools.partial(fused_linear_cross_entropy, chunk_tokens=int(c)))
                for c in filter(None, args.chunks.split(","))]
    if (liger := liger_loss()) is not None:
        systems.append(("liger", liger))
    for V, H, T in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(T, H, device="cuda", generator=g) / 2).bfloat16().requires_grad_()
        w = (torch.randn(V, H, device="cuda", generator=g) / 16).bfloat16().requires_grad_()
        lab = torch.randint(0, V, (T,), device="cuda", generator=g)
        rec = {"vocab": V, "hidden": H, "tokens": T}
        for name, f in systems:
            def reset(x=x, w=w):
                x.grad = w.grad = None

            def step(f=f, x=x, w=w, lab=lab):
                reset()
                f(x, w, lab).backward()
            try:
                t, mem = measure(step, reset)
                rec[f"{name}_s"], rec[f"{name}_peak_gib"] = t, mem / 2**30
            except torch.OutOfMemoryError:
                rec[f"{name}_s"] = rec[f"{name}_peak_gib"] = None
                torch.cuda.empty_cache()
        if rec.get("unfused_s") and rec.get("fused_s"):
            rec["time_ratio"] = rec["fused_s"] / rec["unfused_s"]
            rec["memory_ratio"] = rec["fused_peak_gib"] / rec["unfused_peak_gib"]
        if rec.get("liger_s") and rec.get("fused_s"):
            rec["time_vs_liger"] = rec["fused_s"] / rec["liger_s"]
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
