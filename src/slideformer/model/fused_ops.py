"""Fused RMSNorm, SwiGLU and RoPE on the engine's own layer modules: Liger-Kernel's SwiGLU and RoPE, and
our RMSNorm (kernels/rms_norm.py: Liger's backward moves its bytes at a third of the memory's rate at
a layer's shapes). Qwen 3's per-head q and k norms run in the rotation's kernel (kernels/norm_rope.py:
one pass over q and k each way instead of two).

Liger's ``apply_liger_kernel_to_*`` functions replace transformers' module-level classes and functions,
which changes every model of that family in the process (a user's reference model too). Here only the
engine's skeleton instances change: each RMSNorm's and each MLP's ``forward`` is rebound, and each
attention module gets its class's own ``forward`` code run with Liger's RoPE in place of the
``apply_rotary_pos_emb`` its modeling module defines (a copy of the function with one global swapped).
CUDA only: Liger's SwiGLU does not run in Triton's CPU interpreter.

Why these: unfused, RMSNorm, RoPE and SwiGLU each run as many small elementwise kernels that together
take a sizeable share of a step's GPU time.
"""
from __future__ import annotations

import inspect
import types

import torch
from torch import nn


def liger_available() -> bool:
    try:
        import liger_kernel.ops.swiglu  # noqa: F401
        import liger_kernel.transformers.rope  # noqa: F401
    except Exception:  # not installed, or its Triton does not import: transformers' modules serve
        return False
    return True


# Families whose RMSNorm, SwiGLU and RoPE are the ones Liger's kernels compute ("llama" casting, the whole
# head rotated). Others differ (OLMo 2's norm casts after the product; Phi-3 rotates part of each head).
LIGER_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def resolve(requested: str, device: str, model_type: str | None = None) -> str:
    """"auto" becomes "liger" on CUDA when Liger-Kernel is installed and the family is one of
    LIGER_FAMILIES, else "none"; "liger" asked for a family outside them is refused."""
    fits = model_type is None or model_type in LIGER_FAMILIES
    if requested == "auto":
        return "liger" if device.startswith("cuda") and liger_available() and fits else "none"
    if requested == "liger" and not fits:
        from ..config import ConfigError

        raise ConfigError(f"fused_ops='liger': Liger's kernels compute the norms and RoPE of "
                          f"{', '.join(LIGER_FAMILIES)} models, not {model_type!r}'s; use fused_ops='none'")
    return requested


def liger_missing(requested: str, device: str, model_type: str | None) -> bool:
    """Whether "auto" ran unfused only because Liger-Kernel is not installed (CUDA, a family it serves): the
    layers are then markedly slower, which the engine says once."""
    return requested == "auto" and device.startswith("cuda") and model_type in LIGER_FAMILIES \
        and not liger_available()


def _rms_norm_forward(self, x):
    from ..kernels.rms_norm import rms_norm

    return rms_norm(x, self.weight, self.variance_epsilon)


def _swiglu_forward(self, x):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))


def _liger_rope(q, k, *args, **kwargs):
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    if not torch.is_grad_enabled():
        # Its kernel rotates q and k in their own memory where it can (a projection's output, for Llama-style
        # attention) through raw pointers, unseen by torch's version counters. A forward that keeps its
        # linears' outputs for backward (model/recompute.py) must know: the counters are moved here, before
        # the call (after it, autograd would take the views it returns for modified ones). Only without
        # gradients: that is the forward that keeps products, and autograd then records nothing.
        torch.autograd.graph.increment_version((q, k))
    return liger_rotary_pos_emb(q, k, *args, **kwargs)


def same_code(fn, other) -> bool:
    """Whether two functions run the same code (compared as bytecode and names: transformers' families
    generated from one another's modules share it)."""
    a, b = inspect.unwrap(fn).__code__, inspect.unwrap(other).__code__
    return a.co_code == b.co_code and a.co_names == b.co_names


def _qwen3_attention(forward) -> bool:
    """Whether an attention ``forward`` is Qwen 3's: q and k normalised by head, then rotated."""
    try:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention
    except ImportError:
        return False
    return same_code(forward, Qwen3Attention.forward)


def _norm_rope_of(attn: nn.Module):
    """Qwen 3's rotation for ``attn`` with its q and k norms in the same kernel (kernels/norm_rope.py): the
    norms' own forwards then pass their input on. The norms' weights are read at each call (the engine
    binds each visit's)."""
    from ..kernels.norm_rope import norm_rope

    q_norm, k_norm = attn.q_norm, attn.k_norm
    q_norm.forward = k_norm.forward = _unchanged

    def rope(q, k, cos, sin, *args, **kwargs):
        # q and k: [batch, heads, seq, head_dim] views of the projections' [batch, seq, heads, head_dim]
        q = norm_rope(q.transpose(1, 2), q_norm.weight, cos, sin, q_norm.variance_epsilon).transpose(1, 2)
        k = norm_rope(k.transpose(1, 2), k_norm.weight, cos, sin, k_norm.variance_epsilon).transpose(1, 2)
        return q, k
    return rope


def _unchanged(x):
    return x


def forward_with(fn, **globals_):
    """A copy of function ``fn`` in which the global names given resolve to other objects."""
    scope = dict(fn.__globals__)
    scope.update(globals_)
    new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


def apply_liger(modules: list[nn.Module], hidden_act: str, rope=_liger_rope) -> int:
    """Rebind the RMSNorms, SwiGLU MLPs and RoPE of the attention modules found in ``modules``; returns
    how many modules were rebound."""
    count = 0
    for root in modules:
        for m in root.modules():
            name = type(m).__name__
            fwd = type(m).forward
            if name.endswith("Attention") and inspect.unwrap(fwd) is fwd and \
                    "apply_rotary_pos_emb" in fwd.__code__.co_names:  # (a decorated forward keeps its RoPE)
                own = _norm_rope_of(m) if _qwen3_attention(fwd) else rope
                m.forward = types.MethodType(forward_with(fwd, apply_rotary_pos_emb=own), m)
                count += 1
            elif name.endswith("RMSNorm") and hasattr(m, "variance_epsilon"):
                if vars(m).get("forward") is not _unchanged:  # (Qwen 3's q and k norms: in the rotation)
                    m.forward = types.MethodType(_rms_norm_forward, m)
                count += 1
            elif name.endswith("MLP") and hidden_act in ("silu", "swish") and \
                    all(hasattr(m, p) for p in ("gate_proj", "up_proj", "down_proj")):
                m.forward = types.MethodType(_swiglu_forward, m)
                count += 1
    return count
