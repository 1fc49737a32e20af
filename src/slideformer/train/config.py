"""Training configuration: LLaMA-Factory-style keys, from YAML plus ``key=value`` overrides.

Validated at start: an unknown key gets a did-you-mean, conflicting settings are named with the fix.
"""
from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from ..config import ATTENTION, ConfigError
from ..data.formats import FORMATS, KEYS, hub_name
from ..optim.schedule import SCHEDULES


@dataclass
class DatasetSpec:
    path: str  # a JSONL/JSON/Parquet/CSV/Arrow file, a folder save_to_disk wrote or of data files, a Hub name
    format: str = "auto"
    split: str | None = None  # of a folder or Hub dataset with several (default: train)
    subset: str | None = None  # a Hub dataset's configuration
    # the records' keys under the formats' names, e.g. {instruction: question, output: answer} or {text: body}
    columns: dict | None = None


def resume_point(r):
    """resume_from_checkpoint as the trainer reads it: "auto", None or a path (true and false as transformers'
    Trainer reads them; auto, none and null in any case)."""
    if isinstance(r, bool) or (isinstance(r, str) and r.strip().lower() in ("auto", "none", "null")):
        return "auto" if r is True or str(r).strip().lower() == "auto" else None
    if isinstance(r, str) and not r.strip():
        raise ConfigError("resume_from_checkpoint is empty: set it to auto (this output_dir's newest checkpoint), "
                          "null (a new run) or a checkpoint-N folder's path")
    return r


@dataclass
class OffloadConfig:
    """The engine's memory settings (slideformer.config): the budget, the optimizer state and the NVMe
    folder a user decides, then the placement the planner decides where a key is "auto"."""
    gpu_memory_limit: str | None = None  # e.g. 24GiB: the batch is split and offloaded to fit under it
    # e.g. 48GiB: the whole process's RAM; the planner fits the training state under it, else says what
    # would (null: the machine's RAM less 15%)
    host_memory_limit: str | None = None
    # or "compact" (bf16 state: 8 instead of 14 bytes/param of host RAM), or "8bit" (8-bit moments: 6.06)
    optimizer_state: str = "fp32"
    offload_dir: str | None = None  # NVMe tier for the Adam moments of nvme_fraction of the layers
    # the first N layers train on the GPU (see `slideformer plan`); "auto": as many as the GPU budget
    # (gpu_memory_limit, else the card less a tenth, at most 4 GiB) leaves room for at this batch and cutoff_len
    resident_layers: int | str = "auto"
    resident_edges: bool | str = "auto"  # embedding and head on the GPU too; "auto": the planner's call
    # (with resident_layers "auto"; with a fixed resident_layers, "auto" means no)
    # layer slots of the GPU window; "auto": 3, or 2 where the GPU budget is too tight for 3
    window_slots: int | str = "auto"
    prefetch_depth: int | None = None  # null: two visits ahead where window_slots allows
    # "persistent" (a bf16 host copy the optimizer refreshes), "staged" (the fp32 master sent and cast on
    # the GPU, 2 bytes/param less RAM), a number k (the last k layers staged) or "auto": persistent where
    # the training state fits the host budget (host_memory_limit, else 85% of the RAM), else the fewest
    # staged layers that do
    host_weights: str | int = "auto"
    offload_activations: bool = False
    activations_to_nvme: bool = False  # offloaded layer inputs go on to files under offload_dir
    # pinned buffers decoder-layer gradients land in (null: one per layer); "auto": one per streamed layer
    # where RAM allows, else as many as fit (at least 4). Clipping always holds one per layer.
    host_grad_buffers: int | str | None = "auto"
    # with clipping: layers the CPU updates before the global norm is known, each into a spare copy of its
    # state (12 bytes/param, 8 compact), kept where the norm is within max_grad_norm; "auto": every
    # streamed layer where RAM allows, else as many as fit
    speculative_layers: int | str = "auto"
    # the last fraction of the layers whose moments go to the tier; "auto": as few as the host budget
    # (host_memory_limit, else 85% of the RAM) allows, none where RAM holds everything
    nvme_fraction: float | str = "auto"
    # the tier's layers keep their master there too (4 bytes/param less RAM; compact and 8-bit state: with
    # the weights it doubles as, which the window then reads from disk); auto: where the moments alone
    # leave the host budget short
    nvme_master: bool | str = "auto"


