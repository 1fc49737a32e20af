"""Fused linear + cross-entropy: the loss of ``hidden @ weight.T`` without the full [tokens x vocab] logits.

Tokens are processed in chunks; per chunk the logits are computed, turned into their own gradient in
place by ``cross_entropy_grad_`` and immediately used for the hidden-state gradient (chunk @ weight)
and the weight gradient (chunk.T @ hidden, summed over chunks in fp32). The gradients are computed in
the forward and only scaled by the incoming gradient in backward, so autograd holds no logits. Chunks
whose labels are all ignored cost nothing.

Where the fp32 [V, H] accumulator does not fit, ``weight_grad_by_slices`` sums the weight gradient one
vocabulary slice at a time instead: the logits of the slice are computed again from each token's saved
log-sum-exp, so only a [slice, H] fp32 sum exists (one more [tokens x vocab] product a step).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from .cross_entropy import cross_entropy_grad_, cross_entropy_grad_slice_


def chunks_with_targets(labels: torch.Tensor, chunk_tokens: int, ignore_index: int = -100,
                        targets: torch.Tensor | None = None) -> list[bool]:
    """Which ``chunk_tokens``-token chunks of ``labels`` have a label to train on. From ``targets`` (the
    caller's host copy of ``labels != ignore_index``) without touching the device; else in one transfer,
    not one GPU synchronisation per chunk (each would stall the thread that drives the GPU)."""
    if targets is not None and targets.numel() != labels.numel():
        raise ValueError(f"targets has {targets.numel()} entries for {labels.numel()} labels")
    mask = (targets if targets is not None else labels != ignore_index).reshape(-1).cpu()
    return [bool(mask[s: s + chunk_tokens].any()) for s in range(0, mask.numel(), chunk_tokens)]


def logits_buffer(tokens: int, weight: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """The one [chunk, V] block every chunk's logits are written into (``linear_cross_entropy_grads``)."""
    return torch.empty(min(chunk_tokens, tokens), weight.shape[0], dtype=weight.dtype, device=weight.device)


def linear_cross_entropy_grads(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, scale: float,
                               ignore_index: int = -100, softcap: float | None = None, chunk_tokens: int = 8192,
                               grad_weight: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                               lse_out: torch.Tensor | None = None, workspace: torch.Tensor | None = None):
    """(loss sum x scale as an fp32 scalar, grad_hidden [T, H], grad_weight [V, H] fp32).

    ``grad_weight``, when given (fp32), is accumulated into: the engine sums micro-batches there.
    ``lse_out`` [T] fp32, when given, receives each token's log-sum-exp and the weight gradient is left
    to ``weight_grad_by_slices`` (the third item is then None). ``targets``: see ``chunks_with_targets``.
    ``workspace``: ``logits_buffer``'s block, which each chunk's logits overwrite (else one of this call's).
    One block for all chunks, not one each: a new chunk's product would be allocated while the last one's
    still held it, two blocks of the largest size in the step, which a GPU cap's allocator has to find
    again after every micro-batch's smaller tensors have split them.
    """
    T = hidden.shape[0]
    grad_hidden = torch.zeros_like(hidden)
    if grad_weight is None and lse_out is None:
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    live = chunks_with_targets(labels, chunk_tokens, ignore_index, targets)
    if workspace is None:
        workspace = logits_buffer(T, weight, chunk_tokens)
    elif workspace.shape[0] < min(chunk_tokens, T) or workspace.shape[1:] != weight.shape[:1] \
            or workspace.dtype != weight.dtype:
        raise ValueError(f"logits workspace {tuple(workspace.shape)} {workspace.dtype}: need at least "
                         f"[{min(chunk_tokens, T)}, {weight.shape[0]}] in {weight.dtype}")
    for s in range(0, T, chunk_tokens):
        if not live[s // chunk_tokens]:
            continue
        lab = labels[s: s + chunk_tokens]
        h = hidden[s: s + chunk_tokens]
        logits = torch.matmul(h, weight.T, out=workspace[: h.shape[0]])  # [t, V]: becomes its own gradient below
        lse = None if lse_out is None else lse_out[s: s + chunk_tokens]
        loss += cross_entropy_grad_(logits, lab.contiguous(), scale, ignore_index, softcap, lse_out=lse).sum()
        torch.matmul(logits, weight, out=grad_hidden[s: s + chunk_tokens])
        if lse_out is None:
            addmm_fp32_(grad_weight, logits.T, h)
    return loss, grad_hidden, (grad_weight if lse_out is None else None)


def weight_grad_by_slices(parts: list[tuple], weight: torch.Tensor, scale: float, out: torch.Tensor,
                          slice_rows: int, chunk_tokens: int, ignore_index: int = -100,
                          softcap: float | None = None) -> None:
    """``out`` [V, H] = the weight gradient of every part's loss (overwritten), one ``slice_rows`` slice of
    the vocabulary at a time, each summed in fp32 over all parts and cast once.

    parts: (hidden [T, H], labels [T], lse [T] from ``linear_cross_entropy_grads``'s ``lse_out``, live:
    its chunks_with_targets at ``chunk_tokens``) per micro-batch, with the same ``scale``.
    """
    V, H = weight.shape
    direct = out.dtype == torch.float32  # (no separate sum needed)
    acc = None if direct else torch.empty(min(slice_rows, V), H, dtype=torch.float32, device=out.device)
    for v0 in range(0, V, slice_rows):
        v1 = min(V, v0 + slice_rows)
        a = out[v0:v1] if direct else acc[: v1 - v0]
        a.zero_()
        w = weight[v0:v1]
        for hidden, labels, lse, live in parts:
            for s in range(0, hidden.shape[0], chunk_tokens):
                if not live[s // chunk_tokens]:
                    continue
                h = hidden[s: s + chunk_tokens]
                logits = h @ w.T  # [t, slice]
                cross_entropy_grad_slice_(logits, labels[s: s + chunk_tokens].contiguous(),
                                          lse[s: s + chunk_tokens], v0, scale, ignore_index, softcap)
                addmm_fp32_(a, logits.T, h)
        if not direct:
            out[v0:v1].copy_(a)


def addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with acc in fp32 and a, b in a 16-bit dtype.

    On CUDA the matmul accumulates straight into ``acc`` (cuBLAS with an fp32 output): no [V, H]
    temporaries, where ``acc += (a @ b).float()`` makes two (2 + 4 bytes per element of ``acc``).
    """
    if acc.is_cuda and a.dtype != torch.float32:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError) as e:  # a torch without the fp32-output matmul for this dtype
            warnings.warn(f"fused loss: no fp32-output matmul here ({e}); the lm_head gradient takes "
                          "1.5x its size in temporaries", stacklevel=2)
    acc += (a @ b).float()


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, reduction, softcap, chunk_tokens):
        shape = hidden.shape
        h = hidden.reshape(-1, shape[-1])
        lab = labels.reshape(-1)
        n = int((lab != ignore_index).sum()) if reduction == "mean" else 1
        loss, gh, gw = linear_cross_entropy_grads(h.detach(), weight.detach(), lab, 1.0 / max(n, 1), ignore_index,
                                                  softcap, chunk_tokens)
        ctx.save_for_backward(gh.view(shape), gw.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        gh, gw = ctx.saved_tensors
        return gh * grad_out.to(gh.dtype), gw * grad_out.to(gw.dtype), None, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100, reduction: str = "mean", softcap: float | None = None,
                               chunk_tokens: int = 8192) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels``, differentiable in hidden and weight.

    hidden: [..., H], weight: [V, H], labels: [...] (``ignore_index`` skipped). reduction "mean" divides
    by the number of non-ignored labels, "sum" does not. ``chunk_tokens``: tokens per chunk; each chunk
    reads and writes the fp32 [V, H] weight-gradient accumulator once, so larger chunks cost less time
    and more memory.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    return _FusedLinearCE.apply(hidden, weight, labels, ignore_index, reduction, softcap, chunk_tokens)


def reference_linear_cross_entropy(hidden, weight, labels, ignore_index=-100, reduction="mean", softcap=None):
    """Plain PyTorch, full logits in fp32: what the tests and benchmarks compare against."""
    logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.T).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, labels.reshape(-1), ignore_index=ignore_index, reduction=reduction)
