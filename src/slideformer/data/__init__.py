"""Data: records from local files become token ids and a loss mask, then padded micro-batches."""
from .batches import pack_batch, pad_batch
from .formats import FORMATS, NOT_JSON, DataError, detect_format, read_records, render, to_messages

__all__ = ["FORMATS", "NOT_JSON", "DataError", "detect_format", "pack_batch", "pad_batch", "read_records", "render", "to_messages"]
