"""Write the fp32 masters (the host store's, or copies of the GPU's for units trained there) out as a
Hugging Face checkpoint that ``from_pretrained`` loads.

Files are written under temporary names and renamed into place, so a reader never sees half a file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..host.store import HostStore
from ..model.adapter import ModelAdapter

MAX_SHARD_BYTES = 5 * 2**30


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def shard_plan(adapter: ModelAdapter, dtype: torch.dtype, owner: list[int] | None = None) -> list[list]:
    """The export's files: (unit, parameter) pairs in unit order, a new file past MAX_SHARD_BYTES and
    wherever the owning rank changes (``owner``: each unit's, data parallel), so that each file is
    written by one rank from its own units. The same on every rank."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list] = [[]]
    size, last = 0, None
    for u in adapter.units:
        who = owner[u.index] if owner else 0
        for spec in u.params:
            nbytes = spec.numel * itemsize
            if shards[-1] and (size + nbytes > MAX_SHARD_BYTES or who != last):
                shards.append([])
                size = 0
            shards[-1].append((u, spec))
            size, last = size + nbytes, who
    return shards


def _names(plan: list) -> list[str]:
    return ["model.safetensors"] if len(plan) == 1 else \
        [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]


def _writer(shard: list, owner: list[int] | None) -> int:
    """The rank that writes a file of ``shard_plan``: its units' owner."""
    return owner[shard[0][0].index] if owner else 0


def files_of(adapter: ModelAdapter, dtype: torch.dtype, owner: list[int] | None, rank: int) -> list[str]:
    """The weight files ``save_pretrained`` writes on ``rank``."""
    plan = shard_plan(adapter, dtype, owner)
    return [n for n, shard in zip(_names(plan), plan) if _writer(shard, owner) == rank]


def save_pretrained(out: str | os.PathLike, adapter: ModelAdapter, store: HostStore, dtype: torch.dtype,
                    owner: list[int] | None = None, rank: int = 0) -> Path:
    """Write the files of ``shard_plan`` one at a time (a file's tensors are all the export holds in RAM);
    with ``owner``, only those of this ``rank``'s units, and rank 0 the index and config."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plan = shard_plan(adapter, dtype, owner)
    names = _names(plan)
    meta = {"format": "pt"}
    for name, shard in zip(names, plan):
        if _writer(shard, owner) != rank:
            continue
        tensors, unit, params = {}, None, None
        for u, spec in shard:
            if u is not unit:
                unit, params = u, store.unit_params(u.index)
            tensors[spec.key] = params[spec.key].to(dtype).contiguous()
        _write_atomic(out / name, lambda p, t=tensors: save_file(t, str(p), metadata=meta))
        del tensors, params
    if rank != 0:
        return out
    if len(plan) > 1:
        itemsize = torch.empty((), dtype=dtype).element_size()
        index = {"metadata": {"total_size": sum(spec.numel * itemsize for shard in plan for _, spec in shard)},
                 "weight_map": {spec.key: name for name, shard in zip(names, plan) for _, spec in shard}}
        _write_atomic(out / "model.safetensors.index.json", lambda p: p.write_text(json.dumps(index, indent=2)))
    cfg = adapter.config
    cfg.dtype = dtype
    cfg.save_pretrained(str(out))
    return out


class _StateMasters:
    """A checkpoint's training state read back as ``save_pretrained``'s store: each unit's master in fp32
    (compact state: hi + lo), one unit file at a time."""

    def __init__(self, state_dir: Path, adapter: ModelAdapter):
        self.state_dir, self.adapter = state_dir, adapter

    def unit_params(self, unit: int) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        u = self.adapter.units[unit]
        with safe_open(str(self.state_dir / f"{u.name}.safetensors"), framework="pt") as f:
            hi = f.get_tensor("master")
            lo = f.get_tensor("master_lo") if "master_lo" in f.keys() else None
        out = {}
        for spec in u.params:
            v = hi[spec.offset: spec.offset + spec.numel].view(spec.shape).float()
            if lo is not None:
                v = v + lo[spec.offset: spec.offset + spec.numel].view(spec.shape).float()
            out[spec.key] = v
        return out


def save_from_state(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype) -> list[Path]:
    """The Hugging Face weights and config of a checkpoint written again in ``dtype`` from its training master
    (the exact fp32 values, not the compute-dtype copy); returns the files written, relative to ``out``."""
    from transformers import AutoConfig

    from .state import STATE_DIR

    adapter = ModelAdapter(AutoConfig.from_pretrained(str(checkpoint)))
    save_pretrained(out, adapter, _StateMasters(Path(checkpoint) / STATE_DIR, adapter), dtype)
    weights = files_of(adapter, dtype, None, 0)  # (every file it wrote, new or replaced: what export keeps)
    return sorted(Path(n) for n in weights + ["config.json"] + (["model.safetensors.index.json"] if len(weights) > 1
                                                                 else []))
