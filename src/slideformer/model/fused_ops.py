"""Liger-Kernel's fused RMSNorm and SwiGLU on the engine's own layer modules.

Liger's ``apply_liger_kernel_to_*`` functions replace transformers' module-level classes and functions,
which changes every model of that family in the process (a user's reference model too). Here only the
engine's skeleton instances change: each RMSNorm's and each MLP's ``forward`` is rebound. RoPE stays
transformers': its function is looked up in the modeling module's globals, so it cannot change per
instance. CUDA only: Liger's Triton kernels do not run in Triton's CPU interpreter.

Why these two: the Llama-8B step profile (bench/NOTES.md, session 3) puts the unfused RMSNorm at about
6% of GPU time and SwiGLU at about 2%, spread over many small elementwise kernels.
"""
from __future__ import annotations

import types

from torch import nn


def liger_available() -> bool:
    try:
        import liger_kernel.ops.rms_norm  # noqa: F401
        import liger_kernel.ops.swiglu  # noqa: F401
    except ImportError:
        return False
    return True


def resolve(requested: str, device: str) -> str:
    """"auto" becomes "liger" on CUDA when Liger-Kernel is installed, else "none"."""
    if requested == "auto":
        return "liger" if device.startswith("cuda") and liger_available() else "none"
    return requested


def _rms_norm_forward(self, x):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    # "llama" casting: the inverse RMS in fp32, the product with the weight in the input dtype, as in
    # transformers' RMSNorm; not in place, since the engine reuses the incoming gradients.
    return LigerRMSNormFunction.apply(x, self.weight, self.variance_epsilon, 0.0, "llama", False)


def _swiglu_forward(self, x):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))


def apply_liger(modules: list[nn.Module], hidden_act: str) -> int:
    """Rebind the RMSNorms and SwiGLU MLPs found in ``modules``; returns how many were rebound."""
    count = 0
    for root in modules:
        for m in root.modules():
            name = type(m).__name__
            if name.endswith("RMSNorm") and hasattr(m, "variance_epsilon"):
                m.forward = types.MethodType(_rms_norm_forward, m)
                count += 1
            elif name.endswith("MLP") and hidden_act in ("silu", "swish") and \
                    all(hasattr(m, p) for p in ("gate_proj", "up_proj", "down_proj")):
                m.forward = types.MethodType(_swiglu_forward, m)
                count += 1
    return count
