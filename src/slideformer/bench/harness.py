"""One benchmark case: train a randomly initialised model on random tokens, print one JSON line.

    slideformer bench --system slideformer --model qwen3-4b --seq 1024 --batch 32
    slideformer bench --system plain --model qwen3-4b --seq 1024 --batch 32 --gpu-memory-limit-gib 24

Run one case per process (``bench/run_device.sh`` does), so peak memory and RSS are the case's own.

Systems:
- slideformer: this engine (bf16 compute, fp32 master and moments on the host).
- plain: the same Hugging Face model resident on the GPU: bf16 weights, fp32 master weights and fused
  AdamW on the GPU, activation checkpointing of every layer, the same chunked loss head.
- deepspeed: ZeRO-3 with parameters and optimizer offloaded to pinned CPU memory, DeepSpeedCPUAdam,
  bf16, activation checkpointing, Hugging Face's own loss (what its users run).
- torchao: its CPUOffloadOptimizer (issue 3's optional baseline): fp32 weights on the GPU under bf16
  autocast, torch's fused AdamW on the host, the same loss head as plain.

Model TFLOPS = 6 x params x tokens/s; attention FLOPs are not counted, nor is recompute.
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import pickle
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from .. import EngineConfig, SlideEngine, heap
from ..config import Placement, Tuning
from ..engine.loss import chunked_head_loss, fused_head_loss
from ..model import ModelAdapter
from ..machine import Machine
from ..machine import describe as describe_machine
from ..plan import Auto, ModelShape, resolve
from ..plan.memory import LOSS_CHUNK_TOKENS
from ..presets import preset_config


def commit() -> str:
    if os.environ.get("SLIDEFORMER_COMMIT"):
        return os.environ["SLIDEFORMER_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=Path(__file__).parent, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def random_batch(vocab: int, batch: int, seq: int, gen: torch.Generator) -> dict:
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    return {"input_ids": ids, "labels": ids}


def sync(args):
    if args.device == "cuda":
        torch.cuda.synchronize()


def slideformer_plan(args, config, machine):
    """What `slideformer train` decides for this case's "auto" settings on ``machine`` (plan.resolve)."""
    asked = {"window_slots": args.slots if args.slots == "auto" else int(args.slots),
             "nvme_fraction": args.nvme_fraction if args.nvme_fraction == "auto" else float(args.nvme_fraction),
             "host_weights": args.host_weights, "host_grad_buffers": args.host_grad_buffers,
             "speculative_layers": args.speculative_layers, "resident_edges": True if args.resident_edges else "auto",
             "resident_layers": "auto" if args.resident_layers == "auto" else int(args.resident_layers)}
    auto, fixed = Auto.of(asked)  # (resolve decides the rest)
    placement = Placement(prefetch_depth=args.depth,
                          nvme_master=args.nvme_master,
                          activations_to_nvme=args.activations_to_nvme,
                          offload_activations=args.offload_activations is not None,
                          gpu_activation_layers=args.offload_activations or 0, **fixed)
    tuning = Tuning(profile=True, grad_chunk_elems=args.grad_chunk_elems, optimizer_threads=args.optimizer_threads,
                    loss_chunk_tokens=args.loss_chunk, loss_kernel=args.loss_kernel, fused_ops=args.fused_ops)
    cfg = EngineConfig(lr=1e-5, device=args.device, compute_dtype=args.dtype, max_grad_norm=args.max_grad_norm,
                       optimizer_state=args.optimizer_state, offload_dir=args.offload_dir, fp8=args.fp8,
                       gpu_memory_limit=int(args.gpu_memory_limit_gib * 2**30) if args.gpu_memory_limit_gib else None,
                       host_memory_limit=int(args.host_memory_limit_gib * 2**30) if args.host_memory_limit_gib else None,
                       placement=placement, tuning=tuning)
    shape = ModelShape.from_adapter(ModelAdapter(config, args.dtype))
    return resolve(cfg, auto, shape, args.batch, args.seq, machine)


