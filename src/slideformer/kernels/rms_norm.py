"""RMSNorm, forward and backward, as transformers' Llama-style norm computes it: the inverse RMS in fp32,
the normalised input cast back to the input's dtype, then the product with the weight.

Why our own and not Liger-Kernel's: Liger's backward runs one program per SM that walks its rows one
block at a time, so at the shapes of a layer's norms (8192 x 2560, and Qwen3's per-head q and k norms,
262144 x 128) it moves its bytes at a third to a quarter of the memory bandwidth: about 3% of a step.
Here backward launches several programs per SM, each with a block of rows at a time, and sums the
weight gradient's per-program fp32 rows afterwards. Forward is one block of rows per program.

``add_rms_norm``: the norm of a residual sum, the sum computed (and stored) in the norm's forward pass, its
own gradient added in the norm's backward pass: one read and one write of the rows fewer each way than a
separate add. ``rms_norm_pass``: the norm of a residual stream that also flows on, the stream's gradient
added in the norm's backward pass likewise.

The inverse RMS is saved for backward (4 bytes a row); the input is kept by the caller's autograd graph.
Every load is upcast to fp32 (Triton's CPU interpreter computes bf16 arithmetic on raw bits), so the
kernels also run under TRITON_INTERPRET=1, which the tests use.
"""
from __future__ import annotations

import torch

