"""SwiGLU, ``silu(gate) * up``, forward and backward, reading gate and up through their row strides.

Why our own and not Liger-Kernel's: the engine computes gate and up as one GEMM over their weights side
by side in a slot (model/recompute.py), so each is a column view of one [tokens, 2 x intermediate]
product. Liger's kernel reads every operand through one row stride, the output's. Here each operand has
its own, and backward writes gate's and up's gradients over their values, as Liger's does: for column
views of one product the two gradients are then column views of one buffer, which the projections'
backward multiplies as one GEMM.

The arithmetic is transformers': ``silu(gate)`` rounded to the input's dtype, times up, rounded; backward
through the same roundings. Every load is upcast to fp32, so the kernels also run under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .cross_entropy import triton, triton_usable

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _swiglu_forward(a_ptr, b_ptr, c_ptr, stride_a, stride_b, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        dt = c_ptr.dtype.element_ty
        a = tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
        s = (a / (1.0 + tl.exp(-a))).to(dt).to(tl.float32)
        tl.store(c_ptr + row * n_cols + cols, (s * b).to(dt), mask=mask)

    @triton.jit
    def _swiglu_backward(dc_ptr, a_ptr, b_ptr, stride_dc, stride_a, stride_b, n_cols, BLOCK: tl.constexpr):
        # c = round(silu(a)) * b: db = dc * round(silu(a)); ds = round(dc * b); da = ds * silu'(a), each rounded
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        dt = a_ptr.dtype.element_ty
        dc = tl.load(dc_ptr + row * stride_dc + cols, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        s = (a / (1.0 + tl.exp(-a))).to(dt).to(tl.float32)
        ds = (dc * b).to(dt).to(tl.float32)
        tl.store(a_ptr + row * stride_a + cols, (ds * sig * (1.0 + a * (1.0 - sig))).to(dt), mask=mask)
        tl.store(b_ptr + row * stride_b + cols, (dc * s).to(dt), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, last dim] with unit column stride, a view where its strides allow, else a copy."""
    if not t.numel():
        return t.reshape(0, t.shape[-1])
    try:
        t2 = t.view(-1, t.shape[-1])
    except RuntimeError:
        t2 = t.reshape(-1, t.shape[-1]).contiguous()
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] == 1 else t2.contiguous()


def _grid(n_rows: int, n_cols: int, x: torch.Tensor) -> tuple[tuple[int, int], int, int]:
    block = min(triton.next_power_of_2(n_cols), 256 if not x.is_cuda else 2048)
    return (n_rows, triton.cdiv(n_cols, block)), block, 1 if not x.is_cuda else 8 if block >= 2048 else 4


class SwiGLUFunction(torch.autograd.Function):
    """``silu(a) * b`` over tensors of one shape, each with unit column stride or copied to it. Backward
    writes the gradients of a and b over a's and b's memory (their values are not needed after) and
    returns those views."""

    @staticmethod
    def forward(ctx, a, b):
        a2, b2 = _rows(a), _rows(b)
        n_rows, n_cols = a2.shape
        c = torch.empty(n_rows, n_cols, dtype=a.dtype, device=a.device)
        grid, block, warps = _grid(n_rows, n_cols, a2)
        if n_rows:
            _swiglu_forward[grid](a2, b2, c, a2.stride(0), b2.stride(0), n_cols, BLOCK=block, num_warps=warps)
        ctx.save_for_backward(a2, b2)
        ctx.shape = a.shape
        return c.view(a.shape)

    @staticmethod
    def backward(ctx, dc):
        a2, b2 = ctx.saved_tensors
        dc2 = _rows(dc)
        n_rows, n_cols = a2.shape
        grid, block, warps = _grid(n_rows, n_cols, a2)
        if n_rows:
            _swiglu_backward[grid](dc2, a2, b2, dc2.stride(0), a2.stride(0), b2.stride(0), n_cols, BLOCK=block,
                                   num_warps=warps)
        return a2.view(ctx.shape), b2.view(ctx.shape)  # (splitting the rows keeps a column view one)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` (a the gate projection's output, b the up projection's): the kernels where Triton
    runs, else transformers' arithmetic in PyTorch."""
    if triton_usable(a):
        return SwiGLUFunction.apply(a, b)
    return F.silu(a) * b
