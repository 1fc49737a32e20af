"""Learning-rate schedules as a pure function of the step, as in transformers' get_scheduler."""
from __future__ import annotations

import math

SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine")  # (transformers' names and meanings)


def lr_at(step: int, base_lr: float, kind: str = "constant", warmup_steps: int = 0,
          total_steps: int | None = None) -> float:
    """LR for the optimizer step with 0-based index ``step``."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
    if kind == "constant":  # (no warmup, whatever warmup_steps says: transformers' constant)
        return base_lr
    if step < warmup_steps:
        return base_lr * step / max(1, warmup_steps)
    if kind == "constant_with_warmup":
        return base_lr
    if total_steps is None:
        raise ValueError(f"the {kind} schedule needs total_steps")
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if kind == "linear":
        return base_lr * max(0.0, 1.0 - progress)
    return base_lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))