def _specs(value, key: str) -> list[DatasetSpec]:
    """A dataset key's files as DatasetSpecs (a path, a mapping with a path, or a list of those)."""
    specs = []
    for i, d in enumerate(value if isinstance(value, list) else [value]):
        if isinstance(d, dict) and "path" not in d:
            raise ConfigError(f"{key}[{i}] has no path; write it as {{path: data/train.jsonl, format: auto}}")
        if not isinstance(d, (str, dict, DatasetSpec)):
            raise ConfigError(f"{key}[{i}] must be a file path or a mapping with a path, got {d!r}")
        spec = DatasetSpec(d) if isinstance(d, str) else d if isinstance(d, DatasetSpec) else \
            DatasetSpec(**_checked(d, DatasetSpec, f"{key}[{i}]"))
        if not isinstance(spec.path, (str, os.PathLike)) or not os.fspath(spec.path).strip():
            raise ConfigError(f"{key}[{i}]: path is {spec.path!r}; give your data's file or folder")
        if spec.format != "auto" and spec.format not in FORMATS:
            raise ConfigError(f"{key} {spec.path}: format {spec.format!r} is unknown; use auto or one of "
                              f"{', '.join(FORMATS)}")
        columns = spec.columns if spec.columns is not None else {}
        if not isinstance(columns, dict) or not all(isinstance(x, str) for kv in columns.items() for x in kv) or \
                (spec.columns is not None and not columns):
            typed = isinstance(columns, dict) and any(isinstance(x, (bool, int, float)) for kv in columns.items()
                                                      for x in kv)
            hint = (" (YAML reads yes, no, on, off and numbers as other types than text: quote them, e.g. "
                    "{output: \"no\"})") if typed else ""
            raise ConfigError(f"{key} {spec.path}: columns must map the formats' keys to the records' own, e.g. "
                              f"{{instruction: question, output: answer}}; got {spec.columns!r}{hint}")
        if len(set(columns.values())) < len(columns):
            raise ConfigError(f"{key} {spec.path}: columns maps two keys to one of the records' own; map each once")
        unknown = sorted(set(columns) - set(KEYS))
        if unknown:
            near = difflib.get_close_matches(unknown[0].lower(), KEYS, n=1)
            raise ConfigError(f"{key} {spec.path}: columns names {unknown[0]!r}, which no format reads"
                              + (f"; did you mean {near[0]!r}?" if near else f"; map some of {', '.join(KEYS)}"))
        specs.append(spec)
    seen = {}
    for spec in specs:  # (one file twice: each of its records trained twice as often, unsaid)
        path = os.fspath(spec.path)
        same = (os.path.realpath(path) if os.path.exists(path) else path, spec.split, spec.subset, spec.format,
                tuple(sorted((spec.columns or {}).items())))  # (read another way, a file is other data)
        if same in seen:
            raise ConfigError(f"{key} lists {seen[same]} twice (again as {spec.path}), read alike: its records would "
                              "count twice; list it once")
        seen[same] = spec.path
    return specs


