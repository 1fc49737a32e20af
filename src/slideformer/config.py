"""Engine configuration: one typed, validated dataclass.

Errors name the fix, so a user who mistypes a setting learns what to write instead.
"""
from __future__ import annotations

import math
import numbers
import os
import types
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Literal

import numpy as np
import torch

from .optim.formats import BLOCK8, compact_master


ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")


class ConfigError(ValueError):
    """A setting is invalid; the message says which and how to fix it."""


def float_dtype(value, key: str) -> torch.dtype:
    """bfloat16, float16 or float32, as a torch dtype or its name ("bf16", "torch.float32", ...): the
    dtypes the engine computes and writes weights in."""
    named = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
             "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}
    dtype = named.get(value.removeprefix("torch.")) if isinstance(value, str) else value
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ConfigError(f"{key} must be bfloat16, float16 or float32, got {value!r}")
    return dtype


def learning_rate(value, what: str) -> float:
    """A learning rate as a float: a finite number >= 0 (a Python, NumPy or one-element tensor scalar)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        value = value.item()
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    raise ConfigError(f"{what} must be a finite number >= 0, got {value!r}")


def _fits(value, hint) -> bool:
    """Whether ``value`` is of the annotated type ``hint`` (numbers of any library; a bool is no number)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if typing.get_origin(hint) is typing.Literal:
        return isinstance(value, str) and value in typing.get_args(hint)
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        return isinstance(value, (tuple, list)) and len(value) == len(args) and all(map(_fits, value, args))
    if hint is bool:
        return isinstance(value, (bool, np.bool_))
    if hint in (int, float):
        return isinstance(value, numbers.Integral if hint is int else numbers.Real) and not isinstance(value, bool)
    if hint is type(None):
        return value is None
    return isinstance(value, hint)


def _alternatives(hint) -> list[str]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [a for h in typing.get_args(hint) for a in _alternatives(h)]
    if typing.get_origin(hint) is typing.Literal:
        return list(map(repr, typing.get_args(hint)))
    if typing.get_origin(hint) is tuple:
        return [f"{'two' if len(typing.get_args(hint)) == 2 else len(typing.get_args(hint))} numbers"]
    return [{bool: "True or False", int: "an integer", float: "a number", str: "text", os.PathLike: "a path",
             type(None): "None", torch.dtype: "a torch dtype", torch.device: "a torch.device"}[hint]]


def _said(hint) -> str:
    parts = _alternatives(hint)
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


_PARSED = {"gpu_memory_limit", "host_memory_limit"}  # (read by parse_bytes, which names what it cannot read)


def _check_types(part) -> None:
    """Each field of a config dataclass against its annotation: a wrong type is named here, not met as a
    TypeError (or a truthy "no") deep in the engine."""
    hints = typing.get_type_hints(type(part))
    for f in fields(part):
        value = getattr(part, f.name)
        if f.name not in _PARSED and not _fits(value, hints[f.name]):
            raise ConfigError(f"{f.name} must be {_said(hints[f.name])}, got {value!r}")
        setattr(part, f.name, _plain(value))


def _plain(value):
    """NumPy's scalars as Python's (the engine tests ``isinstance(v, int)``), in tuples too."""
    if isinstance(value, (tuple, list)):
        return type(value)(map(_plain, value))
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
        return int(value) if isinstance(value, numbers.Integral) else float(value)
    return value


