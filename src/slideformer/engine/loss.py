"""The loss head in plain PyTorch: final norm, lm_head and cross-entropy, chunked over tokens.

The [tokens x vocab] logits exist one chunk at a time, and each chunk's backward runs right away,
so the head needs memory for one chunk of logits, not the whole batch. Chunks whose labels are all
ignored cost nothing. (The fused Triton kernel of the kernels issue replaces this.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def chunked_head_loss(hidden: torch.Tensor, labels: torch.Tensor, norm: nn.Module | None, weight: torch.Tensor,
                      denom: int, chunk: int, grad_norm_weight: torch.Tensor | None, grad_weight: torch.Tensor,
                      accumulate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss sum/denom of one micro-batch, its gradient w.r.t. ``hidden``; head gradients go into
    ``grad_norm_weight`` and ``grad_weight`` (added when ``accumulate``, else overwritten).

    hidden: [T, H] (no grad), labels: [T] already shifted (-100 = ignored). ``norm=None`` means
    ``hidden`` is already normalised (then there is no norm gradient).
    """
    params = [weight] if norm is None else [norm.weight, weight]
    grads_out = [grad_weight] if norm is None else [grad_norm_weight, grad_weight]
    grad_hidden = torch.zeros_like(hidden)
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    wrote = accumulate
    for start in range(0, hidden.shape[0], chunk):
        lab = labels[start: start + chunk]
        if not bool((lab != -100).any()):
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
