"""Micro-batches: padding or packing examples into rows, and checking what a caller hands the engine.

``check_step`` is the engine's boundary for batches: every refusal names the micro-batch and the fix,
and what it returns is on the host, shifted for next-token prediction, ready to be copied to the device.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


class BatchError(ValueError):
    """A batch the model cannot train on; the message says what is wrong."""


@dataclass
class HostMicroBatch:
    input_ids: torch.Tensor  # [B, S] integer
    labels: torch.Tensor  # [B, S] shifted left by one, -100 = ignored
    attention_mask: torch.Tensor | None  # [B, S]; None: no padding
    position_ids: torch.Tensor | None  # [B, S] restarting at 0 per packed sample; None: 0..S-1


KEYS = ("input_ids", "labels", "attention_mask", "position_ids")  # what a micro-batch's dict is read for


LABEL_NAMES = ("label", "label_ids", "labels_ids")  # (other libraries' names for labels)


def misspelt(key, item) -> str | None:
    """The key of KEYS that ``key`` of ``item`` was meant as: one the item lacks, within two edits of it or
    HF's other names for labels (``label``, ``label_ids``); other keys (a tokenizer's token_type_ids, a
    collator's labels_mask or prompt_attention_mask, pack_batch's counts) are not read and pass."""
    if not isinstance(key, str) or key in KEYS:
        return None
    for meant in KEYS:
        if meant not in item and (_edits(key, meant) <= 2 or meant == "labels" and key in LABEL_NAMES):
            return meant
    return None


def _edits(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions)."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def as_tensor(value, where: str, key: str) -> torch.Tensor:
    """A batch value as a host-readable tensor, or a BatchError naming it (a ragged list, text, a meta tensor)."""
    try:
        t = torch.as_tensor(value)
    except (ValueError, TypeError, RuntimeError) as e:
        raise BatchError(f"{where}: {key} must be a tensor or a rectangular list of integers, got "
                         f"{type(value).__name__} ({str(e).splitlines()[0]})") from None
    if t.device.type == "meta":
        raise BatchError(f"{where}: {key} is a meta tensor, which holds no values; give its data")
    return t


def check_step(batch, vocab: int, max_positions: int | None, some_targets: bool = True, flash: bool = False
               ) -> tuple[list[HostMicroBatch], int]:
    """A step's micro-batches (a dict, or a list of them) checked and shifted, and the number of target
    tokens in the whole step (each micro-batch's loss sum is divided by it). ``some_targets``: refuse a
    step with none (a data-parallel rank's part may have none: the engine checks the whole step's).
    ``flash``: the attention is flash attention's, which reads restarting position_ids as sample bounds only
    in a batch of one row (transformers' rule; of more rows, each attends across its samples)."""
    items = batch if isinstance(batch, (list, tuple)) else [batch]
    if not items:
        raise BatchError("empty batch: pass a dict with input_ids, or a non-empty list of them")
    out, denom = [], 0
    for k, item in enumerate(items):
        where = f"micro-batch {k}" if len(items) > 1 else "batch"
        if not isinstance(item, Mapping) or "input_ids" not in item:
            raise BatchError(f"{where}: expected a dict with 'input_ids' (and 'labels'), got {type(item).__name__}")
        if typo := next((k for k in item if misspelt(k, item)), None):  # (read as absent: labels would be every token)
            meant = misspelt(typo, item)
            raise BatchError(f"{where}: {typo!r} is not a key the engine reads; did you mean {meant!r}? (it reads "
                             f"{', '.join(KEYS)}" + ("; without labels every token the attention_mask keeps is a "
                                                     "target)" if meant == "labels" else ")"))
        ids = as_tensor(item["input_ids"], where, "input_ids")
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise BatchError(f"{where}: input_ids must be an integer tensor [batch, seq], got {tuple(ids.shape)} {ids.dtype}")
        B, S = ids.shape
        if not B or not S:
            raise BatchError(f"{where}: input_ids of shape {(B, S)} hold no token; give each micro-batch at least "
                             "one row of tokens, or leave it out")
        if max_positions is not None and S > max_positions:
            raise BatchError(f"{where}: sequence length {S} exceeds the model's max_position_embeddings "
                             f"{max_positions}; truncate inputs to at most {max_positions} tokens")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise BatchError(f"{where}: token ids must lie in [0, {vocab}), got [{int(ids.min())}, {int(ids.max())}]")
        am = item.get("attention_mask")
        labels = ids.clone() if item.get("labels") is None else as_tensor(item["labels"], where, "labels")
        if labels.dim() == 1 and B == 1:
            labels = labels.unsqueeze(0)
        if tuple(labels.shape) != (B, S):
            raise BatchError(f"{where}: labels shape {tuple(labels.shape)} differs from input_ids {(B, S)}")
        if labels.dtype not in (torch.int64, torch.int32):
            raise BatchError(f"{where}: labels must be an integer tensor (token ids, -100 where ignored), got "
                             f"{labels.dtype}")
        bad = (labels != -100) & ((labels < 0) | (labels >= vocab))
        if bool(bad.any()):
            raise BatchError(f"{where}: labels must be -100 (ignored) or token ids in [0, {vocab}), got "
                             f"{int(labels[bad][0])}")
        if am is not None:
            am = as_tensor(am, where, "attention_mask")
            if am.dim() == 1 and B == 1:
                am = am.unsqueeze(0)
            if tuple(am.shape) != (B, S):
                raise BatchError(f"{where}: attention_mask shape {tuple(am.shape)} differs from input_ids {(B, S)}")
            if item.get("labels") is None:
                labels = labels.masked_fill(am == 0, -100)
            if bool(am.all()):  # no padding: no mask, and no device read of it in the mask functions
                am = None
        pos = item.get("position_ids")
        if pos is not None:  # packed rows: positions restart per sample, attention stays within it
            pos = as_tensor(pos, where, "position_ids")
            if pos.dim() == 1 or (pos.dim() == 2 and pos.shape[0] == 1):  # (one row for all, as transformers reads it)
                pos = pos.reshape(1, -1).expand(B, -1).contiguous()
            if tuple(pos.shape) != (B, S) or pos.is_floating_point() or pos.is_complex():
                raise BatchError(f"{where}: position_ids must be integers of shape {(B, S)} (or {(1, S)} for every "
                                 f"row), got {tuple(pos.shape)} {pos.dtype}")
            pos = pos.long()
            if am is not None:
                raise BatchError(f"{where}: give either position_ids (packed samples) or attention_mask, not both")
            starts = torch.zeros_like(pos, dtype=torch.bool)
            starts[:, 1:] = pos[:, 1:] == 0
            if flash and B > 1 and bool(starts.any()):
                raise BatchError(f"{where}: {B} rows of packed samples under flash attention, which keeps samples "
                                 "apart only in a batch of one row (of more, each sample would attend to those "
                                 "before it in its row); pass one packed row a micro-batch, or use sdpa")
            labels = labels.masked_fill(starts, -100)  # no target across a sample boundary
        shifted = torch.full_like(labels, -100)
        shifted[:, :-1] = labels[:, 1:]
        denom += int((shifted != -100).sum())
        out.append(HostMicroBatch(ids, shifted, am, pos))
    if denom == 0 and some_targets:
        raise BatchError("every label in the step is ignored (-100): there is nothing to train on")
    return out, denom


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
    padding (their own "sample", never a target). ``examples_used`` and ``tokens_used`` (the tokens not
    padding) are ints beside the tensors.
    """
    ids = torch.full((rows, length), pad_id, dtype=torch.long)
    labels = torch.full((rows, length), -100, dtype=torch.long)
    pos = torch.zeros((rows, length), dtype=torch.long)
    r, col, used, tokens = 0, 0, 0, 0
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
        used, tokens = used + 1, tokens + n
    if r < rows and col < length:
        pos[r, col:] = torch.arange(length - col)
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "examples_used": used, "tokens_used": tokens}
