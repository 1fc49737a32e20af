"""Padding examples of different lengths into one micro-batch."""
from __future__ import annotations

import torch


def pad_batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; padding is masked out of attention and of the loss."""
    S = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), S), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), S), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), S), dtype=torch.long)
    for i, (x, y) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}
