"""Kernels for the step's memory and time bottlenecks (Triton, ours)."""
from .cross_entropy import cross_entropy_grad_, triton_usable
from .fused_linear_ce import fused_linear_cross_entropy, reference_linear_cross_entropy

__all__ = ["cross_entropy_grad_", "fused_linear_cross_entropy", "reference_linear_cross_entropy", "triton_usable"]
