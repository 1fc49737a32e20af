"""The training loop: data in a seeded order, optimizer steps through the engine, logs, checkpoints.

Resume restores the engine's full state and the data position (epoch and offset into that epoch's
seeded permutation), so a resumed run takes exactly the steps the uninterrupted run would have.
Ctrl-C finishes the current step, saves a checkpoint and exits with code 130.
"""
from __future__ import annotations

import dataclasses
import json
import math
import resource
import shutil
import signal
import time
from pathlib import Path

import torch

from .. import EngineConfig, SlideEngine, lr_at
from ..config import ConfigError
from ..data import DataError, detect_format, pack_batch, pad_batch, read_records, render, to_messages
from .config import TrainConfig, _assets

CKPT_PREFIX = "checkpoint-"


class NonFiniteLoss(FloatingPointError):
    """The loss became NaN or infinite; the last checkpoint is kept and nothing after it is saved."""


def load_tokenizer(cfg: TrainConfig):
    from transformers import AutoTokenizer

    path = _assets() / "tiny" if cfg.model_name_or_path == "tiny" else cfg.model_name_or_path
    tok = AutoTokenizer.from_pretrained(str(path))
    if cfg.chat_template:
        tok.chat_template = cfg.chat_template
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def build_examples(cfg: TrainConfig, tok) -> tuple[list[tuple[list[int], list[int]]], int]:
    """Tokenized examples (truncated to cutoff_len) and the number of records skipped as malformed."""
    examples, skipped = [], 0
    for spec in cfg.dataset:
        for where, rec in read_records(spec.path):
            try:
                fmt = detect_format(rec, where) if spec.format == "auto" else spec.format
                if fmt != "text" and tok.chat_template is None:
                    raise ConfigError(f"{where}: {fmt} data needs a chat template, and the tokenizer has none; "
                                      "set chat_template in the config")
                ids, labels = render(to_messages(rec, fmt, where), tok, where)
            except DataError:
                if not cfg.skip_bad_records:
                    raise
                skipped += 1
                continue
            ids, labels = ids[: cfg.cutoff_len], labels[: cfg.cutoff_len]
            if any(l != -100 for l in labels[1:]):
                examples.append((ids, labels))
    if not examples:
        raise DataError("no trainable examples: every record was skipped or had no target tokens within cutoff_len")
    return examples, skipped


def check_fits(cfg: TrainConfig, hf_config, ecfg: EngineConfig, longest: int) -> EngineConfig:
    """The planner's check, before anything is allocated: GPU (when on CUDA) and host RAM. Returns
    ``ecfg`` with ``offload.host_weights``, ``offload.host_grad_buffers`` and ``offload.speculative_layers``
    "auto" decided (plan.auto_host)."""
    from ..model import ModelAdapter
    from ..plan import (DoesNotFit, ModelShape, Placement, auto_host, check_host_fits, config_host_bytes, fit,
                        gpu_bytes, host_memory, parse_bytes)

    shape = ModelShape.from_adapter(ModelAdapter(hf_config, ecfg.compute_dtype))
    seq = cfg.cutoff_len if cfg.packing else min(cfg.cutoff_len, longest)  # packed rows are always full
    batch = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    dt = 2 if ecfg.compute_dtype != torch.float32 else 4
    if ecfg.device == "cuda":
        limit = parse_bytes(ecfg.gpu_memory_limit) if ecfg.gpu_memory_limit else torch.cuda.get_device_properties(0).total_memory
        placement = fit(shape, batch, seq, limit, Placement.of(ecfg)) \
            if ecfg.gpu_memory_limit else Placement.of(ecfg, micro_batch=cfg.micro_batch_size)
        need = gpu_bytes(shape, batch, seq, placement, dt)["peak"]
        if need > limit:
            raise DoesNotFit(f"a step of {cfg.micro_batch_size} x {seq} tokens (x{cfg.gradient_accumulation_steps} "
                             f"accumulated) needs about {need / 2**30:.1f} GiB of GPU memory, over the "
                             f"{limit / 2**30:.1f} GiB available; set offload.gpu_memory_limit to let slideformer "
                             "split and offload, or lower micro_batch_size (see `slideformer plan`)")
    else:
        placement = Placement.of(ecfg, micro_batch=cfg.micro_batch_size)
    have = host_memory()
    ecfg = auto_host(ecfg, shape, batch, seq, placement, have, weights=cfg.offload.host_weights == "auto",
                     buffers=cfg.offload.host_grad_buffers == "auto", spares=cfg.offload.speculative_layers == "auto")
    check_host_fits(config_host_bytes(ecfg, shape, batch, seq, placement), have, ecfg, prefix="offload.")
    return ecfg


