"""slideformer: fine-tune language models larger than GPU memory, on one GPU or several.

``slideformer train`` with no arguments fine-tunes the bundled tiny model on the bundled sample data:
that is what ``make demo`` runs. ``slideformer bench`` measures a training step (see bench/).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from pathlib import Path

from .signals import Interrupted, Signals


# Exit codes (also in `slideformer train --help` and the README); a signal ends a run with 128 + its number.
EXIT_OK, EXIT_BUG, EXIT_USAGE, EXIT_DOES_NOT_FIT, EXIT_NONFINITE, EXIT_IO, EXIT_RANK_LOST = 0, 1, 2, 3, 4, 5, 7
EXIT_PIPE = 141  # (128 + SIGPIPE, as a shell's tools end when their output's reader has gone)
EXIT_CODES_HELP = ("Exit codes: 0 done, 1 unexpected failure (traceback in slideformer-error.log), 2 bad config, "
                   "data, model or checkpoint, 3 does not fit (or ran out of memory), 4 non-finite loss or gradient, "
                   "5 a file could not be written or read (full or read-only disk, permissions), 6 no progress within "
                   "the watchdog's limit (every thread's stack printed), 7 another rank of a torchrun job failed or "
                   "was lost, 129 SIGHUP, 130 SIGINT, 141 the output's reader closed it (`| head`), 143 SIGTERM (a "
                   "checkpoint was saved if a step had finished); 3 also where the process neared its host memory "
                   "budget (a checkpoint was saved).")


def cmd_train(args) -> int:
    from .train.config import load_config
    from .train.loop import train

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        config, overrides = None, [config] + overrides  # only overrides were given
    cfg = load_config(config, overrides)
    args.log_dir = cfg.output_dir
    from .train.launch import check_room, launch, processes

    n = processes(cfg.nproc_per_node, cfg.device)
    if n > 1:  # (this command again, as n ranks: train/launch.py)
        check_room(n, cfg.offload.host_memory_limit)
        return launch(n, ["train", *([config] if config is not None else []), *overrides])
    result = train(cfg)
    code = 128 + result["signal"] if result["status"] == "interrupted" else EXIT_OK
    if not result.get("lead", True):  # (another rank of a torchrun job: rank 0 says it)
        return code
    h = result["history"]
    if h:
        span = (f"loss {h[0]['loss']:.3f} at step {h[0]['step']}" if len(h) == 1 else  # (this run's logged steps)
                f"loss {h[0]['loss']:.3f} at step {h[0]['step']} -> {h[-1]['loss']:.3f} at step {h[-1]['step']}")
        print(f"{span}; checkpoint: {result['checkpoint']} (loads with transformers' from_pretrained)")
    elif result["status"] == "finished":
        print(f"nothing to train: the run is already at step {result['steps']} (checkpoint: {result['checkpoint']}); "
              "raise max_steps or num_train_epochs to train on")
    if result["skipped_records"]:
        print(f"skipped {result['skipped_records']} malformed record(s) (skip_bad_records: true)")
    if result.get("dropped_as_met"):  # (data read as the steps reached it: met on the way)
        print(f"left out {result['dropped_as_met']} sample(s) with no target token within cutoff_len")
    if result.get("truncated_as_met"):
        print(f"cut {result['truncated_as_met']} sample(s) longer than cutoff_len {cfg.cutoff_len} there (their tokens "
              "past it left out)")
    if result["dropped_steps"]:
        print(f"dropped {result['dropped_steps']} step(s) with a non-finite loss or gradient norm "
              "(skip_nonfinite_steps: true)")
    if result["status"] == "interrupted":
        import signal

        name = signal.Signals(result["signal"]).name
        how = ("the same command continues the run" if cfg.resume_from_checkpoint == "auto" else
               "the same command with resume_from_checkpoint=auto continues the run")  # (else: it starts over)
        print(f"{name}: stopped after step {result['steps']}; saved {result['checkpoint']}; {how}", file=sys.stderr)
    return code


def cmd_data(args) -> int:
    from .train.config import load_config
    from .train.loop import describe_data

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        config, overrides = None, [config] + overrides  # only overrides were given
    describe_data(load_config(config, overrides), args.samples)
    return EXIT_OK


def cmd_plan(args) -> int:
    import json
    from dataclasses import replace

    from . import EngineConfig
    from .config import Placement
    from .model import ModelAdapter, UnsupportedModelError
    from .machine import Machine, MachineRates, disk_free, gpu_memory, host_memory
    from .plan import Auto, ModelShape, nvme_layer_count, parse_bytes, predicted_step, resolve
    from .plan.resolve import tier_bytes
    from .plan.memory import (PROCESS_BYTES, check_host_limit, config_rank_host_bytes, fmt_bytes, host_budget,
                              mid_layers, process_allowance, processes_over, saved_layers, user_bytes)
    from .presets import PRESETS, preset_config

    from .config import ConfigError

    if args.model in PRESETS:
        config = preset_config(args.model)
    else:
        from transformers import AutoConfig

        if not (Path(args.model) / "config.json").is_file():
            raise ConfigError(f"--model {args.model}: not a preset ({', '.join(PRESETS)}) nor a local folder with "
                              "config.json")
        try:
            config = AutoConfig.from_pretrained(args.model)
        except Exception as e:  # (as train says it)
            raise ConfigError(f"{Path(args.model) / 'config.json'}: transformers cannot read it "
                              f"({' '.join(str(e).split())[:240]})") from e
    for flag in ("gpu_memory", "cpu_memory", "host_memory_limit", "disk_space"):
        value = getattr(args, flag)
        try:
            if value is not None:
                user_bytes(value)
        except ValueError as e:
            raise ConfigError(f"--{flag.replace('_', '-')}: {e}") from None
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and args.seq_len > positions:  # (as train refuses a cutoff_len past them)
        raise ConfigError(f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings {positions}")
    tier_only = [f for f, given in (("--nvme-fraction", args.nvme_fraction != "auto"),
                                    ("--nvme-master", args.nvme_master),
                                    ("--activations-to-nvme", args.activations_to_nvme),
                                    ("--disk-space", args.disk_space is not None)) if given]
    if args.offload_dir and Path(args.offload_dir).exists() and not Path(args.offload_dir).is_dir():  # (as train)
        raise ConfigError(f"--offload-dir {args.offload_dir} is a file; give a folder (the NVMe tier's)")
    if tier_only and not args.offload_dir:
        raise ConfigError(f"{', '.join(tier_only)} {'describe' if len(tier_only) > 1 else 'describes'} the NVMe tier: "
                          "give its folder too (--offload-dir)")
    try:
        adapter = ModelAdapter(config)
    except UnsupportedModelError as e:  # (planned as train would run it where it says how: eager attention)
        if "set attn_implementation: eager" not in str(e):
            raise
        adapter = ModelAdapter(config, attn_implementation="eager")
    shape = ModelShape.from_adapter(adapter)
    rates = MachineRates(gpu_flops=args.gpu_tflops * 1e12, pcie_bytes_per_s=args.pcie_gbps * 1e9,
                         disk_read_bytes_per_s=args.disk_read_gbps * 1e9,
                         disk_write_bytes_per_s=args.disk_write_gbps * 1e9,
                         disk_bytes_per_s=args.disk_gbps * 1e9 if args.disk_gbps else None,
                         optimizer_params_per_s=args.cpu_update_gparams * 1e9)
    disk = parse_bytes(args.disk_space) if args.disk_space is not None else \
        disk_free(args.offload_dir) if args.offload_dir and Path(args.offload_dir).exists() else None
    machine = Machine(ram=parse_bytes(args.cpu_memory) if args.cpu_memory is not None else host_memory(),
                      gpu=parse_bytes(args.gpu_memory) if args.gpu_memory is not None else gpu_memory(), rates=rates,
                      disk=disk, ranks=args.nproc_per_node)
    cpu_limit, gpu_limit = machine.ram, machine.gpu
    check_host_limit(args.host_memory_limit, cpu_limit, "--host-memory-limit",
                     "--cpu-memory" if args.cpu_memory else "this machine")
    # the engine settings `slideformer train` would use (clipping by default: a gradient buffer per layer)
    placement = Placement(nvme_master=args.nvme_master and bool(args.offload_dir),
                          **({} if args.nvme_fraction == "auto" else {"nvme_fraction": args.nvme_fraction}),
                          activations_to_nvme=args.activations_to_nvme and bool(args.offload_dir),
                          **({} if args.host_weights == "auto" else  # (a count past the layers: all, as train)
                             {"host_weights": args.host_weights if isinstance(args.host_weights, str) else
                              min(args.host_weights, shape.layers)}))
    as_trained = EngineConfig(device="cuda", max_grad_norm=args.max_grad_norm or None,
                              host_memory_limit=args.host_memory_limit,
                              optimizer_state=args.optimizer_state, offload_dir=args.offload_dir, fp8=args.fp8,
                              placement=placement)
    replace(as_trained, device="cpu").validate()  # what train would refuse, refused here too (any machine's GPU)
    host_auto = dict(host_weights=args.host_weights == "auto", host_grad_buffers=True, speculative_layers=True,
                     nvme_fraction=args.nvme_fraction == "auto", nvme_master=not args.nvme_master)

    def streamed(b: int):
        """Every layer streamed, under the whole GPU (the lines below describe this)."""
        return resolve(replace(as_trained, gpu_memory_limit=gpu_limit), Auto(resident_layers=False, resident_edges=False,
                                                                             **host_auto), shape, b, args.seq_len, machine)

    def trained(b: int, cfg=as_trained):
        """What `train` would do: units on the GPU under its budget (--gpu-memory, else the card less its margin)."""
        if gpu_limit is None:
            return None
        return resolve(replace(cfg, gpu_memory_limit=args.gpu_memory), Auto(**host_auto), shape, b, args.seq_len,
                       machine)

    def fits_at(b: int, s=None) -> bool:
        """The GPU holds batch ``b`` with every layer streamed, and RAM holds it so or with what `train` would
        put on the GPU (those units keep no host state)."""
        s = s or streamed(b)
        if s.binds == "gpu":
            return False
        return s.fits or bool((t := trained(b)) and t.fits)

    plan = streamed(args.batch_size)
    fits_gpu, reason = plan.binds != "gpu", plan.problem
    placement, chosen_host, h, g = plan.placement, plan.config.placement, plan.host, plan.gpu
    host_total = sum(h.values())
    state_limit = host_budget(plan.config, machine.rank_ram)[1]  # (one process's, under several)
    fits = fits_at(args.batch_size, plan)
    max_batch, most = 0, 4096  # (searched up to ``most``: a batch that large is said as "or more")
    for b in range(1, most + 1):  # (counted: a batch's micro-batches divide it, so a larger one may fit where
        if not fits_at(b):        # a smaller prime one does not; the first that does not is what is said)
            break
        max_batch = b
    compact = args.optimizer_state != "fp32"
    nvme_layers = nvme_layer_count(plan.config, shape.layers)  # (the tier's layers as resolved)
    clip = as_trained.max_grad_norm is not None  # the update then waits for backward's global norm
    out = {"model": args.model, "params": shape.params, "seq_len": args.seq_len, "batch_size": args.batch_size,
           "clipping": clip,
           "binds": plan.binds, "gpu_bytes": g["peak"], "gpu": g, "host_bytes": host_total, "host": h,
           "nvme_bytes": tier_bytes(plan.config, plan.shape, args.batch_size, args.seq_len, placement),
           "gpu_limit": gpu_limit,
           "host_limit": parse_bytes(args.host_memory_limit) if args.host_memory_limit else cpu_limit,
           "host_state_limit": state_limit, "fits": fits, "max_batch_size": max_batch,
           "placement": vars(placement), "host_weights": chosen_host.host_weights,
           "host_grad_buffers": chosen_host.host_grad_buffers, "speculative_layers": chosen_host.speculative_layers}
    if args.nproc_per_node > 1:  # the machine's RAM: every process's state, and each process itself
        ranks = config_rank_host_bytes(plan.config, plan.shape, args.batch_size, args.seq_len, placement)
        out.update(nproc_per_node=args.nproc_per_node,
                   host_bytes_machine=sum(sum(r.values()) for r in ranks) + PROCESS_BYTES * len(ranks))
    timing = predicted_step(plan, plan.shape, args.batch_size, args.seq_len, machine.rank_rates)
    if gpu_limit and fits_gpu:  # what training some layers on the GPU would buy
        def as_train_would(cfg) -> dict:
            """`train`'s step with ``cfg`` (its resident units chosen) and its host bytes."""
            p = trained(args.batch_size, cfg)
            return {**predicted_step(p, p.shape, args.batch_size, args.seq_len, machine.rank_rates),
                    "host_bytes": sum(p.host.values()),
                    "resident_layers": p.config.placement.resident_layers,
                    "resident_edges": p.config.placement.resident_edges, "fits": p.fits}

        t = as_train_would(as_trained)
        out["suggested_resident_layers"] = t["resident_layers"]
        out["suggested_resident_edges"] = t["resident_edges"]
        out["predicted_step_s_resident"] = t["step_s"]
        # resident units keep no host state: what train's RAM holds with them (the lines above: none resident)
        out["host_bytes_resident"] = t["host_bytes"]
        if clip:
            out["predicted_step_s_resident_unclipped"] = as_train_would(replace(as_trained, max_grad_norm=None))["step_s"]
        if not compact and not args.nvme_master:
            # where the CPU update bounds the step: compact state moves 18 instead of 28 bytes a parameter,
            # and its resident layers take 10 instead of 16 GPU bytes
            tc = as_train_would(replace(as_trained, optimizer_state="compact"))
            # (a plan that does not fit is no hint; nor is a saving under a hundredth of a second, a tiny model's)
            if tc["fits"] and tc["step_s"] < 0.95 * t["step_s"] and t["step_s"] - tc["step_s"] >= 0.01:
                out["predicted_step_s_compact"] = tc["step_s"]
                out["host_bytes_compact"] = tc["host_bytes"]
    gib = fmt_bytes
    if fits:
        verdict = "fits"
    elif not fits_gpu:
        verdict = "does NOT fit the GPU: " + re.sub(r"(?<![\w.])gpu_memory_limit", "--gpu-memory", reason)  # (its flag)
    elif (disk := next((q for q in (plan, trained(args.batch_size)) if q and q.binds == "disk"), None)):
        verdict = f"does NOT fit the disk: {disk.problem}"
    else:  # the GPU holds it; host RAM binds
        need = out.get("host_bytes_resident", host_total)
        share = f", shared by {args.nproc_per_node} processes" if args.nproc_per_node > 1 else ""
        against = (f"{gib(state_limit)} (--host-memory-limit{share}, less the process itself)"
                   if args.host_memory_limit else f"{gib(state_limit)} (95% of "
                   f"{gib(cpu_limit)}, {'--cpu-memory' if args.cpu_memory else 'this machine'}{share}, less the "
                   "process itself)")
        levers = [] if args.offload_dir else ["the NVMe tier (--offload-dir)"]
        if args.offload_dir and args.nvme_fraction != "auto" and args.nvme_fraction < 1:
            levers.append("more of the NVMe tier (--nvme-fraction)")
        if clip and h.get("grads", 0) > need / 4:  # (clipping holds every layer's gradient until the norm)
            levers.append(f"no clipping (--max-grad-norm 0: a few gradient buffers, not one per layer: "
                          f"{gib(h['grads'])} now)")
        levers.append("a larger --gpu-memory" if args.optimizer_state == "8bit" else
                      "--optimizer-state 8bit (6.06 bytes a parameter)" if compact else
                      "--optimizer-state compact or 8bit (8 or 6.06 instead of 14 bytes a parameter)")
        verdict = (f"does NOT fit host RAM: about {gib(need)} of state against {against}; {' or '.join(levers)} "
                   "would lower it")
        if (allowance := process_allowance(plan.config, machine.rank_ram)) <= PROCESS_BYTES:  # (no state fits)
            verdict = (f"does NOT fit host RAM: {processes_over(args.nproc_per_node, allowance)} allowed "
                       + ("(--host-memory-limit" + share + ")" if args.host_memory_limit else
                          f"(95% of {gib(cpu_limit)}, {'--cpu-memory' if args.cpu_memory else 'this machine'}{share})"))
        if plan.disk_short:  # (the disk short too: said with it)
            verdict += f"; and {plan.disk_short}"
    out["verdict"] = verdict
    out["predicted_step_s"] = timing["step_s"]
    out["predicted_tokens_per_s"] = args.batch_size * args.seq_len / timing["step_s"]
    out["timing"] = timing
    if args.json:
        print(json.dumps(out))
    else:
        n = args.nproc_per_node
        count = (f"{shape.params / 1e9:.2f} B" if shape.params >= 1e8 else f"{shape.params / 1e6:.2f} M"
                 if shape.params >= 1e5 else f"{shape.params}")
        print(f"{args.model}: {count} params, batch {args.batch_size} x seq {args.seq_len}"
              + (f" per GPU, {n} processes (data parallel): each GPU's and one process's figures, the one "
                 "that holds the most" if n > 1 else ""))
        print("GPU  " + ", ".join(f"{k} {gib(v)}" for k, v in g.items()) + (
            f"  (limit {gib(gpu_limit)})" if gpu_limit else
            "  (no GPU here and no --gpu-memory: no GPU size assumed, none checked; pass e.g. --gpu-memory 24GiB)"))
        print("host " + ", ".join(f"{k} {gib(v)}" for k, v in h.items()) + f" = {gib(host_total)}  (limit {gib(out['host_state_limit'])} of state; "
              f"host_weights {chosen_host.host_weights}, gradient buffers "
              f"{chosen_host.host_grad_buffers or 'one per layer'}"
              + (f", {chosen_host.speculative_layers} speculative layers" if clip else "") + ")")
        if n > 1:
            print(f"host of the machine: {gib(out['host_bytes_machine'])} for {n} processes' state and the processes "
                  f"themselves (the state is split by unit; each keeps its own gradient buffers and layer inputs)")
        if out["nvme_bytes"]:
            print(f"NVMe {gib(out['nvme_bytes'])} under {args.offload_dir}")
        print(f"placement: micro-batch {min(placement.micro_batch, args.batch_size)}, "
              f"{min(placement.gpu_activation_layers, shape.layers)}/{shape.layers} layer inputs on the GPU"
              + (f", MLPs in {placement.mlp_chunk_tokens}-token chunks" if placement.mlp_chunk_tokens else "")
              + (f", {saved_layers(shape, placement)} layers' products kept (no matmul recompute)"
                 if saved_layers(shape, placement) else "")
              + (f", {mid_layers(shape, placement)} offloaded layers' sums after attention too (no output "
                 "projection recomputed)" if mid_layers(shape, placement) else "")
              + (f", the lm_head gradient in {placement.head_slice}-row slices" if placement.head_slice else "")
              + (", the first streamed layer's update on the GPU (its fp32 state crosses each step, beside the "
                 "step boundary)" if placement.gpu_first_update else "")
              + (f", {placement.window_slots} window slots" if placement.window_slots != 3 else ""))
        model = ("of the H200 machine, within 6% of its unclipped 4B and 8B steps" if rates == MachineRates() else
                 "at the rates given")
        each = f" per GPU, {n * out['predicted_tokens_per_s']:.1f} in all" if n > 1 else ""
        print(f"predicted step {timing['step_s']:.2f} s ({out['predicted_tokens_per_s']:.1f} tok/s{each} by the time "
              f"model {model}): GPU {timing['gpu_compute_s']:.2f} s"
              + (f" + {timing['peer_s']:.2f} s between GPUs (weights and gradients over NVLink)" if n > 1 else "")
              + ", "
              f"optimizer {timing['optimizer_s']:.2f} s"
              + (f" (clipping: it follows backward, {timing['after_backward_s']:.2f} s)"
                 if clip and timing["after_backward_s"] >= timing["step_s"] else "")
              + f", weights in {timing['h2d_s']:.2f} s" + (f", NVMe tier {timing['nvme_s']:.1f} s" if nvme_layers else "")
              + (f", embedding update at the step boundary {timing['edge_stall_s']:.2f} s"
                 if timing["edge_stall_s"] and not clip else ""))
        if "suggested_resident_layers" in out:
            edges = " and resident_edges" if out["suggested_resident_edges"] else ""
            print(f"with resident_layers={out['suggested_resident_layers']}{edges} (trained on the GPU): predicted step "
                  f"{out['predicted_step_s_resident']:.2f} s, host {gib(out['host_bytes_resident'])}")
        unclipped = out.get("predicted_step_s_resident_unclipped")
        if unclipped and unclipped < 0.95 * out["predicted_step_s_resident"] - 0.01:
            print(f"clipping (max_grad_norm) makes the CPU update of the layers without a spare state wait for "
                  f"backward's global norm; without it: predicted step {unclipped:.2f} s")
        if "predicted_step_s_compact" in out:
            bound = "the NVMe tier" if timing["nvme_s"] >= timing["optimizer_s"] else "the CPU optimizer"
            print(f"bound by {bound}: with optimizer_state=compact (bf16 master halves and moments; it matched "
                  f"fp32 state in bench/NOTES.md's fine-tuning run) predicted step {out['predicted_step_s_compact']:.2f} s, "
                  f"host {gib(out['host_bytes_compact'])}")
        print(f"{verdict}; largest batch that fits: {max_batch}{' or more' if max_batch == most else ''}")
    return EXIT_OK if fits else EXIT_DOES_NOT_FIT


