"""slideformer: fine-tune language models larger than GPU memory on one GPU.

Names are imported on first use (PEP 562), so that the CLI can install its signal handlers before
torch loads (signals.py)."""
import importlib

_EXPORTS = {"SlideEngine": ".engine", "EngineConfig": ".config", "Placement": ".config", "Tuning": ".config", "ConfigError": ".config",
            "BatchError": ".data.batches", "CheckpointError": ".checkpoint", "UnsupportedModelError": ".model",
            "DoesNotFit": ".plan", "StepFailed": ".engine", "lr_at": ".optim"}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'slideformer' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
