"""AdamW on one unit's flat fp32 buffers.

Two interchangeable backends, exact to rounding against ``torch.optim.AdamW``:
- "native": our one-pass C++ kernel (optim/csrc/adamw.cpp). It reads a bf16/fp16/fp32 gradient,
  updates master and moments and writes the compute-dtype copy in a single pass, with the gradient
  clipping coefficient folded in (28 bytes per parameter for bf16), on its own threads, GIL released.
- "torch": torch's fused CPU kernel. It needs an fp32 gradient, so a bf16 gradient is first cast into
  a reusable fp32 scratch, and the compute copy is refreshed by a separate cast (40 bytes per parameter).
"""
from __future__ import annotations

import torch

from . import native


def adamw_update_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  *, step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                  grad_coef: float = 1.0, out: torch.Tensor | None = None, scratch: torch.Tensor | None = None,
                  backend: str = "torch", threads: int | None = None) -> None:
    """Decoupled-weight-decay Adam, exactly torch.optim.AdamW's update for the ``step``-th step.

    ``out``, when given, receives the updated weights in its dtype (the compute copy sent to the GPU).
    """
    if backend == "native":
        mod = native.load(strict=True)
        mod.adamw_step(master, grad, exp_avg, exp_avg_sq, out, step, lr, betas[0], betas[1], eps, weight_decay,
                       grad_coef, threads or native.default_threads())
        return
    if backend != "torch":
        raise ValueError(f"unknown optimizer backend {backend!r}; use 'native' or 'torch'")
    if grad.dtype != torch.float32:
        if scratch is None or scratch.numel() < grad.numel():
            raise ValueError("a non-fp32 gradient needs an fp32 scratch buffer at least as large")
        g = scratch[: grad.numel()]
        g.copy_(grad)
    else:
        g = grad
    if grad_coef != 1.0:
        g.mul_(grad_coef)  # fp32 grads are host-side copies owned by the store: scaling in place is safe
    step_t = torch.tensor(float(step))
    torch._fused_adamw_([master], [g], [exp_avg], [exp_avg_sq], [], [step_t], lr=lr, beta1=betas[0],
                        beta2=betas[1], weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    if out is not None:
        out.copy_(master)


def resolve_backend(requested: str) -> str:
    """"auto" becomes "native" when the C++ kernel builds here, else "torch" (with one warning)."""
    if requested == "auto":
        return "native" if native.load() is not None else "torch"
    if requested == "native":
        native.load(strict=True)
    return requested