def auto_residency(cfg: TrainConfig, hf_config, ecfg: EngineConfig, examples) -> dict:
    """What trains on the GPU (``resident_layers``, ``resident_edges``) at this step's shape under the
    budget: the planner's call (plan.auto_residency)."""
    from ..model import ModelAdapter
    from .. import plan

    shape = plan.ModelShape.from_adapter(ModelAdapter(hf_config, ecfg.compute_dtype))
    seq = cfg.cutoff_len if cfg.packing else min(cfg.cutoff_len, max(len(ids) for ids, _ in examples))
    edges = None if cfg.offload.resident_edges == "auto" else cfg.offload.resident_edges
    return plan.auto_residency(ecfg, shape, cfg.micro_batch_size * cfg.gradient_accumulation_steps, seq, edges)


def _checkpoints(out: Path) -> list[Path]:
    found = [p for p in out.glob(f"{CKPT_PREFIX}*") if p.is_dir() and p.name[len(CKPT_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(CKPT_PREFIX):]))


def train(cfg: TrainConfig) -> dict:
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = cfg.bf16 if cfg.bf16 is not None else device == "cuda"
    out = Path(cfg.output_dir)
    tok = load_tokenizer(cfg)
    examples, skipped = build_examples(cfg, tok)
    per_step = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    steps_per_epoch = max(1, len(examples) // per_step)
    total = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * steps_per_epoch)
    warmup = int(cfg.warmup_ratio * total)
    o = cfg.offload
    ecfg = EngineConfig(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay,
                        max_grad_norm=cfg.max_grad_norm, device=device,
                        compute_dtype=torch.bfloat16 if bf16 else torch.float32, seed=cfg.seed,
                        gpu_memory_limit=o.gpu_memory_limit, window_slots=o.window_slots, prefetch_depth=o.prefetch_depth,
                        host_weights="persistent" if o.host_weights == "auto" else o.host_weights,
                        offload_activations=o.offload_activations,
                        activations_to_nvme=o.activations_to_nvme,
                        host_grad_buffers=4 if o.host_grad_buffers == "auto" else o.host_grad_buffers,
                        speculative_layers=0 if o.speculative_layers == "auto" else o.speculative_layers,
                        optimizer_threads=o.optimizer_threads,
                        offload_dir=o.offload_dir, nvme_fraction=o.nvme_fraction, nvme_master=o.nvme_master,
                        optimizer_state=o.optimizer_state,
                        resident_layers=0 if o.resident_layers == "auto" else o.resident_layers,
                        resident_edges=o.resident_edges is True,
                        loss_kernel=o.loss_kernel, fused_ops=o.fused_ops)
    from transformers import AutoConfig

    from ..presets import preset_config

    hf_config = preset_config("tiny") if cfg.model_name_or_path == "tiny" else AutoConfig.from_pretrained(cfg.model_name_or_path)
    if o.speculative_layers == "auto":  # (for the residency choice: check_fits then decides how many fit)
        from ..model import ModelAdapter
        from ..plan import ModelShape, spares_that_fit

        seq = cfg.cutoff_len if cfg.packing else min(cfg.cutoff_len, max(len(ids) for ids, _ in examples))
        ecfg = dataclasses.replace(ecfg, speculative_layers=spares_that_fit(
            ecfg, ModelShape.from_adapter(ModelAdapter(hf_config, ecfg.compute_dtype)),
            cfg.micro_batch_size * cfg.gradient_accumulation_steps, seq))
    if o.resident_layers == "auto" and device == "cuda":
        from ..plan import gpu_budget

        ecfg = dataclasses.replace(ecfg, **auto_residency(cfg, hf_config, ecfg, examples),
                                   gpu_memory_limit=gpu_budget(ecfg))
    ecfg = check_fits(cfg, hf_config, ecfg, max(len(ids) for ids, _ in examples))
    if cfg.model_name_or_path == "tiny":
        engine = SlideEngine.from_config(hf_config, ecfg)
    else:
        engine = SlideEngine.from_pretrained(cfg.model_name_or_path, ecfg)

    print(f"slideformer: {engine.describe()}", flush=True)
    start, epoch, offset = 0, 0, 0
    resume = cfg.resume_from_checkpoint
    if resume == "auto":
        found = _checkpoints(out)
        resume = str(found[-1]) if found else None
    if resume:
        state = engine.load_checkpoint(resume)
        start, epoch, offset = state["step"], state["epoch"], state["offset"]

    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    tb = _tensorboard(out)
    stop = {"requested": False}

    def on_sigint(signum, frame):
        stop["requested"] = True

    old_handler = signal.signal(signal.SIGINT, on_sigint)
    order = _permutation(len(examples), cfg.seed, epoch)
    params = engine.adapter.num_params
    history, t_last, tokens_since = [], time.perf_counter(), 0
    progress = _progress(cfg.progress, total, start)
    status = "finished"
    try:
        with engine:
            for step in range(start, total):
                mbs = []
                for _ in range(cfg.gradient_accumulation_steps):
                    need = 1 if cfg.packing else cfg.micro_batch_size
                    if offset + need > len(order):
                        epoch, offset = epoch + 1, 0
                        order = _permutation(len(examples), cfg.seed, epoch)
                    if cfg.packing:  # as many samples as fill micro_batch_size rows of cutoff_len tokens
                        window = [examples[i] for i in order[offset: offset + cfg.micro_batch_size * cfg.cutoff_len]]
                        mb = pack_batch(window, cfg.micro_batch_size, cfg.cutoff_len, tok.pad_token_id)
                        offset += mb.pop("examples_used")
                        mb["attention_mask"] = None
                    else:
                        picked = [examples[i] for i in order[offset: offset + cfg.micro_batch_size]]
                        offset += cfg.micro_batch_size
                        mb = pad_batch(picked, tok.pad_token_id)
                    mbs.append(mb)
                lr = lr_at(step, cfg.learning_rate, cfg.lr_scheduler_type, warmup, total)
                engine.set_lr(lr)
                loss = engine.train_step(mbs)
                if not math.isfinite(loss):
                    raise NonFiniteLoss(f"step {step + 1}: loss is {loss}; stopping without saving this state "
                                        f"(the last checkpoint in {out} is intact). Lower learning_rate "
                                        f"(now {cfg.learning_rate}) or set max_grad_norm.")
                tokens_since += sum(m["input_ids"].numel() if m["attention_mask"] is None  # packed: full rows
                                    else int(m["attention_mask"].sum()) for m in mbs)
                done = step + 1
                if done % cfg.logging_steps == 0 or done == total:
                    now = time.perf_counter()
                    rec = {"step": done, "loss": loss, "lr": lr, "grad_norm": engine.last_grad_norm,
                           "tokens_per_s": tokens_since / (now - t_last),
                           "tflops": 6 * params * tokens_since / (now - t_last) / 1e12,
                           "gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0,
                           "host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                           "epoch": epoch}
                    t_last, tokens_since = now, 0
                    history.append(rec)
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(rec) + "\n")
                    if tb:
                        for k in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops", "gpu_mem_gib", "host_rss_gib"):
                            tb.add_scalar(f"train/{k}", rec[k], done)
                    progress(done, rec)
                state = {"step": done, "epoch": epoch, "offset": offset, "skipped_records": skipped}
                if (cfg.save_steps and done % cfg.save_steps == 0) or done == total or stop["requested"]:
                    _save(engine, tok, out, done, state, cfg.save_total_limit)
                if stop["requested"]:
                    status = "interrupted"
                    break
    finally:
        signal.signal(signal.SIGINT, old_handler)
        progress(None, None)
        if tb:
            tb.close()
    if history:
        _plot_loss(history, out / "loss.png")
    final = _checkpoints(out)
    return {"status": status, "steps": history[-1]["step"] if history else start, "history": history,
            "checkpoint": str(final[-1]) if final else None, "skipped_records": skipped}


