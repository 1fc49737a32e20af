"""One benchmark case per process: train a randomly initialised model on random tokens, print a JSON line.

    python bench/harness.py --system slideformer --model qwen3-4b --seq 1024 --batch 32
    python bench/harness.py --system plain --model qwen3-4b --seq 1024 --batch 32

Systems:
- slideformer: this engine (bf16 compute, fp32 master and moments on the host).
- plain: the same Hugging Face model resident on the GPU: bf16 weights, fp32 master weights and fused
  AdamW on the GPU, activation checkpointing of every layer, the same chunked loss head.

Model TFLOPS = 6 x params x tokens/s; attention FLOPs are not counted, nor is recompute.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from slideformer import EngineConfig, SlideEngine  # noqa: E402
from slideformer.presets import preset_config  # noqa: E402


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


def run_slideformer(args, config):
    cfg = EngineConfig(lr=1e-5, device=args.device, compute_dtype=args.dtype, window_slots=args.slots,
                       prefetch_depth=args.depth, host_weights=args.host_weights, profile=True,
                       max_grad_norm=args.max_grad_norm, loss_chunk_tokens=args.loss_chunk)
    engine = SlideEngine.from_config(config, cfg)
    params = engine.adapter.num_params
    gen = torch.Generator().manual_seed(0)

    def step():
        b = random_batch(config.vocab_size, args.batch, args.seq, gen)
        if args.micro_batch and args.micro_batch < args.batch:
            b = [{k: v[i: i + args.micro_batch] for k, v in b.items()} for i in range(0, args.batch, args.micro_batch)]
        return engine.train_step(b)

    def finish():
        engine.synchronize()
        sync(args)

    extra = lambda: {"breakdown": engine.profile(), "host_bytes": engine.memory_report()}  # noqa: E731
    return params, step, finish, extra, engine.profile


def run_plain(args, config):
    from transformers import AutoModelForCausalLM

    from slideformer.engine.loss import chunked_head_loss

    config._attn_implementation = "sdpa"
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=args.dtype)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    params = list(model.parameters())
    master = [p.detach().float() for p in params]
    opt = torch.optim.AdamW(master, lr=1e-5, fused=True)
    n_params = sum(p.numel() for p in params)
    gen = torch.Generator().manual_seed(0)

    W = model.lm_head.weight

    def step():
        ids = random_batch(config.vocab_size, args.batch, args.seq, gen)["input_ids"].to(args.device)
        labels = torch.full_like(ids, -100)
        labels[:, :-1] = ids[:, 1:]
        hidden = model.model(input_ids=ids).last_hidden_state  # [B, S, H], final norm applied
        # The same chunked loss head as slideformer; its weight gradient is summed in fp32.
        gw = torch.zeros_like(W, dtype=torch.float32)
        loss, gh = chunked_head_loss(hidden.detach().flatten(0, 1), labels.flatten(), None, W,
                                     int((labels != -100).sum()), args.loss_chunk, None, gw, accumulate=False)
        hidden.backward(gh.view_as(hidden))
        W.grad = gw.to(W.dtype) if W.grad is None else W.grad + gw.to(W.dtype)
        del gw
        for m, p in zip(master, params):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(params, master)
        return loss

    def finish():
        sync(args)

    return n_params, step, finish, (lambda: {}), None


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", choices=["slideformer", "plain"], required=True)
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--host-weights", default="persistent")
    ap.add_argument("--max-grad-norm", type=float, default=None)
    ap.add_argument("--gpu-memory-limit-gib", type=float, default=None)
    ap.add_argument("--loss-chunk", type=int, default=1024)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    cuda = args.device == "cuda"

    if args.gpu_memory_limit_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_limit_gib * 2**30 / total))
    config = preset_config(args.model)
    t_build = time.perf_counter()
    params, step, finish, extra, prof = (run_slideformer if args.system == "slideformer" else run_plain)(args, config)
    build_s = time.perf_counter() - t_build
    for _ in range(args.warmup):
        step()
    finish()
    if prof:
        prof()  # discard warm-up timings
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    finish()
    dt = (time.perf_counter() - t0) / args.steps
    tokens = args.batch * args.seq
    rec = {
        "system": args.system, "model": args.model, "params": params, "seq": args.seq, "batch": args.batch,
        "micro_batch": args.micro_batch or args.batch, "step_s": dt, "tokens_per_s": tokens / dt,
        "model_tflops": 6 * params * tokens / dt / 1e12, "loss": float(loss),
        "gpu_peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "gpu_peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
        "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "build_s": build_s, "commit": commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if cuda else "none", "torch": torch.__version__,
        "settings": {k: getattr(args, k) for k in ("slots", "depth", "host_weights", "max_grad_norm",
                                                   "gpu_memory_limit_gib", "loss_chunk")},
    }
    ex = extra()
    if "breakdown" in ex:
        b = {k: v / args.steps for k, v in ex["breakdown"].items()}
        rec["breakdown_per_step_s"] = b
        parts = [b.get("gpu_compute_s", 0), b.get("h2d_busy_s", 0), b.get("d2h_busy_s", 0), b.get("host_optimizer_s", 0)]
        rec["pipeline_efficiency"] = max(parts) / dt
        rec["host_bytes"] = ex["host_bytes"]
    line = json.dumps(rec)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return rec


if __name__ == "__main__":
    main()
