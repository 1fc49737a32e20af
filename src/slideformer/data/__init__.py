"""Data: records from local files become token ids and a loss mask, then padded micro-batches."""
from .records import DataError, read_jsonl, render_alpaca
from .batches import pad_batch

__all__ = ["DataError", "read_jsonl", "render_alpaca", "pad_batch"]
