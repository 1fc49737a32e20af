"""The fine-tuning product: a typed config, the training loop, checkpoints and resume."""
from .config import TrainConfig, load_config

__all__ = ["TrainConfig", "load_config"]
