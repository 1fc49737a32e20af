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


def pack_batch(examples: list[tuple[list[int], list[int]]], rows: int, length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Pack examples end to end into ``rows`` rows of ``length`` tokens.

    ``position_ids`` restart at 0 for each sample: transformers' mask functions read that as separate
    sequences, so attention never crosses a sample boundary, and the engine drops the one target that
    would (the first token of a sample predicted from the previous one). Examples are placed in order,
    first fit; one that does not fit in what is left of a row starts the next. Unused tail tokens are
    padding (their own "sample", never a target).
    """
    ids = torch.full((rows, length), pad_id, dtype=torch.long)
    labels = torch.full((rows, length), -100, dtype=torch.long)
    pos = torch.zeros((rows, length), dtype=torch.long)
    r, col, used = 0, 0, 0
    for x, y in examples:
        n = min(len(x), length)
        if col + n > length:
            if col < length:
                pos[r, col:] = torch.arange(length - col)  # the padding tail is a sequence of its own
            r, col = r + 1, 0
        if r == rows:
            break
        ids[r, col: col + n] = torch.tensor(x[:n])
        labels[r, col: col + n] = torch.tensor(y[:n])
        pos[r, col: col + n] = torch.arange(n)
        col += n
        used += 1
    if r < rows and col < length:
        pos[r, col:] = torch.arange(length - col)
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "examples_used": used}