def _not_a_checkpoint(src: Path) -> str:
    """Why ``src`` cannot be exported, and what can: a run's folder names its newest checkpoint."""
    from .train.outdir import RUN_FILE, _step_of

    if not src.exists():
        return f"{src} does not exist; give a checkpoint folder (a run's output_dir/checkpoint-N)"
    if not src.is_dir():
        return f"{src} is a file; give a checkpoint folder (a run's output_dir/checkpoint-N)"
    steps = sorted((n, p) for p in src.iterdir() if (n := _step_of(p)) is not None and (p / "config.json").is_file())
    if steps:
        return (f"{src} is a run's folder, not one checkpoint; export one of its {len(steps)} checkpoint(s), "
                f"e.g. the newest: {steps[-1][1]}")
    if (src / RUN_FILE).is_file():
        return f"{src} is a run's folder with no checkpoint yet; export one once it has saved (checkpoint-N)"
    return f"{src} is not a slideformer checkpoint (no config.json)"


def _blocked(dst: Path, folder: Path) -> int:
    print(f"error: export target {dst} holds a folder {folder.relative_to(dst)} where the export writes a file; move "
          "it away, or export to a new folder", file=sys.stderr)
    return EXIT_USAGE


def cmd_export(args) -> int:
    """Copy a checkpoint's Hugging Face files (weights, config, tokenizer) without the training state,
    after checking them against the checkpoint's checksums."""
    import shutil

    from .checkpoint.state import STATE_DIR, TRAINER, is_checkpoint_dir, verify_checkpoint

    src, dst = Path(args.checkpoint), Path(args.output_dir)
    if not (src / "config.json").is_file():
        print(f"error: {_not_a_checkpoint(src)}", file=sys.stderr)
        return EXIT_USAGE
    if (src / STATE_DIR).exists() or (src / STATE_DIR / TRAINER).is_file():
        verify_checkpoint(src)  # (corrupt, altered or missing its metadata: refused, naming the file)
    else:  # no checksums to check against (a plain Hugging Face folder): its weight files at least readable
        from .checkpoint.loader import readable_weights

        readable_weights(src)
    rs, rd = src.resolve(), dst.resolve()
    if rd == rs or rd.is_relative_to(rs) or rs.is_relative_to(rd):
        print(f"error: export target {dst} overlaps the checkpoint {src}; choose a folder outside it", file=sys.stderr)
        return EXIT_USAGE
    if dst.exists() and not dst.is_dir():
        print(f"error: export target {dst} is a file; give a folder", file=sys.stderr)
        return EXIT_USAGE
    if is_checkpoint_dir(dst):  # (--overwrite too: its weights would no longer match its state or checksums)
        print(f"error: export target {dst} is a training checkpoint (it has {STATE_DIR}/); export to a new folder",
              file=sys.stderr)
        return EXIT_USAGE
    if dst.exists() and any(dst.iterdir()) and not args.overwrite:
        print(f"error: export target {dst} exists and is not empty; choose a new folder, or pass --overwrite "
              "(its model weights and files of the same names are replaced)", file=sys.stderr)
        return EXIT_USAGE
    if args.dtype and not (src / STATE_DIR).is_dir():
        print(f"error: --dtype rewrites the weights from the training state, and {src} has no {STATE_DIR}/; export "
              "it without --dtype", file=sys.stderr)
        return EXIT_USAGE
    files = []
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if rel.parts[0] == STATE_DIR or p.name.endswith(".tmp"):
            continue
        if args.dtype and (p.name.startswith("model") and p.name.endswith((".safetensors", ".index.json"))
                           or p.name == "config.json"):
            continue  # (written below, in the dtype asked for)
        if p.is_symlink() and not p.resolve().is_relative_to(rs):
            print(f"error: {p} is a link to {p.resolve()}, outside the checkpoint; export copies only the "
                  "checkpoint's own files", file=sys.stderr)
            return EXIT_USAGE
        if p.is_file():
            files.append(rel)
    names = files + ([Path("config.json")] if args.dtype else [])  # (the weight files' names: once staged, below)
    if blocked := next((dst / f for f in names if (dst / f).is_dir() and not (dst / f).is_symlink()), None):
        return _blocked(dst, blocked)
    made = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    import torch
    from safetensors import SafetensorError

    from .checkpoint.export import (drop_staged, forget, place, pretrained_changes, stage_from_state, stale_staged,
                                    staged_file, stale_weights)
    from .signals import undoable

    for folder in {dst} | {(dst / rel).parent for rel in files}:  # (a killed export's temporary files)
        for p in stale_staged(folder, {f.name for f in names}):
            p.unlink(missing_ok=True)
    had = set(dst.rglob("*"))

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}[args.dtype]
    staged, weights = [], None  # (temporary, final) names: nothing in the target changes until all are written

    committed = []  # (what place set aside, once every file is in place: from then nothing is undone)

    def undo():
        if committed:
            return
        drop_staged(staged + (weights[1] if weights else []))
        for p in sorted(set(dst.rglob("*")) - had, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                p.rmdir() if p.is_dir() else p.unlink()
        if made:
            shutil.rmtree(dst, ignore_errors=True)

    with undoable(f"the export stopped; {dst} is left as it was" if not made else
                  f"the export stopped; nothing was written ({dst} removed)"):
        try:
            for rel in files:
                target = dst / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                staged.append((staged_file(target, lambda tmp, rel=rel: shutil.copyfile(src / rel, tmp)), target))
            if dtype is not None:
                weights = stage_from_state(src, dst, dtype)
            # (the weight files' names, known once staged; the rest were checked before: a rename onto a folder
            # fails, and the change is undone)
            blocked = next((f for _, f in (weights[1] if weights else []) if f.is_dir() and not f.is_symlink()),
                           None)
            if blocked is not None:
                undo()
                return _blocked(dst, blocked)
            # every file renamed into place as one change, a failure midway putting back what was there; the
            # model's weight files are replaced as a set (a stale shard index or single file would shadow them),
            # with its config where the weights are written again
            if weights is not None:
                staged, remove = pretrained_changes(dst, weights[0], dtype, staged + weights[1])
                weights = None  # (its files are among ``staged`` now)
            else:
                remove = stale_weights(dst, [str(f) for f in files])
            committed.append(place(staged, remove))
        except BaseException as e:  # (a full disk, weights not finite, a file that cannot be replaced, a signal)
            undo()
            if not isinstance(e, (OSError, SafetensorError)):
                raise
            code = getattr(e, "errno", None) or int((re.search(r"os error (\d+)", str(e)) or [0, 0])[1])
            fn = getattr(e, "filename", None)  # (a file of the target's that could not be replaced, named)
            at = f"{fn}: " if fn and Path(fn).is_relative_to(dst) and not str(fn).endswith(".tmp") else ""
            raise OSError(code, f"export to {dst} failed ({at}{os.strerror(code) if code else e}); {dst} is left as "
                                "it was; free space there, make it writable or choose another folder, then export "
                                "again") from e
    forget(committed[0])
    print(f"exported {src} -> {dst} ({len({final for _, final in staged})} files)")
    return EXIT_OK


def _exit_code(e: BaseException) -> int | None:
    """The documented exit code of an error a user can cause; None for a bug."""
    from .checkpoint import CheckpointError
    from .checkpoint.state import CorruptCheckpointError, NonFiniteStateError
    from .config import ConfigError
    from .data import DataError
    from .data.batches import BatchError
    from .model import UnsupportedModelError
    from .parallel import RankLost
    from .plan import DoesNotFit
    from .train.loop import HostMemoryExceeded, NonFiniteLoss

    if isinstance(e, Interrupted):
        return 128 + e.signum
    if isinstance(e, KeyboardInterrupt):
        return 130
    if _out_of_memory(e):
        return EXIT_DOES_NOT_FIT
    for types, code in (((ConfigError, DataError, CorruptCheckpointError, CheckpointError, UnsupportedModelError,
                          BatchError), EXIT_USAGE), ((DoesNotFit, HostMemoryExceeded), EXIT_DOES_NOT_FIT),
                        ((NonFiniteLoss, NonFiniteStateError), EXIT_NONFINITE), ((OSError,), EXIT_IO),
                        ((RankLost,), EXIT_RANK_LOST)):
        if isinstance(e, types):
            return code
    return None


def _out_of_memory(e: BaseException) -> str | None:
    """Which memory ran out (host RAM: a MemoryError, or torch's CPU allocator failing; the GPU's: torch's
    OutOfMemoryError), or None (the memory guard's HostMemoryExceeded says its own line)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(e, torch.OutOfMemoryError):
        return "GPU"
    return "host" if type(e) is MemoryError or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e)) \
        else None


def _reader_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it (its later writes, and Python's flush at
    exit, then go nowhere: it is pointed at /dev/null)."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        if not any(ev & select.POLLERR for _, ev in poll.poll(0)):
            return False
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
        return True
    except (OSError, ValueError, AttributeError):  # (no descriptor: a library caller's stdout)
        return False


def _say(line: str) -> None:
    """A run's error line, on stderr; a rank of our own launcher's job leaves it for the launcher, which says
    each distinct line of its ranks once (train/launch.py)."""
    from .signals import say

    if not say(line):
        print(line, file=sys.stderr)


def _one_line(e: BaseException) -> str:
    if isinstance(e, KeyboardInterrupt):
        return (e if isinstance(e, Interrupted) else Interrupted(2)).line()
    if memory := _out_of_memory(e):
        first = (str(e).strip().splitlines() or [""])[0][:200]
        what = f"{type(e).__name__}: {first}" if first and memory == "host" else first or type(e).__name__
        return (f"error: out of {memory} memory ({what}): " + (
            "set offload.host_memory_limit below what this machine has free (the planner then keeps less in RAM), "
            "use offload.optimizer_state: 8bit or offload.offload_dir" if memory == "host" else
            "set offload.gpu_memory_limit below what the GPU has free (another process on it?)")
            + ", or fewer tokens a micro-batch (micro_batch_size, cutoff_len); then resume")
    if isinstance(e, OSError) and e.strerror:
        import errno

        name = os.fsdecode(e.filename) if isinstance(e.filename, (bytes, str)) else e.filename
        where = f"{name}: " if name and str(name) not in e.strerror else ""
        fix = {errno.ENOSPC: "free space there or choose another folder", errno.EDQUOT: "free space there or choose "
               "another folder", errno.EROFS: "choose a writable folder", errno.EACCES: "check its permissions or "
               "choose another folder", errno.EPERM: "check its permissions or choose another folder"}.get(e.errno)
        return f"error: {where}{e.strerror}" + (f"; {fix}" if fix and "; " not in e.strerror else "")
    text = str(e).strip() or type(e).__name__
    return "error: " + " ".join(text.split())  # one line, whatever the message held


def _thread_failed(args) -> None:
    """A library's background thread failed: its traceback goes to a log, not the terminal; whatever the
    failure means for the run (a full disk) surfaces in the main thread as one line."""
    import tempfile
    import traceback

    try:
        with open(Path(tempfile.gettempdir()) / f"slideformer-threads-{os.getpid()}.log", "a") as f:
            f.write("".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)))
    except OSError:
        pass


def _log_bug(log_dir: str | None) -> Path:
    """The traceback of an unexpected failure: under the run's output_dir when it exists, else the temp folder."""
    import tempfile
    import traceback

    from .train.outdir import ERROR_LOG, RUN_FILE

    # (into output_dir only where a run has marked it as its own: never into a folder it refused)
    folder = Path(log_dir) if log_dir and (Path(log_dir) / RUN_FILE).is_file() else Path(tempfile.gettempdir())
    rank = os.environ.get("RANK", "0")  # (each rank of a torchrun job its own file)
    path = folder / (f"slideformer-error-{os.getpid()}.log" if folder == Path(tempfile.gettempdir())
                     else ERROR_LOG if rank == "0" else ERROR_LOG.replace(".log", f"-rank{rank}.log"))
    try:
        path.write_text(traceback.format_exc())
    except OSError:
        path = Path("<not written>")
    return path


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in one line, naming the help that lists the options (its own prints the whole
    usage block first); the subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


# EngineConfig's defaults, written out so that parsing (and --help) does not import torch (a test holds them equal)
PLAN_DEFAULTS = {"optimizer_state": "fp32"}


def _whole(v: str) -> int:
    if not v.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {v!r}")
    return int(v)


def _processes(v: str) -> int:
    """--nproc-per-node: a number, or auto (one per GPU here, at least one: train's count for auto where no
    launcher started it; plan never runs under one, so its environment is not asked)."""
    if v == "auto":
        from .train.launch import local_gpus

        return max(1, local_gpus(None))
    if (n := _positive(v)) > 1024:  # (one a GPU: no machine has that many)
        raise argparse.ArgumentTypeError(f"must be at most 1024 (processes on one machine, one a GPU), got {v!r}")
    return n


def _positive(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {v!r}")
    return n


def entry() -> int:
    """The `slideformer` command: signals are handled before anything heavy is imported (signals.py)."""
    with Signals(hard=True):
        if os.environ.get("SLIDEFORMER_LAUNCHER_PID"):  # (a rank of our launcher: it ends with the launcher)
            from .train.launch import follow_launcher

            follow_launcher()
        code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a rank of a job: train/launch.py says how it ends
        from .train.launch import end_rank

        end_rank(code)
    return code


def _number(v: str, low: float, high: float, what: str) -> float:
    import math

    try:
        x = float(v)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and low <= x <= high):
        raise argparse.ArgumentTypeError(f"must be {what}, got {v!r}")
    return x


def _host_weights(v: str) -> str | int:
    if v in ("auto", "persistent", "staged") or (v.isdigit() and v.isascii()):
        return v if not v.isdigit() else int(v)
    raise argparse.ArgumentTypeError(f"must be persistent, staged, auto or a number of staged layers, got {v!r}")


def _fraction(v: str) -> float:
    return _number(v, 0.0, 1.0, "a number in [0, 1]")


def _non_negative(v: str) -> float:
    return _number(v, 0.0, float("inf"), "a finite number >= 0 (0: no clipping)")


def _positive_float(v: str) -> float:
    x = _number(v, 0.0, 1e9, "a number in (0, 1e9]")
    if x <= 0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1e9], got {v!r}")
    return x