def plan_record(args, config) -> dict:
    """--plan-on: the placement this case would train with on a machine of the given GPU and RAM, without
    building it (to compare the planner's choices before and after a change, case by case)."""
    gpu, ram = (float(x) * 2**30 for x in args.plan_on.split(","))
    plan = slideformer_plan(args, config, Machine(ram=int(ram), gpu=int(gpu)))
    cfg = plan.config
    p, c = plan.placement, cfg.placement
    return {"micro_batch": min(p.micro_batch, args.batch), "gpu_activation_layers": p.gpu_activation_layers,
            "saved_layers": p.saved_layers, "mid_layers": p.mid_layers, "head_slice": p.head_slice, "loss_chunk_tokens": p.loss_chunk_tokens,
            "resident_layers": c.resident_layers, "resident_edges": c.resident_edges, "window_slots": c.window_slots,
            "host_weights": c.host_weights, "host_grad_buffers": c.host_grad_buffers,
            "host_input_bytes": c.host_input_bytes, "micro_batch_tokens": getattr(c, "micro_batch_tokens", None),  # (older srcs: compare_plans.sh)
            "min_gpu_inputs": getattr(c, "min_gpu_inputs", 0), "gpu_first_update": getattr(p, "gpu_first_update", False),
            "nvme_fraction": c.nvme_fraction if cfg.offload_dir else None, "problem": plan.problem}


def run_slideformer(args, config):
    # what `slideformer train` decides for what is "auto" (plan.resolve), not refused here where it does not fit:
    # the engine's own check, or the GPU, says so (a case that does not fit is a result too)
    cfg = slideformer_plan(args, config, Machine.detect(args.device)).config
    engine = SlideEngine.from_config(config, cfg)
    args.fused_ops = engine.fused_ops  # recorded as resolved ("auto" depends on what is installed)
    params = engine.adapter.num_params
    gen = torch.Generator().manual_seed(0)

    def step():
        b = random_batch(config.vocab_size, args.batch, args.seq, gen)
        if args.micro_batch and args.micro_batch < args.batch:
            b = [{k: v[i: i + args.micro_batch] for k, v in b.items()} for i in range(0, args.batch, args.micro_batch)]
        return engine.train_step(b, blocking=False)  # as plain's step: no sync until finish()

    def finish():
        engine.synchronize()
        sync(args)

    def extra():
        p = cfg.placement
        rep = {"window_slots_chosen": p.window_slots, "nvme_fraction_chosen": p.nvme_fraction,
               "nvme_master_chosen": p.nvme_master,
               "resident_layers_chosen": p.resident_layers,
               "resident_edges_chosen": p.resident_edges,
               "host_weights_chosen": p.host_weights, "host_grad_buffers_chosen": p.host_grad_buffers,
               "speculative_layers_chosen": len(engine.store.spares),
               "speculation": dict(engine.runtime.updates.speculation),  # (units, warm-up steps included)
               "breakdown": engine.profile(timeline=args.timeline),
               "host_bytes": engine.memory_report()}
        if engine._placements:
            rep["placement"] = {f"{b}x{s}": vars(p) for (b, s), p in engine._placements.items()}
        return rep

    prof = engine.runtime.profiler
    return params, step, finish, extra, (prof.reset, prof.close)


def run_plain(args, config):
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "sdpa"
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=args.dtype)
    if args.fused_ops == "liger":  # explicit only: plain's default is transformers' modules, as users run it
        from ..model.fused_ops import apply_liger

        apply_liger(list(model.model.layers) + [model.model.norm], config.hidden_act)
    else:
        args.fused_ops = "none"
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    params = list(model.parameters())
    master = [p.detach().float() for p in params]
    opt = torch.optim.AdamW(master, lr=1e-5, fused=True)
    n_params = sum(p.numel() for p in params)
    gen = torch.Generator().manual_seed(0)

    def step():
        loss = _head_step(args, config, model, gen)
        for m, p in zip(master, params):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(params, master)
        return loss

    return n_params, step, (lambda: sync(args)), (lambda: {}), None


