"""Write the fp32 masters (the host store's, or copies of the GPU's for units trained there) out as a
Hugging Face checkpoint that ``from_pretrained`` loads.

Every file is written under a temporary name and checked finite first; the names are renamed into place
only once all are written, as one change (``place``), so a failed export leaves the folder's earlier files
as they were.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..host.store import HostStore
from ..model.adapter import ModelAdapter

MAX_SHARD_BYTES = 5 * 2**30


class NonFiniteStateError(FloatingPointError):
    """The weights or the training state hold NaN or infinity (in the dtype asked for): they are not written."""


def readable(path: Path) -> None:
    """``path`` given the mode a plain write gives (the umask's): safetensors' save_file makes its files
    readable by their owner alone, which a serving container or a colleague cannot load."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without setting it (Linux's /proc: setting and putting it back would race
    the engine's threads' files); elsewhere the common 022."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0o022


def _temp_name(path: Path) -> Path:
    """A hidden name beside ``path`` that ``STAGED`` matches (a killed export's leftovers: ``stale_staged``)."""
    import uuid

    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")


def staged_file(path: Path, write) -> Path:
    """``write`` the file under a temporary name beside ``path``, flushed to disk: the name to rename. The
    name is one no file had (made exclusively): a user's own ``<name>.tmp`` there is neither replaced nor
    removed."""
    tmp = _temp_name(path)
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # (the umask's mode, as a plain write's)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def stale_staged(folder: Path, names: set[str]) -> list[Path]:
    """Files ``staged_file`` left in ``folder`` (a killed export's) for a file of ``names`` or a weight file:
    hidden, the file's name, a 12-hex tag, .tmp."""
    def staged_for(name: str) -> bool:
        m = STAGED.fullmatch(name)
        return bool(m) and (m[1] in names or WEIGHT_FILE.fullmatch(m[1]) is not None)

    return [p for p in folder.iterdir() if p.is_file() and staged_for(p.name)] if folder.is_dir() else []


