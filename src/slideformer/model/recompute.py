"""Backward's recompute of a layer: never the output of its last matmul, and, for the layers the planner
names, none of its matmuls at all; each weight's gradient added into its slot within the GEMM.

Backward recomputes each layer from its saved input to rebuild the autograd graph. Three savings:

- **The down projection's output** (every layer). It is the layer's last matmul, and its output only
  joins the residual sum, whose value backward never reads: the projection's backward needs its input
  and weight, not its output. So while the engine recomputes, the projection records its graph and
  returns uninitialised memory of the right shape. Plain training with gradient checkpointing gets the
  same saving from torch.utils.checkpoint's early stop. Without it the recompute would run a quarter of
  a layer's forward GEMM work for nothing.
- **The attention's output projection** (the planner's ``mid_layers``, where RAM holds what it needs).
  Forward keeps the residual sum after the attention (the layer's midpoint: hidden values a token, offloaded
  beside the layer's input), and backward's recompute returns it for that sum: the projection, whose output
  only joins the sum, then records its graph without its product, as the down projection does.
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
- **SwiGLU's product** (every layer whose MLP is ``down(silu(gate(x)) * up(x))``). With the down
  projection's output not computed, its input, the product, is read only by that projection's weight
  gradient. So the recompute does not run SwiGLU's forward at all: backward's one pass over gate, up and
  the product's gradient writes the product beside their gradients (kernels/swiglu.py), and the weight
  gradient follows it. One pass over gate and up a layer fewer, and one [tokens, ffn] tensor fewer alive
  at the down projection's backward.
- **The input gradient's sums** (every layer). Linears that read one input (q, k and v; gate and up) run
  in the recompute as one autograd node: backward adds the others' input gradients into the last one's
  within their GEMMs (beta 1), where autograd would write each to a temporary and sum them in separate
  kernels. Which linears share an input is learnt from the forwards (the same tensor passed to each in
  turn), so no family's module names are listed. (Not in FP8, whose products have no beta.)
- **The weight gradient's second pass** (every layer). The recompute's linears add their weight's
  gradient into the ``.grad`` the engine binds to the slot with the GEMM itself (beta 1), where autograd
  would write each micro-batch's gradient to a temporary and add it in a separate kernel. (In FP8,
  ``_scaled_mm`` has no beta: its product is added after.)

In most families the down projection's output is used only by the residual add. A family that normalises
the MLP output (OLMo 2's and Gemma's post-feedforward norm) needs it: there the down projection is a kept
linear like the others, computed again where its layer's products are not kept.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import deque

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.swiglu import swiglu_backward_product
from .fp8 import Fp8Weights, fp8_gradients, fp8_linear


def _weight_gradient(w: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor, gw: torch.Tensor | None):
    """The weight's gradient added into the ``.grad`` the engine bound (the parameter saved is the one the
    layer holds: its .grad is the slot's view) within the GEMM, and None returned; else returned
    (contiguous, [out, in], as autograd's). ``gw``: the product where FP8 computed it already."""
    into = w.grad
    if into is not None and into.dtype == g2.dtype and into.is_contiguous():
        into.addmm_(g2.t(), x2) if gw is None else into.add_(gw)
        return None
    return g2.t().mm(x2) if gw is None else gw


class _RecomputedLinear(torch.autograd.Function):
    """``F.linear`` in backward's recompute. Its output is ``kept[0]`` (the product forward kept) where
    given, uninitialised memory of the right shape where ``output_free``, else the product. Backward adds
    the weight's gradient into the weight's ``.grad`` within the GEMM (beta 1: one pass over it, one
    rounding) where the engine has bound one of the product's dtype, which it does for each visit's
    slot: autograd would write the product to a temporary and add it in a second pass, a weight's worth
    of memory traffic three times over for every micro-batch after the first. (``kept`` a list, not a
    tensor argument: an input returned as an output would become a view, which the in-place RoPE may
    not modify.)"""

    @staticmethod
    def forward(ctx, x, weight, bias, kept=None, output_free=False, casts=None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.casts = casts
        if kept:
            return kept[0]
        if output_free:
            return x.new_empty(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias) if casts is None else fp8_linear(x, weight, bias, casts)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        need_x, need_w = ctx.needs_input_grad[:2]
        if ctx.casts is None:
            gx, gw = g2.mm(w) if need_x else None, None
        else:
            gx, gw = fp8_gradients(g2, x2, w, ctx.casts, need_x, need_w)
        gx = None if gx is None else gx.view_as(x)
        if need_w:
            gw = _weight_gradient(w, g2, x2, gw)
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None, None


class _SharedInputLinears(torch.autograd.Function):
    """Several linears of one input ``x`` in backward's recompute, as one node: outputs the products (or
    the kept ones, where given), and in backward one input gradient, each linear's added into the last's
    within its GEMM (beta 1) instead of summed by autograd in separate kernels; weight gradients as
    ``_RecomputedLinear``'s. ``params``: each linear's weight and bias (None where it has none)."""

    @staticmethod
    def forward(ctx, x, kept, *params):
        ctx.set_materialize_grads(False)  # (an output nobody used has no gradient: no zeros multiplied)
        weights, biases = params[0::2], params[1::2]
        ctx.save_for_backward(x, *weights)
        ctx.has_bias = [b is not None for b in biases]
        return tuple(k if k is not None else F.linear(x, w, b) for k, w, b in zip(kept, weights, biases))

    @staticmethod
    def backward(ctx, *gs):
        x, *weights = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        need = ctx.needs_input_grad
        gx, out = None, [None] * (2 * len(weights))
        # (the last linear first, as autograd runs their nodes: autograd's order of the sums, where the input
        # has no other use)
        for i in reversed(range(len(weights))):
            w, g = weights[i], gs[i]
            if g is None:
                continue
            g2 = g.reshape(-1, g.shape[-1])
            if need[0]:
                gx = g2.mm(w) if gx is None else gx.addmm_(g2, w)
            if need[2 + 2 * i]:
                out[2 * i] = _weight_gradient(w, g2, x2, None)
            if ctx.has_bias[i] and need[3 + 2 * i]:
                out[2 * i + 1] = g2.sum(0)
        return (None if gx is None else gx.view_as(x), None, *out)


class _UnreadSwiGLUDown(torch.autograd.Function):
    """``down(silu(gate) * up)`` in backward's recompute, where nobody reads its value (the down projection
    is output-free): memory of its shape. Backward makes the product's gradient, then in one pass the
    product and gate's and up's gradients (over the gradient, gate and up: nothing else reads them), then
    the weight's gradient from the product."""

    @staticmethod
    def forward(ctx, gate, up, weight):
        ctx.save_for_backward(gate, up, weight)
        return gate.new_empty(*gate.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g):
        gate, up, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        dy = g2.mm(w)
        gate2, up2 = gate.reshape(dy.shape), up.reshape(dy.shape)
        swiglu_backward_product(dy, gate2, up2)  # (dy is the product now; gate and up their gradients)
        gw = _weight_gradient(w, g2, dy, None) if ctx.needs_input_grad[2] else None
        return gate2.view_as(gate), up2.view_as(up), gw


def swiglu_mlp(layer: nn.Module) -> nn.Module | None:
    """The layer's MLP where it is ``down(silu(gate(x)) * up(x))`` of plain linears without bias (transformers'
    Llama MLP code, or the fused ops' SwiGLU), with an output-free down projection; else None."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    from .fused_ops import _swiglu_forward, same_code

    mlp = getattr(layer, "mlp", None)
    if output_free_down(layer) is None or \
            any(type(getattr(mlp, n, None)) is not nn.Linear or getattr(mlp, n).bias is not None
                for n in ("gate_proj", "up_proj", "down_proj")):
        return None
    fn = getattr(mlp, "forward", None)
    while hasattr(fn, "__wrapped__"):  # (token chunking's wrapper: model/chunked_mlp.py)
        fn = fn.__wrapped__
    fn = getattr(fn, "__func__", fn)
    if fn is _swiglu_forward:
        return mlp
    try:
        from transformers.activations import SiLUActivation
        silu = (nn.SiLU, SiLUActivation)
    except ImportError:
        silu = (nn.SiLU,)
    return mlp if isinstance(getattr(mlp, "act_fn", None), silu) and \
        callable(fn) and same_code(fn, LlamaMLP.forward) else None


def mid_projection(layer: nn.Module) -> nn.Linear | None:
    """The attention's output projection where the engine's own forward (model/decoder.py: Llama-style
    layers) can take the residual sum after it from forward (``LayerRecompute.active(mid=...)``), else None."""
    from .decoder import llama_style

    o = getattr(getattr(layer, "self_attn", None), "o_proj", None)
    return o if type(o) is nn.Linear and llama_style(layer) else None


def output_free_down(layer: nn.Module) -> nn.Linear | None:
    """The layer's MLP down projection where its output only joins the residual sum, else None: where the
    layer's modules with weights are its attention, its MLP and the norms before them, nothing with weights
    reads that output (a norm after the MLP, as Gemma 2's, OLMo 2's or GLM-4's, would read the values
    backward's recompute never makes)."""
    mlp = getattr(layer, "mlp", None)
    down = getattr(mlp, "down_proj", None)
    if type(down) is not nn.Linear or not _weighted(layer) <= _PRE_NORM_LAYER or not _weighted(mlp) <= _MLP:
        return None
    return down


_PRE_NORM_LAYER = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_MLP = {"gate_proj", "up_proj", "gate_up_proj", "down_proj"}


def _weighted(module: nn.Module) -> set[str]:
    """The names of ``module``'s children with weights, and of its own weights (a scale it applies itself)."""
    return {n for n, m in module.named_children() if any(True for _ in m.parameters())} | \
        {n for n, p in module.named_parameters(recurse=False)}


def kept_values_per_token(layer: nn.Module) -> int:
    """Values a token of one layer keeps from forward to backward as kept products (the planner's
    ``saved_layers``): every linear's output but an output-free down projection's."""
    down = output_free_down(layer)
    return sum(m.out_features for m in layer.modules() if type(m) is nn.Linear and m is not down)


class LayerRecompute:
    """Wraps the ``forward`` of each layer's linears. Inside ``recording()`` (a forward without
    gradients) they keep their outputs; inside ``active()`` (the engine's recompute, with gradients on)
    an output-free down projection records its graph only, with the kept products the others return
    theirs, and each adds its weight's gradient into the weight's ``.grad``. With ``fp8`` their products
    without gradients and in the recompute, and their input and weight gradients, multiply in FP8
    (model/fp8.py);
    token-chunked MLPs' layers recompute in the compute dtype (their checkpoints run plain linears)."""

    def __init__(self, layers: list[nn.Module], fp8: bool = False):
        self.casts = Fp8Weights() if fp8 else None
        self._active = False
        self._kept: dict | None = None
        self._copied: set[nn.Module] = set()  # linears whose output forward modifies in place: kept as copies
        # Linears that read one input, in call order, learnt from forwards without gradients: each member maps
        # to its group. The run being learnt: its linears, their input (weakly), their layer.
        self._groups: dict[nn.Linear, tuple[nn.Linear, ...]] = {}
        self._run: tuple[list, weakref.ref | None, nn.Module | None] = ([], None, None)
        self._pending: dict[nn.Linear, tuple[torch.Tensor, torch.Tensor]] = {}  # a group's later outputs, by input
        self._residual: torch.Tensor | None = None  # (sum_in_down's, for the down projection's GEMM)
        self._swiglu: dict[nn.Module, nn.Module | None] = {}  # layer -> its SwiGLU MLP (unread_mlp's), once seen
        self._mid_out: list | None = None  # (keeping_mids': the residual sums after attention, forward's)
        self._mid_in: torch.Tensor | None = None  # (active's: the one the recompute's layer takes)
        self._mid_free = {o for o in map(mid_projection, layers) if o is not None}
        for layer in layers:
            down = output_free_down(layer)
            for m in layer.modules():
                if type(m) is nn.Linear:
                    m.forward = self._wrap(m, layer, last=m is down)

    def _learn(self, proj: nn.Linear, layer: nn.Module, x: torch.Tensor, last: bool) -> None:
        members, ref, owner = self._run
        if last:  # (never in a group: the down projection records its graph only)
            self._run = ([], None, None)
        elif members and owner is layer and ref is not None and ref() is x and proj not in members:
            members.append(proj)
            for m in members:
                self._groups[m] = tuple(members)
        else:
            self._run = ([proj], weakref.ref(x), layer)

    def _take_kept(self, kept: dict, proj: nn.Linear) -> torch.Tensor | None:
        """The product forward kept for ``proj``'s next call, or None where forward changed it in place after
        returning it (then multiplied again, and kept as a copy from then on)."""
        y, version = kept[proj].popleft()
        if y._version == version:
            return y
        self._copied.add(proj)
        return None

    def _group_forward(self, proj: nn.Linear, x: torch.Tensor, kept: dict | None) -> torch.Tensor | None:
        """In the recompute, at a group's first linear: one node for the group, whose later linears' outputs
        wait in ``_pending`` for their calls; None for a linear in no group."""
        group = self._groups.get(proj)
        if group is None or proj is not group[0] or any(m in self._pending for m in group) or \
                (kept is not None and not all(kept.get(m) for m in group)):
            return None  # (no group, or a call order the forward did not show: each linear on its own)
        outs = [None if kept is None else self._take_kept(kept, m) for m in group]
        params = [t for m in group for t in (m.weight, m.bias)]
        ys = _SharedInputLinears.apply(x, outs, *params)
        for m, y in zip(group[1:], ys[1:]):
            self._pending[m] = (x, y)
        return ys[0]

    def _wrap(self, proj: nn.Linear, layer: nn.Module, last: bool):
        def forward(x: torch.Tensor) -> torch.Tensor:
            kept, casts = self._kept, self.casts
            grad = torch.is_grad_enabled()
            if grad and self._active:
                if last or (self._mid_in is not None and proj in self._mid_free):
                    return _RecomputedLinear.apply(x, proj.weight, proj.bias, None, True, casts)
                if casts is None:
                    pending = self._pending.pop(proj, None)
                    if pending is not None:  # a group's later linear: its output came with the first's
                        if pending[0] is x:
                            return pending[1]
                        # (another input than the group's: its product, its kept one having been taken)
                        return _RecomputedLinear.apply(x, proj.weight, proj.bias, None, False, None)
                    y = self._group_forward(proj, x, kept)
                    if y is not None:
                        return y
                y = None if kept is None else self._take_kept(kept, proj)
                return _RecomputedLinear.apply(x, proj.weight, proj.bias, None if y is None else [y], False, casts)
            # (with gradients outside the recompute, as token-chunked MLPs' checkpoints: autograd's linear)
            if not grad:
                self._learn(proj, layer, x, last)
                r = self._residual
                # (not a token chunk of the MLP's input, model/chunked_mlp.py: the whole sum's rows only)
                if last and r is not None and proj.bias is None and casts is None and x.shape[:-1] == r.shape[:-1]:
                    self._residual = None
                    return torch.addmm(r.reshape(-1, r.shape[-1]), x.reshape(-1, x.shape[-1]),
                                       proj.weight.t()).view(r.shape)
            y = F.linear(x, proj.weight, proj.bias) if grad or casts is None else \
                fp8_linear(x, proj.weight, proj.bias, casts)
            if kept is not None and not last:
                k = y.clone() if proj in self._copied else y
                kept.setdefault(proj, deque()).append((k, k._version))
            return y
        return forward

    def unread_mlp(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The layer's MLP in the recompute, whose output's value nobody reads: for a SwiGLU MLP (not in FP8)
        gate and up as the forward ran them, and no SwiGLU forward (``_UnreadSwiGLUDown``); else the MLP."""
        if layer not in self._swiglu:
            self._swiglu[layer] = swiglu_mlp(layer)
        mlp = self._swiglu[layer]
        if mlp is None or self.casts is not None:
            return layer.mlp(x)
        return _UnreadSwiGLUDown.apply(mlp.gate_proj(x), mlp.up_proj(x), mlp.down_proj.weight)

    @contextlib.contextmanager
    def keeping_mids(self, out: list):
        """A forward without gradients whose layers append the residual sum after their attention to ``out``
        (``keep_mid``), one a layer and micro-batch, for backward's ``active(mid=...)``."""
        self._mid_out = out
        try:
            yield
        finally:
            self._mid_out = None

    def keep_mid(self, residual: torch.Tensor) -> None:
        """The layer's residual sum after its attention, in a forward without gradients (model/decoder.py)."""
        if self._mid_out is not None:
            self._mid_out.append(residual)

    def take_mid(self) -> torch.Tensor | None:
        """In the recompute of a layer given ``mid``: that sum (once), which the layer returns for its
        attention's residual sum; its output projection is output-free until then. Else None."""
        mid, self._mid_in = self._mid_in, None
        return mid

    def sum_in_down(self, layer: nn.Module, residual: torch.Tensor, mlp) -> torch.Tensor:
        """``residual + mlp()`` in a forward without gradients, the sum added by the layer's output-free down
        projection within its GEMM (beta 1: the product rounded once with the sum, and one pass over the
        rows fewer than a separate add); a plain sum where the MLP ends otherwise (a MoE block's experts,
        a post-feedforward norm) or multiplies in FP8."""
        if self.casts is not None or output_free_down(layer) is None:
            return residual + mlp()
        self._residual = residual
        try:
            y = mlp()
        finally:
            r, self._residual = self._residual, None
        return y if r is None else r + y

    def new_visit(self) -> None:
        """A unit's visit begins: FP8 casts of the weights a slot held before are gone (a slot's new weights
        come by copies, broadcasts and kernels that a version counter does not always see)."""
        if self.casts is not None:
            self.casts.clear()

    @property
    def recomputing(self) -> bool:
        """Inside ``active()`` (on): backward's recompute, whose layer outputs' values nobody reads."""
        return self._active

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
    def active(self, on: bool = True, kept: dict | None = None, mid: torch.Tensor | None = None):
        """Backward's recompute: the down projection without its product, and the other linears' products
        taken from ``kept`` (from ``recording``; emptied as they are used), every weight's gradient added
        in its GEMM; with ``mid`` (from ``keeping_mids``) the attention's residual sum taken from it and its
        output projection without its product. ``on`` False (token-chunked MLPs, whose checkpoints run
        their linears again after this context has closed, and must find the same graph): plain linears
        throughout."""
        self._active, self._kept, self._mid_in = on, kept if on else None, mid if on else None
        try:
            yield
        finally:
            self._active, self._kept, self._mid_in = False, None, None
            self._pending.clear()
