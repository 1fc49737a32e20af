"""The benchmark table and plot, made from result JSON lines (``slideformer bench report FILE...``).

Ratios are only taken between lines of the same file, i.e. of one run on one machine: these machines
are noisy, and only side-by-side numbers are comparable.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

SYSTEMS = ("slideformer", "plain", "deepspeed", "torchao")


def load(paths) -> list[dict]:
    rows = []
    for p in paths:
        for line in Path(p).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                r["_file"] = str(p)
                rows.append(r)
    return rows


# (settings record what was asked; "auto" choices are in the record's *_chosen keys. Files without those keys
# recorded the resolved host_weights and host_grad_buffers. Depth: the harness's default is unset (two visits
# ahead); files that record no optimizer_threads may have run at 1 by default, in those that do 1 is asked for.)
DEFAULTS = {"slots": (3, "auto"), "depth": (None, 1), "host_weights": ("auto", "persistent"), "host_grad_buffers": ("auto", 4, None),
            "optimizer_threads": None,
            "loss_chunk": (None, 1024),
            "resident_layers": "auto",
            "loss_kernel": "fused", "optimizer_state": "fp32", "offload_dir": None, "nvme_fraction": (1.0, "auto"),
            "grad_chunk_elems": 16 << 20, "switch_interval": None, "nvme_master": False,
            "activations_to_nvme": False, "resident_edges": False, "offload_activations": None,
            "resident_at": "start",  # a setting of older files only ("end": the last layers resident)
            "max_grad_norm": None, "speculative_layers": "auto", "host_memory_limit_gib": None, "fp8": False}


def variant(r) -> str:
    """The system's name plus any setting that differs from the default (files that record no fused_ops
    ran without them: "none")."""
    st = r.get("settings") or {}
    defaults = dict(DEFAULTS)
    if "host_grad_buffers_chosen" in r:  # (a file that records the ask: only "auto" is the default)
        defaults.update(host_weights="auto", host_grad_buffers="auto")
    if "optimizer_threads" in st:
        defaults.update(depth=None)
    extra = [f"{k}={st[k]}" for k, d in defaults.items() if r["system"] == "slideformer" and k in st
             and st[k] not in (d if isinstance(d, tuple) else (d,))]  # (a tuple: the defaults over time)
    if st.get("fused_ops", "none") not in ("none", "auto"):
        extra.append(f"fused_ops={st['fused_ops']}")
    if r["system"] == "deepspeed" and st.get("ds_loss", "hf") != "hf":
        extra.append(f"loss={st['ds_loss']}")
    return r["system"] + (f" ({', '.join(extra)})" if extra else "")


def _cap(r) -> str:
    c = (r.get("settings") or {}).get("gpu_memory_limit_gib")
    return f"{c:g} GiB" if c else "none"


def table(rows: list[dict]) -> str:
    """Markdown: one row per (model, seq, batch, cap) and run of it, one column per system, and
    slideformer's ratios (taken within a row; a file's first runs share the first row). A
    run that failed for want of GPU memory shows as such (the harness records it: a result too).
    Where plain training has no line under a row's cap (it does not fit, or was run on the whole card as
    the peak to compare with), the ratio is against plain on the whole card in the same file, marked *."""
    cells: dict[tuple, dict[str, dict]] = defaultdict(dict)
    commits = defaultdict(set)
    for r in rows:
        commits[r["_file"]].add(r.get("commit"))
    for r in rows:
        if (r.get("settings") or {}).get("max_grad_norm"):
            continue  # clipping runs stay out of the comparison table: it compares unclipped steps
        # a case run again in one file gets a row of its own, named by its commit where the file holds several
        # (an A/B of two commits on one machine)
        case = (r["_file"], r["model"], r["seq"], r["batch"], _cap(r),
                r.get("commit") if len(commits[r["_file"]]) > 1 else "")
        repeat = 0
        while variant(r) in cells[case + (repeat,)]:
            repeat += 1
        cells[case + (repeat,)][variant(r)] = r
    names = {v for c in cells.values() for v in c}
    systems = sorted(names, key=lambda v: (SYSTEMS.index(v.split(" ")[0]) if v.split(" ")[0] in SYSTEMS else 9, v))
    head = ["model", "seq", "batch", "GPU cap"] + [f"{s} tok/s (GPU / host GiB)" for s in systems]
    others = [s for s in systems if not s.startswith("slideformer")]
    head += [f"slideformer / {s}" for s in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (f, model, seq, batch, cap, commit, repeat), c in sorted(cells.items(), key=lambda kv: kv[0][1:]):
        row = [model + (f" @{commit}" if commit else ""), str(seq), str(batch), cap]
        for s in systems:
            r = c.get(s)
            row.append("—" if not r else r["error"] if r.get("error") else
                       f"{r['tokens_per_s']:.0f} ({r['gpu_peak_alloc_gib']:.1f} / {r['host_peak_rss_gib']:.0f})")
        for s in others:
            # the ratio's slideformer: its defaults (fused_ops=liger where "auto" resolved to Liger)
            a, b, mark = c.get("slideformer") or c.get("slideformer (fused_ops=liger)"), c.get(s), ""
            if a and not b and s.startswith("plain") and cap != "none":
                b, mark = cells.get((f, model, seq, batch, "none", commit, 0), {}).get(s), "*"
            ok = a and b and not a.get("error") and not b.get("error")
            row.append(f"{a['tokens_per_s'] / b['tokens_per_s']:.3f}x{mark}" if ok else "—")
        lines.append("| " + " | ".join(row) + " |")
    if any("x*" in line for line in lines):
        lines.append("\n\\* against plain training on the whole card (no cap), in the same run.")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:  # slideformer with its defaults, and the baselines (the table has every variant); a later
        v = variant(r)  # file's point replaces an earlier one at the same batch
        if not r.get("error") and not (r.get("settings") or {}).get("max_grad_norm") and (
                r["system"] != "slideformer" or v in ("slideformer", "slideformer (fused_ops=liger)")):
            series[r["model"]][f"{v}, GPU cap {_cap(r)}"][r["batch"]] = r["tokens_per_s"]
    models = sorted(series)
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 5.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for name, pts in sorted(series[model].items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", label=name)
        ax.set_title(f"{model}, seq {rows[0]['seq']}")
        ax.set_xlabel("batch (sequences)")
        ax.set_ylabel("tokens/s")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="slideformer bench report", description="table and plot from result files")
    ap.add_argument("results", nargs="+")
    ap.add_argument("--plot", help="write a PNG of tokens/s against batch per system")
    args = ap.parse_args(argv)
    rows = load(args.results)
    print(table(rows))
    if args.plot:
        plot(rows, Path(args.plot))
    return 0