def main(argv: list[str] | None = None) -> int:
    with Signals() as signals:  # (shares entry()'s where that is active)
        try:
            return _main(sys.argv[1:] if argv is None else argv, signals)
        except Interrupted as e:
            _say(_one_line(e))
            return 128 + e.signum


def _main(argv: list[str], signals: Signals) -> int:
    from . import __version__
    from .machine import MachineRates
    from .presets import PRESETS

    # Before CUDA starts: the window's slots, loss chunks and layer activations come and go every step in
    # varying sizes, and fixed-size segments would hold their gaps reserved (over a gpu_memory_limit the
    # planner kept allocations under). A user's own setting stands, under either of torch's names.
    if not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & set(os.environ):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

    if argv[:1] == ["bench"]:  # its own parser: one case, or `bench report FILE...`
        if argv[1:2] == ["report"]:
            from .bench.report import main as report
            return report(argv[2:])
        from .bench.harness import main as bench
        bench(argv[1:])
        return 0
    p = _Parser(prog="slideformer", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"slideformer {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="fine-tune (no arguments: the bundled tiny model on the sample data)",
                       description="Fine-tune from a YAML config; key=value pairs override it (e.g. learning_rate=1e-5 "
                                   "offload.gpu_memory_limit=24GiB). " + EXIT_CODES_HELP)
    t.add_argument("config", nargs="?", help="YAML config (default: the embedded demo)")
    t.add_argument("overrides", nargs="*", metavar="key=value")
    t.set_defaults(func=cmd_train)
    d = sub.add_parser("data", help="what a config's data becomes: counts, and samples with the trained tokens "
                       "marked")
    d.add_argument("config", nargs="?", help="YAML config (default: the embedded demo)")
    d.add_argument("overrides", nargs="*", metavar="key=value")
    d.add_argument("--samples", type=_whole, default=2, help="samples to print (default 2)")
    d.set_defaults(func=cmd_data)
    pl = sub.add_parser("plan", help="GPU, host and NVMe bytes of a run, whether it fits, the largest batch",
                        description="What a run would take and whether it fits: exit 0 where it fits, 3 where it "
                                    "does not, 2 for a bad argument.")
    pl.add_argument("--model", required=True, help=f"a preset ({', '.join(PRESETS)}) or a HF directory")
    pl.add_argument("--seq-len", type=_positive, required=True)
    pl.add_argument("--batch-size", type=_positive, required=True)
    pl.add_argument("--gpu-memory", help="GPU budget, e.g. 24GiB (default: this machine's GPU)")
    pl.add_argument("--cpu-memory", help="the machine's RAM (default: this machine's)")
    pl.add_argument("--host-memory-limit", help="offload.host_memory_limit: the process's RAM budget, e.g. 48GiB "
                    "(default: none; the planner then aims at 85%% of the RAM and takes up to 95%%)")
    pl.add_argument("--offload-dir", help="NVMe tier directory: the moments of --nvme-fraction of the layers go there")
    pl.add_argument("--nvme-fraction", type=lambda v: v if v == "auto" else _fraction(v), default="auto",
                    help="the last fraction of the layers on the tier, or auto (as `slideformer train`): as few "
                         "as the host budget allows")
    pl.add_argument("--disk-space", help="bytes free for the tier under --offload-dir, e.g. 4TB (default: what is "
                    "free there now, where the folder exists)")
    pl.add_argument("--nvme-master", action="store_true", help="the tier's layers keep their master there too (compact "
                    "state: with the weights it doubles as, read from disk) (without it: as `slideformer train`, where "
                    "the moments alone leave the host budget short)")
    pl.add_argument("--activations-to-nvme", action="store_true",
                    help="offloaded layer inputs go to files under --offload-dir (RAM: 3 staging buffers)")
    pl.add_argument("--host-weights", default="auto", type=_host_weights,
                    help="persistent, staged, a number of staged layers, or auto (as `slideformer train`): "
                         "persistent where the state fits the host budget (host_memory_limit, else 85%% of the "
                         "RAM), else the fewest staged layers")
    pl.add_argument("--max-grad-norm", type=_non_negative, default=1.0,
                    help="as the trainer's max_grad_norm (default 1.0; 0: no clipping, which lets gradients share "
                         "a ring of host buffers)")
    pl.add_argument("--optimizer-state", default=PLAN_DEFAULTS["optimizer_state"], choices=["fp32", "compact", "8bit"])  # (optim/formats.py; the parser loads no torch)
    pl.add_argument("--fp8", action="store_true", help="the layers' linears in FP8 (train's fp8: true)")
    rates = MachineRates()
    pl.add_argument("--gpu-tflops", type=_positive_float, default=rates.gpu_flops / 1e12,
                    help="bf16 TFLOP/s a step's GPU work runs at (default: the H200's %(default).0f, measured)")
    pl.add_argument("--pcie-gbps", type=_positive_float, default=rates.pcie_bytes_per_s / 1e9,
                    help="host-GPU copies, GB/s each way (default %(default).0f)")
    pl.add_argument("--disk-read-gbps", type=_positive_float, default=rates.disk_read_bytes_per_s / 1e9,
                    help="the NVMe tier's disk, GB/s read (default %(default).1f, the H200 machine's)")
    pl.add_argument("--disk-write-gbps", type=_positive_float, default=rates.disk_write_bytes_per_s / 1e9,
                    help="the NVMe tier's disk, GB/s written (default %(default).1f)")
    pl.add_argument("--disk-gbps", type=_positive_float, default=None,
                    help="the NVMe tier's disk, GB/s read and written together (default: the H200 machine's "
                    f"{rates.disk_shared_bytes_per_s / 1e9:.2f} with its rates, else the faster of the two: one "
                    "device's bandwidth, shared)")
    pl.add_argument("--cpu-update-gparams", type=_positive_float, default=rates.optimizer_params_per_s / 1e9,
                    help="the CPU AdamW's billions of parameters a second (default %(default).0f, 15 threads)")
    pl.add_argument("--nproc-per-node", type=_processes, default=1,
                    help="data parallel (torchrun's --nproc-per-node): processes on this machine, one a GPU, or "
                         "auto (one per GPU here, as train's nproc_per_node: auto); --batch-size is then one GPU's, "
                         "and the processes share the RAM, cores and disk")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)
    ex = sub.add_parser("export", help="a checkpoint's Hugging Face files, without the training state")
    ex.add_argument("checkpoint")
    ex.add_argument("output_dir")
    ex.add_argument("--overwrite", action="store_true", help="export into a folder that is not empty")
    ex.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                    help="write the weights in this dtype, from the checkpoint's training master (fp32, or compact "
                    "state's two bf16 halves); default: as the checkpoint holds them (the training's compute dtype)")
    ex.set_defaults(func=cmd_export)
    sub.add_parser("bench", help="benchmark one case (see `slideformer bench --help`), or `bench report FILE...`",
                   add_help=False)
    if not argv:  # (what there is to do, not argparse's "arguments are required: cmd")
        p.print_help(sys.stderr)
        return EXIT_USAGE
    # key=value overrides after an option (`data cfg.yaml --samples 3 lr=1e-5`): argparse leaves them over,
    # and cannot parse subcommands intermixed; they join the command's own (anything else is refused)
    args, rest = p.parse_known_args(argv)
    if rest:
        if hasattr(args, "overrides") and all("=" in r and not r.startswith("-") for r in rest):
            args.overrides = list(args.overrides) + rest
        else:
            sub.choices[args.cmd].error(f"unrecognized arguments: {' '.join(rest)}")  # (exit 2)
    import threading

    hook = threading.excepthook
    threading.excepthook = _thread_failed  # (a library's thread: TensorBoard's writer on a full disk)
    try:
        return args.func(args)
    except BaseException as e:  # the one boundary: a line for what a user can cause, a log for the rest
        if isinstance(e, SystemExit):
            raise
        if signals.requested is not None and not signals.started and not isinstance(e, Interrupted):
            # a signal that surfaced as another error (an import it interrupted): the signal is what happened
            e = Interrupted(signals.requested)
        if isinstance(e, KeyboardInterrupt):  # (before anything is imported: torch may be half-imported)
            _say(_one_line(e))
            return e.signum + 128 if isinstance(e, Interrupted) else 130
        if isinstance(e, BrokenPipeError) and _reader_gone():  # (`slideformer plan | head -1`: as SIGPIPE would)
            return EXIT_PIPE
        code, cause = _exit_code(e), e
        while code is None and cause.__cause__ is not None:  # (a worker thread's error, re-raised in the main one)
            cause = cause.__cause__
            # (a KeyboardInterrupt raised in a worker thread is no signal: a signal is the main thread's)
            code = None if isinstance(cause, KeyboardInterrupt) else _exit_code(cause)
        e = cause if code is not None else e
        if code is None:
            log = _log_bug(getattr(args, "log_dir", None))
            first = lambda x: (str(x).strip().splitlines() or [""])[0][:300]  # noqa: E731
            why = f" ({type(cause).__name__}: {first(cause)})" if cause is not e else ""
            _say(f"error: unexpected {type(e).__name__}: {first(e)}{why} (the full traceback is in {log}; please "
                 "report it)")
            return EXIT_BUG
        _say(_one_line(e))
        return code
    finally:
        threading.excepthook = hook


if __name__ == "__main__":
    sys.exit(entry())
