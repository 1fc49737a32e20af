"""A per-head RMSNorm and the rotary embedding after it, in one pass each way (Qwen 3's q and k norms).

Qwen 3 normalises each head of q and k, then rotates it. Apart, the norm reads and writes q and k, the
rotation reads and writes them again, and backward does the same twice over: here each direction reads
and writes them once. The arithmetic is transformers' (``Qwen3RMSNorm`` then ``apply_rotary_pos_emb``):
the inverse RMS in fp32, the normalised head cast to the input's dtype, times the weight and rounded again;
the rotation ``y * cos + rotate_half(y) * sin`` in fp32, rounded once (as Liger-Kernel's RoPE).

Rows are heads: x is [batch, seq, heads, head_dim], contiguous (a projection's output viewed by head);
cos and sin are [batch or 1, seq, head_dim]. Every load is upcast to fp32, so the kernels also run under
TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch

from .cross_entropy import triton, triton_usable
from .rms_norm import _blocks, _sm_count, rms_norm

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _angles(cos_ptr, sin_ptr, rows, heads, seq, stride_b, stride_s, cols, mask, HALF: tl.constexpr):
        tok = rows // heads
        at = (tok // seq)[:, None] * stride_b + (tok % seq)[:, None] * stride_s + cols[None, :]
        c1 = tl.load(cos_ptr + at, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + at + HALF, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + at, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + at + HALF, mask=mask, other=0.0).to(tl.float32)
        return c1, c2, s1, s2

    @triton.jit
    def _norm_rope_forward(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, rstd_ptr, n_rows, heads, seq, stride_b,
                           stride_s, eps, HALF: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        rmask, cmask = rows < n_rows, cols < HALF
        mask = rmask[:, None] & cmask[None, :]
        at = rows[:, None] * (2 * HALF) + cols[None, :]
        x1 = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + at + HALF, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
        dt = y_ptr.dtype.element_ty
        w1 = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
        y1 = ((x1 * rstd[:, None]).to(dt).to(tl.float32) * w1[None, :]).to(dt).to(tl.float32)
        y2 = ((x2 * rstd[:, None]).to(dt).to(tl.float32) * w2[None, :]).to(dt).to(tl.float32)
        c1, c2, s1, s2 = _angles(cos_ptr, sin_ptr, rows, heads, seq, stride_b, stride_s, cols, mask, HALF)
        tl.store(y_ptr + at, (y1 * c1 - y2 * s1).to(dt), mask=mask)
        tl.store(y_ptr + at + HALF, (y2 * c2 + y1 * s2).to(dt), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=rmask)

    @triton.jit
    def _norm_rope_backward(do_ptr, x_ptr, w_ptr, rstd_ptr, cos_ptr, sin_ptr, dx_ptr, dw_ptr, n_rows, heads, seq,
                            stride_b, stride_s, blocks_per_program, HALF: tl.constexpr, BLOCK: tl.constexpr,
                            ROWS: tl.constexpr):
        # As kernels/rms_norm.py's backward: program p takes row blocks p, p + P, ... and writes its fp32
        # share of the weight gradient to row p of dw. The rotation's transpose first: dy = R^T do.
        pid = tl.program_id(0).to(tl.int64)
        programs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK)
        cmask = cols < HALF
        dt = dx_ptr.dtype.element_ty
        w1 = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
        dw1 = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        dw2 = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for i in range(blocks_per_program):
            rows = (pid + i * programs) * ROWS + tl.arange(0, ROWS)
            rmask = rows < n_rows
            mask = rmask[:, None] & cmask[None, :]
            at = rows[:, None] * (2 * HALF) + cols[None, :]
            do1 = tl.load(do_ptr + at, mask=mask, other=0.0).to(tl.float32)
            do2 = tl.load(do_ptr + at + HALF, mask=mask, other=0.0).to(tl.float32)
            c1, c2, s1, s2 = _angles(cos_ptr, sin_ptr, rows, heads, seq, stride_b, stride_s, cols, mask, HALF)
            dy1 = do1 * c1 + do2 * s2
            dy2 = do2 * c2 - do1 * s1
            x1 = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_ptr + at + HALF, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
            xn1, xn2 = x1 * rstd[:, None], x2 * rstd[:, None]
            m1, m2 = dy1 * w1[None, :], dy2 * w2[None, :]
            dot = (tl.sum(m1 * xn1, 1) + tl.sum(m2 * xn2, 1)) / (2 * HALF)
            tl.store(dx_ptr + at, (rstd[:, None] * (m1 - xn1 * dot[:, None])).to(dt), mask=mask)
            tl.store(dx_ptr + at + HALF, (rstd[:, None] * (m2 - xn2 * dot[:, None])).to(dt), mask=mask)
            dw1 += dy1 * xn1.to(dt).to(tl.float32)
            dw2 += dy2 * xn2.to(dt).to(tl.float32)
        tl.store(dw_ptr + pid * (2 * HALF) + cols, tl.sum(dw1, 0), mask=cmask)
        tl.store(dw_ptr + pid * (2 * HALF) + HALF + cols, tl.sum(dw2, 0), mask=cmask)


def _shape(d: int, x: torch.Tensor) -> tuple[int, int, int]:
    """(block of half a head, heads a program, warps): blocks of about 4096 values, as the norm's own."""
    _, rows, warps = _blocks(d, not x.is_cuda)
    return triton.next_power_of_2(d // 2), rows, warps


def _angle_strides(cos: torch.Tensor, batch: int) -> tuple[int, int]:
    return (0 if cos.shape[0] == 1 and batch != 1 else cos.stride(0)), cos.stride(1)


class NormRopeFunction(torch.autograd.Function):
    """``rope(weight * rmsnorm(x).to(x.dtype))`` over each head of x [batch, seq, heads, head_dim]."""

    @staticmethod
    def forward(ctx, x, weight, cos, sin, eps):
        x = x.contiguous()
        b, s, h, d = x.shape
        cos, sin = cos.contiguous(), sin.contiguous()
        weight = weight.contiguous()
        n_rows = b * s * h
        y = torch.empty_like(x)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block, rows, warps = _shape(d, x)
        sb, ss = _angle_strides(cos, b)
        if n_rows:
            _norm_rope_forward[(triton.cdiv(n_rows, rows),)](x, weight, cos, sin, y, rstd, n_rows, h, s, sb, ss,
                                                             float(eps), HALF=d // 2, BLOCK=block, ROWS=rows,
                                                             num_warps=warps)
        ctx.save_for_backward(x, weight, rstd, cos, sin)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd, cos, sin = ctx.saved_tensors
        b, s, h, d = x.shape
        dy = dy.contiguous()
        n_rows = b * s * h
        dx = torch.empty_like(x)
        block, rows, warps = _shape(d, x)
        row_blocks = triton.cdiv(n_rows, rows)
        programs = min(row_blocks, 8 * _sm_count(x.device)) if n_rows else 1
        dw = torch.zeros(programs, d, dtype=torch.float32, device=x.device)
        sb, ss = _angle_strides(cos, b)
        if n_rows:
            _norm_rope_backward[(programs,)](dy, x, weight, rstd, cos, sin, dx, dw, n_rows, h, s, sb, ss,
                                             triton.cdiv(row_blocks, programs), HALF=d // 2, BLOCK=block,
                                             ROWS=rows, num_warps=warps)
        return dx, dw.sum(0).to(weight.dtype), None, None, None


def norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head of x [batch, seq, heads, head_dim] normalised (transformers' Llama-style RMSNorm with
    ``weight``), then rotated by cos and sin [batch or 1, seq, head_dim]; the result as x is laid out. The
    kernels where Triton runs, else the same arithmetic in PyTorch."""
    if triton_usable(x):
        return NormRopeFunction.apply(x, weight, cos, sin, eps)
    y = rms_norm(x, weight, eps)
    half = y.shape[-1] // 2
    return y * cos.unsqueeze(2) + torch.cat((-y[..., half:], y[..., :half]), -1) * sin.unsqueeze(2)