def _head_step(args, config, model, gen, autocast: bool = False) -> torch.Tensor:
    """Forward and backward of an HF model with slideformer's loss head (fused or chunked): the baselines'
    shared step. The head's weight gradient is summed in fp32 and enters autograd beside the hidden
    states' in one backward, so a tied weight's gradient hooks see it whole."""
    ids = random_batch(config.vocab_size, args.batch, args.seq, gen)["input_ids"].to(args.device)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    with torch.autocast(args.device, dtype=args.dtype, enabled=autocast):
        hidden = model.model(input_ids=ids).last_hidden_state  # [B, S, H], final norm applied
    W = model.lm_head.weight
    gw = torch.zeros_like(W, dtype=torch.float32)
    head_loss = fused_head_loss if args.loss_kernel == "fused" else chunked_head_loss
    loss, gh = head_loss(hidden.detach().to(args.dtype).flatten(0, 1), labels.flatten(), None, W.to(args.dtype),
                         int((labels != -100).sum()), args.loss_chunk or LOSS_CHUNK_TOKENS[0], None, gw,
                         accumulate=False)
    torch.autograd.backward([hidden, W], [gh.view_as(hidden).to(hidden.dtype), gw.to(W.dtype)])
    return loss


def profile_ops(step, finish, top: int) -> dict:
    """One step under the torch profiler: the ``top`` GPU kernels by GPU time (self time, so nested ops are
    not counted twice), each with its share of the step's GPU time, and the ``top`` matrix products by
    operand shapes (which GEMM a slow kernel belongs to). What issue 6 asks to look at before writing a
    kernel."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        finish()
    rows = [(e.key, e.self_device_time_total / 1e6, e.count) for e in prof.key_averages() if e.self_device_time_total]
    total = sum(t for _, t, _ in rows) or 1.0
    rows.sort(key=lambda r: -r[1])
    # (self time: an op nested in one of the same name, as addmm's fp32 output, is not counted twice)
    mms = [(e.key, e.input_shapes, e.self_device_time_total / 1e6, e.count)
           for e in prof.key_averages(group_by_input_shape=True) if e.key in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm")]
    mms.sort(key=lambda r: -r[2])
    return {"kernels": [{"op": k, "gpu_s": t, "calls": n, "share": t / total} for k, t, n in rows[:top]],
            "matmuls": [{"op": k, "shapes": sh, "gpu_s": t, "calls": n} for k, sh, t, n in mms[:top]],
            "launchers": kernel_launchers(prof, {k for k, _, _ in rows[:top]})}


def kernel_launchers(prof, kernels: set[str]) -> dict[str, list]:
    """For each of ``kernels``, the ops that launched it: the innermost aten op with its operand shapes and
    two of its callers, with calls and GPU seconds. Where a kernel table shows an extra or slower kernel,
    this says which op and shapes it belongs to."""
    found: dict[str, dict[str, list]] = {}
    for e in prof.events():
        # a launch can be filed under an op and under its runtime call too (counted at both, the calls
        # would exceed the kernel table's): count it at the deepest event that holds it
        below = {(k.name, k.duration) for c in getattr(e, "cpu_children", None) or () for k in getattr(c, "kernels", None) or ()}
        for k in getattr(e, "kernels", None) or ():
            if k.name not in kernels or (k.name, k.duration) in below:
                continue
            op, chain = e, []
            while op is not None and not op.name.startswith("aten::"):
                op = op.cpu_parent
            op = op or e
            chain.append(f"{op.name} {op.input_shapes}" if op.input_shapes else op.name)
            up = op.cpu_parent
            while up is not None and len(chain) < 3:
                chain.append(up.name)
                up = up.cpu_parent
            c = found.setdefault(k.name, {}).setdefault(" < ".join(chain), [0, 0.0])
            c[0] += 1
            c[1] += k.duration / 1e6
    return {k: sorted(([label, n, t] for label, (n, t) in v.items()), key=lambda r: -r[2])[:6] for k, v in found.items()}


# Our competitors' harness is not installed with slideformer: it lives in the repository (bench/baselines.py)
BASELINES = Path(__file__).resolve().parents[3] / "bench" / "baselines.py"
RUNNERS = {"slideformer": run_slideformer, "plain": run_plain, "deepspeed": None, "torchao": None}


def runner(system: str):
    """The run function of ``system``; DeepSpeed's and torchao's from the repository's bench/baselines.py."""
    if RUNNERS[system] is not None:
        return RUNNERS[system]
    if not BASELINES.is_file():
        raise SystemExit(f"the {system} baseline lives in the slideformer repository's bench/baselines.py "
                         "(run from a checkout)")
    import importlib.util

    spec = importlib.util.spec_from_file_location("slideformer_baselines", BASELINES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, f"run_{system}")


