"""Full training state on disk: a checkpoint that resumes the same training, written atomically.

A checkpoint directory holds
- the Hugging Face model (``model.safetensors`` or shards, ``config.json``): what transformers loads;
- ``state/<unit>.safetensors``, one file per unit (embed, layer0, ..., head): its fp32 master weights
  and Adam moments as flat tensors, so that resume is bit-identical (the exported weights may be bf16).
  One file per unit so that state living on the NVMe tier passes through RAM one unit at a time;
- ``state/trainer.json``: the optimizer step, the caller's own state (data position, RNG, schedule)
  and a CRC32 of every file in the checkpoint, checked on load.
No pickle anywhere. Everything is written into ``<dir>.tmp``, flushed to disk, then renamed into place,
so a process killed mid-save leaves the previous checkpoint intact and no half-written one.
"""
from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..host.store import HostStore
from ..model.adapter import ModelAdapter
from . import export

STATE_DIR = "state"
TRAINER = "trainer.json"
FORMAT = 2  # 1: two files (master, moments) for all units


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated or altered."""


def _crc(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(64 << 20):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unit_key(adapter: ModelAdapter, unit: int) -> str:
    return adapter.units[unit].name


def save_checkpoint(path: str | os.PathLike, adapter: ModelAdapter, store: HostStore, dtype: torch.dtype,
                    trainer_state: dict | None = None) -> Path:
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # a save that was interrupted earlier
    (tmp / STATE_DIR).mkdir(parents=True)
    try:
        export.save_pretrained(tmp, adapter, store, dtype)
        for u in range(len(adapter.units)):
            save_file(store.unit_state(u), str(tmp / STATE_DIR / f"{_unit_key(adapter, u)}.safetensors"))
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        for f in files:
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        meta = {"format": FORMAT, "step": store.step, "trainer": trainer_state or {},
                "checksums": {str(f.relative_to(tmp)): _crc(f) for f in files}}
        (tmp / STATE_DIR / TRAINER).write_text(json.dumps(meta, indent=1))
        with open(tmp / STATE_DIR / TRAINER, "rb") as fh:
            os.fsync(fh.fileno())
        _fsync_dir(tmp / STATE_DIR)
        _fsync_dir(tmp)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(e.errno, f"saving checkpoint {final} failed ({e.strerror}); the previous checkpoint is intact") from e
    if final.exists():  # replacing a checkpoint of the same name: move the old one aside first
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


def load_checkpoint(path: str | os.PathLike, adapter: ModelAdapter, store: HostStore) -> dict:
    """Restore master, moments and step into ``store``; returns the trainer state saved with them."""
    root = Path(path)
    meta_path = root / STATE_DIR / TRAINER
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{meta_path}: unreadable ({e}); this is not a complete slideformer checkpoint") from e
    if meta.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{meta_path}: format {meta.get('format')!r}, this slideformer reads {FORMAT}")
    for rel, crc in meta["checksums"].items():
        f = root / rel
        if not f.is_file():
            raise CorruptCheckpointError(f"checkpoint file {f} is missing")
        if _crc(f) != crc:
            raise CorruptCheckpointError(f"checkpoint file {f} is corrupt (CRC32 {_crc(f)}, expected {crc})")
    for u in range(len(adapter.units)):
        f = root / STATE_DIR / f"{_unit_key(adapter, u)}.safetensors"
        if not f.is_file():
            raise CorruptCheckpointError(f"{f} is missing: a checkpoint of another model?")
        with safe_open(str(f), framework="pt") as fh:
            saved = {k: fh.get_tensor(k) for k in fh.keys()}
        for k, want in store.unit_layout(u).items():
            t = saved.get(k)
            if t is None:
                raise CorruptCheckpointError(f"{f} lacks {k!r}: saved with another optimizer_state? Resume with the same")
            if t.numel() != want[0]:
                raise CorruptCheckpointError(f"{f}: {k} has {t.numel()} values, the model has {want[0]}: a "
                                             "checkpoint of another model?")
            if t.dtype != want[1]:
                raise CorruptCheckpointError(f"{root}: saved with optimizer_state="
                                             f"{'compact' if t.dtype == torch.bfloat16 else 'fp32'}; resume with the same")
        store.set_unit_state(u, saved)
    store.step = int(meta["step"])
    return meta["trainer"]