STAGED = re.compile(r"\.(.+)\.[0-9a-f]{12}\.tmp")
WEIGHT_FILE = re.compile(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?")


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


INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
GENERATION = "generation_config.json"  # (the source model's sampling defaults: transformers' generate reads them)


def hub_layout(adapter: ModelAdapter):
    """The tensors of a file as transformers' save_pretrained writes them: its load-time conversions
    (conversion_mapping) reversed, so a family whose experts share a fused parameter (Qwen3-MoE, Mixtral,
    OLMoE) is written one tensor an expert under the Hub's names (Mixtral's ``block_sparse_moe``), which vLLM,
    converters and older transformers read. The same tensors elsewhere. Each reversal needs one fused tensor,
    so a file's tensors are reversed on their own; the parts are views of it (no copy)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # (a transformers without conversions: its names are the modules')
        return lambda tensors: tensors
    return lambda tensors: revert_weight_conversion(adapter.skeleton, tensors)


def _all_names(plan: list) -> list[str]:
    """Every weight file an export of ``plan`` holds, its shards' index too."""
    return _names(plan) + [INDEX] * (len(plan) > 1)


def _writer(shard: list, owner: list[int] | None) -> int:
    """The rank that writes a file of ``shard_plan``: its units' owner."""
    return owner[shard[0][0].index] if owner else 0


def files_of(adapter: ModelAdapter, dtype: torch.dtype, owner: list[int] | None, rank: int) -> list[str]:
    """The weight files ``save_pretrained`` writes on ``rank``."""
    plan = shard_plan(adapter, dtype, owner)
    return [n for n, shard in zip(_names(plan), plan) if _writer(shard, owner) == rank]


def stage_pretrained(out: str | os.PathLike, adapter: ModelAdapter, store: HostStore, dtype: torch.dtype,
                     owner: list[int] | None = None, rank: int = 0) -> list[tuple[Path, Path]]:
    """Write the files of ``shard_plan`` (with ``owner``, only those of this ``rank``'s units; rank 0 the
    index too) one at a time, under temporary names: a file's tensors are all the export holds in RAM.
    A tensor that is not finite in ``dtype`` (a NaN, or a value past float16's range) stops it, and what
    it wrote goes. Returns (temporary, final) names for ``place_pretrained``: until then nothing a reader
    sees has changed."""
    out = Path(out)
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    plan = shard_plan(adapter, dtype, owner)
    names = _names(plan)
    hub = hub_layout(adapter)
    staged = []
    try:
        for name, shard in zip(names, plan):
            if _writer(shard, owner) != rank:
                continue
            tensors, unit, params = {}, None, None
            for u, spec in shard:
                if u is not unit:
                    unit, params = u, store.unit_params(u.index)
                t = tensors[spec.key] = params[spec.key].to(dtype).contiguous()
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise NonFiniteStateError(
                        f"{spec.key} holds NaN or infinite values in {str(dtype).replace('torch.', '')}"
                        + (" (past float16's range: export in bfloat16 or float32)" if dtype == torch.float16
                           and bool(torch.isfinite(params[spec.key]).all()) else "")
                        + f"; nothing was written to {out}")
            tensors = {k: v.contiguous() for k, v in hub(tensors).items()}
            staged.append((staged_file(out / name, lambda p, t=tensors: (save_file(t, str(p), metadata={"format": "pt"}), readable(p))),
                           out / name))
            del tensors, params
        if rank == 0 and len(plan) > 1:
            itemsize = torch.empty((), dtype=dtype).element_size()
            index = {"metadata": {"total_size": sum(spec.numel * itemsize for shard in plan for _, spec in shard)},
                     "weight_map": {key: name for name, shard in zip(names, plan) for key in hub(
                         {spec.key: torch.empty(spec.shape, dtype=dtype, device="meta") for _, spec in shard})}}
            staged.append((staged_file(out / INDEX, lambda p: p.write_text(json.dumps(index, indent=2))), out / INDEX))
    except BaseException:
        drop_staged(staged)
        if made:
            with contextlib.suppress(OSError):
                out.rmdir()  # (only where empty: another rank's files stay)
        raise
    return staged


def drop_staged(staged: list[tuple[Path, Path]]) -> None:
    for tmp, _ in staged:
        tmp.unlink(missing_ok=True)


def stale_weights(out: Path, names) -> list[Path]:
    """Weight files in ``out`` under the names an export gives (``model.safetensors``, its shards, their
    index) that are not among ``names``: an earlier export's, which a loader would take instead of the
    new ones (a single file before an index)."""
    ours = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
    return sorted(p for p in out.iterdir() if ours.fullmatch(p.name) and p.name not in set(names)
                  and (p.is_symlink() or p.is_file()))  # (a link goes, never what it points to)


def _aside(path: Path, backup: Path, move: bool) -> None:
    """A second name ``backup`` for what ``path`` holds, to put back: a hard link where ``path`` stays in place
    until replaced (a reader never misses it), else (``move``, or a file system without links) the file
    renamed."""
    if not move:
        try:
            os.link(path, backup, follow_symlinks=False)
            return
        except OSError:
            pass
    os.replace(path, backup)


def _backup_name(path: Path) -> Path | None:
    """The name ``_aside`` gives what ``path`` holds (None where nothing is there): one a killed export's
    leftovers are cleared by (``stale_staged``)."""
    return _temp_name(path) if path.exists() or path.is_symlink() else None


def place(staged: list[tuple[Path, Path]], remove: list[Path] = ()) -> list[tuple[Path, Path | None]]:
    """Rename each staged file onto its name and remove ``remove`` (an earlier export's weight files, which a
    loader would take instead) as one change: where one fails midway (a file that cannot be replaced, a
    signal), what was there is put back (``undo``), so the folder never holds two exports' files mixed. An
    OSError names the file. Returns the change, for ``undo`` (another rank's part failed) or ``forget`` (kept).
    Staged files left on a failure are the caller's to drop."""
    done: list[tuple[Path, Path | None]] = []  # (name, the second name of what it held before), before each move
    try:
        for tmp, final in staged:
            done.append((final, before := _backup_name(final)))
            if before is not None:
                _aside(final, before, move=False)
            try:
                os.replace(tmp, final)
            except OSError as e:
                raise OSError(e.errno, e.strerror, str(final)) from e
        for old in remove:
            done.append((old, before := _backup_name(old)))
            if before is not None:
                _aside(old, before, move=True)
    except BaseException:
        undo(done)
        raise
    return done


def undo(done: list[tuple[Path, Path | None]]) -> None:
    """Put back what ``place`` changed: each name holds again what it held before, or nothing."""
    for final, before in reversed(done):
        with contextlib.suppress(OSError):
            if before is None:
                final.unlink(missing_ok=True)  # (nothing was there: the new file goes)
            elif _same_file(before, final):
                before.unlink()  # (a second link to what is still in place: a rename onto it would do nothing)
            elif before.exists() or before.is_symlink():
                os.replace(before, final)  # (else it was never set aside: it is still in place)


def _same_file(a: Path, b: Path) -> bool:
    """Two names of one file (a link is not what it points to)."""
    try:
        sa, sb = os.stat(a, follow_symlinks=False), os.stat(b, follow_symlinks=False)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def forget(done: list[tuple[Path, Path | None]]) -> None:
    """Delete what ``place`` set aside, once the change is kept."""
    for _, before in done:
        if before is not None:
            with contextlib.suppress(OSError):
                before.unlink()


def pretrained_changes(out: Path, adapter: ModelAdapter, dtype: torch.dtype, staged: list[tuple[Path, Path]],
                       owner: list[int] | None = None, rank: int = 0, source: Path | None = None
                       ) -> tuple[list[tuple[Path, Path]], list[Path]]:
    """What ``place`` does for an export: ``staged``, on rank 0 with the config (staged too), the source
    model folder's sampling defaults (``generation_config.json``) and an earlier export's weight files that
    would shadow the new ones to remove."""
    if rank != 0:
        return staged, []
    generation = None if source is None else Path(source) / GENERATION
    if generation is not None and generation.is_file() and generation.resolve() != (out / GENERATION).resolve():
        staged = staged + [(staged_file(out / GENERATION, lambda p: shutil.copyfile(generation, p)),
                            out / GENERATION)]
    cfg = adapter.config
    cfg.dtype = dtype
    if "transformers_weights" in cfg:  # (as transformers' save_pretrained: known on load, never saved)
        delattr(cfg, "transformers_weights")
    config = staged_file(out / CONFIG, lambda p: cfg.to_json_file(str(p), use_diff=True))
    return staged + [(config, out / CONFIG)], stale_weights(out, _all_names(shard_plan(adapter, dtype, owner)))


def place_pretrained(out: str | os.PathLike, adapter: ModelAdapter, dtype: torch.dtype,
                     staged: list[tuple[Path, Path]], owner: list[int] | None = None, rank: int = 0,
                     source: Path | None = None, agree=None) -> Path:
    """Rename what ``stage_pretrained`` wrote into place as one change (``place``), with what
    ``pretrained_changes`` adds. A failure drops the staged files. ``agree`` (several ranks: ``parallel.together``)
    is given this rank's error, or None, and raises if any rank's part failed: every rank then puts back what
    it changed, so the folder holds the earlier export whole, never one rank's new files beside another's old."""
    out = Path(out)
    err, done = None, []
    try:
        staged, remove = pretrained_changes(out, adapter, dtype, staged, owner, rank, source)
        done = place(staged, remove)
    except BaseException as e:
        drop_staged(staged)
        if agree is None:
            raise
        err = e
    if agree is not None:
        try:
            agree(err)
        except BaseException:
            undo(done)
            raise
    forget(done)
    return out


def save_pretrained(out: str | os.PathLike, adapter: ModelAdapter, store: HostStore, dtype: torch.dtype,
                    owner: list[int] | None = None, rank: int = 0, source: Path | None = None) -> Path:
    """A Hugging Face checkpoint of ``store``'s weights in ``dtype`` (one process's part, with ``owner``):
    written whole, or (weights not finite, a full disk) not at all over what ``out`` held."""
    return place_pretrained(out, adapter, dtype, stage_pretrained(out, adapter, store, dtype, owner, rank), owner, rank,
                            source)


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


def stage_from_state(checkpoint: str | os.PathLike, out: str | os.PathLike,
                     dtype: torch.dtype) -> tuple[ModelAdapter, list[tuple[Path, Path]]]:
    """The Hugging Face weights of a checkpoint written again in ``dtype`` from its training master (the exact
    fp32 values, not the compute-dtype copy), staged as ``stage_pretrained`` stages them: the model's
    adapter and the staged files, for ``place_pretrained`` (which writes the config too)."""
    from transformers import AutoConfig

    from .state import STATE_DIR

    # (the layout only: eager attention builds for every model, whatever its training ran)
    adapter = ModelAdapter(AutoConfig.from_pretrained(str(checkpoint)), attn_implementation="eager")
    return adapter, stage_pretrained(out, adapter, _StateMasters(Path(checkpoint) / STATE_DIR, adapter), dtype)
