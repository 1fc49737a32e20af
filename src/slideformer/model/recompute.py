"""Backward's recompute of a layer: never the output of its last matmul, and, for the layers the planner
names, none of its matmuls at all.

Backward recomputes each layer from its saved input to rebuild the autograd graph. Two savings:

- **The down projection's output** (every layer). It is the layer's last matmul, and its output only
  joins the residual sum, whose value backward never reads: the projection's backward needs its input
  and weight, not its output. So while the engine recomputes, the projection records its graph and
  returns uninitialised memory of the right shape. Plain training with gradient checkpointing gets the
  same saving from torch.utils.checkpoint's early stop. Without it the recompute would run a quarter of
  a layer's forward GEMM work for nothing.
- **Kept products** (the planner's ``saved_layers``, where the GPU budget holds them). Forward keeps the
  output of each of the layer's other linears (q, k, v, o, gate and up: about 11 x hidden values a
  token at Qwen3-4B), and backward's recompute returns those instead of multiplying again. Only the
  elementwise work (norms, RoPE, the SwiGLU product, residual sums) and attention run again: the
  recompute's matmuls are about a fifth of a layer's GPU work. Attention is recomputed, not kept: its
  saved outputs depend on the backend SDPA picks, and at the sequence lengths of fine-tuning it is a
  few percent of the layer's products.
  An output that forward changed in place after its linear returned it (Liger's RoPE rotates q and k in
  their projections' memory for Llama-style attention) cannot be returned: backward multiplies again for
  it, and from then on forward keeps a copy of that linear's output.

In most families the down projection's output is used only by the residual add. A family that normalises
the MLP output (OLMo 2's and Gemma's post-feedforward norm) needs it: there the down projection is a kept
linear like the others, computed again where its layer's products are not kept.
"""
from __future__ import annotations

import contextlib
from collections import deque

import torch
import torch.nn.functional as F
from torch import nn


class _GraphOnlyLinear(torch.autograd.Function):
    """``F.linear``'s graph and gradients (the products autograd's backward computes), no forward
    product: the output is ``kept[0]`` (the product forward kept) where given, else uninitialised memory
    of the right shape. (A list, not a tensor argument: an input returned as an output would become a
    view, which the in-place RoPE may not modify.)"""

    @staticmethod
    def forward(ctx, x, weight, bias, kept=None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return kept[0] if kept else x.new_empty(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        gx = g2.mm(w).view_as(x) if ctx.needs_input_grad[0] else None
        gw = g2.t().mm(x2) if ctx.needs_input_grad[1] else None  # (as autograd: contiguous, [out, in])
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def output_free_down(layer: nn.Module) -> nn.Linear | None:
    """The layer's MLP down projection where its output only joins the residual sum, else None."""
    down = getattr(getattr(layer, "mlp", None), "down_proj", None)
    if type(down) is not nn.Linear or hasattr(layer, "post_feedforward_layernorm"):
        return None
    return down


def kept_values_per_token(layer: nn.Module) -> int:
    """Values a token of one layer keeps from forward to backward as kept products (the planner's
    ``saved_layers``): every linear's output but an output-free down projection's."""
    down = output_free_down(layer)
    return sum(m.out_features for m in layer.modules() if type(m) is nn.Linear and m is not down)


class LayerRecompute:
    """Wraps the ``forward`` of each layer's linears. Inside ``recording()`` (a forward without
    gradients) they keep their outputs; inside ``active()`` (the engine's recompute, with gradients on)
    an output-free down projection records its graph only, and with the kept products the others return
    theirs."""

    def __init__(self, layers: list[nn.Module]):
        self._output_free = False
        self._kept: dict | None = None
        self._copied: set[nn.Module] = set()  # linears whose output forward modifies in place: kept as copies
        for layer in layers:
            down = output_free_down(layer)
            for m in layer.modules():
                if type(m) is nn.Linear:
                    m.forward = self._wrap(m, last=m is down)

    def _wrap(self, proj: nn.Linear, last: bool):
        def forward(x: torch.Tensor) -> torch.Tensor:
            kept = self._kept
            if torch.is_grad_enabled():
                if last and self._output_free:
                    return _GraphOnlyLinear.apply(x, proj.weight, proj.bias)
                if kept is not None and not last:
                    y, version = kept[proj].popleft()
                    if y._version == version:
                        return _GraphOnlyLinear.apply(x, proj.weight, proj.bias, [y])
                    self._copied.add(proj)  # changed in place after forward returned it: multiply again
            elif kept is not None and not last:
                y = F.linear(x, proj.weight, proj.bias)
                k = y.clone() if proj in self._copied else y
                kept.setdefault(proj, deque()).append((k, k._version))
                return y
            return F.linear(x, proj.weight, proj.bias)
        return forward

    @contextlib.contextmanager
    def recording(self):
        """A forward without gradients that keeps its linears' outputs: yields what backward's
        ``active(kept=...)`` takes (one layer and micro-batch's worth)."""
        self._kept = kept = {}
        try:
            yield kept
        finally:
            self._kept = None

    @contextlib.contextmanager
    def active(self, output_free: bool = True, kept: dict | None = None):
        """Backward's recompute: the down projection without its product (``output_free``), and the other
        linears' products taken from ``kept`` (from ``recording``; emptied as they are used)."""
        self._output_free, self._kept = output_free, kept
        try:
            yield
        finally:
            self._output_free, self._kept = False, None
