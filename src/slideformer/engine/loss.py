"""The loss head: final norm, lm_head and cross-entropy, chunked over tokens.

Two implementations with one contract:
- ``chunked_head_loss``: PyTorch autograd per chunk (about 16 bytes per logit of the chunk);
- ``fused_head_loss``: the kernels package's fused linear cross-entropy (the logits chunk becomes its
  own gradient in place: 4 bytes per logit with the copy the fp32-output addmm makes), with the norm's
  backward through autograd.
The [tokens x vocab] logits exist one chunk at a time in both, and all-ignored chunks cost nothing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def chunked_head_loss(hidden: torch.Tensor, labels: torch.Tensor, norm: nn.Module | None, weight: torch.Tensor,
                      denom: int, chunk: int, grad_norm_weight: torch.Tensor | None, grad_weight: torch.Tensor,
                      accumulate: bool, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss sum/denom of one micro-batch, its gradient w.r.t. ``hidden``; head gradients go into
    ``grad_norm_weight`` and ``grad_weight`` (added when ``accumulate``, else overwritten).

    hidden: [T, H] (no grad), labels: [T] already shifted (-100 = ignored). ``norm=None`` means
    ``hidden`` is already normalised (then there is no norm gradient). ``targets``: the host copy of
    ``labels != -100``, so that skipping all-ignored chunks does not synchronise with the GPU.
    """
    from ..kernels.fused_linear_ce import chunks_with_targets

    params = [weight] if norm is None else [norm.weight, weight]
    grads_out = [grad_weight] if norm is None else [grad_norm_weight, grad_weight]
    grad_hidden = torch.zeros_like(hidden)
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    wrote = accumulate
    live = chunks_with_targets(labels, chunk, targets=targets)
    for start in range(0, hidden.shape[0], chunk):
        lab = labels[start: start + chunk]
        if not live[start // chunk]:
            continue
        h = hidden[start: start + chunk].detach().requires_grad_(True)
        with torch.enable_grad():
            logits = F.linear(h if norm is None else norm(h), weight)  # [t, V] in the compute dtype, as HF does
            part = F.cross_entropy(logits.float(), lab, ignore_index=-100, reduction="sum") / denom
        gh, *gp = torch.autograd.grad(part, [h] + params)
        grad_hidden[start: start + chunk] = gh
        torch._foreach_add_(grads_out, gp) if wrote else torch._foreach_copy_(grads_out, gp)
        wrote = True
        loss += part.detach()
    if not wrote:  # every label of this micro-batch ignored, and nothing accumulated before it
        torch._foreach_zero_(grads_out)
    return loss, grad_hidden


def fused_head_loss(hidden: torch.Tensor, labels: torch.Tensor, norm: nn.Module | None, weight: torch.Tensor,
                    denom: int, chunk: int, grad_norm_weight: torch.Tensor | None, grad_weight: torch.Tensor,
                    accumulate: bool, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``chunked_head_loss``; ``grad_weight`` must be fp32 (it is summed into)."""
    from ..kernels.fused_linear_ce import linear_cross_entropy_grads

    if not accumulate:
        grad_weight.zero_()
    if norm is None:
        loss, gh, _ = linear_cross_entropy_grads(hidden.detach(), weight.detach(), labels, 1.0 / denom,
                                                 chunk_tokens=chunk, grad_weight=grad_weight, targets=targets)
        return loss, gh
    h = hidden.detach().requires_grad_(True)
    with torch.enable_grad():
        z = norm(h)  # [T, H]: small next to the logits, so the norm runs on the whole micro-batch
    loss, gz, _ = linear_cross_entropy_grads(z.detach(), weight.detach(), labels, 1.0 / denom,
                                             chunk_tokens=chunk, grad_weight=grad_weight, targets=targets)
    gh, gn = torch.autograd.grad(z, [h, norm.weight], gz)
    grad_norm_weight.add_(gn) if accumulate else grad_norm_weight.copy_(gn)
    return loss, gh
