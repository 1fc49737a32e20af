"""Full training state on disk: a checkpoint that resumes the same training, written atomically.

A checkpoint directory holds
- the Hugging Face model (``model.safetensors`` or shards, ``config.json``): what transformers loads;
- ``state/<unit>.safetensors``, one file per unit (embed, layer0, ..., head): its fp32 master weights
  and Adam moments as flat tensors, so that resume is bit-identical (the exported weights may be bf16).
  One file per unit so that state living on the NVMe tier passes through RAM one unit at a time;
- ``state/trainer.json``: the optimizer step, the caller's own state (data position, RNG, schedule),
  a CRC32 of every other file in the checkpoint and one of its own content, all checked on load.
No pickle anywhere. Everything is written into ``<dir>.tmp``, flushed to disk, then renamed into place,
so a process killed mid-save leaves the previous checkpoint intact and no half-written one. State that
is not finite is refused before anything is renamed: a checkpoint never holds a NaN.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..host.store import HostStore
from ..model.adapter import ModelAdapter
from . import export
from .export import NonFiniteStateError, readable
from .loader import CheckpointError

STATE_DIR = "state"
TRAINER = "trainer.json"
MARK = ".slideformer-save"  # written first into a save's folder: an interrupted save is told from a user's folder
FORMAT = 3  # 2: trainer.json without a checksum of its own (still read); 1: two files for all units
READS = (2, 3)


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated or altered."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full or read-only disk); the partial one is removed."""


def is_checkpoint_dir(path: Path) -> bool:
    """A folder a save wrote, whole (its metadata) or interrupted (the mark a save leaves first): what a save
    may replace or remove; any other folder is the user's."""
    return path.is_dir() and not path.is_symlink() and any((path / STATE_DIR / n).is_file() for n in (TRAINER, MARK))


def _remove_save(path: Path) -> None:
    """Remove a folder a save made (``is_checkpoint_dir``), its mark or metadata last: a removal cut short
    leaves a folder that is still told as one, and the next save removes the rest."""
    keep = [path / STATE_DIR / n for n in (TRAINER, MARK)]
    for entry in path.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            for sub in entry.iterdir() if entry.name == STATE_DIR else ():
                if sub not in keep:
                    shutil.rmtree(sub) if sub.is_dir() and not sub.is_symlink() else sub.unlink()
            if entry.name != STATE_DIR:
                shutil.rmtree(entry)
        else:
            entry.unlink()
    for f in keep:
        f.unlink(missing_ok=True)
    if (path / STATE_DIR).is_dir():
        (path / STATE_DIR).rmdir()
    path.rmdir()


def _meta_crc(meta: dict) -> str:
    body = json.dumps({k: v for k, v in meta.items() if k != "crc32"}, sort_keys=True)
    return f"{zlib.crc32(body.encode()):08x}"


def _check_finite(state: dict[str, torch.Tensor], where: str) -> None:
    for k, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise NonFiniteStateError(f"{where}: {k} holds NaN or infinite values; the state is not saved")


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


def _write_error(final: Path, e: BaseException, left: str) -> BaseException:
    """A failed write as the error the caller reports: a full or read-only disk (safetensors reports one
    as its own error type) becomes CheckpointWriteError with the system's words for it, and ``left``: what
    the failure left on disk."""
    if not isinstance(e, (OSError, SafetensorError)):
        return e
    errno_ = getattr(e, "errno", None)
    if errno_ is None and (m := re.search(r"os error (\d+)", str(e))):
        errno_ = int(m.group(1))
    why = os.strerror(errno_) if errno_ else str(e)
    out = CheckpointWriteError(errno_ or 0, f"cannot write checkpoint {final}: {why}; {left}")
    out.__cause__ = e
    return out


def _together(ranks, err: BaseException | None) -> None:
    """Raise if this rank failed, or (data parallel) any rank did: its own error, else the first failing
    rank's."""
    if ranks is None:
        if err is not None:
            raise err
        return
    from .. import parallel

    parallel.together(err)


