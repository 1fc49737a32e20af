"""SwiGLU's backward for a recompute that never ran SwiGLU's forward: one pass that also writes the product.

Backward's recompute needs SwiGLU's output ``silu(gate) * up`` only as the down projection's input, for
that projection's weight gradient; nothing reads it before backward reaches the projection (its output is
never computed: model/recompute.py). So the recompute skips the forward kernel, and this pass, which reads
gate, up and the product's gradient anyway, writes the product beside the two gradients, the projection's
weight gradient following it. One read of gate and up a layer and micro-batch fewer.

The arithmetic is Liger-Kernel's (its forward and backward kernels, which the fused ops run): silu in fp32,
cast to the compute dtype, times up, rounded once; the gradients in fp32 from the bf16 loads, rounded once.
In place, as Liger's backward: gate's gradient over gate, up's over up, the product over its gradient.
Where Triton does not run, autograd's own ops compute the same. Every load is upcast to fp32, so the kernel also runs under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch

from .cross_entropy import triton, triton_usable

BLOCK = 4096

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _swiglu_backward_product(dy_ptr, g_ptr, u_ptr, n, BLOCK: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = at < n
        dt = dy_ptr.dtype.element_ty
        dy = tl.load(dy_ptr + at, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + at, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        tl.store(dy_ptr + at, (silu.to(dt).to(tl.float32) * u).to(dt), mask=mask)
        tl.store(g_ptr + at, (dy * (silu * (1 - sig) + sig) * u).to(dt), mask=mask)
        tl.store(u_ptr + at, (dy * silu).to(dt), mask=mask)


def swiglu_backward_product(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                            use_triton: bool | None = None) -> None:
    """In place: ``gate`` becomes its gradient, ``up`` its gradient, ``dy`` (the gradient of
    ``silu(gate) * up``) that product. All three contiguous, of one shape and dtype. ``use_triton``: the
    kernel (None: on CUDA; True also runs it in Triton's CPU interpreter)."""
    assert dy.is_contiguous() and gate.is_contiguous() and up.is_contiguous()
    if (dy.is_cuda if use_triton is None else use_triton) and triton_usable(dy):
        n = dy.numel()
        _swiglu_backward_product[(triton.cdiv(n, BLOCK),)](dy, gate, up, n, BLOCK=BLOCK, num_warps=8)
        return
    # (elsewhere autograd's own ops: the training is then bit for bit transformers' MLP's)
    with torch.enable_grad():
        g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
        y = torch.nn.functional.silu(g) * u
        dg, du = torch.autograd.grad(y, (g, u), dy)
    dy.copy_(y.detach())
    gate.copy_(dg)
    up.copy_(du)
