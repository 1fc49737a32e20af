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


def save_pretrained(out: str | os.PathLike, adapter: ModelAdapter, store: HostStore, dtype: torch.dtype) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for u in adapter.units:
        params = store.unit_params(u.index)
        for spec in u.params:
            t = params[spec.key].to(dtype).contiguous()
            nbytes = t.numel() * t.element_size()
            if size and size + nbytes > MAX_SHARD_BYTES:
                shards.append({})
                size = 0
            shards[-1][spec.key] = t
            size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        _write_atomic(out / "model.safetensors", lambda p: save_file(shards[0], str(p), metadata=meta))
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _write_atomic(out / name, lambda p, s=shard: save_file(s, str(p), metadata=meta))
            weight_map.update({k: name for k in shard})
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for s in shards for t in s.values())},
                 "weight_map": weight_map}
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
    before = set(Path(out).iterdir())
    save_pretrained(out, adapter, _StateMasters(Path(checkpoint) / STATE_DIR, adapter), dtype)
    return sorted(p.relative_to(out) for p in set(Path(out).iterdir()) - before)