@dataclass
class TrainConfig:
    model_name_or_path: str = "tiny"  # a local Hugging Face directory, or "tiny" (bundled, random init)
    # default: the bundled sample, one file per format (alpaca, sharegpt, OpenAI messages, plain text)
    dataset: list | str = field(default_factory=lambda: [DatasetSpec(str(_assets() / "sample" / f"{f}.jsonl"))
                                                   for f in ("alpaca", "sharegpt", "messages", "text")])
    # the first N records of each dataset (and eval_dataset) file or source, as LLaMA-Factory's key (null: all)
    max_samples: int | None = None
    # held-out data, evaluated every eval_steps (0: at the end only) and at the end: its files (as dataset),
    # or val_size, a fraction of dataset's records kept out of training (the same ones whatever the seed)
    eval_dataset: list | str | None = None
    val_size: float = 0.0
    eval_steps: int = 0
    chat_template: str | None = None  # default: the tokenizer's
    cutoff_len: int | None = None  # tokens a sample keeps; default: 1024, or the model's positions if fewer
    packing: bool = False  # pack samples into rows of cutoff_len; attention never crosses a sample boundary
    skip_bad_records: bool = False  # malformed records and lines that are not JSON: skipped and counted
    micro_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-5
    lr_scheduler_type: str = "cosine"
    warmup_ratio: float = 0.1
    # transformers 5's: warmup in steps (>= 1) or as a fraction of them (< 1); set, it replaces warmup_ratio
    warmup_steps: float | None = None
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    # a step whose loss or gradient norm is not finite is dropped (with clipping, before it is applied);
    # false: the run stops there (exit 4); true: training goes on with the next data, and stops after 10
    # such steps in a row
    skip_nonfinite_steps: bool = False
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8  # AdamW's eps (transformers' name and default)
    num_train_epochs: float = 3.0
    max_steps: int = -1  # > 0 overrides num_train_epochs
    seed: int = 0
    output_dir: str = "out/run"
    # a folder with content not written by a slideformer run, or a new run over an earlier run's
    # checkpoints, is refused unless true; then what the run writes replaces what has its names
    # (checkpoint-N, metrics.jsonl, loss.png) and nothing else is touched
    overwrite_output_dir: bool = False
    logging_steps: int = 10
    save_steps: int = 0  # 0: only at the end
    save_total_limit: int | None = 2  # this run's newest checkpoints kept (null: all)
    # "auto": continue this output_dir's run from its newest intact checkpoint (none: start), so the same
    # command resumes after a preemption; a path: that checkpoint; null: a new run (refused over a run's checkpoints);
    # true and false as transformers' Trainer reads them (auto, null)
    resume_from_checkpoint: str | bool | None = "auto"
    device: str | None = None  # default: cuda if available
    # processes on this machine, one per GPU, each a rank of the data parallel (train/launch.py): a number, or
    # "auto" (one per GPU); under torchrun, its --nproc-per-node decides
    nproc_per_node: int | str = 1
    bf16: bool | None = None  # default: bf16 on CUDA, fp32 on CPU
    # sdpa, eager, flash_attention_2 or flash_attention_3; default: sdpa, or eager where a model needs it
    attn_implementation: str | None = None
    # the decoder layers' linears in FP8 (Hopper or newer, bf16): faster matmuls, not the same training as bf16
    fp8: bool = False
    progress: bool = True
    # where scalars and the run's metadata go: tensorboard, wandb, mlflow (their clients: optional extras), a
    # list of them, or none
    report_to: list | str = "tensorboard"
    # no step, evaluation or checkpoint for this long ends the run with every thread's stack (exit 6), the last
    # checkpoint intact; default: ten times the slowest step so far, at least 10 minutes (30 before the first
    # step); 0: off. A checkpoint's save has at least an hour, whatever this is
    watchdog_seconds: float | None = None
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    def validate(self) -> "TrainConfig":
        self.resume_from_checkpoint = resume_point(self.resume_from_checkpoint)
        self.dataset = _specs(self.dataset, "dataset")
        if not self.dataset:
            raise ConfigError("dataset is empty: give one or more local files")
        if self.eval_dataset is not None:
            self.eval_dataset = _specs(self.eval_dataset, "eval_dataset") or None
        if not 0 <= self.val_size < 1:
            raise ConfigError(f"val_size must lie in [0, 1) (a fraction of dataset's records), got {self.val_size}")
        if self.val_size and self.eval_dataset:
            raise ConfigError("eval_dataset and val_size both name held-out data: set one of them")
        from .trackers import parse

        self.report_to = parse(self.report_to)
        if self.watchdog_seconds is not None and self.watchdog_seconds < 0:
            raise ConfigError(f"watchdog_seconds must be >= 0 (0: off), or unset, got {self.watchdog_seconds}")
        if self.eval_steps < 0:
            raise ConfigError(f"eval_steps must be >= 0 (0: evaluate at the end only), got {self.eval_steps}")
        if self.eval_steps and not (self.eval_dataset or self.val_size):
            raise ConfigError("eval_steps needs held-out data: set eval_dataset (files) or val_size (a fraction of "
                              "dataset)")
        if self.attn_implementation is not None and self.attn_implementation not in ATTENTION:
            raise ConfigError(f"attn_implementation must be one of {', '.join(ATTENTION)}, or unset (sdpa, or eager "
                              f"where a model needs it), got {self.attn_implementation!r}")
        if self.packing and (self.attn_implementation or "").startswith("flash") and self.micro_batch_size > 1:
            raise ConfigError(f"packing with attn_implementation {self.attn_implementation}: flash attention keeps "
                              "packed samples apart only in a micro-batch of one row (of more, each sample would "
                              f"attend to those before it in its row); set micro_batch_size: 1 (now "
                              f"{self.micro_batch_size}; gradient_accumulation_steps makes the batch), or "
                              "attn_implementation: sdpa")
        if self.lr_scheduler_type not in SCHEDULES:
            raise ConfigError(f"lr_scheduler_type {self.lr_scheduler_type!r}: choose one of {', '.join(SCHEDULES)}")
        for k in ("micro_batch_size", "gradient_accumulation_steps", "cutoff_len", "logging_steps", "max_samples"):
            if getattr(self, k) is not None and getattr(self, k) < 1:
                raise ConfigError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.save_steps < 0:
            raise ConfigError(f"save_steps must be >= 0 (0: save only at the end), got {self.save_steps}")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ConfigError(f"save_total_limit must be >= 1, or null to keep every checkpoint, got "
                              f"{self.save_total_limit}")
        if self.learning_rate < 0 or self.weight_decay < 0:
            k = "learning_rate" if self.learning_rate < 0 else "weight_decay"
            raise ConfigError(f"{k} must be >= 0, got {getattr(self, k)}")
        for k in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, k) < 1:
                raise ConfigError(f"{k} must lie in [0, 1), got {getattr(self, k)}")
        if not self.adam_epsilon > 0:
            raise ConfigError(f"adam_epsilon must be > 0 (AdamW divides by the moment's root plus it), got "
                              f"{self.adam_epsilon}")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must lie in [0, 2**63), got {self.seed}")
        n = self.nproc_per_node
        if not (n == "auto" or (isinstance(n, int) and not isinstance(n, bool) and n >= 1)):
            raise ConfigError(f"nproc_per_node must be a number of processes >= 1 (one per GPU), or auto, got {n!r}")
        if self.device not in (None, "cpu", "cuda"):
            raise ConfigError(f"device {self.device!r} is not supported; use cuda or cpu, or leave it unset")
        if self.skip_nonfinite_steps and self.max_grad_norm is None:
            raise ConfigError("skip_nonfinite_steps needs max_grad_norm: without clipping the update runs before the "
                              "gradient norm is known, so a non-finite step cannot be dropped; set max_grad_norm")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"warmup_ratio must lie in [0, 1), got {self.warmup_ratio}")
        if self.warmup_steps is not None and not (self.warmup_steps >= 0 and (self.warmup_steps < 1 or
                                                                              float(self.warmup_steps).is_integer())):
            raise ConfigError(f"warmup_steps must be a number of steps (an integer >= 1) or a fraction of them in "
                              f"[0, 1), got {self.warmup_steps}")
        if self.max_steps < -1:
            raise ConfigError(f"max_steps must be > 0, or 0 or -1 for num_train_epochs to decide, got {self.max_steps}")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise ConfigError("set max_steps > 0 or num_train_epochs > 0")
        if self.max_steps <= 0 and self.packing and self.num_train_epochs > MAX_PACKED_EPOCHS:
            raise ConfigError(f"num_train_epochs {self.num_train_epochs} with packing: each epoch's packed rows are "
                              f"counted before training (up to {MAX_PACKED_EPOCHS} epochs); set max_steps instead")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ConfigError("max_grad_norm must be > 0, or null for no clipping")
        hw = self.offload.host_weights
        if hw not in ("auto", "persistent", "staged") and not (isinstance(hw, int) and not isinstance(hw, bool) and hw >= 0):
            raise ConfigError(f"offload.host_weights must be auto, persistent, staged or a number of staged layers, "
                              f"got {hw!r}")
        hgb = self.offload.host_grad_buffers
        if not (hgb is None or hgb == "auto" or (isinstance(hgb, int) and hgb >= 1)):
            raise ConfigError(f"offload.host_grad_buffers must be auto, null or an integer >= 1, got {hgb!r}")
        sl = self.offload.speculative_layers
        if not (sl == "auto" or (isinstance(sl, int) and not isinstance(sl, bool) and sl >= 0)):
            raise ConfigError(f"offload.speculative_layers must be auto or an integer >= 0, got {sl!r}")
        nf = self.offload.nvme_fraction
        if not (nf == "auto" or (isinstance(nf, (int, float)) and not isinstance(nf, bool) and 0 <= nf <= 1)):
            raise ConfigError(f"offload.nvme_fraction must be auto or a number in [0, 1], got {nf!r}")
        if self.offload.nvme_master not in (True, False, "auto"):
            raise ConfigError(f"offload.nvme_master must be true, false or auto, got {self.offload.nvme_master!r}")
        if nf not in ("auto", 0) and not self.offload.offload_dir:  # (as plan --nvme-fraction: no tier, no share)
            raise ConfigError(f"offload.nvme_fraction {nf} puts that share of the layers on the NVMe tier: set "
                              "offload.offload_dir, its folder, too")
        ws = self.offload.window_slots
        if not (ws == "auto" or (isinstance(ws, int) and not isinstance(ws, bool) and ws >= 2)):
            raise ConfigError(f"offload.window_slots must be auto or a number of slots >= 2, got {ws!r}")
        rl = self.offload.resident_layers
        if not (rl == "auto" or (isinstance(rl, int) and not isinstance(rl, bool) and rl >= 0)):
            raise ConfigError(f"offload.resident_layers must be a number of layers >= 0, or auto; got {rl!r}")
        for key in ("gpu_memory_limit", "host_memory_limit"):
            if getattr(self.offload, key) is not None:
                from ..plan.memory import user_bytes

                try:
                    user_bytes(getattr(self.offload, key))
                except ValueError as e:
                    raise ConfigError(f"offload.{key}: {e}") from None
        if self.offload.resident_edges not in (True, False, "auto"):
            raise ConfigError(f"offload.resident_edges must be true, false or auto, got {self.offload.resident_edges!r}")
        if self.device == "cuda" and self.bf16 is False and self.offload.gpu_memory_limit:
            raise ConfigError("gpu_memory_limit plans for bf16 compute; set bf16: true or drop offload.gpu_memory_limit")
        return self