def save_checkpoint(path: str | os.PathLike, adapter: ModelAdapter, store: HostStore, dtype: torch.dtype,
                    trainer_state: dict | None = None, extra=None, ranks=None, owner: list[int] | None = None) -> Path:
    """``extra(folder)`` writes more files (a tokenizer) into the checkpoint before its checksums are taken.
    Data parallel (``ranks``, every rank calls this): each rank writes its units' state and export files
    (``owner``), rank 0 the rest, the checksums and the rename; a failure on any rank stops all of them."""
    final = Path(path)
    tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
    rank = 0 if ranks is None else ranks.rank
    lead = rank == 0
    mine = [u for u in range(len(adapter.units)) if owner is None or owner[u] == rank]
    made = []  # (the partial copy, once this save made it: only that is removed on failure)

    def phase(work, clean: bool = True) -> None:
        err = None
        try:
            work()
        except BaseException as e:
            err = _write_error(final, e, "the partial copy was removed and existing checkpoints are untouched"
                               if clean else f"what was written is in {tmp} (or the old copy beside it, "
                               f"{final.name}.old or .old-N); move it into place by hand")
        try:
            _together(ranks, err)
        except BaseException:
            if lead and clean and made:
                with contextlib.suppress(OSError):
                    _remove_save(tmp)
            raise

    def start():
        if lead:
            for p in (final, tmp):  # (replaced or removed below: only ever a checkpoint, whole or half written)
                if p.exists() and not is_checkpoint_dir(p):
                    raise CheckpointError(f"{p} exists and is not a slideformer checkpoint: a save replaces only "
                                          "its own; choose another path, or move it away")
            if tmp.exists():
                _remove_save(tmp)  # a save that was interrupted earlier
            (tmp / STATE_DIR).mkdir(parents=True)
            made.append(tmp)
            (tmp / STATE_DIR / MARK).touch()

    def write():  # (a unit that is not finite stops the save before its file: the folder is then removed)
        written = []
        for u in mine:
            st = store.unit_state(u)  # (read once: from the tier or the GPU, it is a copy)
            _check_finite(st, f"unit {_unit_key(adapter, u)}")
            written.append(tmp / STATE_DIR / f"{_unit_key(adapter, u)}.safetensors")
            save_file(st, str(written[-1]))
            readable(written[-1])
        export.save_pretrained(tmp, adapter, store, dtype, owner, rank)
        if lead:  # (rank 0 syncs every file in seal)
            return
        for f in written + [tmp / name for name in export.files_of(adapter, dtype, owner, rank)]:
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())

    def seal():
        if not lead:
            return
        if extra is not None:
            extra(tmp)
        files = sorted(p for p in tmp.rglob("*") if p.is_file() and p != tmp / STATE_DIR / MARK)
        for f in files:
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        meta = {"format": FORMAT, "step": store.step, "trainer": trainer_state or {},
                "checksums": {str(f.relative_to(tmp)): _crc(f) for f in files}}
        meta["crc32"] = _meta_crc(meta)
        (tmp / STATE_DIR / TRAINER).write_text(json.dumps(meta, indent=1))
        with open(tmp / STATE_DIR / TRAINER, "rb") as fh:
            os.fsync(fh.fileno())
        (tmp / STATE_DIR / MARK).unlink()  # (whole now: its metadata says so)
        _fsync_dir(tmp / STATE_DIR)
        _fsync_dir(tmp)

    def rename():
        if not lead:
            return
        if final.exists():  # replacing a checkpoint of the same name: move the old one aside first
            aside, k = old, 1  # (one there already, a backup or what an earlier replacement left, stays)
            while aside.exists():
                k += 1
                aside = old.with_name(f"{old.name}-{k}")
            os.replace(final, aside)
            os.replace(tmp, final)
            try:
                kept, why = remove_checkpoint(aside)
            except OSError as e:  # (the new checkpoint is in place: the old one's remains are only said)
                kept, why = [aside], f"removing it failed ({e.strerror or e})"
            if kept:
                print(f"slideformer: {final} replaced; {len(kept)} file(s) of the old one kept in {aside}, as {why}",
                      file=sys.stderr)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)

    for work in (start, write, seal):
        phase(work)
    phase(rename, clean=False)  # (what a failed rename leaves, the sealed copy or the old one, stays)
    return final


