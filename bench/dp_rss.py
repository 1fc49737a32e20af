"""Host RAM under data parallel: N ranks of one machine against one process, each at the same per-rank batch.

Runs the ranks on gloo (on one GPU, or the CPU): the figure is the host's, which does not depend on the
backend; the step time over gloo's host path says nothing of NCCL's. Prints one JSON line per run:
each process's peak RSS, their sum, and what the planner predicted for each.
  python3 bench/dp_rss.py --model qwen3-4b --batch 8 --ranks 2 [--device cuda] [--state compact]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def one(rank: int, world: int, init: str, args, out: str) -> None:
    os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo")
    if world > 1 and args.backend == "nccl":  # one GPU a rank (train/loop.py's LOCAL_RANK)
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
    elif world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from slideformer import EngineConfig, SlideEngine
    from slideformer.machine import Machine
    from slideformer.model import ModelAdapter
    from slideformer.plan import Auto, ModelShape, resolve
    from slideformer.presets import preset_config

    config = preset_config(args.model)
    cfg = EngineConfig(lr=1e-5, device=args.device, compute_dtype=torch.bfloat16, max_grad_norm=1.0,
                       optimizer_state=args.state,
                       host_memory_limit=f"{args.host_gib}GiB" if args.host_gib else None,  # (resolve splits it)
                       gpu_memory_limit=f"{args.gpu_gib}GiB" if args.device == "cuda" else None)
    shape = ModelShape.from_adapter(ModelAdapter(config, torch.bfloat16))
    plan = resolve(cfg, Auto(), shape, args.batch, args.seq, Machine.detect(args.device))
    gen = torch.Generator().manual_seed(rank)
    times = []
    with SlideEngine.from_config(config, plan.config) as eng:
        for _ in range(args.steps):
            ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen)
            t = time.perf_counter()
            eng.train_step({"input_ids": ids, "labels": ids.clone()})
            times.append(time.perf_counter() - t)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(out, "w") as f:
        json.dump({"rank": rank, "rss": rss, "planned_host": sum(plan.host.values()), "step_s": times}, f)
    if world > 1:
        dist.destroy_process_group()


def run(world: int, args) -> dict:
    tmp = tempfile.mkdtemp()
    outs = [os.path.join(tmp, f"r{r}.json") for r in range(world)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=one, args=(r, world, os.path.join(tmp, "init"), args, outs[r])) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        return {"ranks": world, "error": [p.exitcode for p in procs]}
    res = [json.load(open(o)) for o in outs]
    return {"ranks": world, "rss_gib": [round(r["rss"] / 2**30, 2) for r in res],
            "rss_sum_gib": round(sum(r["rss"] for r in res) / 2**30, 2),
            "planned_host_gib": [round(r["planned_host"] / 2**30, 2) for r in res],
            "step_s": [r["step_s"] for r in res]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--gpu-gib", type=float, default=24)
    ap.add_argument("--state", default="compact")
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    ap.add_argument("--host-gib", type=float, default=None,
                    help="host_memory_limit of the machine (split by the ranks)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    import datetime
    import sys

    from slideformer.machine import describe

    meta = {"commit": os.environ.get("SLIDEFORMER_COMMIT"), "date": datetime.datetime.now(datetime.timezone.utc)
            .isoformat(timespec="seconds"), "machine": describe(), "command": " ".join(["python3"] + sys.argv)}
    for world in (1, args.ranks):
        print(json.dumps({"bench": "dp_rss", "backend": args.backend, "model": args.model, "batch": args.batch,
                          "state": args.state,
                          "device": args.device, **run(world, args), **meta}), flush=True)


if __name__ == "__main__":
    main()