def _assets() -> Path:
    from importlib import resources

    return Path(str(resources.files("slideformer") / "assets"))


def _checked(d: dict, cls, where: str) -> dict:
    """Unknown keys get a did-you-mean; each value is checked against its field's type: numbers written as
    strings ("2e-4": YAML 1.1 reads it as text) become numbers, a number for a text field becomes text
    (``output_dir=123``), and anything else of the wrong kind is named with what it must be."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(d).__name__}")
    types = {f.name: str(f.type) for f in fields(cls)}
    unknown = [k for k in d if k not in types]
    entry = {f.name for f in fields(DatasetSpec)} if cls is TrainConfig else set()
    if len(unknown) == 1 and unknown[0] in entry:
        raise ConfigError(f"unknown key {unknown[0]}: it belongs to a dataset's entry, e.g. "
                          f"dataset=[{{path: data/train.jsonl, {unknown[0]}: ...}}]")
    if len(unknown) == 1 and not (cls is TrainConfig and unknown[0] in FOREIGN):
        k = unknown[0]
        near = difflib.get_close_matches(k, list(types), n=1)
        raise ConfigError(f"unknown key {k if where == 'config' else f'{where}.{k}'}"
                          + (f"; did you mean {near[0]!r}?" if near else f"; known keys: {', '.join(types)}"))
    if unknown:  # (every one at once: a config written for another trainer holds several)
        def why(k: str) -> str:
            if k in entry:
                return f"a dataset entry's: dataset=[{{path: ..., {k}: ...}}]"
            if cls is TrainConfig and k in FOREIGN:
                return FOREIGN[k]
            near = difflib.get_close_matches(k, list(types), n=1)
            return f"did you mean {near[0]!r}?" if near else "no such key"
        name = (lambda k: k) if where == "config" else (lambda k: f"{where}.{k}")
        raise ConfigError(f"unknown key{'s' if len(unknown) > 1 else ''} "
                          + "; ".join(f"{name(k)} ({why(k)})" for k in unknown))
    for k in list(d):
        d[k] = _typed(d[k], types[k], f"{where}.{k}" if where != "config" else k)
    return d


_REMOVE = "remove it"
# Other trainers' keys (LLaMA-Factory's, transformers' TrainingArguments) that a config brought over holds:
# what slideformer does instead
FOREIGN = {
    "stage": "slideformer fine-tunes (sft) only: " + _REMOVE,
    "do_train": _REMOVE, "do_eval": "eval_dataset or val_size evaluates: " + _REMOVE,
    "finetuning_type": "every parameter trains: " + _REMOVE,
    **dict.fromkeys(("lora_rank", "lora_alpha", "lora_target", "lora_dropout"), "no LoRA, every parameter trains: "
                    + _REMOVE),
    "template": "the tokenizer's chat template renders chats: " + _REMOVE + ", or give another as chat_template",
    "per_device_train_batch_size": "use micro_batch_size",
    "per_device_eval_batch_size": "evaluation runs micro_batch_size rows: " + _REMOVE,
    "gradient_checkpointing": "each layer is always recomputed in backward: " + _REMOVE,
    **dict.fromkeys(("deepspeed", "fsdp", "fsdp_config"), "slideformer offloads on its own (offload: ...): " + _REMOVE),
    "optim": "the optimizer is AdamW; offload.optimizer_state sets its state: " + _REMOVE,
    **dict.fromkeys(("eval_strategy", "evaluation_strategy"), "use eval_steps (0: at the end only)"),
    "save_strategy": "use save_steps (0: at the end only)",
    "overwrite_cache": "slideformer keeps no tokenized cache (each run tokenizes its data): " + _REMOVE,
    "save_only_model": "checkpoints keep the training state to resume from; `slideformer export` writes the "
                       "model alone: " + _REMOVE,
    "logging_dir": "TensorBoard's logs go under output_dir: " + _REMOVE,
    "plot_loss": "output_dir's loss.png is drawn where matplotlib is installed: " + _REMOVE,
    "fp16": "use bf16 (fp16 is not offered)",
    **dict.fromkeys(("tf32", "preprocessing_num_workers", "dataloader_num_workers", "ddp_timeout",
                     "trust_remote_code", "torch_compile"), _REMOVE),
    "flash_attn": "use attn_implementation (sdpa, eager, flash_attention_2 or flash_attention_3)",
    **dict.fromkeys(("enable_liger_kernel", "use_liger_kernel"), "the fused kernels (Liger-Kernel's where it is "
                    "installed) run by default on a GPU: " + _REMOVE),
    "neat_packing": "packing: true keeps attention inside each sample: use it",
    "streaming": "data too large for RAM is read as the steps reach it, by itself: " + _REMOVE,
    "dataset_dir": "give each file's path (or a Hub name) in dataset: " + _REMOVE,
    "data_seed": "seed orders the data: " + _REMOVE,
    "run_name": "the trackers name the run after output_dir's folder: " + _REMOVE,
    **dict.fromkeys(("push_to_hub", "hub_model_id"), "`slideformer export` writes the model for the Hub: "
                    + _REMOVE),
    **dict.fromkeys(("train_on_prompt", "mask_history", "neftune_noise_alpha", "lr_scheduler_kwargs"),
                    "not offered: " + _REMOVE),
}


def _typed(v, annotation: str, key: str):
    kinds = {t.strip() for t in annotation.split("|")}
    if v is None:
        if "None" in kinds:
            return v
        raise ConfigError(f"{key} cannot be null")
    if isinstance(v, bool):
        if "bool" in kinds:
            return v
    elif isinstance(v, int):
        if kinds & {"int", "float"}:
            return v
        if "str" in kinds:
            return str(v)
    elif isinstance(v, float):
        if not math.isfinite(v) and kinds & {"float", "int"}:
            raise ConfigError(f"{key} must be a finite number, got {v}")
        if "float" in kinds:
            return v
        if "int" in kinds and v.is_integer():
            return int(v)
        if "int" in kinds:
            raise ConfigError(f"{key} must be a whole number, got {v}")
    elif isinstance(v, str):
        if "str" in kinds:
            return v
        for kind, conv in (("int", int), ("float", float)):
            if kind in kinds:
                try:
                    number = conv(v)
                except ValueError:
                    continue
                return _typed(number, annotation, key)  # (a string "nan" is checked as the number)
    elif isinstance(v, (list, dict)) and kinds & {"list", "dict", "OffloadConfig"}:
        return v
    names = {"int": "a whole number", "float": "a number", "str": "text", "bool": "true or false", "None": "null",
             "list": "a list", "dict": "a mapping", "OffloadConfig": "a mapping"}
    want = " or ".join(sorted(names.get(k, k) for k in kinds))
    raise ConfigError(f"{key} must be {want}, got {v!r}")


def _coerce(item: str, value: str):
    try:
        out = yaml.safe_load(value)  # "1e-5" -> float, "null" -> None, "true" -> True, "[a, b]" -> list
    except yaml.YAMLError as e:
        quote = " (quote a value with {, [, : or #)" if any(c in value for c in "{[:#") else ""
        raise ConfigError(f"override {item!r}: the value is not valid YAML{quote} "
                          f"({str(e).splitlines()[0]})") from None
    _check_colons(f"override {item!r}", out)
    return out


def _check_colons(where: str, v, seen: set | None = None) -> None:
    """YAML reads {path:a.jsonl} as one key "path:a.jsonl" without a value: said, with the fix. (Each list
    and mapping once: a YAML alias may hold itself.)"""
    seen = set() if seen is None else seen
    if not isinstance(v, (list, dict)) or id(v) in seen:
        return
    seen.add(id(v))
    for k, x in v.items() if isinstance(v, dict) else enumerate(v):
        if isinstance(v, dict) and x is None and isinstance(k, str) and ":" in k:
            a, b = k.split(":", 1)
            if a and not b.startswith("//"):  # (a URL's scheme is no key)
                raise ConfigError(f"{where}: YAML reads {k!r} as one key; write {a}: {b} (a space after the colon)")
        _check_colons(where, x, seen)


MAX_PACKED_EPOCHS = 10_000  # (num_train_epochs with packing: each one's rows counted before training)


class _KeyTwice(yaml.YAMLError):
    pass


class _OnceLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (a learning_rate written twice would
    train with the one further down)."""