from .cross_entropy import triton, triton_usable

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rms_forward(x_ptr, r_ptr, s_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, eps, N: tl.constexpr,
                     BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr):
        # HAS_RES: the norm of s = x + r (rounded to the input's dtype, as a separate add would), s stored too
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_N)
        rmask, cmask = rows < n_rows, cols < N
        mask = rmask[:, None] & cmask[None, :]
        at = rows[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            x += tl.load(r_ptr + at, mask=mask, other=0.0).to(tl.float32)
            x = x.to(s_ptr.dtype.element_ty)
            tl.store(s_ptr + at, x, mask=mask)
            x = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 1) / N + eps)
        xn = (x * rstd[:, None]).to(y_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + at, (xn * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=rmask)

    @triton.jit
    def _rms_backward(dy_ptr, x_ptr, w_ptr, rstd_ptr, ds_ptr, dx_ptr, dw_ptr, n_rows, N: tl.constexpr,
                      BLOCK_N: tl.constexpr, ROWS: tl.constexpr, blocks_per_program, HAS_DS: tl.constexpr):
        # Program p takes the row blocks p, p + P, p + 2P, ... (P programs) and writes its fp32 share of the
        # weight gradient to row p of dw. HAS_DS: the gradient ds of the sum the norm read is added to dx
        # (the norm of a residual sum: x is that sum).
        pid = tl.program_id(0).to(tl.int64)
        programs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        dw = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for i in range(blocks_per_program):  # (a runtime bound: no build per token count)
            rows = (pid + i * programs) * ROWS + tl.arange(0, ROWS)
            rmask = rows < n_rows
            mask = rmask[:, None] & cmask[None, :]
            at = rows[:, None] * N + cols[None, :]
            dy = tl.load(dy_ptr + at, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
            xn = x * rstd[:, None]
            # y = w * cast(xn): d/d(xn) = dy * w; dw = sum(dy * cast(xn)); through xn = x * rstd(x)
            m = dy * w[None, :]
            dot = tl.sum(m * xn, 1) / N
            dx = rstd[:, None] * (m - xn * dot[:, None])
            if HAS_DS:
                dx += tl.load(ds_ptr + at, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + at, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * xn.to(dx_ptr.dtype.element_ty).to(tl.float32)
        tl.store(dw_ptr + pid * N + cols, tl.sum(dw, 0), mask=cmask)


def _blocks(n: int, interpret: bool) -> tuple[int, int, int]:
    """(BLOCK_N, rows a block, warps) for rows of n values: blocks of about 4096 values (one row a block
    from 2048 up), so that short rows (per-head norms) still give each program a sizeable load."""
    block_n = triton.next_power_of_2(n)
    rows = 1 if interpret else max(1, 4096 // block_n)
    # (as Liger's settings for long rows: more warps, fewer values a thread keeps in registers)
    warps = 1 if interpret else 32 if block_n >= 32768 else 16 if block_n >= 8192 else 8 if block_n * rows >= 4096 else 4
    return block_n, rows, warps


def _forward(x: torch.Tensor, r: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(y, the rows normalised, rstd), rows flattened: the norm of x, or of s = x + r where r is given (then
    s is the rows normalised)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    r2 = x2 if r is None else r.reshape(x2.shape).contiguous()
    s2 = None if r is None else torch.empty_like(x2)
    n_rows, n = x2.shape
    y = torch.empty_like(x2)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block_n, rows, warps = _blocks(n, not x.is_cuda)
    if n_rows:
        _rms_forward[(triton.cdiv(n_rows, rows),)](x2, r2, x2 if s2 is None else s2, weight.contiguous(), y, rstd,
                                                   n_rows, float(eps), N=n, BLOCK_N=block_n, ROWS=rows,
                                                   HAS_RES=r is not None, num_warps=warps)
    return y, x2 if s2 is None else s2, rstd


def _backward(dy: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
              ds: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) for the norm of x2's rows (the fp32 weight gradient summed over the programs' rows), with ds
    added to dx where given."""
    n_rows, n = x2.shape
    dy2 = dy.reshape(-1, n).contiguous()
    ds2 = dy2 if ds is None else ds.reshape(-1, n).contiguous()
    dx = torch.empty_like(x2)
    block_n, rows, warps = _blocks(n, not x2.is_cuda)
    row_blocks = triton.cdiv(n_rows, rows)
    # several programs an SM hide the loads' latency; each adds one fp32 row to the weight's sum
    programs = min(row_blocks, 8 * _sm_count(x2.device)) if n_rows else 1
    dw = torch.zeros(programs, n, dtype=torch.float32, device=x2.device)
    if n_rows:
        _rms_backward[(programs,)](dy2, x2, weight.contiguous(), rstd, ds2, dx, dw, n_rows, N=n, BLOCK_N=block_n,
                                   ROWS=rows, blocks_per_program=triton.cdiv(row_blocks, programs),
                                   HAS_DS=ds is not None, num_warps=warps)
    return dx, dw.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dimension, as transformers'
    Llama-style RMSNorm; the weight gradient in the weight's dtype."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, x2, rstd = _forward(x, None, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(dy, x2, weight, rstd, None)
        return dx.view(dy.shape), dw, None


class AddRMSNormFunction(torch.autograd.Function):
    """``(norm(x + r), x + r)``: a residual sum and its RMSNorm in one pass (the sum rounded to the inputs'
    dtype first, as the separate add would); backward adds the sum's own gradient into the norm's input
    gradient in the same pass, where autograd would add them in another kernel."""

    @staticmethod
    def forward(ctx, x, r, weight, eps):
        ctx.set_materialize_grads(False)
        y, s, rstd = _forward(x, r, weight, eps)
        ctx.save_for_backward(s, weight, rstd)
        return y.view(x.shape), s.view(x.shape)

    @staticmethod
    def backward(ctx, dy, ds):
        s2, weight, rstd = ctx.saved_tensors
        if dy is None:  # (only the sum was used)
            return ds, ds, None, None
        dx, dw = _backward(dy, s2, weight, rstd, ds)
        dx = dx.view(dy.shape)
        return dx, dx, dw, None


class RMSNormPassFunction(torch.autograd.Function):
    """``(norm(x), x)``: the norm of a residual stream, and the stream passed on (a view of ``x``); backward
    adds the stream's gradient into the norm's input gradient in the same pass, where autograd would add
    them in another kernel."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.set_materialize_grads(False)
        y, x2, rstd = _forward(x, None, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape), x

    @staticmethod
    def backward(ctx, dy, dx_passed):
        x2, weight, rstd = ctx.saved_tensors
        if dy is None:  # (only the stream was used)
            return dx_passed, None, None
        dx, dw = _backward(dy, x2, weight, rstd, dx_passed)
        return dx.view(dy.shape), dw, None


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(norm(x + r), x + r)`` in one kernel where Triton runs, else the same arithmetic in PyTorch."""
    if triton_usable(x):
        return AddRMSNormFunction.apply(x, r, weight, eps)
    s = x + r
    return rms_norm(s, weight, eps), s


def rms_norm_pass(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(norm(x), x)``, the stream's gradient added in the norm's backward kernel where Triton runs."""
    if triton_usable(x):
        return RMSNormPassFunction.apply(x, weight, eps)
    return rms_norm(x, weight, eps), x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The fused kernels where Triton runs, else the same arithmetic in PyTorch (transformers' own)."""
    if triton_usable(x):
        return RMSNormFunction.apply(x, weight, eps)
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
