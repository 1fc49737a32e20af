"""AdamW on one unit's flat fp32 buffers.

Uses torch's fused CPU kernel (one pass over master, grad and moments; it releases the GIL, so it
runs beside the Python thread that drives the GPU). It needs an fp32 gradient, so a bf16 gradient
is cast into a reusable fp32 scratch first; the clipping coefficient is applied in that same pass.
"""
from __future__ import annotations

import torch


def adamw_update_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  *, step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                  grad_coef: float = 1.0, scratch: torch.Tensor | None = None) -> None:
    """Decoupled-weight-decay Adam, exactly torch.optim.AdamW's update for the ``step``-th step."""
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
