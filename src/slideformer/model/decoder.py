"""The engine's forward of Llama-style decoder layers: those whose ``forward`` is transformers' Llama
decoder layer's own code (Llama, Qwen 2 and 3, Mistral, Gemma, Qwen 3 MoE, OLMoE): a pre-norm attention and a pre-norm
MLP, each added to the residual stream. The same arithmetic, with two sums fewer a layer:

- **The residual sum before the MLP's norm** runs in the norm's kernel where the fused ops are on
  (kernels/rms_norm.py ``add_rms_norm``); backward adds the sum's own gradient into the norm's input
  gradient in the same pass, where autograd would add them in another kernel.
- **The layer's output sum in a forward without gradients** is added by the down projection's GEMM
  (model/recompute.py ``sum_in_down``), where the MLP ends in one.
- **The layer input's two gradients** (through the attention's norm and along the residual stream) are
  summed in that norm's backward kernel likewise (``rms_norm_pass``), where the fused ops are on.
- **The residual sum after the attention in backward's recompute**, where forward kept it (the planner's
  ``mid_layers``), is forward's: the attention's output projection then runs without its product
  (model/recompute.py).
- **The layer's output sum in backward's recompute** is not computed: backward needs its graph, never its
  value (the engine differentiates the recomputed output against the gradient it already holds), and
  its MLP term is the down projection's output, which the recompute does not compute either, nor, for a
  SwiGLU MLP, that projection's input (model/recompute.py ``unread_mlp``).

Why our own forward and not transformers': its sums are Python operators inside the method, which no
module or function rebinding reaches.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.rms_norm import add_rms_norm, rms_norm_pass
from .fused_ops import same_code


def llama_style(layer: nn.Module) -> bool:
    """Whether the layer's class runs transformers' Llama decoder layer's forward code."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return same_code(type(layer).forward, LlamaDecoderLayer.forward)


class _KeptSum(torch.autograd.Function):
    """``a + b`` whose value forward kept (``kept[0]``, the same sum): returned as it is, the gradient passed
    to both terms. (``kept`` a list: a tensor input returned as an output would become a view.)"""

    @staticmethod
    def forward(ctx, a, b, kept):
        return kept[0]

    @staticmethod
    def backward(ctx, g):
        return g, g, None


class _UnreadSum(torch.autograd.Function):
    """``a + b`` whose value nobody reads: memory of its shape, and the gradient passed to both terms."""

    @staticmethod
    def forward(ctx, a, b):
        return torch.empty_like(a)

    @staticmethod
    def backward(ctx, g):
        return g, g


def install(layers: list[nn.Module], recompute, fused: bool) -> int:
    """Rebind the forward of each Llama-style layer in ``layers``; ``recompute`` (model/recompute.py
    ``LayerRecompute``) says when backward's recompute runs; ``fused``: the residual sum in the norm's
    kernel, whose norm is Llama's (only for the fused ops' families: model/fused_ops.py LIGER_FAMILIES).
    Returns how many layers were rebound."""
    count = 0
    for layer in layers:
        if llama_style(layer):
            layer.forward = _forward_of(layer, recompute, fused)
            count += 1
    return count


def _forward_of(layer: nn.Module, recompute, fused: bool):
    def forward(hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        grad = torch.is_grad_enabled()
        if fused and grad:
            norm = layer.input_layernorm
            h, residual = rms_norm_pass(hidden_states, norm.weight, norm.variance_epsilon)
        else:
            residual = hidden_states
            h = layer.input_layernorm(hidden_states)
        h, _ = layer.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
                               past_key_values=past_key_values, use_cache=use_cache,
                               position_embeddings=position_embeddings, **kwargs)
        norm = layer.post_attention_layernorm
        mid = recompute.take_mid()
        if mid is not None:  # (backward's recompute of a layer whose forward kept this sum)
            residual = _KeptSum.apply(residual, h, [mid])
            h, residual = rms_norm_pass(residual, norm.weight, norm.variance_epsilon) if fused else \
                (norm(residual), residual)
        elif fused:
            h, residual = add_rms_norm(residual, h, norm.weight, norm.variance_epsilon)
        else:
            residual = residual + h
            h = norm(residual)
        if recompute.recomputing:
            return _UnreadSum.apply(residual, recompute.unread_mlp(layer, h))
        if not grad:
            recompute.keep_mid(residual)
            return recompute.sum_in_down(layer, residual, lambda: layer.mlp(h))
        return residual + layer.mlp(h)
    return forward
