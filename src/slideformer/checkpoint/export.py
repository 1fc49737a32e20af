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
