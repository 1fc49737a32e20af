"""The decoder layers' linears in FP8 (opt-in: ``EngineConfig.fp8``), as torchao's rowwise float8 recipe
with the weight gradient in high precision: forward's product and backward's input gradient multiply e4m3
rows, each with its own scale (kernels/fp8.py), on Hopper's FP8 tensor cores through ``torch._scaled_mm``;
the weight gradient stays a bf16 GEMM that adds into the slot's gradient (model/recompute.py), since
it sums over every token of the step and carries FP8's error straight into the update.

A weight is cast once a visit of its unit, not once per micro-batch: the casts (its rows for forward, its
columns for backward) are kept until the engine starts the next visit (``LayerRecompute.new_visit``),
whatever the weights' version counters say: broadcasts and Triton kernels write weights without moving
them. That is two bytes per parameter of one layer, which the planner counts.

A linear whose dimensions ``_scaled_mm`` cannot take (not multiples of 16) runs in the compute dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.fp8 import cast_rows


def fp8_shapes_ok(weight: torch.Tensor) -> bool:
    """``_scaled_mm`` takes inner and outer dimensions in multiples of 16."""
    return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


class Fp8Weights:
    """The current visit's e4m3 casts of each weight: its rows (forward: ``x @ w.T``) and its columns
    (backward: ``g @ w``), each as (values, inverse scales). The owner clears them when the weights
    may change."""

    def __init__(self):
        self._casts: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, w: torch.Tensor, columns: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        key = (w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, w.device, columns)
        if key not in self._casts:
            self._casts[key] = cast_rows(w.detach().t() if columns else w.detach())
        return self._casts[key]

    def clear(self) -> None:
        self._casts.clear()


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, casts: Fp8Weights) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with x's rows and the weight's rows in e4m3 (no gradient recorded)."""
    if not fp8_shapes_ok(weight):
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    qx, sx = cast_rows(x2)
    qw, sw = casts.get(weight)
    y = torch._scaled_mm(qx, qw.t(), sx, sw.t(), bias=None, out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


def fp8_input_grad(g2: torch.Tensor, weight: torch.Tensor, casts: Fp8Weights) -> torch.Tensor:
    """``g2 @ weight`` (the input's gradient, [tokens, in]) with g's rows and the weight's columns in e4m3."""
    if not fp8_shapes_ok(weight):
        return g2.mm(weight)
    qg, sg = cast_rows(g2)
    qwt, swt = casts.get(weight, columns=True)
    return torch._scaled_mm(qg, qwt.t(), sg, swt.t(), out_dtype=g2.dtype)
