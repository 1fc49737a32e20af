"""Rows cast to FP8 (e4m3) with one scale a row, in one kernel: each row's largest magnitude maps to
e4m3's largest value (448), the rowwise recipe of torchao's float8 training. ``torch._scaled_mm`` then
multiplies the quantized rows, given the inverse scales.

Why our own: torchao's casts are PyTorch ops that only torch.compile fuses, and the engine runs its layers
eagerly (the recompute's wrapped linears). Unfused, the casts (abs, amax, an fp32 product, the cast, for
each activation, gradient and weight) cost more than the FP8 GEMMs save (`bench/layer_speed.py --fp8`).
Here a row is read twice (its amax, then the cast) and written once as one byte a value.

Each value is rounded to e4m3's grid in fp32 (to nearest, ties to even; subnormals on their fixed step)
before the conversion, which is then exact: Triton's CPU interpreter, which the tests use, rounds some
values just under a power of two down a whole binade.

``cast_columns`` is the weight gradient's cast: ``g.T @ x`` sums over tokens, so each of its operands is
scaled by feature (a column of ``[tokens, features]``, over every token) and written transposed, the
row-major ``[features, tokens]`` operand ``_scaled_mm`` takes. Its largest magnitudes come from one
reduction (``vector_norm`` of order infinity: no temporary), then one kernel reads each value once.

``cast_rows_and_columns`` is a gradient's two casts (the input gradient takes its rows, the weight gradient
its columns) from two reads of it, where the two casts apart read it three times: one pass takes each tile's
largest magnitudes by row and by column, the next writes both casts.
"""
from __future__ import annotations

import torch