@dataclass
class Placement:
    """Where each piece of the model lives and moves: the planner's decisions (plan.resolve), which an
    expert may fix by hand. The engine alone takes these defaults."""
    # Decoder layers trained on the GPU with their optimizer state (16 bytes/param of GPU memory, none of
    # host RAM); all of them: the embedding and head too, i.e. plain GPU training. They are the first
    # layers, so the streamed ones' gradients come first in backward and the next forward begins with
    # work that waits for no update.
    resident_layers: int = 0
    # The embedding and head train on the GPU too, whatever resident_layers says: they are the last
    # gradient of a step and the first weights of the next.
    resident_edges: bool = False
    # The first streamed layer's update on the GPU: its gradient completes last and the next forward needs
    # it first, so a CPU update there stalls every step boundary. Its fp32 master and moments (pinned) cross
    # PCIe both ways each step instead, and take 12 bytes/param of GPU memory around the boundary only.
    # fp32 state, one process; the planner takes it where the GPU has that room (plan/memory.py fit).
    gpu_first_update: bool = False
    # GPU window: decoder-layer slots, and how many visits ahead weights stream in (None: two where the
    # slots allow, so that a staged layer's larger copy hides behind two visits).
    window_slots: int = 3
    prefetch_depth: int | None = None
    # Where the compute-dtype weights sent to the GPU come from: "persistent", a host copy the optimizer
    # refreshes (+2 bytes/param); "staged", the fp32 master sent and cast on the GPU at copy time; an int
    # k, the last k decoder layers staged (they stay in the window from forward into backward: sent once a
    # step).
    host_weights: Literal["persistent", "staged"] | int = "persistent"
    # Layer inputs of all but the last `gpu_activation_layers` layers go to pinned host memory and come
    # back one layer ahead of backward; with activations_to_nvme, on to files under offload_dir.
    offload_activations: bool = False
    gpu_activation_layers: int = 2
    activations_to_nvme: bool = False
    # The last `saved_layers` layers keep their linears' outputs on the GPU from forward to backward, whose
    # recompute then runs no matmul for them (model/recompute.py): about a fifth less GPU work a layer,
    # for about 11 x hidden bf16 values a token. Never with token-chunked MLPs.
    saved_layers: int = 0
    # The first `mid_layers` of the offloaded layers also offload the residual sum after their attention
    # (hidden values a token more), and backward's recompute then runs their attention's output
    # projection without its product (model/recompute.py): where RAM has room and the GPU bounds the step.
    mid_layers: int = 0
    # Pinned host bytes the planner may give the first layers' inputs (offloaded then) so that their GPU
    # memory keeps more saved layers' products: where RAM has room and the time model says it is faster.
    host_input_bytes: int = 0
    # Tokens up to which fit() grows micro-batches before it keeps more layer inputs or saved layers on
    # the GPU (None: plan/memory.py's LARGE_TOKENS); the resolver's call, smaller where the larger ones'
    # offloaded inputs would stage the embedding's host copy or not fit the host budget.
    micro_batch_tokens: int | None = None
    # Layer inputs fit() keeps on the GPU at the least (the resolver's call, where the host budget cannot
    # hold the others): it then takes the sliced head or smaller micro-batches, slower but within both.
    min_gpu_inputs: int = 0
    # Host buffers decoder-layer gradients land in, reused as the optimizer frees them (None: one per
    # layer; clipping always holds one per layer until the global norm is known).
    host_grad_buffers: int | None = 4
    # Under clipping, streamed layers the CPU updates before the global norm is known, each into a spare
    # copy of its state (12 bytes/param, 8 compact), kept where the norm is within the limit.
    speculative_layers: int = 0
    # NVMe tier (with offload_dir): the Adam moments of the last nvme_fraction of the decoder layers live
    # in files, read ahead into nvme_buffers RAM buffers; nvme_master puts their master there too (compact
    # state: with the weights it doubles as, which the window then reads from disk; fp32 state: the window
    # reads a staged layer's master from disk, and the others' bf16 copy from RAM).
    nvme_fraction: float = 1.0
    nvme_buffers: int = 4
    nvme_master: bool = False

    @property
    def lookahead(self) -> int:
        """The prefetch depth in force: prefetch_depth, or its default."""
        return self.prefetch_depth if self.prefetch_depth is not None else min(2, self.window_slots - 1)


