"""The decoder layers' linears in FP8 (opt-in: ``EngineConfig.fp8``), as torchao's rowwise float8 recipe:
each of a linear's three products multiplies e4m3 operands on Hopper's FP8 tensor cores through
``torch._scaled_mm``, each operand scaled along the dimension its product keeps (kernels/fp8.py):

- forward (and the recompute): ``x @ w.T`` from x's rows and w's rows;
- the input gradient: ``g @ w`` from g's rows and w's columns;
- the weight gradient: ``g.T @ x`` from g's columns and x's columns, each over every token of the
  micro-batch, added into the slot's gradient in the compute dtype.

A weight is cast once a visit of its unit, not once per micro-batch: the casts (its rows for forward, its
columns for backward) are kept until the engine starts the next visit (``LayerRecompute.new_visit``),
whatever the weights' version counters say: broadcasts and Triton kernels write weights without moving
them. That is two bytes per parameter of one layer, which the planner counts.

An activation that several linears take (the normed hidden state, for q, k and v; for gate and up) is
cast once for all of them: the last one cast, rows and columns apart, is kept with a reference to it (so
that its memory cannot hold another tensor meanwhile) and matched by its memory, shape and version.

A linear whose dimensions ``_scaled_mm`` cannot take (not multiples of 16) runs in the compute dtype, and so
does a weight gradient whose token count is not a multiple of 16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.fp8 import cast_columns, cast_rows, cast_rows_and_columns


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` of e4m3 operands, a's rows and b's columns each on its own (inverse) scale: Hopper's FP8
    tensor cores through ``_scaled_mm``; on the CPU the same product of the values dequantized in fp32
    (the CPU's ``_scaled_mm`` takes only one scale a tensor in some torch versions: 2.11 asserts)."""
    if a.is_cuda:
        return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)


def fp8_shapes_ok(weight: torch.Tensor) -> bool:
    """``_scaled_mm`` takes inner and outer dimensions in multiples of 16."""
    return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def _key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device


class Fp8Weights:
    """The current visit's e4m3 casts of each weight: its rows (forward: ``x @ w.T``) and its columns
    (backward: ``g @ w``), each as (values, inverse scales); and the last activation cast by rows and by
    columns. The owner clears them when the weights may change."""

    def __init__(self):
        self._casts: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._last: dict[bool, tuple] = {}  # columns? -> (the tensor, its version, its cast)

    def get(self, w: torch.Tensor, columns: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        key = (*_key(w), columns)
        if key not in self._casts:
            self._casts[key] = cast_columns(w.detach()) if columns else cast_rows(w.detach())
        return self._casts[key]

    def activation(self, x: torch.Tensor, columns: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``cast_columns(x)`` or ``cast_rows(x)``, made once for consecutive linears that take the same x."""
        last = self._last.get(columns)
        if last is not None and _key(last[0]) == _key(x) and last[1] == x._version:
            return last[2]
        cast = cast_columns(x) if columns else cast_rows(x)
        self._last[columns] = (x, x._version, cast)
        return cast

    def clear(self) -> None:
        self._casts.clear()
        self._last.clear()


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, casts: Fp8Weights) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with x's rows and the weight's rows in e4m3 (no gradient recorded)."""
    if not fp8_shapes_ok(weight):
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    qx, sx = casts.activation(x2)
    qw, sw = casts.get(weight)
    y = scaled_mm(qx, qw.t(), sx, sw.t(), x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


def fp8_gradients(g2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, casts: Fp8Weights, input_grad: bool,
                  weight_grad: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The input's gradient ``g2 @ weight`` ([tokens, in]; g's rows and the weight's columns in e4m3) where
    ``input_grad``, and the weight's ``g2.T @ x2`` ([out, in], in g's dtype; g's and x's columns) where
    ``weight_grad``, each None where not asked. The weight's is None too where ``_scaled_mm`` cannot take the
    shapes (tokens not a multiple of 16): the caller multiplies in the compute dtype. g's two casts come
    from one kernel where both products are FP8."""
    shapes_ok = fp8_shapes_ok(weight)
    rows_ok = input_grad and shapes_ok
    columns_ok = weight_grad and shapes_ok and g2.shape[0] % 16 == 0
    if rows_ok and columns_ok:
        g_rows, g_columns = cast_rows_and_columns(g2)
    else:
        g_rows = cast_rows(g2) if rows_ok else None
        g_columns = cast_columns(g2) if columns_ok else None
    gx = gw = None
    if rows_ok:
        qwt, swt = casts.get(weight, columns=True)
        gx = scaled_mm(g_rows[0], qwt.t(), g_rows[1], swt.t(), g2.dtype)
        del g_rows  # (its memory serves the weight gradient's product)
    elif input_grad:
        gx = g2.mm(weight)
    if columns_ok:
        qx, sx = casts.activation(x2, columns=True)
        gw = scaled_mm(g_columns[0], qx.t(), g_columns[1], sx.t(), g2.dtype)
    return gx, gw
