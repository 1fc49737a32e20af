"""The CPU optimizer: AdamW math on flat host buffers, and learning-rate schedules."""
from .adamw import adamw_update_
from .schedule import lr_at

__all__ = ["adamw_update_", "lr_at"]
