"""Cross-entropy over a [tokens, vocab] logits chunk that overwrites the logits with their gradient.

Layers, as in Liger-Kernel: the ``@triton.jit`` kernel, its launcher ``cross_entropy_grad_``, and a
pure-PyTorch path with the same contract (used where Triton cannot run, and by the tests).

One program per row: an online max / sum-of-exponentials pass over the vocabulary gives the
log-sum-exp in fp32; a second pass writes ``scale * (softmax - onehot)`` back into the row in the
logits' dtype. So the chunk needs no fp32 copy, no separate softmax and no separate gradient buffer:
2 bytes per logit instead of about 16 for ``F.cross_entropy(logits.float())`` with autograd. Every
load is upcast to fp32 at once (Triton's CPU interpreter computes bf16 arithmetic on raw bits).
Optional logit soft-capping, cap * tanh(x / cap), as Gemma 2 uses.
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
    def _ce_grad_kernel(x_ptr, stride, labels_ptr, loss_ptr, scale, ignore_index, softcap,
                        V: tl.constexpr, BLOCK: tl.constexpr, SOFTCAP: tl.constexpr):
        # (V a constant: one build per vocabulary; the interpreter of some Triton and NumPy versions
        # cannot bound a loop by a runtime argument)
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        label = tl.load(labels_ptr + row)
        valid = label != ignore_index
        safe_label = tl.where(valid, label, 0)
        row_scale = tl.where(valid, scale, 0.0)
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
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=0.0).to(tl.float32)
            if SOFTCAP:
                x = softcap * (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0)
            g = tl.exp(x - lse) - tl.where(offs == safe_label, 1.0, 0.0)
            g = g * row_scale
            if SOFTCAP:
                g = g * (1.0 - (x / softcap) * (x / softcap))  # d tanh: 1 - tanh^2
            tl.store(base + offs, g.to(x_ptr.dtype.element_ty), mask=offs < V)


def cross_entropy_grad_(logits: torch.Tensor, labels: torch.Tensor, scale: float, ignore_index: int = -100,
                        softcap: float | None = None) -> torch.Tensor:
    """Per-row ``scale * loss`` (fp32, 0 for ignored rows); ``logits`` [t, V] becomes d(sum)/d(logits)."""
    assert logits.dim() == 2 and logits.stride(1) == 1 and labels.shape == logits.shape[:1]
    t, V = logits.shape
    loss = torch.empty(t, dtype=torch.float32, device=logits.device)
    if t == 0:
        return loss
    if triton_usable(logits):
        interp = not logits.is_cuda
        block = min(triton.next_power_of_2(V), 64 if interp else 4096)  # the interpreter pays per element
        _ce_grad_kernel[(t,)](logits, logits.stride(0), labels, loss, float(scale), ignore_index,
                              float(softcap or 1.0), V=V, BLOCK=block, SOFTCAP=softcap is not None,
                              num_warps=1 if interp else 16)
        return loss
    return _cross_entropy_grad_torch(logits, labels, scale, ignore_index, softcap, loss)


def _cross_entropy_grad_torch(logits, labels, scale, ignore_index, softcap, loss):
    """The same contract in PyTorch, row block by row block to bound the fp32 temporaries."""
    for s in range(0, logits.shape[0], 256):
        x = logits[s: s + 256].float()
        lab = labels[s: s + 256]
        if softcap is not None:
            x = softcap * torch.tanh(x / softcap)
        valid = lab != ignore_index
        safe = torch.where(valid, lab, 0)
        lse = torch.logsumexp(x, dim=1)
        loss[s: s + 256] = torch.where(valid, (lse - x.gather(1, safe[:, None])[:, 0]) * scale, 0.0)
        g = torch.exp(x - lse[:, None])
        g.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
        g *= (valid * scale)[:, None]
        if softcap is not None:
            g *= 1 - (x / softcap) ** 2
        logits[s: s + 256] = g.to(logits.dtype)
    return loss
