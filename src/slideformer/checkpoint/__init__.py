"""Disk <-> host: Hugging Face safetensors checkpoints into the host store, and back out."""
from .loader import CheckpointError, load_safetensors, random_init
from .export import save_pretrained

__all__ = ["CheckpointError", "load_safetensors", "random_init", "save_pretrained"]
