"""Engine configuration: one typed, validated dataclass.

Errors name the fix, so a user who mistypes a setting learns what to write instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


class ConfigError(ValueError):
    """A setting is invalid; the message says which and how to fix it."""


@dataclass
class EngineConfig:
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = None
    device: str = "cuda"
    compute_dtype: torch.dtype = torch.bfloat16
    # Decoder layers trained on the GPU with their optimizer state (16 bytes/param of GPU memory, none of
    # host RAM); all of them: the embedding and head too, i.e. plain GPU training. They are the first layers,
    # so the streamed ones' gradients come first in backward, the CPU updates them during all of it, and the
    # next forward begins with work that waits for no update.
    resident_layers: int = 0
    # The embedding and head train on the GPU too, whatever resident_layers says (all layers resident
    # implies it): they are the last gradient of a step and the first weights of the next.
    resident_edges: bool = False
    # GPU window: how many decoder-layer slots exist, and how many visits ahead weights stream in (None:
    # two where the slots allow, so that a staged layer's cast hides behind two visits).
    window_slots: int = 3
    prefetch_depth: int | None = None
    # Where the compute-dtype weights sent to the GPU come from:
    #   "persistent": a host copy refreshed by the optimizer (+2 bytes/param, no work at copy time);
    #   "staged":     cast from the fp32 master chunk by chunk into pinned staging at copy time;
    #   an int k:     the last k decoder layers staged, the other units persistent: where RAM holds most
    #                 of the copy (the last layers stay in the window from forward into backward, so they
    #                 are loaded, and cast, once a step; the others twice).
    host_weights: Literal["persistent", "staged"] | int = "persistent"
    # A cap on the engine's GPU memory ("24GiB", "80GB" or bytes): the planner (plan/memory.py) then
    # splits each batch into micro-batches and offloads layer inputs so that a step fits under it.
    gpu_memory_limit: str | int | None = None
    # Activation checkpoints (each layer's input): offload all but the last `gpu_activation_layers` layers'
    # to pinned host memory; they come back one layer ahead of need in backward.
    offload_activations: bool = False
    gpu_activation_layers: int = 2
    # Offloaded layer inputs go on to a file under `offload_dir` (RAM holds 3 staging buffers only), at
    # the disk's speed: for when RAM, not time, is short.
    activations_to_nvme: bool = False
    # Host buffers that decoder-layer gradients land in, reused as the optimizer frees them (None: one per
    # layer). Clipping always uses one per layer: every gradient is held until the global norm is known.
    host_grad_buffers: int | None = 4
    # Under clipping (max_grad_norm), how many streamed decoder layers the CPU may update before the global
    # norm is known, each into a spare copy of its optimizer state (12 bytes/param, 8 compact): the update
    # stands where the norm is within the limit, else it runs again (engine/runtime.py). 0: every update
    # waits for backward to end.
    speculative_layers: int = 0
    # Gradients leave the GPU in chunks of this many elements (32 MB in bf16), each with its own event,
    # and the CPU update of a chunk starts as soon as it lands.
    grad_chunk_elems: int = 1 << 24
    # NVMe tier: the Adam moments of the last `nvme_fraction` of the decoder layers (the resident ones are
    # the first) live in files under
    # `offload_dir`, read ahead of each update into `nvme_buffers` RAM buffers and written behind it.
    offload_dir: str | None = None
    nvme_fraction: float = 1.0
    nvme_buffers: int = 4
    # The tier's units keep their fp32 master on the tier too (12 instead of 8 bytes per parameter there,
    # 4 fewer in RAM); their bf16 compute copy stays in RAM. Needs host_weights="persistent", fp32 state.
    nvme_master: bool = False
    # Loss head: "fused" (kernels/: each logits chunk becomes its own gradient in place, faster and in far
    # less memory than F.cross_entropy) or "torch" (autograd per chunk: the plain-PyTorch reference).
    loss_kernel: Literal["torch", "fused"] = "fused"
    # RMSNorm and SwiGLU in the layers: "liger" (Liger-Kernel's fused Triton kernels, CUDA only;
    # model/fused_ops.py), "none" (transformers' modules), or "auto": "liger" on CUDA when it is installed.
    fused_ops: Literal["auto", "none", "liger"] = "auto"
    # Tokens per chunk of the loss head: bounds the transient [tokens x vocab] logits. None: under a GPU
    # budget the planner takes the largest of 8192..1024 that fits beside everything else (each chunk passes
    # once over the fp32 lm_head-gradient accumulator: fewer is faster), else 1024.
    loss_chunk_tokens: int | None = None
    # Each layer's MLP in chunks of this many tokens, each under its own checkpoint (model/chunked_mlp.py):
    # a layer's backward then holds one chunk's MLP intermediates, for sequences too long for micro-batches
    # to bound. None: whole micro-batches; under gpu_memory_limit the planner sets it where nothing else fits.
    mlp_chunk_tokens: int | None = None
    # CPU optimizer: "auto" (our one-pass C++ kernel when it builds, else torch's fused), "native", "torch";
    # and its thread count (None: all cores but one, which drives the GPU).
    optimizer_backend: Literal["auto", "native", "torch"] = "auto"
    optimizer_threads: int | None = None
    # "fp32": fp32 master and moments (exact AdamW). "compact": bf16 master with a bf16 compensation term
    # and bf16 moments rounded stochastically: 8 instead of 14 bytes/param of host RAM, 18 instead of 28
    # bytes of optimizer traffic; resident units keep the lo half and moments on the GPU (10 instead of 16
    # bytes/param there). Needs bf16 compute.
    optimizer_state: Literal["fp32", "compact"] = "fp32"
    seed: int = 0
    # Record where step time goes (CUDA events per visit and copy); see engine/profile.py.
    profile: bool = False

    @property
    def lookahead(self) -> int:
        """The prefetch depth in force: prefetch_depth, or its default."""
        return self.prefetch_depth if self.prefetch_depth is not None else min(2, self.window_slots - 1)

    def validate(self) -> "EngineConfig":
        if not self.lr >= 0:
            raise ConfigError(f"lr must be >= 0, got {self.lr}")
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ConfigError(f"betas must each lie in [0, 1), got {self.betas}")
        if self.eps <= 0:
            raise ConfigError(f"eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ConfigError(f"max_grad_norm must be > 0 or None (no clipping), got {self.max_grad_norm}")
        if self.window_slots < 2:
            raise ConfigError(f"window_slots must be >= 2 (one computing, one loading), got {self.window_slots}")
        if self.prefetch_depth is not None and not 1 <= self.prefetch_depth <= self.window_slots - 1:
            raise ConfigError(
                f"prefetch_depth={self.prefetch_depth} needs window_slots >= prefetch_depth + 1 "
                f"(got window_slots={self.window_slots}); raise window_slots or lower prefetch_depth"
            )
        if self.host_weights not in ("persistent", "staged") and not (
                isinstance(self.host_weights, int) and not isinstance(self.host_weights, bool) and self.host_weights >= 0):
            raise ConfigError(f"host_weights must be 'persistent', 'staged' or a number of staged layers (>= 0), "
                              f"got {self.host_weights!r}")
        if self.compute_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ConfigError(f"compute_dtype must be bfloat16, float16 or float32, got {self.compute_dtype}")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device='cuda' but CUDA is not available; pass device='cpu' to run on the CPU")
        if dev.type not in ("cuda", "cpu"):
            raise ConfigError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.optimizer_backend not in ("auto", "native", "torch"):
            raise ConfigError(f"optimizer_backend must be 'auto', 'native' or 'torch', got {self.optimizer_backend!r}")
        if self.optimizer_threads is not None and self.optimizer_threads < 1:
            raise ConfigError(f"optimizer_threads must be >= 1 or None (all cores but one), got {self.optimizer_threads}")
        if self.gpu_memory_limit is not None:
            from .plan.memory import parse_bytes

            try:
                parse_bytes(self.gpu_memory_limit)
            except ValueError as e:
                raise ConfigError(f"gpu_memory_limit: {e}") from None
        if self.grad_chunk_elems < 1:
            raise ConfigError(f"grad_chunk_elems must be >= 1, got {self.grad_chunk_elems}")
        if self.host_grad_buffers is not None and self.host_grad_buffers < 1:
            raise ConfigError(f"host_grad_buffers must be >= 1 or None (one per layer), got {self.host_grad_buffers}")
        if isinstance(self.speculative_layers, bool) or not isinstance(self.speculative_layers, int) \
                or self.speculative_layers < 0:
            raise ConfigError(f"speculative_layers must be >= 0, got {self.speculative_layers}")
        if self.gpu_activation_layers < 0:
            raise ConfigError(f"gpu_activation_layers must be >= 0, got {self.gpu_activation_layers}")
        if self.resident_layers < 0:
            raise ConfigError(f"resident_layers must be >= 0, got {self.resident_layers}")
        if self.optimizer_state not in ("fp32", "compact"):
            raise ConfigError(f"optimizer_state must be 'fp32' or 'compact', got {self.optimizer_state!r}")
        if self.optimizer_state == "compact" and self.compute_dtype != torch.bfloat16:
            raise ConfigError("optimizer_state='compact' keeps the weights the GPU reads in bf16: set "
                              "compute_dtype=torch.bfloat16, or use optimizer_state='fp32'")
        if not 0.0 <= self.nvme_fraction <= 1.0:
            raise ConfigError(f"nvme_fraction must lie in [0, 1], got {self.nvme_fraction}")
        if self.activations_to_nvme and self.offload_dir is None:
            raise ConfigError("activations_to_nvme writes offloaded layer inputs under offload_dir: set it too")
        if self.nvme_master:
            if self.offload_dir is None:
                raise ConfigError("nvme_master puts the master on the NVMe tier: set offload_dir too")
            if self.host_weights not in ("persistent", 0) or self.optimizer_state != "fp32":
                raise ConfigError("nvme_master needs host_weights='persistent' (the window reads the RAM copy, not "
                                  "the master) and optimizer_state='fp32' (compact state's master is that copy)")
        if self.nvme_buffers < 1:
            raise ConfigError(f"nvme_buffers must be >= 1, got {self.nvme_buffers}")
        if self.loss_kernel not in ("torch", "fused"):
            raise ConfigError(f"loss_kernel must be 'torch' or 'fused', got {self.loss_kernel!r}")
        if self.fused_ops not in ("auto", "none", "liger"):
            raise ConfigError(f"fused_ops must be 'auto', 'none' or 'liger', got {self.fused_ops!r}")
        if self.fused_ops == "liger":
            from .model.fused_ops import liger_available

            if not liger_available():
                raise ConfigError("fused_ops='liger' needs Liger-Kernel: pip install liger-kernel")
            if self.device == "cpu":
                raise ConfigError("fused_ops='liger' runs on CUDA only (its kernels do not run in Triton's CPU "
                                  "interpreter); use fused_ops='none' on the CPU")
        if self.mlp_chunk_tokens is not None and self.mlp_chunk_tokens < 1:
            raise ConfigError(f"mlp_chunk_tokens must be >= 1 or None, got {self.mlp_chunk_tokens}")
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 1:
            raise ConfigError(f"loss_chunk_tokens must be >= 1, got {self.loss_chunk_tokens}")
        return self
