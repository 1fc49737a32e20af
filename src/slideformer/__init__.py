"""slideformer: fine-tune language models larger than GPU memory on one GPU."""
from .config import ConfigError, EngineConfig
from .engine import SlideEngine
from .engine.engine import BatchError
from .checkpoint import CheckpointError
from .model import UnsupportedModelError
from .optim import lr_at
from .plan import DoesNotFit

__all__ = ["SlideEngine", "EngineConfig", "ConfigError", "BatchError", "CheckpointError",
           "UnsupportedModelError", "DoesNotFit", "lr_at"]
__version__ = "0.1.0"
