"""The loss head in plain PyTorch: final norm, lm_head and cross-entropy, chunked over tokens.

The [tokens x vocab] logits exist one chunk at a time, and each chunk's backward runs right away,
so the head needs memory for one chunk of logits, not the whole batch. Chunks whose labels are all
ignored cost nothing. (The fused Triton kernel of the kernels issue replaces this.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def chunked_head_loss(hidden: torch.Tensor, labels: torch.Tensor, norm: nn.Module, weight: torch.Tensor,
                      denom: int, chunk: int, grad_norm_weight: torch.Tensor, grad_weight: torch.Tensor,
                      accumulate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss sum/denom of one micro-batch, its gradient w.r.t. ``hidden``; head gradients go into
    ``grad_norm_weight`` and ``grad_weight`` (added when ``accumulate``, else overwritten).

    hidden: [T, H] (no grad), labels: [T] already shifted (-100 = ignored).
    """
    grad_hidden = torch.zeros_like(hidden)
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    wrote = accumulate
    for start in range(0, hidden.shape[0], chunk):
        lab = labels[start: start + chunk]
        if not bool((lab != -100).any()):
            continue
        h = hidden[start: start + chunk].detach().requires_grad_(True)
        with torch.enable_grad():
            logits = F.linear(norm(h), weight)  # [t, V] in the compute dtype, as Hugging Face does
            part = F.cross_entropy(logits.float(), lab, ignore_index=-100, reduction="sum") / denom
        gh, gn, gw = torch.autograd.grad(part, [h, norm.weight, weight])
        grad_hidden[start: start + chunk] = gh
        if wrote:
            grad_norm_weight.add_(gn)
            grad_weight.add_(gw)
        else:
            grad_norm_weight.copy_(gn)
            grad_weight.copy_(gw)
            wrote = True
        loss += part.detach()
    if not wrote:  # every label of this micro-batch ignored, and nothing accumulated before it
        grad_norm_weight.zero_()
        grad_weight.zero_()
    return loss, grad_hidden