def read_meta(path: str | os.PathLike) -> dict:
    """``trainer.json`` of the checkpoint at ``path``, its own checksum verified (not the other files')."""
    root = Path(path)
    meta_path = root / STATE_DIR / TRAINER
    if not root.is_dir():
        raise CorruptCheckpointError(f"{root} is not a directory: give a checkpoint-N folder written by slideformer")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{meta_path}: unreadable ({e}); {root} is not a complete slideformer "
                                     "checkpoint") from e
    if not isinstance(meta, dict) or meta.get("format") not in READS or not isinstance(meta.get("checksums"), dict):
        got = meta.get("format") if isinstance(meta, dict) else None
        raise CorruptCheckpointError(f"{meta_path}: format {got!r}, this slideformer reads {', '.join(map(str, READS))}")
    if meta["format"] >= 3 and meta.get("crc32") != _meta_crc(meta):
        raise CorruptCheckpointError(f"{meta_path} is corrupt or was edited (its CRC32 does not match its content)")
    return meta


EDITABLE_BYTES = 64 << 20  # a checkpoint's files (not tensors) this small are checked before removal (a hand edit)


def remove_checkpoint(path: str | os.PathLike) -> tuple[list[Path], str]:
    """Delete the files a save wrote into the checkpoint at ``path`` (those its metadata names), the metadata
    last (so that a removal cut short is finished by the next), then the folders that leaves empty. Returns
    what is left, never deleted, and why: files the save did not write, or every file where the metadata
    cannot be read (what it wrote cannot be told then) or ``path`` is a link."""
    root = Path(path)
    if root.is_symlink() or (root.exists() and not root.is_dir()):
        return [root], "it is a link or a file, not a checkpoint folder"
    try:
        checksums = read_meta(root)["checksums"]
    except CorruptCheckpointError:
        checksums, why = {}, "its metadata is damaged, so what a save wrote there cannot be told"
    else:
        why = "no save wrote them"
    ours = set(checksums)
    meta = f"{STATE_DIR}/{TRAINER}"
    found = []  # (walked, links not followed: a file named in the metadata but reached through a link is not ours)
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        found += [here / n for n in files + [d for d in dirs if (here / d).is_symlink()]]
    mine = {f for f in found if f.relative_to(root).as_posix() in ours and not f.is_symlink()}
    # (a config or tokenizer file edited since the save, by hand, is the user's now: kept; the weights and the
    # state, no hand's to edit, are not read back for it: one that differs is damaged)
    edited = {f for f in mine if f.suffix != ".safetensors" and f.stat().st_size <= EDITABLE_BYTES
              and _crc(f) != checksums[f.relative_to(root).as_posix()]}
    mine -= edited
    for f in mine:
        f.unlink()
    if ours and root / meta in found and not (root / meta).is_symlink():  # (not among its own checksums)
        (root / meta).unlink()
        mine.add(root / meta)
    for folder, dirs, _ in os.walk(root, topdown=False):
        for name in dirs:
            if not (Path(folder) / name).is_symlink():
                with contextlib.suppress(OSError):
                    (Path(folder) / name).rmdir()  # (only where empty)
    with contextlib.suppress(OSError):
        root.rmdir()
    left = sorted(f for f in found if f not in mine)
    if edited:
        why = "edited since the save" if set(left) <= edited else f"{why}, or edited since the save"
    return left, why


def verify_checkpoint(path: str | os.PathLike, only=None) -> dict:
    """Every file's CRC32 (``only``: of those relative paths) checked against ``trainer.json``, nothing
    loaded; returns that file's content."""
    root = Path(path)
    meta = read_meta(root)
    for rel, crc in meta["checksums"].items():
        if only is not None and rel not in only:
            continue
        f = root / rel
        if not f.is_file():
            raise CorruptCheckpointError(f"checkpoint file {f} is missing")
        if (got := _crc(f)) != crc:
            raise CorruptCheckpointError(f"checkpoint file {f} is corrupt (CRC32 {got}, expected {crc})")
    return meta


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I16": torch.int16, "I32": torch.int32,
           "U8": torch.uint8}
