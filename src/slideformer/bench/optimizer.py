"""CPU optimizer throughput against host memory bandwidth (issue 4's measurement).

    python -m slideformer.bench.optimizer --params 2e9 --threads 8,12,15,16

STREAM-like copy (8 B/element) and triad (12 B/element) through torch on fp32 arrays give the host's
bandwidth; then one-pass AdamW (bf16 gradient in, bf16 copy out: 28 B/param) at several thread counts,
and torch's fused AdamW on fp32 tensors (28 B/param, no casts) for comparison. One JSON line.
"""
from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..optim import native

# Compile-time variants of csrc/adamw.cpp, measured side by side (bench/NOTES.md, session 3).
VARIANTS = {
    "portable": ("-DSF_NO_INTRIN",),  # what a CPU without AVX-512 runs
    "no_prefetch": ("-DSF_PREFETCH=0",),
}


def best(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=2e9)
    ap.add_argument("--threads", default="8,12,15,16")
    ap.add_argument("--variants", default="", help="comma-separated builds of the kernel to compare, from VARIANTS")
    args = ap.parse_args(argv)
    n = int(args.params)
    threads = [int(t) for t in args.threads.split(",")]
    rec: dict = {"params": n, "cores": torch.get_num_threads()}
    torch.set_num_threads(max(threads))
    a, b, c = torch.ones(n), torch.ones(n), torch.ones(n)
    rec["stream_copy_gbs"] = 8 * n / best(lambda: a.copy_(b)) / 1e9
    rec["stream_triad_gbs"] = 12 * n / best(lambda: torch.add(b, c, alpha=0.5, out=a)) / 1e9
    p, m, v = a, b.zero_(), c.zero_()
    g = torch.randn(n // 8).bfloat16().repeat(8)
    out = torch.empty(n, dtype=torch.bfloat16)
    mod = native.load(strict=True)
    step = [0]

    def native_step(t, mod=mod):
        step[0] += 1
        mod.adamw_step(p, g, m, v, out, step[0], 1e-5, 0.9, 0.999, 1e-8, 0.0, 1.0, t)

    for t in threads:
        dt = best(lambda t=t: native_step(t))
        rec[f"native_t{t}_gparams"] = n / dt / 1e9
        rec[f"native_t{t}_gbs"] = 28 * n / dt / 1e9
    # as the engine calls it: one call per 16M-element chunk of gradient (EngineConfig.grad_chunk_elems)
    chunk = 16 << 20
    pieces = list(zip(*(x.split(chunk) for x in (p, g, m, v, out))))

    def chunked_step(t):
        step[0] += 1
        for pp, gg, mm, vv, oo in pieces:
            mod.adamw_step(pp, gg, mm, vv, oo, step[0], 1e-5, 0.9, 0.999, 1e-8, 0.0, 1.0, t)

    t = max(threads) - 1
    rec[f"chunked_t{t}_gparams"] = n / best(lambda: chunked_step(t)) / 1e9
    names = [v for v in args.variants.split(",") if v]
    with ThreadPoolExecutor(len(names) or 1) as ex:  # each build is one compiler process
        built = dict(zip(names, ex.map(lambda v: native.build("_" + v, VARIANTS[v]), names)))
    for name, variant in built.items():
        t = max(threads)
        dt = best(lambda: native_step(t, variant))
        rec[f"{name}_t{t}_gparams"] = n / dt / 1e9
    gf = g.float()
    st = torch.tensor(1.0)
    for t in (max(threads),):
        torch.set_num_threads(t)
        dt = best(lambda: torch._fused_adamw_([p], [gf], [m], [v], [], [st], lr=1e-5, beta1=0.9, beta2=0.999,
                                               weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False))
        rec[f"torch_fused_t{t}_gparams"] = n / dt / 1e9
    print(json.dumps(rec), flush=True)
    return rec


if __name__ == "__main__":
    main()
