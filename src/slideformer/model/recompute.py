"""Backward's recompute of a layer, without the output of its last matmul.

Backward recomputes each layer from its saved input to rebuild the autograd graph. The MLP's down
projection is the layer's last matmul, and its output only joins the residual sum, whose value backward
never reads: the projection's backward needs its input and weight, not its output. So while the engine
recomputes, the projection records its graph and returns uninitialised memory of the right shape.
Plain training with gradient checkpointing gets the same saving from torch.utils.checkpoint's early stop.
Without it the recompute would run a quarter of a layer's forward GEMM work for nothing.

For the families the adapter supports (Llama, Qwen2/3, Mistral) the down projection's output is used
only by the residual add. A family that normalises the MLP output (Gemma's post-feedforward norm) would
need it: ``OutputFreeRecompute`` refuses modules it is not sure of.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


class _GraphOnlyLinear(torch.autograd.Function):
    """``F.linear``'s graph and gradients (the products autograd's backward computes), no forward product."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        gx = g2.mm(w).view_as(x) if ctx.needs_input_grad[0] else None
        gw = g2.t().mm(x2) if ctx.needs_input_grad[1] else None  # (as autograd: contiguous, [out, in])
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


class OutputFreeRecompute:
    """Wraps the ``forward`` of each layer's ``mlp.down_proj``; inside ``active()`` (the engine's
    recompute, with gradients on) it records the graph only."""

    def __init__(self, layers: list[nn.Module]):
        self._on = False
        for layer in layers:
            proj = layer.mlp.down_proj
            if type(proj) is not nn.Linear or hasattr(layer, "post_feedforward_layernorm"):
                raise TypeError(f"{type(layer).__name__}: the MLP output must go straight to the residual sum")
            proj.forward = self._wrap(proj)

    def _wrap(self, proj: nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if self._on and torch.is_grad_enabled():
                return _GraphOnlyLinear.apply(x, proj.weight, proj.bias)
            return F.linear(x, proj.weight, proj.bias)
        return forward

    @contextlib.contextmanager
    def active(self, on: bool = True):
        self._on = on
        try:
            yield
        finally:
            self._on = False