def _permutation(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def _save(engine, tok, out: Path, step: int, state: dict, limit: int | None) -> None:
    path = engine.save_checkpoint(out / f"{CKPT_PREFIX}{step}", state)
    tok.save_pretrained(str(path))  # after the atomic rename: a missing tokenizer is recoverable, weights are not
    if limit:
        for old in _checkpoints(out)[:-limit]:
            shutil.rmtree(old, ignore_errors=True)


def _tensorboard(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(out / "tensorboard"))


def _progress(enabled: bool, total: int, start: int):
    """A rich progress bar (or plain lines when disabled): step/total, loss, lr, grad-norm, tok/s, memory, ETA."""
    if not enabled:
        def plain(done, rec):
            if rec:
                print(_line(done, total, rec), flush=True)
        return plain
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"),
                   TimeRemainingColumn())
    task = bar.add_task("train", total=total, completed=start, info="")
    bar.start()

    def update(done, rec):
        if done is None:
            bar.stop()
            return
        bar.update(task, completed=done, info=_line(None, total, rec))
    return update


def _line(done, total, r) -> str:
    head = f"step {done}/{total}  " if done is not None else ""
    gn = f"{r['grad_norm']:.3f}" if r["grad_norm"] is not None else "-"
    return (f"{head}loss {r['loss']:.4f}  lr {r['lr']:.2e}  grad-norm {gn}  {r['tokens_per_s']:.0f} tok/s  "
            f"{r['tflops']:.1f} TFLOPS  GPU {r['gpu_mem_gib']:.1f} GiB  host {r['host_rss_gib']:.1f} GiB")


def _plot_loss(history: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
