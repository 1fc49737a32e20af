"""The loss head: final norm, lm_head and cross-entropy, chunked over tokens.

Two implementations with one contract:
- ``chunked_head_loss``: PyTorch autograd per chunk (about 16 bytes per logit of the chunk);
- ``fused_head_loss``: the kernels package's fused linear cross-entropy (the logits chunk becomes its
  own gradient in place, in one block for every chunk of a step: ``logits_workspace``), with the norm's
  backward through autograd.
The [tokens x vocab] logits exist one chunk at a time in both, and all-ignored chunks cost nothing.
``sliced_head_loss`` is the fused head without its [vocab, hidden] fp32 gradient accumulator, for GPU
budgets where that does not fit (the planner's ``head_slice``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def chunked_head_loss(hidden: torch.Tensor, labels: torch.Tensor, norm: nn.Module | None, weight: torch.Tensor,
                      denom: int, chunk: int, grad_norm_weight: torch.Tensor | None, grad_weight: torch.Tensor,
                      accumulate: bool, targets: torch.Tensor | None = None, logit_scale: float = 1.0,
                      logit_divisor: float = 1.0, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss sum/denom of one micro-batch, its gradient w.r.t. ``hidden``; head gradients go into
    ``grad_norm_weight`` and ``grad_weight`` (added when ``accumulate``, else overwritten). The logits are
    multiplied by ``logit_scale``, divided by ``logit_divisor`` and soft-capped (``softcap`` x tanh(logits /
    ``softcap``)) after the product, as the model's own forward does.

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
            part = _chunk_loss(h, lab, norm, weight, denom, logit_scale, logit_divisor, softcap)
        gh, *gp = torch.autograd.grad(part, [h] + params)
        grad_hidden[start: start + chunk] = gh
        torch._foreach_add_(grads_out, gp) if wrote else torch._foreach_copy_(grads_out, gp)
        wrote = True
        loss += part.detach()
    if not wrote:  # every label of this micro-batch ignored, and nothing accumulated before it
        torch._foreach_zero_(grads_out)
    return loss, grad_hidden


def head_loss_value(hidden: torch.Tensor, labels: torch.Tensor, norm: nn.Module, weight: torch.Tensor, denom: int,
                    chunk: int, targets: torch.Tensor | None = None, logit_scale: float = 1.0,
                    logit_divisor: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """``chunked_head_loss``'s loss alone, without autograd (evaluation): the logits of one chunk at a time."""
    from ..kernels.fused_linear_ce import chunks_with_targets

    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    live = chunks_with_targets(labels, chunk, targets=targets)
    with torch.no_grad():
        for start in range(0, hidden.shape[0], chunk):
            if live[start // chunk]:
                loss += _chunk_loss(hidden[start: start + chunk], labels[start: start + chunk], norm, weight, denom,
                                    logit_scale, logit_divisor, softcap)
    return loss


def _chunk_loss(h, labels, norm, weight, denom, logit_scale, logit_divisor, softcap) -> torch.Tensor:
    """One chunk's loss sum / denom by the model's own ops: [t, V] logits in the compute dtype (as HF does),
    scaled, divided and soft-capped after the product, the cross-entropy in fp32."""
    logits = F.linear(h if norm is None else norm(h), weight)
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if logit_divisor != 1.0:
        logits = logits / logit_divisor
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum") / denom


def logits_workspace(tokens: int, weight: torch.Tensor, chunk: int) -> torch.Tensor:
    """The block ``fused_head_loss`` writes each chunk's logits into, for micro-batches of up to ``tokens``."""
    from ..kernels.fused_linear_ce import logits_buffer

    return logits_buffer(tokens, weight, chunk)


def fused_head_loss(hidden: torch.Tensor, labels: torch.Tensor, norm: nn.Module | None, weight: torch.Tensor,
                    denom: int, chunk: int, grad_norm_weight: torch.Tensor | None, grad_weight: torch.Tensor,
                    accumulate: bool, targets: torch.Tensor | None = None, softcap: float | None = None,
                    workspace: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``chunked_head_loss`` (a logit scale folded into ``norm``); ``grad_weight`` must be
    fp32 (it is summed into). ``workspace``: the logits' block (kernels/fused_linear_ce.py ``logits_buffer``),
    one for every micro-batch of a step."""
    from ..kernels.fused_linear_ce import linear_cross_entropy_grads

    if not accumulate:
        grad_weight.zero_()

    def head(z):
        loss, gz, _ = linear_cross_entropy_grads(z, weight.detach(), labels, 1.0 / denom, chunk_tokens=chunk,
                                                 grad_weight=grad_weight, targets=targets, softcap=softcap,
                                                 workspace=workspace)
        return loss, gz
    return _through_norm(hidden, norm, grad_norm_weight, accumulate, head)


def sliced_head_loss(hiddens: list[torch.Tensor], labels: list[torch.Tensor], targets: list[torch.Tensor | None],
                     norm: nn.Module | None, weight: torch.Tensor, denom: int, chunk: int, slice_rows: int,
                     grad_norm_weight: torch.Tensor | None, grad_weight: torch.Tensor,
                     softcap: float | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``fused_head_loss`` for all of a step's micro-batches at once, without the [vocab, hidden] fp32
    accumulator: the lm_head gradient is summed one ``slice_rows`` slice of the vocabulary at a time
    (kernels/fused_linear_ce.py ``weight_grad_by_slices``) and written into ``grad_weight`` (any dtype,
    overwritten). Returns the loss and each micro-batch's gradient w.r.t. its hidden state."""
    from ..kernels.fused_linear_ce import chunks_with_targets, linear_cross_entropy_grads, weight_grad_by_slices

    loss = torch.zeros((), dtype=torch.float32, device=weight.device)
    parts, grads = [], []
    workspace = logits_workspace(max(h.shape[0] for h in hiddens), weight, chunk)
    for i, (hidden, lab, tg) in enumerate(zip(hiddens, labels, targets)):
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)

        def head(z):
            parts.append((z, lab, lse, chunks_with_targets(lab, chunk, targets=tg)))
            part, gz, _ = linear_cross_entropy_grads(z, weight.detach(), lab, 1.0 / denom, chunk_tokens=chunk,
                                                     targets=tg, lse_out=lse, softcap=softcap, workspace=workspace)
            return part, gz
        part, gh = _through_norm(hidden, norm, grad_norm_weight, i > 0, head)
        loss += part
        grads.append(gh)
    workspace = None  # (its memory back: the second pass's logits are a slice's)
    weight_grad_by_slices(parts, weight.detach(), 1.0 / denom, grad_weight, slice_rows, chunk, softcap=softcap)
    return loss, grads


def _through_norm(hidden, norm, grad_norm_weight, accumulate, head):
    """``head(z) -> (loss, grad of z)`` on ``norm(hidden)``, and the norm's backward: (loss, grad of
    ``hidden``). The norm runs on the whole micro-batch: [T, H] is small next to the logits."""
    if norm is None:
        return head(hidden.detach())
    h = hidden.detach().requires_grad_(True)
    with torch.enable_grad():
        z = norm(h)
    loss, gz = head(z.detach())
    gh, gn = torch.autograd.grad(z, [h, norm.weight], gz)
    grad_norm_weight.add_(gn) if accumulate else grad_norm_weight.copy_(gn)
    return loss, gh
