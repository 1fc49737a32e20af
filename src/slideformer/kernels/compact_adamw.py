"""Compact-state AdamW for units trained on the GPU, in one pass (Triton).

Compact state (config.optimizer_state): the master is hi + lo, both bf16, hi being the weights the
layer computes with; the moments are bf16, rounded stochastically with bits hashed from (seed, position
in the unit), so updating in pieces or on another device rounds the same way. The CPU does this in
optim/csrc/adamw.cpp; its PyTorch reference (optim/adamw.py: adamw_compact_) takes some 90 kernels and
fp32 temporaries of 56 bytes per element on a GPU. This kernel reads 10 and writes 8 bytes per parameter
and allocates nothing. bf16 values are handled as raw 16-bit patterns (round-to-nearest-even by integer
arithmetic), so no bf16 conversion of the interpreter's or the GPU's decides a result; they still differ
from the reference in the last bit now and then (the GPU fuses multiply-adds, the interpreter keeps
scalar arguments in fp64).
"""
from __future__ import annotations

import torch

from ..optim.adamw import compact_seeds
from .cross_entropy import triton, triton_usable

if triton is not None:
    import triton.language as tl

    # Integer work is done in int64 with explicit masks, so that no promotion rule of Triton (or of the
    # interpreter's numpy) decides where a uint32 product wraps.
    @triton.jit
    def _mix32(x):  # lowbias32 of uint32 values held in int64, as optim/adamw.py's _mix32
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit
    def _bf16_load(ptr, offs, mask):  # 16-bit pattern -> fp32
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.int64) & 0xFFFF
        return (bits << 16).to(tl.int32).to(tl.float32, bitcast=True)

    @triton.jit
    def _bits(x):  # fp32 -> its pattern as a non-negative int64
        return x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF

    @triton.jit
    def _as_int16(v):  # a 16-bit pattern in int64 -> int16, without a saturating cast
        return (v - ((v >> 15) << 16)).to(tl.int16)

    @triton.jit
    def _nearest(x):  # fp32 -> bf16 pattern (int64), rounded to nearest even
        bits = _bits(x)
        return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16

    # Triton compiles a variant per integer argument's type (i32 or i64, by value) and divisibility by 16.
    # The seeds change with every unit and step: passed as they come, they would compile a new variant now
    # and then, inside a step. They come as int32 patterns and are not specialised on, so one variant
    # serves every step.
    @triton.jit(do_not_specialize=["offset", "seed_m", "seed_v"])
    def _compact_adamw_kernel(hi_ptr, lo_ptr, g_ptr, m_ptr, v_ptr, n, offset, seed_m, seed_v,
                              grad_coef, w1, b2, one_minus_b2, bc2_sqrt, eps, decay, step_size,
                              GRAD_BF16: tl.constexpr, BLOCK: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        if GRAD_BF16:
            g = _bf16_load(g_ptr, idx, mask)
        else:
            g = tl.load(g_ptr + idx, mask=mask, other=0.0)
        g = g * grad_coef
        m0 = _bf16_load(m_ptr, idx, mask)
        # the reference's two forms of m0 + (1 - b1)(g - m0), whichever is exact for its b1
        m = tl.where(w1 < 0.5, m0 + w1 * (g - m0), g - (g - m0) * (1.0 - w1))
        v = _bf16_load(v_ptr, idx, mask) * b2 + one_minus_b2 * g * g
        # IEEE square root and division (Triton's plain ones are approximate on the GPU), as the CPU has
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = (_bf16_load(hi_ptr, idx, mask) + _bf16_load(lo_ptr, idx, mask)) * decay - tl.div_rn(step_size * m, denom)
        hi = _nearest(p)
        lo = _nearest(p - (hi << 16).to(tl.int32).to(tl.float32, bitcast=True))
        pos = offset.to(tl.int64) + idx
        m_bits = (_bits(m) + (_mix32(pos ^ (seed_m.to(tl.int64) & 0xFFFFFFFF)) & 0xFFFF)) >> 16
        v_bits = (_bits(v) + (_mix32(pos ^ (seed_v.to(tl.int64) & 0xFFFFFFFF)) & 0xFFFF)) >> 16
        tl.store(hi_ptr + idx, _as_int16(hi), mask=mask)
        tl.store(lo_ptr + idx, _as_int16(lo), mask=mask)
        tl.store(m_ptr + idx, _as_int16(m_bits), mask=mask)
        tl.store(v_ptr + idx, _as_int16(v_bits), mask=mask)


def compact_adamw_(hi: torch.Tensor, lo: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor, *, step: int, lr: float, betas: tuple[float, float], eps: float,
                   weight_decay: float, grad_coef: float = 1.0, seed: int = 0, offset: int = 0) -> None:
    """In place, the contract of optim.adamw.adamw_compact_ (contiguous 1-D bf16 state, bf16 or fp32
    gradient); where Triton cannot run, that PyTorch reference does it."""
    if not triton_usable(hi):
        from ..optim.adamw import adamw_compact_

        adamw_compact_(hi, lo, grad, exp_avg, exp_avg_sq, step=step, lr=lr, betas=betas, eps=eps,
                       weight_decay=weight_decay, grad_coef=grad_coef, seed=seed, offset=offset, backend="torch")
        return
    b1, b2 = betas
    seed_m, seed_v = (s - (1 << 32) if s >= 1 << 31 else s for s in compact_seeds(seed, step))  # as int32
    n = hi.numel()
    block = 1024
    _compact_adamw_kernel[(triton.cdiv(n, block),)](
        hi.view(torch.int16), lo.view(torch.int16), grad.view(torch.int16) if grad.dtype == torch.bfloat16 else grad,
        exp_avg.view(torch.int16), exp_avg_sq.view(torch.int16), n, offset, seed_m, seed_v,
        grad_coef, 1.0 - b1, b2, 1.0 - b2, (1.0 - b2 ** step) ** 0.5, eps, 1.0 - lr * weight_decay,
        lr / (1.0 - b1 ** step), GRAD_BF16=grad.dtype == torch.bfloat16, BLOCK=block)
