"""Where a benchmark step's GPU memory peaks, against the planner's memory model.

For each record of a results file measured with ``--timeline``: the visit at which the allocator's peak
(counted from the timed steps' start) last rose, by unit and pass; the measured peak; and, for the same
case on the same machine, the planner's GPU categories (plan/memory.py ``gpu_bytes``) with its peak
before SAFETY. The peak's phase says which term of the model (the loss head's, or one layer's backward)
to check against it.

    .venv/bin/python bench/memory_peaks.py bench/results/FILE.jsonl
"""
from __future__ import annotations

import json
import shlex
import sys

GIB = 2**30


def peak_visit(rows: list[list], layers: int) -> tuple[int, str]:
    """The index of the visit where the peak last rose, and its name: the embedding (unit 0), a layer
    (units 1..layers) or the head, with its pass (a unit's visits alternate forward and backward)."""
    peaks = [r[4] for r in rows]
    at = peaks.index(peaks[-1])
    unit = rows[at][0]
    seen = sum(1 for r in rows[: at + 1] if r[0] == unit)
    if unit > layers:
        return at, "the loss head"
    what = "the embedding" if unit == 0 else f"layer {unit - 1}"
    return at, f"{what}, {'forward' if seen % 2 else 'backward'}"


def planned(rec: dict) -> dict[str, float]:
    """The planner's GPU categories (GiB) for the record's case on its machine."""
    import torch

    from slideformer.bench import harness
    from slideformer.plan.memory import SAFETY

    argv = shlex.split(rec["command"])[2:]  # (after "slideformer bench")
    if "--out" in argv:
        i = argv.index("--out")
        del argv[i: i + 2]
    args = harness.parser().parse_args(argv)
    args.dtype = torch.bfloat16
    m = rec["machine"]
    plan = harness.slideformer_plan(args, harness.preset_config(args.model),
                                    harness.Machine(ram=int(m["ram_gib"] * GIB), gpu=int(m["gpu_gib"] * GIB)))
    out = {k: v / GIB for k, v in plan.gpu.items() if k != "peak"}
    out["peak before SAFETY"] = plan.gpu["peak"] / SAFETY / GIB
    return out


def report(path: str) -> list[str]:
    from slideformer.bench.harness import preset_config

    lines = []
    for line in open(path):
        rec = json.loads(line)
        case = rec["command"].split(" --out")[0].removeprefix("slideformer bench ")
        rows = rec.get("timeline", {}).get("gpu", [])
        if not rows or len(rows[0]) < 5:
            lines.append(f"{case}: no GPU memory timeline (run with --timeline, by a tree whose timeline records the peaks)")
            continue
        at, where = peak_visit(rows, preset_config(rec["model"]).num_hidden_layers)
        model = ", ".join(f"{k} {v:.2f}" for k, v in planned(rec).items())
        lines.append(f"{case} ({rec['commit']}): peak {rows[-1][4] / GIB:.3f} GiB allocated (reserved "
                     f"{rec['gpu_peak_reserved_gib']:.3f}), reached at visit {at} ({where}); planned GiB: {model}")
    return lines


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print("\n".join(report(p)))