def parser() -> argparse.ArgumentParser:
    """One case's flags (bench/cases.yaml writes cases in them)."""
    ap = argparse.ArgumentParser(prog="slideformer bench", description=__doc__.splitlines()[0])
    ap.add_argument("--system", choices=sorted(RUNNERS), required=True)
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--slots", default="auto", help="layer slots of the window, or auto (the planner's)")
    ap.add_argument("--depth", type=int, default=None, help="prefetch depth (default: the engine's, 2 with 3 slots)")
    ap.add_argument("--host-weights", default="auto", type=lambda v: v if v in ("auto", "persistent", "staged") else int(v),
                    help="persistent, staged, a number of staged layers, or auto: persistent where the training "
                         "state fits the host budget (plan.host_budget), else the fewest staged layers that do "
                         "(plan.auto_host)")
    ap.add_argument("--host-grad-buffers", type=lambda v: v if v == "auto" else int(v), default="auto",
                    help="pinned host gradient buffers the layers share (the optimizer's backlog); auto: one per "
                         "streamed layer where RAM allows (plan.auto_host)")
    ap.add_argument("--speculative-layers", type=lambda v: v if v == "auto" else int(v), default="auto",
                    help="with --max-grad-norm: layers updated before the global norm is known, into spare "
                         "states; auto: every streamed layer where RAM allows (plan.auto_host)")
    ap.add_argument("--grad-chunk-elems", type=int, default=Tuning.grad_chunk_elems)
    ap.add_argument("--optimizer-threads", type=int, default=None,
                    help="the CPU update's threads (default: the engine's, all cores but one)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the run: how long the GPU-driving thread may hold the GIL")
    ap.add_argument("--max-grad-norm", type=float, default=None)
    ap.add_argument("--gpu-memory-limit-gib", type=float, default=None)
    ap.add_argument("--host-memory-limit-gib", type=float, default=None,
                    help="slideformer's host_memory_limit: the planner keeps the process's RAM under it")
    ap.add_argument("--loss-chunk", type=int, default=None,
                    help="loss head tokens per chunk (default: slideformer's planner chooses under its budget; "
                         "plain takes the largest, 8192, as the planner does on a roomy card)")
    ap.add_argument("--resident-edges", action="store_true",
                    help="embedding and head on the GPU (else, with --resident-layers auto, the planner decides)")
    ap.add_argument("--resident-layers", default="auto",
                    help="decoder layers trained on the GPU; 'auto' (default): as many as the budget allows, "
                         "as `slideformer train` chooses")
    ap.add_argument("--ds-loss", default="hf", choices=["hf", "fused"],
                    help="DeepSpeed's loss: HF's full logits, or our fused linear cross-entropy")
    ap.add_argument("--loss-kernel", default=Tuning.loss_kernel, choices=["torch", "fused"])
    ap.add_argument("--fused-ops", default=Tuning.fused_ops, choices=["auto", "none", "liger"],
                    help="slideformer: its layers' RMSNorm/SwiGLU; plain: the same rebinding on the HF model")
    ap.add_argument("--optimizer-state", default="fp32", choices=["fp32", "compact", "8bit"])
    ap.add_argument("--fp8", action="store_true", help="slideformer: the layers' linears in FP8 (model/fp8.py)")
    ap.add_argument("--offload-dir", default=None, help="NVMe tier directory for the moments of --nvme-fraction of the layers")
    ap.add_argument("--nvme-fraction", default="auto", help="the layers on the tier, or auto (the planner's)")
    ap.add_argument("--nvme-master", action="store_true", help="the tier's layers keep their master there too (compact "
                    "state: and the weights it doubles as)")
    ap.add_argument("--offload-activations", type=int, metavar="KEEP",
                    help="offload every layer input to host memory but the last KEEP (without a GPU budget; "
                         "under one the planner decides)")
    ap.add_argument("--activations-to-nvme", action="store_true", help="offloaded layer inputs go to --offload-dir")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--timeline", action="store_true",
                    help="slideformer: record each GPU visit and CPU update of the timed steps (engine/profile.py)")
    ap.add_argument("--memory-history", default=None, metavar="PATH",
                    help="CUDA: record torch's memory history through the timed steps, write its snapshot to PATH "
                         "(a gzipped pickle: gunzip it for pytorch.org/memory_viz) and put each allocation "
                         "retry, with what it waited for, in the record (bench/allocations.py)")
    ap.add_argument("--profile-ops", type=int, default=0, metavar="N",
                    help="after the timed steps, profile one more step and record its N costliest GPU ops")
    ap.add_argument("--failed", metavar="WHY",
                    help="record this case as failed with WHY, without running it: a process the host killed "
                         "(out of RAM) or a timeout leaves no line of its own (bench/run_device.sh)")
    ap.add_argument("--plan-on", metavar="GPU_GIB,RAM_GIB",
                    help="slideformer: print the plan this case gets on a machine of that GPU and RAM (the H200's: "
                         "139.8,125.8) as one JSON line, and run nothing")
    ap.add_argument("--out", default=None)
    return ap


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    args.command = " ".join(["slideformer", "bench", *argv])
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    cuda = args.device == "cuda"

    if args.plan_on:
        if args.system != "slideformer":
            raise SystemExit("--plan-on plans slideformer's cases only")
        rec = {"model": args.model, "batch": args.batch, "command": args.command, **plan_record(args, preset_config(args.model))}
        print(json.dumps(rec))
        return rec
    if args.memory_history:
        if Path(args.memory_history).exists():  # (a run writes only files of its own)
            raise SystemExit(f"--memory-history: {args.memory_history} exists; name a new file")
        if not cuda:
            raise SystemExit("--memory-history records the CUDA allocator's history: run it on a GPU")
        torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_EVENTS, stacks="python")
    if args.gpu_memory_limit_gib and cuda:  # the same hard cap for every system; slideformer also plans for it
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_limit_gib * 2**30 / total))
    config = preset_config(args.model)
    rec = {"system": args.system, "model": args.model, "params": None, "seq": args.seq, "batch": args.batch,
           "micro_batch": args.micro_batch or args.batch}
    if args.failed:
        rec.update(error=args.failed, **{**_common(args, False), "gpu_peak_alloc_gib": None,
                                         "gpu_peak_reserved_gib": None, "host_peak_rss_gib": None})
        _write(rec, args.out)
        return rec
    t_build = time.perf_counter()
    settled = False
    try:
        params, step, finish, extra, window = runner(args.system)(args, config)
        rec["params"] = params
        build_s = time.perf_counter() - t_build
        for _ in range(args.warmup):
            step()
        settled = heap.settle()  # (as the trainer does after its first step: every system alike)
        # Steady state, as a long run goes: the timed steps follow the warm-up without draining the
        # pipeline, and are timed from the return of the last warm-up step to that of the last timed one
        # (each step waits for the work the previous one left: its updates, its GPU queue). Draining first
        # would charge every timed window a cold start: the CPU idle until backward's first gradient.
        if window:
            window[0]()  # slideformer's profile counts from here...
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        retries = _alloc_retries(cuda)
        t0 = time.perf_counter()
        with heap.Pauses() as pauses:
            for _ in range(args.steps):
                loss = step()
        dt = (time.perf_counter() - t0) / args.steps
        retries = _alloc_retries(cuda) - retries
        if window:
            window[1]()  # ...to here: not the drain below, which the next step would overlap
        finish()
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
        # A result too ("does not fit under this cap, or in this RAM"): recorded, then raised. (A host OOM
        # kill leaves only run_device.sh's FAILED line; pinned allocations fail as RuntimeError.)
        what = "out of GPU memory" if isinstance(e, torch.OutOfMemoryError) else \
            "out of host memory" if isinstance(e, MemoryError) or "out of memory" in str(e) else None
        if what:
            rec.update(error=what, detail=(str(e).splitlines() or [""])[0][:300], **_common(args, cuda))
            _write(rec, args.out)
        raise
    finally:
        if settled:
            heap.release()
    tokens = args.batch * args.seq
    shape = ModelShape.from_adapter(ModelAdapter(config, args.dtype))  # (a MoE layer: its active parameters)
    active = params - shape.layers * (shape.layer_params - shape.flop_params)
    rec.update({
        "step_s": dt, "tokens_per_s": tokens / dt, **({"active_params": active} if shape.experts else {}),
        "gc_s": pauses.seconds / args.steps, "gc_full": pauses.full,
        "model_tflops": 6 * active * tokens / dt / 1e12, "loss": float(loss.detach() if torch.is_tensor(loss) else loss),
        "build_s": build_s, **_common(args, cuda), "gpu_alloc_retries_timed": retries})
    if args.memory_history:
        rec["alloc_retries"] = _memory_history(args.memory_history)
    ex = extra()  # before the profiled step below, which is not one of the timed ones
    if args.profile_ops and cuda:
        prof = profile_ops(step, finish, args.profile_ops)
        rec["op_profile"], rec["matmul_profile"], rec["kernel_launchers"] = prof["kernels"], prof["matmuls"], prof["launchers"]
    if "breakdown" in ex:
        if "timeline" in ex["breakdown"]:
            rec["timeline"] = ex["breakdown"].pop("timeline")
        b = {k: v / args.steps for k, v in ex["breakdown"].items()}
        rec["breakdown_per_step_s"] = b
        gpu = b.get("gpu_compute_s", 0) + b.get("gpu_adamw_busy_s", 0)  # the resident units' AdamW is GPU work too
        # the CPU update's own time: without the waits for gradient chunks still in flight
        b["host_optimizer_own_s"] = b.get("host_optimizer_s", 0) - b.get("host_optimizer_wait_landing_s", 0)
        parts = [gpu, b.get("h2d_busy_s", 0), b.get("d2h_busy_s", 0), b["host_optimizer_own_s"]]
        rec["pipeline_efficiency"] = max(parts) / dt
        rec["host_bytes"] = ex["host_bytes"]
        rec["placement"] = ex.get("placement")
        rec["resident_layers_chosen"] = ex["resident_layers_chosen"]
        rec["resident_edges_chosen"] = ex["resident_edges_chosen"]
        rec["host_weights_chosen"] = ex["host_weights_chosen"]
        rec["host_grad_buffers_chosen"] = ex["host_grad_buffers_chosen"]
        rec["speculative_layers_chosen"] = ex["speculative_layers_chosen"]
        rec["speculation"] = ex["speculation"]
    _write(rec, args.out)
    return rec


