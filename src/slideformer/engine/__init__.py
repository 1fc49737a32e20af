"""The training engine: a sliding window of layers with the CPU optimizer overlapped with backward."""
from .engine import SlideEngine

__all__ = ["SlideEngine"]
