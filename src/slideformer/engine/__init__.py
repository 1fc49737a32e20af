"""The training engine: a sliding window of layers with the CPU optimizer overlapped with backward."""
from .engine import SlideEngine, StepFailed

__all__ = ["SlideEngine", "StepFailed"]