def _common(args, cuda: bool) -> dict:
    """What every record carries, measured or failed: peaks, provenance and the settings asked for."""
    return {
        "gpu_peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "gpu_peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
        # (the caching allocator freed its cache and tried again: each a wait for the device; the
        # warm-up's too, where the timed steps' are gpu_alloc_retries_timed)
        "gpu_alloc_retries": _alloc_retries(cuda),
        "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "commit": commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if cuda else "none", "torch": torch.__version__,
        "machine": describe_machine(), "command": args.command,
        "settings": {k: getattr(args, k) for k in ("slots", "depth", "host_weights", "host_grad_buffers",
                                                   "speculative_layers", "grad_chunk_elems", "optimizer_threads",
                                                   "switch_interval", "max_grad_norm",
                                                   "gpu_memory_limit_gib", "host_memory_limit_gib", "loss_chunk",
                                                   "resident_layers", "resident_edges",
                                                   "loss_kernel", "fused_ops", "optimizer_state", "ds_loss", "offload_dir",
                                                   "nvme_fraction", "nvme_master", "activations_to_nvme",
                                                   "offload_activations", "fp8")},
    }


MEMORY_HISTORY_EVENTS = 1_000_000  # allocator events kept (a 4B b64 step under a cap makes about 30k)


def _memory_history(path: str) -> list[dict]:
    """The recorded history to ``path`` (recording stops), and its retries (bench/allocations.py)."""
    from .allocations import retries

    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with gzip.open(path, "wb") as f:
        pickle.dump(snapshot, f)
    return [r for trace in snapshot["device_traces"] for r in retries(trace)]


def _alloc_retries(cuda: bool) -> int:
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0


def _write(rec: dict, out: str | None) -> None:
    line = json.dumps(rec)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
