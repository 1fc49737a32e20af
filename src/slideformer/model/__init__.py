"""How a Hugging Face causal LM is seen by the engine: a sequence of units."""
from .adapter import ModelAdapter, ParamSpec, UnitSpec, UnsupportedModelError, SUPPORTED_MODEL_TYPES

__all__ = ["ModelAdapter", "ParamSpec", "UnitSpec", "UnsupportedModelError", "SUPPORTED_MODEL_TYPES"]
