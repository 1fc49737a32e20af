"""Cross-entropy over a [tokens, vocab] logits chunk that overwrites the logits with their gradient.

Layers, as in Liger-Kernel: the ``@triton.jit`` kernel, its launcher ``cross_entropy_grad_``, and a
pure-PyTorch path with the same contract (used where Triton cannot run, and by the tests).

One program per row: an online max / sum-of-exponentials pass over the vocabulary gives the
log-sum-exp in fp32; a second pass writes ``scale * (softmax - onehot)`` back into the row in the
logits' dtype. So the chunk needs no fp32 copy, no separate softmax and no separate gradient buffer:
2 bytes per logit instead of about 16 for ``F.cross_entropy(logits.float())`` with autograd. Every
load is upcast to fp32 at once (Triton's CPU interpreter computes bf16 arithmetic on raw bits).
Optional logit soft-capping, cap * tanh(x / cap), as Gemma 2 uses.

The same kernel redoes the gradient of one vocabulary slice of a row from the row's log-sum-exp, saved
by the first call: the lm_head gradient can then be summed slice by slice (fused_linear_ce.py).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch path serves
    triton = None


def triton_usable(t: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors when TRITON_INTERPRET=1 was set before import."""
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:
    @triton.jit
    def _ce_grad_kernel(x_ptr, stride, labels_ptr, loss_ptr, lse_ptr, col0, scale, ignore_index, softcap,
                        V: tl.constexpr, BLOCK: tl.constexpr, SOFTCAP: tl.constexpr, LSE_IN: tl.constexpr,
                        LSE_OUT: tl.constexpr):
        # (V a constant: one build per vocabulary; the interpreter of some Triton and NumPy versions
        # cannot bound a loop by a runtime argument)
        # LSE_IN: the row is the vocabulary slice starting at column col0 and its log-sum-exp is given;
        # only the gradient is written. LSE_OUT: the whole row's log-sum-exp is stored too.
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        label = tl.load(labels_ptr + row)
        valid = label != ignore_index
        safe_label = tl.where(valid, label, 0)
        row_scale = tl.where(valid, scale, 0.0)
        if LSE_IN:
            lse = tl.load(lse_ptr + row)
        else:
            m = -float("inf")
            d = 0.0
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.load(base + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
                if SOFTCAP:
                    x = softcap * (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0)  # cap * tanh(x / cap)
                    x = tl.where(offs < V, x, -float("inf"))  # the cap maps padding's -inf to -cap
                m_new = tl.maximum(m, tl.max(x, 0))
                d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
                m = m_new
            lse = m + tl.log(d)
            xl = tl.load(base + safe_label).to(tl.float32)
            if SOFTCAP:
                xl = softcap * (2.0 * tl.sigmoid(2.0 * xl / softcap) - 1.0)
            tl.store(loss_ptr + row, tl.where(valid, (lse - xl) * scale, 0.0))
            if LSE_OUT:
                tl.store(lse_ptr + row, lse)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=0.0).to(tl.float32)
            if SOFTCAP:
                x = softcap * (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0)
            g = tl.exp(x - lse) - tl.where(offs + col0 == safe_label, 1.0, 0.0)
            g = g * row_scale
            if SOFTCAP:
                g = g * (1.0 - (x / softcap) * (x / softcap))  # d tanh: 1 - tanh^2
            tl.store(base + offs, g.to(x_ptr.dtype.element_ty), mask=offs < V)


def cross_entropy_grad_(logits: torch.Tensor, labels: torch.Tensor, scale: float, ignore_index: int = -100,
                        softcap: float | None = None, lse_out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row ``scale * loss`` (fp32, 0 for ignored rows); ``logits`` [t, V] becomes d(sum)/d(logits).
    ``lse_out`` [t] fp32, when given, receives each row's log-sum-exp (what ``cross_entropy_grad_slice_``
    needs to redo the gradient of any slice of the row later)."""
    assert logits.dim() == 2 and logits.stride(1) == 1 and labels.shape == logits.shape[:1]
    loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    _run(logits, labels, loss, lse_out, 0, scale, ignore_index, softcap, lse_in=False)
    return loss


def cross_entropy_grad_slice_(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, col0: int,
                              scale: float, ignore_index: int = -100, softcap: float | None = None) -> None:
    """``logits`` [t, v]: columns col0..col0+v of the rows whose log-sum-exp over the whole vocabulary is
    ``lse`` [t] (fp32); they become their part of d(sum)/d(logits), as ``cross_entropy_grad_`` writes it."""
    assert logits.dim() == 2 and logits.stride(1) == 1 and labels.shape == lse.shape == logits.shape[:1]
    _run(logits, labels, None, lse, col0, scale, ignore_index, softcap, lse_in=True)


def _run(logits, labels, loss, lse, col0, scale, ignore_index, softcap, lse_in):
    t, V = logits.shape
    if t == 0:
        return
    if triton_usable(logits):
        interp = not logits.is_cuda
        block = min(triton.next_power_of_2(V), 64 if interp else 4096)  # the interpreter pays per element
        dummy = loss if loss is not None else lse
        _ce_grad_kernel[(t,)](logits, logits.stride(0), labels, dummy, lse if lse is not None else dummy, col0,
                              float(scale), ignore_index, float(softcap or 1.0), V=V, BLOCK=block,
                              SOFTCAP=softcap is not None, LSE_IN=lse_in, LSE_OUT=not lse_in and lse is not None,
                              num_warps=1 if interp else 16)
        return
    _cross_entropy_grad_torch(logits, labels, scale, ignore_index, softcap, loss, lse, col0, lse_in)


def _cross_entropy_grad_torch(logits, labels, scale, ignore_index, softcap, loss, lse, col0, lse_in):
    """The same contract in PyTorch, row block by row block to bound the fp32 temporaries."""
    V = logits.shape[1]
    for s in range(0, logits.shape[0], 256):
        x = logits[s: s + 256].float()
        lab = labels[s: s + 256]
        if softcap is not None:
            x = softcap * torch.tanh(x / softcap)
        valid = lab != ignore_index
        if lse_in:
            row_lse = lse[s: s + 256]
        else:
            row_lse = torch.logsumexp(x, dim=1)
            safe = torch.where(valid, lab, 0)
            loss[s: s + 256] = torch.where(valid, (row_lse - x.gather(1, safe[:, None])[:, 0]) * scale, 0.0)
            if lse is not None:
                lse[s: s + 256] = row_lse
        g = torch.exp(x - row_lse[:, None])
        col = lab - col0
        here = valid & (col >= 0) & (col < V)  # (the label's column is in this slice)
        g.scatter_add_(1, torch.where(here, col, 0)[:, None], -here.to(g.dtype)[:, None])
        g *= (valid * scale)[:, None]
        if softcap is not None:
            g *= 1 - (x / softcap) ** 2
        logits[s: s + 256] = g.to(logits.dtype)
