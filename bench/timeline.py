"""What a benchmark's ``--timeline`` steps show: where the GPU memory peaks, and where the GPU waits.

For each record of a results file measured with ``--timeline``:
- memory: the visit at which the allocator's peak (counted from the timed steps' start) last rose, by
  unit and pass; the measured peak; and, for the same case on the same machine, the planner's GPU
  categories (plan/memory.py ``gpu_bytes``) with its peak before SAFETY. The peak's phase says which
  term of the model (the loss head's, or one layer's backward) to check against it;
- waits: the GPU's idle time before each visit (nothing enqueued: the driving thread was waiting on the
  host) and its wait for the visit's weights to land, summed by where in the step they fall (at a step's
  start, in the forward, at the head, in the backward), with the largest named.

    .venv/bin/python bench/timeline.py bench/results/FILE.jsonl
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
    return at, visit_names(rows[: at + 1], layers)[at][0]


def visit_names(rows: list[list], layers: int) -> list[tuple[str, str]]:
    """Each visit's name (unit and pass) and its part of the step: "start" (a step's first visit), "forward",
    "head" or "backward" (a step is the embedding, the layers, the head, the layers again, the embedding)."""
    out, seen = [], {}
    for r in rows:
        unit = r[0]
        if unit > layers:
            out.append(("the loss head", "head"))
            continue
        seen[unit] = seen.get(unit, 0) + 1
        forward = seen[unit] % 2 == 1
        what = "the embedding" if unit == 0 else f"layer {unit - 1}"
        part = "start" if unit == 0 and forward else "forward" if forward else "backward"
        out.append((f"{what}, {'forward' if forward else 'backward'}", part))
    return out


def waits(rows: list[list], layers: int, largest: int = 5, busy: list[list] = ()) -> tuple[dict[str, float], list[tuple]]:
    """Milliseconds the GPU stood idle before a visit (from the last visit's end to this one's start, less
    the ``busy`` spans there: the resident units' AdamW) and waited for its weights (start to ready),
    summed by part of the step, and the ``largest`` single waits as (ms, "idle" or "weights", visit
    index, name). (The global norm's few kernels at a step's end count as idle.)"""
    names = visit_names(rows, layers)
    sums: dict[str, float] = {}
    each = []
    for i, (r, (name, part)) in enumerate(zip(rows, names)):
        gap = r[1] - rows[i - 1][3] - sum(max(0.0, min(b, r[1]) - max(a, rows[i - 1][3])) for a, b in busy) \
            if i else 0.0
        for kind, ms in (("idle", gap), ("weights", r[2] - r[1])):
            if ms > 0:
                sums[f"{kind} {part}"] = sums.get(f"{kind} {part}", 0.0) + ms
                each.append((ms, kind, i, name))
    return sums, sorted(each, reverse=True)[:largest]


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
        if not rows:
            lines.append(f"{case}: no GPU timeline (run with --timeline)")
            continue
        layers = preset_config(rec["model"]).num_hidden_layers
        steps = sum(1 for _, part in visit_names(rows, layers) if part == "start")
        sums, top = waits(rows, layers, busy=rec["timeline"].get("gpu_adamw", []))
        lines.append(f"{case} ({rec['commit']}): GPU waits over {steps} step(s), ms: "
                     + (", ".join(f"{k} {v:.1f}" for k, v in sorted(sums.items())) or "none")
                     + "; largest: " + "; ".join(f"{ms:.1f} {kind} before visit {i} ({name})"
                                                 for ms, kind, i, name in top))
        if len(rows[0]) < 5:
            lines.append(f"{case}: no memory peaks (a tree whose timeline records them)")
            continue
        at, where = peak_visit(rows, layers)
        model = ", ".join(f"{k} {v:.2f}" for k, v in planned(rec).items())
        lines.append(f"{case} ({rec['commit']}): peak {rows[-1][4] / GIB:.3f} GiB allocated (reserved "
                     f"{rec['gpu_peak_reserved_gib']:.3f}), reached at visit {at} ({where}); planned GiB: {model}")
    return lines


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print("\n".join(report(p)))
