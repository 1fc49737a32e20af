"""CPU optimizer throughput against host memory bandwidth (issue 4's measurement).

    python -m slideformer.bench.optimizer --params 2e9 --threads 8,12,15,16
    python -m slideformer.bench.optimizer --params 4e9 --threads 15,16 --only native,torch_fused,dma

STREAM-like copy (8 B/element) and triad (12 B/element) through torch on fp32 arrays give the host's
bandwidth; then one-pass AdamW (bf16 gradient in, bf16 copy out: 28 B/param) at several thread counts,
the same update out of place (into a spare state), the update on compact state (bf16 gradient, hi/lo
master and moments, stochastic rounding: 18 B/param) at the same thread counts, and torch's fused AdamW
on fp32 tensors (28 B/param, no casts) for comparison; with a GPU, the update again while pinned memory
is copied to and from it nonstop (``dma``: the share of bandwidth the engine's copies take). One JSON
line. Every candidate's buffers together take 40 B/param (160 GB at issue 4's 4B parameters); ``--only``
keeps the groups named and allocates only their buffers (native and torch fused at 4B: 80 GB).
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..optim import native

# Compile-time variants of csrc/adamw.cpp, measured side by side; those named compact_* change only the
# compact update, and are measured on it.
VARIANTS = {
    "portable": ("-DSF_NO_INTRIN",),  # what a CPU without AVX-512 runs
    "no_prefetch": ("-DSF_PREFETCH=0",),
    "stream_in_place": ("-DSF_STREAM_IN_PLACE=1",),  # non-temporal stores in place too
    "compact_scalar": ("-DSF_COMPACT_AVX512=0",),  # the compact update as the compiler vectorises it
}


GROUPS = ("native", "out_of_place", "compact", "8bit", "torch_fused", "dma")


class Copies:
    """Pinned host memory copied to and from the GPU nonstop, both ways at once (the pipeline's weights
    in, gradients out), while an update runs: how much of the host's bandwidth the update keeps when the
    copies it overlaps with in the engine take their share. ``gbs`` is what the copies moved."""

    def __init__(self, nbytes: int = 1 << 30):
        self.src, self.dst = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
        self.dev_in, self.dev_out = (torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2))
        self.streams = (torch.cuda.Stream(), torch.cuda.Stream())
        self.moved, self.seconds = 0, 0.0

    def __enter__(self):
        self.stop = threading.Event()

        def loop():
            t = time.perf_counter()
            while not self.stop.is_set():
                with torch.cuda.stream(self.streams[0]):
                    self.dev_in.copy_(self.src, non_blocking=True)
                with torch.cuda.stream(self.streams[1]):
                    self.dst.copy_(self.dev_out, non_blocking=True)
                for st in self.streams:
                    st.synchronize()
                self.moved += 2 * self.src.numel()
            self.seconds += time.perf_counter() - t

        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    @property
    def gbs(self) -> float:
        return self.moved / self.seconds / 1e9 if self.seconds else 0.0


def interleaved(cands: dict, rounds: int) -> dict[str, float]:
    """Best time of each candidate over ``rounds`` round-robin passes (after one warm-up pass): the host's
    speed drifts within one process, so measuring candidates one after another would rank them by when
    they ran."""
    for fn in cands.values():
        fn()
    times = {k: float("inf") for k in cands}
    for _ in range(rounds):
        for k, fn in cands.items():
            t = time.perf_counter()
            fn()
            times[k] = min(times[k], time.perf_counter() - t)
    return times


def main(argv=None) -> dict:
    """The benchmark, run at its own thread counts; torch's thread count is given back after (a caller in the
    same process, a test suite among them, computes with the count it had)."""
    threads = torch.get_num_threads()
    try:
        return _main(argv)
    finally:
        torch.set_num_threads(threads)


def _main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=2e9)
    ap.add_argument("--threads", default="8,12,15,16")
    ap.add_argument("--variants", default="", help="comma-separated builds of the kernel to compare, from VARIANTS")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--only", default=",".join(GROUPS), help="comma-separated candidate groups, from " + ",".join(GROUPS))
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    if not only <= set(GROUPS):
        ap.error(f"--only takes groups from {','.join(GROUPS)}")
    n = int(args.params)
    threads = [int(t) for t in args.threads.split(",")]
    top = max(threads)
    rec: dict = {"params": n, "cores": torch.get_num_threads(), "rounds": args.rounds, "only": sorted(only)}
    torch.set_num_threads(top)
    a, b, c = torch.ones(n), torch.ones(n), torch.ones(n)
    bw = interleaved({"copy": lambda: a.copy_(b), "triad": lambda: torch.add(b, c, alpha=0.5, out=a)}, args.rounds)
    rec["stream_copy_gbs"] = 8 * n / bw["copy"] / 1e9
    rec["stream_triad_gbs"] = 12 * n / bw["triad"] / 1e9
    p, m, v = a, b.zero_(), c.zero_()
    g = torch.randn(n // 8).bfloat16().repeat(8)
    step = [0]
    cands, copies = {}, None
    names = [x for x in args.variants.split(",") if x]
    if only & {"native", "out_of_place", "compact", "8bit", "dma"}:
        out = torch.empty(n, dtype=torch.bfloat16)

        def adamw(mod, t, pieces=((p, g, m, v, out),)):
            step[0] += 1
            for pp, gg, mm, vv, oo in pieces:
                mod.adamw_step(pp, gg, mm, vv, oo, step[0], 1e-5, 0.9, 0.999, 1e-8, 0.0, 1.0, t)

        with ThreadPoolExecutor(len(names) + 1) as ex:  # each build is one compiler process
            built = dict(zip(["native"] + names, ex.map(lambda x: native.build(*(("", ()) if x == "native" else
                                                                                   ("_" + x, VARIANTS[x]))),
                                                           ["native"] + names)))
        mod = built["native"]
    if "native" in only:
        # the engine's pattern: 16M-element pieces (Tuning.grad_chunk_elems), one parallel pass each
        pieces = list(zip(*(x.split(16 << 20) for x in (p, g, m, v, out))))
        cands.update({f"native_t{t}": (lambda t=t: adamw(mod, t)) for t in threads})
        cands[f"chunked_t{top - 1}"] = lambda: adamw(mod, top - 1, pieces)
        cands.update({f"{k}_t{top}": (lambda k=k: adamw(built[k], top)) for k in names if not k.startswith("compact_")})
    if "dma" in only and torch.cuda.is_available():
        # at the engine's thread count (one core left), beside the same update alone
        copies, engine_t = Copies(), max(1, top - 1)

        def under_copies():
            with copies:
                adamw(mod, engine_t)

        cands[f"native_t{engine_t}"] = lambda: adamw(mod, engine_t)
        cands[f"native_dma_t{engine_t}"] = under_copies
    elif "dma" in only:
        rec["dma"] = "no CUDA device: not measured"
    if "out_of_place" in only:
        # out of place (the engine's speculative updates: state read from one copy, written to a spare, with
        # non-temporal stores), against in place above
        p2, m2, v2 = (torch.empty(n) for _ in range(3))
        cands[f"out_of_place_t{top}"] = lambda: mod.adamw_step(p2, g, m2, v2, out, step[0] + 1, 1e-5, 0.9, 0.999,
                                                               1e-8, 0.0, 1.0, top, src=[p, m, v])
    if "compact" in only:
        hi, lo, cm, cv = (torch.zeros(n, dtype=torch.bfloat16) for _ in range(4))

        def compact(m, t):
            m.adamw_step_compact(hi, lo, g, cm, cv, step[0] + 1, 1e-5, 0.9, 0.999, 1e-8, 0.0, 1.0, 0, 0, t)

        # (at every thread count: does it scale with cores, i.e. is it bound by its arithmetic, or not?)
        cands.update({f"compact_t{t}": (lambda t=t: compact(mod, t)) for t in threads})
        cands.update({f"{k}_t{top}": (lambda k=k: compact(built[k], top)) for k in names if k.startswith("compact_")})
    if "8bit" in only:
        from ..optim.formats import code_tables, moment_numel, qmap

        hi8, lo8 = (torch.zeros(n - n % 128, dtype=torch.bfloat16) for _ in range(2))
        m8, v8 = (torch.zeros(moment_numel("8bit", hi8.numel()), dtype=torch.uint8) for _ in range(2))
        tables = (qmap(True), qmap(False), *code_tables(True), *code_tables(False))

        def eight(t):
            mod.adamw_step_8bit(hi8, lo8, g[: hi8.numel()], m8, v8, *tables, step[0] + 1, 1e-5, 0.9, 0.999, 1e-8, 0.0,
                                1.0, t)

        cands.update({f"8bit_t{t}": (lambda t=t: eight(t)) for t in threads})
    if "torch_fused" in only:
        gf, st = g.float(), torch.tensor(1.0)
        cands[f"torch_fused_t{top}"] = lambda: torch._fused_adamw_(
            [p], [gf], [m], [v], [], [st], lr=1e-5, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8,
            amsgrad=False, maximize=False)
    for k, dt in interleaved(cands, args.rounds).items():
        rec[f"{k}_gparams"] = n / dt / 1e9
        if k.startswith(("native", "compact", "8bit", "out_of_place")):  # (native_dma too)
            rec[f"{k}_gbs"] = (18 if k.startswith("compact") else 14.125 if k.startswith("8bit") else 28) * n / dt / 1e9
    if {"native", "torch_fused"} <= only:
        rec["native_vs_torch_fused"] = rec[f"native_t{top}_gparams"] / rec[f"torch_fused_t{top}_gparams"]
    if copies is not None:
        rec["dma_copies_gbs"] = copies.gbs  # both directions together, while updates ran
        rec["dma_vs_alone"] = rec[f"native_dma_t{engine_t}_gparams"] / rec[f"native_t{engine_t}_gparams"]
    if {"native", "out_of_place"} <= only:
        rec["out_of_place_vs_in_place"] = rec[f"out_of_place_t{top}_gparams"] / rec[f"native_t{top}_gparams"]
    print(json.dumps(rec), flush=True)
    return rec

if __name__ == "__main__":
    main()
