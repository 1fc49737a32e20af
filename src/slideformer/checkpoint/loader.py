"""Stream a Hugging Face safetensors checkpoint into the host store's flat fp32 masters.

Tensors are read one at a time through safetensors' memory map and copied (with the dtype cast)
straight into their slot in the unit's flat buffer, so the model is never held twice in RAM.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from ..host.store import HostStore
from ..model.adapter import ModelAdapter

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated or does not match the model."""


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    root = Path(path)
    if (root / INDEX).is_file():
        try:
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{root / INDEX}: not a valid safetensors index ({e})") from e
        files = [root / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"checkpoint shard(s) listed in {root / INDEX} are missing: {', '.join(missing)}")
        return files
    if (root / SINGLE).is_file():
        return [root / SINGLE]
    raise CheckpointError(f"no {SINGLE} or {INDEX} in {root}: slideformer loads safetensors checkpoints")


def load_safetensors(path: str | os.PathLike, adapter: ModelAdapter, store: HostStore) -> None:
    wanted = adapter.checkpoint_keys()
    seen: set[str] = set()
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key not in wanted:
                        continue  # e.g. a tied lm_head.weight, or rotary buffers saved by old versions
                    unit, spec = wanted[key]
                    t = f.get_tensor(key)
                    if tuple(t.shape) != spec.shape:
                        raise CheckpointError(f"{file}: {key} has shape {tuple(t.shape)}, the config implies {spec.shape}")
                    store.view(unit.index, store.master, spec).copy_(t)
                    seen.add(key)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            raise CheckpointError(f"cannot read checkpoint shard {file}: {e} (truncated or corrupt?)") from e
    missing = sorted(set(wanted) - seen)
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}")
    for u in adapter.units:
        store.refresh_weights(u.index)


def random_init(adapter: ModelAdapter, store: HostStore, seed: int = 0, device: str | torch.device = "cpu") -> None:
    """Hugging Face's default init (normal(0, initializer_range), norms at 1, biases at 0), per unit.

    The random numbers are drawn on ``device``: on a GPU this takes seconds for billions of weights.
    """
    std = getattr(adapter.config, "initializer_range", 0.02)
    gen = torch.Generator(device=device).manual_seed(seed)
    for u in adapter.units:
        for spec in u.params:
            v = store.view(u.index, store.master, spec)
            if spec.key.endswith("norm.weight"):
                v.fill_(1.0)
            elif spec.key.endswith(".bias"):
                v.zero_()
            else:
                v.copy_(torch.empty(spec.shape, device=device).normal_(0.0, std, generator=gen))
        store.refresh_weights(u.index)


def load_state_from_module(model: torch.nn.Module, adapter: ModelAdapter, store: HostStore) -> None:
    """Copy an in-memory Hugging Face model's weights into the store."""
    state = model.state_dict()
    for key, (unit, spec) in adapter.checkpoint_keys().items():
        if key not in state:
            raise CheckpointError(f"model has no parameter {key}")
        store.view(unit.index, store.master, spec).copy_(state[key])
    for u in adapter.units:
        store.refresh_weights(u.index)