from .cross_entropy import triton, triton_usable

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _to_e4m3_grid(v):
        """``v`` (fp32, already scaled into e4m3's range) rounded to e4m3's values, to nearest even."""
        # normals: 3 mantissa bits, to nearest even, on the bit pattern
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
        normal = bits.to(tl.float32, bitcast=True)
        # subnormals (under 2^-6): multiples of 2^-9, rounded by the fp32 add of 1.5 x 2^23
        sub = v * 512.0 + 12582912.0
        sub = (sub - 12582912.0) / 512.0
        v = tl.where(tl.abs(v) >= 0.015625, normal, sub)
        # (NaN stays NaN: the GPU's min and max drop it, and a NaN or infinite input must reach the loss)
        return tl.where(v == v, tl.minimum(tl.maximum(v, -448.0), 448.0), v)

    @triton.jit
    def _cast_rows(x_ptr, q_ptr, inv_ptr, n_rows, stride, N: tl.constexpr, BLOCK_N: tl.constexpr,
                   ROWS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_rows
        amax = tl.zeros((ROWS,), dtype=tl.float32)
        for c0 in range(0, N, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            mask = rmask[:, None] & (cols < N)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
        amax = tl.maximum(amax, 1e-12)
        scale = 448.0 / amax
        for c0 in range(0, N, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            mask = rmask[:, None] & (cols < N)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            v = _to_e4m3_grid(x * scale[:, None])
            tl.store(q_ptr + rows[:, None] * N + cols[None, :], v.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(inv_ptr + rows, amax / 448.0, mask=rmask)

    @triton.jit
    def _cast_columns_t(x_ptr, amax_ptr, q_ptr, inv_ptr, ramax_ptr, qr_ptr, rinv_ptr, n_rows, n_cols, stride,
                        BT: tl.constexpr, BC: tl.constexpr, ROWS_TOO: tl.constexpr):
        # a tile of BT rows and BC columns of x, scaled by its columns' amax, stored transposed in q; with
        # ROWS_TOO also scaled by its rows' amax, stored as it is in qr
        rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        cols = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
        rmask, cmask = rows < n_rows, cols < n_cols
        amax = tl.maximum(tl.load(amax_ptr + cols, mask=cmask, other=1.0).to(tl.float32), 1e-12)
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        v = _to_e4m3_grid(x * (448.0 / amax)[None, :])
        tl.store(q_ptr + cols[:, None] * n_rows + rows[None, :], tl.trans(v).to(q_ptr.dtype.element_ty),
                 mask=tl.trans(mask))
        if tl.program_id(0) == 0:
            tl.store(inv_ptr + cols, amax / 448.0, mask=cmask)
        if ROWS_TOO:
            ramax = tl.maximum(tl.load(ramax_ptr + rows, mask=rmask, other=1.0), 1e-12)
            vr = _to_e4m3_grid(x * (448.0 / ramax)[:, None])
            tl.store(qr_ptr + rows[:, None] * n_cols + cols[None, :], vr.to(qr_ptr.dtype.element_ty), mask=mask)
            if tl.program_id(1) == 0:
                tl.store(rinv_ptr + rows, ramax / 448.0, mask=rmask)

    @triton.jit
    def _tile_amax(x_ptr, rmax_ptr, cmax_ptr, n_rows, n_cols, stride, BT: tl.constexpr, BC: tl.constexpr):
        # each tile's largest magnitude by row (rmax [n_rows, column tiles]) and by column (cmax [row tiles,
        # n_cols])
        rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        cols = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
        rmask, cmask = rows < n_rows, cols < n_cols
        x = tl.load(x_ptr + rows[:, None] * stride + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
        a = tl.abs(x)
        tl.store(rmax_ptr + rows * tl.num_programs(1) + tl.program_id(1), tl.max(a, 1), mask=rmask)
        tl.store(cmax_ptr + tl.program_id(0) * n_cols + cols, tl.max(a, 0), mask=cmask)


def cast_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, inv)`` for a 2-D ``x`` (its rows may be strided): ``q`` e4m3 [rows, n], contiguous, and ``inv``
    fp32 [rows, 1], with ``q * inv`` about ``x`` (each row to e4m3's 3 mantissa bits of its largest value).
    The kernel where Triton runs, else the same arithmetic in PyTorch."""
    n_rows, n = x.shape
    if not triton_usable(x):
        amax = x.abs().amax(1, keepdim=True).float().clamp(min=1e-12)
        q = (x.float() * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        return q, amax / E4M3_MAX
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(n_rows, n, dtype=E4M3, device=x.device)
    inv = torch.empty(n_rows, 1, dtype=torch.float32, device=x.device)
    block_n = min(triton.next_power_of_2(max(n, 16)), 2048)
    rows = 1 if not x.is_cuda else max(1, 2048 // block_n)
    if n_rows:
        _cast_rows[(triton.cdiv(n_rows, rows),)](x, q, inv, n_rows, x.stride(0), N=n, BLOCK_N=block_n, ROWS=rows,
                                                 num_warps=1 if not x.is_cuda else 8)
    return q, inv


def cast_columns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, inv)`` for a 2-D ``x`` [rows, n]: ``q`` e4m3 [n, rows], contiguous (x's columns as rows), and
    ``inv`` fp32 [n, 1], each column on the scale of its largest magnitude: ``cast_rows(x.t())``'s values
    without its transposed copy. A NaN or an infinity in a column makes that column's products non-finite."""
    n_rows, n = x.shape
    if not n_rows:  # (an infinity norm over no values has no identity)
        return (torch.empty(n, 0, dtype=E4M3, device=x.device),
                torch.full((n, 1), 1e-12 / E4M3_MAX, dtype=torch.float32, device=x.device))
    if x.stride(1) != 1:
        x = x.contiguous()
    amax = torch.linalg.vector_norm(x, float("inf"), dim=0).float()
    if not triton_usable(x):
        amax = amax.clamp(min=1e-12)[:, None]
        q = (x.t().float() * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).contiguous()
        return q, amax / E4M3_MAX
    return _columns_kernel(x, amax)


def _tiles(x: torch.Tensor) -> tuple[int, int, int]:
    """The column casts' tile (rows, columns) and warps."""
    return (64, 64, 4) if x.is_cuda else (16, 16, 1)


def _columns_kernel(x: torch.Tensor, amax: torch.Tensor, row_amax: torch.Tensor | None = None):
    """``_cast_columns_t`` over x (unit column stride) given its columns' amax (and its rows', for both casts)."""
    n_rows, n = x.shape
    bt, bc, warps = _tiles(x)
    q = torch.empty(n, n_rows, dtype=E4M3, device=x.device)
    inv = torch.empty(n, 1, dtype=torch.float32, device=x.device)
    qr = torch.empty(n_rows, n, dtype=E4M3, device=x.device) if row_amax is not None else q
    rinv = torch.empty(n_rows, 1, dtype=torch.float32, device=x.device) if row_amax is not None else inv
    if n:
        _cast_columns_t[(triton.cdiv(n_rows, bt), triton.cdiv(n, bc))](
            x, amax, q, inv, amax if row_amax is None else row_amax, qr, rinv, n_rows, n, x.stride(0),
            BT=bt, BC=bc, ROWS_TOO=row_amax is not None, num_warps=warps)
    return (q, inv) if row_amax is None else ((qr, rinv), (q, inv))


def cast_rows_and_columns(x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``(cast_rows(x), cast_columns(x))``, the same values and scales, from two reads of x."""
    n_rows, n = x.shape
    if not triton_usable(x) or not n_rows or not n:
        return cast_rows(x), cast_columns(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    bt, bc, warps = _tiles(x)
    grid = (triton.cdiv(n_rows, bt), triton.cdiv(n, bc))
    rmax = torch.empty(n_rows, grid[1], dtype=torch.float32, device=x.device)
    cmax = torch.empty(grid[0], n, dtype=torch.float32, device=x.device)
    _tile_amax[grid](x, rmax, cmax, n_rows, n, x.stride(0), BT=bt, BC=bc, num_warps=warps)
    return _columns_kernel(x, cmax.amax(0), rmax.amax(1))