@dataclass
class Tuning:
    """Internal knobs, not settings: the planner or the machine decides them; tests and benchmarks pin
    them to compare one path with another."""
    grad_chunk_elems: int = 1 << 24  # gradients leave the GPU in chunks of this many elements, each with an event
    # tokens per chunk of the loss head (None: the planner's choice under a GPU budget, else 1024), and of
    # each layer's MLP under its own checkpoint (None: whole micro-batches unless the planner needs it)
    loss_chunk_tokens: int | None = None
    mlp_chunk_tokens: int | None = None
    loss_kernel: Literal["torch", "fused"] = "fused"  # "torch": autograd per chunk, the plain-PyTorch reference
    # "auto": the fused ops (our RMSNorm, Liger-Kernel's SwiGLU and RoPE) where Liger runs (CUDA) and is installed
    fused_ops: Literal["auto", "none", "liger"] = "auto"
    optimizer_backend: Literal["auto", "native", "torch"] = "auto"  # "auto": our C++ kernel when it builds
    optimizer_threads: int | None = None  # None: all cores but one, which drives the GPU
    profile: bool = False  # record where step time goes (engine/profile.py)


@dataclass
class EngineConfig:
    """What a user decides; the rest is the planner's (``placement``) or internal (``tuning``)."""
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = None
    device: str | torch.device = "cuda"
    compute_dtype: torch.dtype = torch.bfloat16
    # a cap on the engine's GPU memory ("24GiB", "80GB" or bytes): each batch is then split into
    # micro-batches and layer inputs offloaded so that a step fits under it (plan/memory.py)
    gpu_memory_limit: str | int | None = None
    # its twin for the host: the whole process's RAM. The planner keeps the training state under it, less
    # what the process itself takes (plan/memory.py host_budget); None: the machine's RAM, less a margin
    host_memory_limit: str | int | None = None
    # "fp32": exact AdamW. "compact": bf16 master with a bf16 compensation term and bf16 moments rounded
    # stochastically: 8 instead of 14 bytes/param of host RAM. "8bit": that master and 8-bit block-quantized
    # moments, 6.06 bytes/param (optim/formats.py). The last two need bf16 compute.
    optimizer_state: Literal["fp32", "compact", "8bit"] = "fp32"
    offload_dir: str | os.PathLike | None = None  # the NVMe tier's folder (Placement.nvme_*); None: no tier
    # transformers' attention for the layers: "sdpa", "eager", "flash_attention_2" or "flash_attention_3"
    # (installed, on CUDA); None: SDPA (the fastest measured on the H200), or eager where the model's
    # attention scores are soft-capped (Gemma 2), which SDPA cannot do
    attn_implementation: str | None = None
    # The decoder layers' linears multiply in FP8 (e4m3, a scale a row; the weight gradient in bf16:
    # model/fp8.py): Hopper's FP8 tensor cores, bf16 compute. Not the same training as bf16: opt-in.
    fp8: bool = False
    seed: int = 0
    placement: Placement = field(default_factory=Placement)
    tuning: Tuning = field(default_factory=Tuning)

    def placed(self, **changes) -> "EngineConfig":
        """This config with ``changes`` made to its placement."""
        return replace(self, placement=replace(self.placement, **changes))

    def validate(self) -> "EngineConfig":
        if not isinstance(self.placement, Placement) or not isinstance(self.tuning, Tuning):
            raise ConfigError("placement and tuning must be a Placement and a Tuning (slideformer.config)")
        p, t = self.placement, self.tuning
        if isinstance(self.compute_dtype, str):
            self.compute_dtype = float_dtype(self.compute_dtype, "compute_dtype")
        for part in (self, p, t):
            _check_types(part)
        if not self.lr >= 0 or not math.isfinite(self.lr):
            raise ConfigError(f"lr must be a finite number >= 0, got {self.lr}")
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ConfigError(f"betas must each lie in [0, 1), got {self.betas}")
        if not (0 < self.eps < math.inf):  # (NaN fails every comparison)
            raise ConfigError(f"eps must be a finite number > 0, got {self.eps}")
        if not (0 <= self.weight_decay < math.inf):
            raise ConfigError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.max_grad_norm is not None and not (0 < self.max_grad_norm < math.inf):
            raise ConfigError(f"max_grad_norm must be a finite number > 0 or None (no clipping), got {self.max_grad_norm}")
        if p.window_slots < 2:
            raise ConfigError(f"window_slots must be a number of slots >= 2 (one computing, one loading), "
                              f"got {p.window_slots!r}")
        if p.prefetch_depth is not None and not 1 <= p.prefetch_depth <= p.window_slots - 1:
            raise ConfigError(
                f"prefetch_depth={p.prefetch_depth} needs window_slots >= prefetch_depth + 1 "
                f"(got window_slots={p.window_slots}); raise window_slots or lower prefetch_depth"
            )
        if not isinstance(p.host_weights, str) and p.host_weights < 0:
            raise ConfigError(f"host_weights must be 'persistent', 'staged' or a number of staged layers (>= 0), "
                              f"got {p.host_weights!r}")
        if self.compute_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ConfigError(f"compute_dtype must be bfloat16, float16 or float32, got {self.compute_dtype}")
        if self.compute_dtype == torch.float16:  # (float16 weights are written on export: float_dtype's)
            raise ConfigError("compute_dtype=float16 would train without loss scaling, which the engine does not do: "
                              "gradients under float16's range (6e-8) would be lost; use torch.bfloat16 (a GPU from "
                              "Ampere on, or the CPU) or torch.float32")
        if self.fp8 and (self.compute_dtype != torch.bfloat16 and str(self.device).startswith("cuda")):
            raise ConfigError("fp8 multiplies the layers' linears in FP8 with bf16 outputs: set compute_dtype="
                              "torch.bfloat16, or leave fp8 off")
        try:
            dev = torch.device(self.device)
        except RuntimeError:
            dev = None
        if dev is None or dev.type not in ("cuda", "cpu"):
            raise ConfigError(f"device must be 'cuda' or 'cpu' (or 'cuda:N'), got {self.device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device='cuda' but CUDA is not available; pass device='cpu' to run on the CPU")
        if t.optimizer_threads is not None and t.optimizer_threads < 1:
            raise ConfigError(f"optimizer_threads must be >= 1 or None (all cores but one), got {t.optimizer_threads}")
        for key in ("gpu_memory_limit", "host_memory_limit"):
            if getattr(self, key) is not None:
                from .plan.memory import parse_bytes

                try:
                    parse_bytes(getattr(self, key))
                except ValueError as e:
                    raise ConfigError(f"{key}: {e}") from None
        if t.grad_chunk_elems < 1:
            raise ConfigError(f"grad_chunk_elems must be >= 1, got {t.grad_chunk_elems}")
        if p.host_grad_buffers is not None and p.host_grad_buffers < 1:
            raise ConfigError(f"host_grad_buffers must be >= 1 or None (one per layer), got {p.host_grad_buffers}")
        if p.speculative_layers < 0:
            raise ConfigError(f"speculative_layers must be >= 0, got {p.speculative_layers}")
        if p.mid_layers < 0:
            raise ConfigError(f"mid_layers must be >= 0, got {p.mid_layers}")
        if p.gpu_activation_layers < 0:
            raise ConfigError(f"gpu_activation_layers must be >= 0, got {p.gpu_activation_layers}")
        if p.saved_layers < 0:
            raise ConfigError(f"saved_layers must be >= 0, got {p.saved_layers}")
        if p.min_gpu_inputs < 0:
            raise ConfigError(f"min_gpu_inputs must be >= 0, got {p.min_gpu_inputs!r}")
        if p.micro_batch_tokens is not None and p.micro_batch_tokens < 1:
            raise ConfigError(f"micro_batch_tokens must be >= 1 or None, got {p.micro_batch_tokens}")
        if p.host_input_bytes < 0:
            raise ConfigError(f"host_input_bytes must be >= 0, got {p.host_input_bytes}")
        if p.resident_layers < 0:
            raise ConfigError(f"resident_layers must be >= 0, got {p.resident_layers}")
        if compact_master(self.optimizer_state) and self.compute_dtype != torch.bfloat16:
            raise ConfigError(f"optimizer_state={self.optimizer_state!r} keeps the weights the GPU reads in bf16: "
                              "set compute_dtype=torch.bfloat16, or use optimizer_state='fp32'")
        if self.optimizer_state == "8bit" and t.grad_chunk_elems % BLOCK8:
            raise ConfigError(f"8-bit moments are updated in blocks of {BLOCK8}: grad_chunk_elems must be a "
                              f"multiple of it, got {t.grad_chunk_elems}")
        if self.attn_implementation is not None:
            if self.attn_implementation not in ATTENTION:
                raise ConfigError(f"attn_implementation must be one of {', '.join(ATTENTION)} (or unset: sdpa, or "
                                  f"eager where a model needs it), got {self.attn_implementation!r}")
            if self.attn_implementation.startswith("flash"):
                import transformers.utils as tu

                version = self.attn_implementation[-1]
                if dev.type != "cuda":
                    raise ConfigError(f"attn_implementation={self.attn_implementation!r} runs on CUDA only; use "
                                      "sdpa on the CPU")
                if self.compute_dtype == torch.float32:
                    raise ConfigError(f"attn_implementation={self.attn_implementation!r} runs in bf16 or fp16, not "
                                      "fp32: set compute_dtype=torch.bfloat16, or use sdpa")
                if not getattr(tu, f"is_flash_attn_{version}_available")():
                    raise ConfigError(f"attn_implementation={self.attn_implementation!r} needs FlashAttention "
                                      f"{version} installed (pip install flash-attn"
                                      f"{'' if version == '2' else ' from its hopper/ folder'}); or use sdpa")
        if not 0.0 <= p.nvme_fraction <= 1.0:
            raise ConfigError(f"nvme_fraction must lie in [0, 1], got {p.nvme_fraction}")
        if self.offload_dir is not None and os.path.exists(self.offload_dir) and not os.path.isdir(self.offload_dir):
            raise ConfigError(f"offload_dir {self.offload_dir} is a file, not a folder; point it at a folder (it is "
                              "made where missing) on a fast disk")
        if p.activations_to_nvme and self.offload_dir is None:
            raise ConfigError("activations_to_nvme writes offloaded layer inputs under offload_dir: set it too")
        if p.nvme_master:
            if self.offload_dir is None:
                raise ConfigError("nvme_master puts the master on the NVMe tier: set offload_dir too")
        if p.nvme_buffers < 1:
            raise ConfigError(f"nvme_buffers must be >= 1, got {p.nvme_buffers}")
        if t.fused_ops == "liger":
            from .model.fused_ops import liger_available

            if not liger_available():
                raise ConfigError("fused_ops='liger' needs Liger-Kernel: pip install liger-kernel")
            if dev.type == "cpu":
                raise ConfigError("fused_ops='liger' runs on CUDA only (its kernels do not run in Triton's CPU "
                                  "interpreter); use fused_ops='none' on the CPU")
        if t.mlp_chunk_tokens is not None and t.mlp_chunk_tokens < 1:
            raise ConfigError(f"mlp_chunk_tokens must be >= 1 or None, got {t.mlp_chunk_tokens}")
        if t.loss_chunk_tokens is not None and t.loss_chunk_tokens < 1:
            raise ConfigError(f"loss_chunk_tokens must be >= 1, got {t.loss_chunk_tokens}")
        return self
