"""Kernels for the step's memory and time bottlenecks (Triton, ours)."""
from .compact_adamw import compact_adamw_
from .cross_entropy import cross_entropy_grad_, triton_usable
from .fused_linear_ce import fused_linear_cross_entropy, reference_linear_cross_entropy

# (imported with the package, as the kernels above: ``@triton.jit`` reads TRITON_INTERPRET at import)
from . import norm_rope, rms_norm  # noqa: E402,F401

__all__ = ["compact_adamw_", "cross_entropy_grad_", "fused_linear_cross_entropy", "reference_linear_cross_entropy",
           "triton_usable"]