def _mapping_once(loader: _OnceLoader, node: yaml.MappingNode):
    lines: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # (``<<: *defaults`` is overridden by its mapping's keys)
            continue
        key = loader.construct_object(key_node)
        try:
            twice = key in lines
        except TypeError:  # (a key that is no hashable value: construct_mapping says so)
            continue
        if twice:
            raise _KeyTwice(f"line {key_node.start_mark.line + 1}: {key} is given twice (also on line {lines[key]}; "
                            "YAML would keep the last unsaid); keep one")
        lines[key] = key_node.start_mark.line + 1
    data: dict = {}
    yield data
    data.update(loader.construct_mapping(node))


_OnceLoader.add_constructor("tag:yaml.org,2002:map", _mapping_once)


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> TrainConfig:
    """The config at ``path`` (defaults for what it leaves out), or with no file the embedded demo's settings
    while the model is the demo's (the bundled tiny one; another model named on the command line starts from
    the defaults, as a file would: the demo's learning rate and output folder are the tiny model's alone);
    then the ``key=value`` overrides."""
    raw: dict = {}
    named = dict(item.partition("=")[::2] for item in overrides)
    if path is None:
        if named.get("model_name_or_path", "tiny") == "tiny":
            raw = yaml.safe_load((_assets() / "demo.yaml").read_text())
    else:
        try:
            raw = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_OnceLoader)
        except _KeyTwice as e:
            raise ConfigError(f"config {path}, {e}") from None
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"config {path} is not UTF-8 text (byte {e.start}); save it as UTF-8 YAML") from None
        except OSError as e:  # (permissions or the disk: exit 5, as any file that cannot be read)
            raise OSError(e.errno, f"config {path}: cannot read it ({e.strerror})") from e
        raw = {} if raw is None else raw  # (an empty file: refused below, as it names no model)
        if not isinstance(raw, dict):
            raise ConfigError(f"config {path} must be a mapping of keys to values")
        _check_colons(f"config {path}", raw)
    given, in_file = set(named), set(raw) if path is not None else set()
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. learning_rate=1e-5)")
        *parents, leaf = key.split(".")
        if parents not in ([], ["offload"]) or not leaf:
            raise ConfigError(f"override {item!r}: only offload.<key> is a section (e.g. offload.gpu_memory_limit=24GiB)")
        node = raw
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} in the config is not a mapping")
        node[leaf] = _coerce(item, value)
    if path is not None and "model_name_or_path" not in raw:  # (the demo's tiny model is the demo's alone)
        raise ConfigError(f"config {path} names no model_name_or_path: set it to a local Hugging Face model folder "
                          "(or tiny, the bundled test model)")
    if "dataset" not in raw and raw["model_name_or_path"] != "tiny":  # (nor its sample data)
        where, fix = (f"config {path}", "set dataset:") if path is not None else ("the command", "add dataset=PATH")
        raise ConfigError(f"{where} names no dataset: {fix}, your data's file or folder (or a list of them; "
                          "docs/training.md says which formats); the bundled samples are the demo's alone")
    if path is None and "output_dir" in given:  # the demo starts over in its own folder only, never in one named
        for k in ("overwrite_output_dir", "resume_from_checkpoint"):
            if k not in given:
                raw.pop(k, None)
    elif path is None and raw.get("overwrite_output_dir") and "overwrite_output_dir" not in given:
        from .outdir import RUN_FILE

        # (and there over a run's only: a folder of the name that slideformer did not mark is refused as any is)
        demo = Path(raw["output_dir"])
        if demo.is_dir() and not (demo / RUN_FILE).is_file() and any(demo.iterdir()):
            raw["overwrite_output_dir"] = False
    # (both named in one place: transformers 4 took warmup_steps over the ratio only where above 0, transformers 5
    # has warmup_steps alone, so which is meant cannot be told; one overriding the file's other replaces it)
    both = {"warmup_steps", "warmup_ratio"}
    if raw.get("warmup_steps") is not None and (both <= given or both <= in_file - given):
        raise ConfigError("warmup_ratio and warmup_steps both set the warmup: keep one (warmup_steps, transformers "
                          "5's: a number of steps, or a fraction of them below 1)")
    if "warmup_ratio" in given and "warmup_steps" not in given:
        raw.pop("warmup_steps", None)
    _checked(raw, TrainConfig, "config")
    if "offload" in raw:
        raw["offload"] = OffloadConfig(**_checked(raw["offload"], OffloadConfig, "offload"))
    cfg = TrainConfig(**raw)
    # a config file's data paths are relative to it; the command line's to where it runs; ``~`` is a home
    # folder in every path (as a shell reads it: YAML and a quoted override never went through one)
    base = Path(path).parent if path is not None else None
    for key in ("dataset", "eval_dataset"):
        ds = getattr(cfg, key)
        if ds is None:
            continue
        where = (lambda p: os.path.expanduser(p)) if base is None or key in given else \
            (lambda p: _from(base, p, hub=True))
        setattr(cfg, key, [{**d, "path": where(d["path"])} if isinstance(d, dict) and isinstance(d.get("path"), str)
                           else where(d) if isinstance(d, str) else d
                           for d in (ds if isinstance(ds, list) else [ds])])
    t = cfg.chat_template  # (a template's file too; a template itself has Jinja's markers)
    if t and "{{" not in t and "{%" not in t:
        cfg.chat_template = _from(base, t) if base is not None and "chat_template" not in given else \
            os.path.expanduser(t)
    for part, key in ((cfg, "model_name_or_path"), (cfg, "output_dir"), (cfg, "resume_from_checkpoint"),
                      (cfg.offload, "offload_dir")):
        if isinstance(v := getattr(part, key), str):
            setattr(part, key, os.path.expanduser(v))
    return cfg.validate()


def _from(base: Path, path: str, hub: bool = False) -> str:
    """A path a config file names, from the file's folder (``~`` a home folder, as a shell would read it);
    with ``hub``, a Hub dataset's name ("org/name", no such file there) as it is."""
    path = os.path.expanduser(path)
    if os.path.isabs(path) or hub and not (base / path).exists() and hub_name(path):
        return path
    return str(base / path)