_SAVED_FORMAT = {"F32": "fp32", "BF16": "compact", "U8": "8bit"}  # by the moments' dtype


def saved_state_format(path: str | os.PathLike) -> str | None:
    """The optimizer_state a checkpoint's Adam moments were saved in (from a state file's header, before any
    model is built); None where no state file says."""
    for f in sorted((Path(path) / STATE_DIR).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as fh:
                if "exp_avg" in fh.keys():
                    return _SAVED_FORMAT.get(fh.get_slice("exp_avg").get_dtype())
        except (OSError, SafetensorError):
            continue  # (load_checkpoint's checks name a damaged file)
    return None


def load_checkpoint(path: str | os.PathLike, adapter: ModelAdapter, store: HostStore, ranks=None,
                    check=None) -> dict:
    """Restore master, moments and step into ``store``; returns the trainer state saved with them.
    Every file is verified, every unit's layout checked from the file headers, and the trainer state
    by ``check(trainer_state)`` (which raises), before the store is touched: a refused checkpoint leaves
    the state as it was. Data parallel (``ranks``): each rank reads and verifies the units it keeps
    (whichever rank wrote them), and all stop if any refuses."""
    root = Path(path)
    units = [u for u in range(len(adapter.units)) if store.owns(u)]
    err, meta = None, None
    try:
        meta = _verified(root, adapter, store, units)
        if not isinstance(meta["trainer"], dict):
            raise CorruptCheckpointError(f"{root / STATE_DIR / TRAINER}: its trainer state is not a dict")
        if check is not None:
            check(meta["trainer"])
    except BaseException as e:
        err = e
    _together(ranks, err)
    for u in units:
        with safe_open(str(root / STATE_DIR / f"{_unit_key(adapter, u)}.safetensors"), framework="pt") as fh:
            store.set_unit_state(u, {k: fh.get_tensor(k) for k in fh.keys()})
    store.step = int(meta["step"])
    return meta["trainer"]


def _verified(root: Path, adapter: ModelAdapter, store: HostStore, units: list[int]) -> dict:
    """``trainer.json``, once the files that ``units`` need are checked (CRC32, names, layouts)."""
    files = {u: root / STATE_DIR / f"{_unit_key(adapter, u)}.safetensors" for u in units}
    everything = len(units) == len(adapter.units)
    meta = verify_checkpoint(root, None if everything else {str(f.relative_to(root)) for f in files.values()})
    ours = {f"{STATE_DIR}/{_unit_key(adapter, u)}.safetensors" for u in range(len(adapter.units))}
    extra = sorted(Path(k).stem for k in meta["checksums"]
                   if k.startswith(f"{STATE_DIR}/") and k.endswith(".safetensors") and k not in ours)
    if extra:  # (a model with fewer layers would take the first ones and train on, silently)
        named = ", ".join(extra[:4]) + (" ..." if len(extra) > 4 else "")
        raise CorruptCheckpointError(f"{root} holds the state of {named}, which this model ({adapter.num_layers} "
                                     "layers) has not: a checkpoint of another model")
    for u, f in files.items():
        if not f.is_file():
            raise CorruptCheckpointError(f"{f} is missing: a checkpoint of another model?")
        with safe_open(str(f), framework="pt") as fh:
            saved = {k: fh.get_slice(k) for k in fh.keys()}
            for k, (numel, dtype) in store.unit_layout(u).items():
                if k not in saved:
                    raise CorruptCheckpointError(f"{f} lacks {k!r}: saved with another optimizer_state? Resume with the same")
                if _DTYPES.get(saved[k].get_dtype()) != dtype:
                    was = _SAVED_FORMAT.get(saved["exp_avg"].get_dtype() if "exp_avg" in saved else "", "another")
                    raise CorruptCheckpointError(f"{root}: saved with optimizer_state={was}, this run has "
                                                 f"{store.state_format}; resume with optimizer_state={was}")
                got = 1
                for d in saved[k].get_shape():
                    got *= d
                if got != numel:
                    raise CorruptCheckpointError(f"{f}: {k} has {got} values, the model has {numel}: a "
                                                 "checkpoint of another model?")
    return meta
