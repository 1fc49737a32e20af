"""The run's output folder: which of its contents the run owns, and so may rotate, resume or overwrite.

A run marks the folder with ``slideformer-run.json`` (a run id) before it writes a metric or a checkpoint,
and stamps that id into every checkpoint it writes (``state/trainer.json``). Rotation and
``resume_from_checkpoint: auto`` only ever consider checkpoints that carry the folder's id, so a user's
own ``checkpoint-N`` folders, or those of another run copied in, are never deleted or taken for ours.
A folder that holds anything but no mark is refused, unless ``overwrite_output_dir`` says to take it.
``check`` decides with no side effect (refusals come before any work); ``open`` takes the folder under a
lock held for the run (the kernel drops it with the process), deciding again under it; ``begin``, at the
run's first write (a metric or a checkpoint), replaces an earlier run's mark, metrics and TensorBoard
event files (those its writer named: ``events_suffix``; until then a failure, a signal or a kill leaves them: the
earlier run's ``auto`` resume still works); a new run that ends before it leaves the folder as it found it
(``close``).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import uuid
from pathlib import Path

from ..checkpoint.state import (CorruptCheckpointError, is_checkpoint_dir, read_meta, remove_checkpoint,
                                verify_checkpoint)
from ..config import ConfigError

def events_suffix(run_id: str) -> str:
    """The end of the names of the TensorBoard event files a run writes (its writer's filename_suffix): the
    files a later run may remove as that run's, where a user's own files beside them stay."""
    return f".slideformer-{run_id}"


RUN_FILE = "slideformer-run.json"
LOCK_FILE = "slideformer-run.lock"
CKPT_PREFIX = "checkpoint-"
METRICS = "metrics.jsonl"
PLOT = "loss.png"  # metrics.jsonl's curves, drawn as the run ends
TENSORBOARD = "tensorboard"
MLRUNS = "mlruns"  # mlflow's file store, where no MLFLOW_TRACKING_URI is set
TRACKER_DIRS = (TENSORBOARD, "wandb", MLRUNS)  # what the trackers make in the folder (wandb names its own)
ERROR_LOG = "slideformer-error.log"
DEEPEST = 96  # what a save adds to output_dir's path, at most: /checkpoint-N.tmp/state/<unit>.safetensors.tmp


class OutputDirError(ConfigError):
    """The output folder cannot be used as asked; the message names the fix."""


def _step_of_name(name: str) -> int | None:
    tail = name[len(CKPT_PREFIX):]
    return int(tail) if name.startswith(CKPT_PREFIX) and tail.isascii() and tail.isdigit() else None


def _step_of(p: Path) -> int | None:
    return _step_of_name(p.name) if p.is_dir() else None


def _write_atomic(path: Path, text: str) -> None:
    """``text`` as ``path``, whole or not at all; an OSError names ``path`` (a write's own names nothing)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class OutputDir:
    """The folder of one run (one id, kept across resumes)."""

    def __init__(self, path: Path, run_id: str):
        self.path, self.run_id = path, run_id
        self.passed_over: set[str] = set()  # checkpoints resuming passed over as damaged (latest_intact)
        self.fresh, self.begun = False, True  # (a new run, and whether it has written: ``check`` and ``begin``)

    @classmethod
    def check(cls, path: str | os.PathLike, *, resume: str | None, overwrite: bool,
              resume_run: str | None = None) -> "OutputDir":
        """Whether ``path`` may be this run's, with no side effect (so refusals come before any work): a
        folder another slideformer run marked is continued when ``resume`` is set (its id is kept), else
        refused if it holds that run's checkpoints (``overwrite`` starts a new run there); so is a checkpoint
        path of another run (``resume_run``, its id) resumed there, a branch; a folder with other content
        and no mark is refused unless ``overwrite``. ``open`` then takes it."""
        out = Path(path)
        if out.exists() and not out.is_dir():
            raise OutputDirError(f"output_dir {out} is a file; set output_dir to a folder")
        if out.is_symlink() and not out.exists():
            raise OutputDirError(f"output_dir {out} is a link to {os.readlink(out)}, which does not exist; make that "
                                 "folder, or set output_dir to another")
        above = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
        if not above.is_dir():
            raise OutputDirError(f"output_dir {out}: {above} is a file; set output_dir to a folder's path")
        # (a checkpoint's deepest file, written last, within the file system's limit on a path's length)
        try:
            limit = os.pathconf(above, "PC_PATH_MAX")
        except (OSError, ValueError):  # (a file system that does not say)
            limit = -1
        if 0 < limit < len(os.fsencode(out.absolute())) + DEEPEST:  # (-1: no limit)
            raise OutputDirError(f"output_dir {out} is too long: a checkpoint's files there would pass this file "
                                 f"system's limit of {limit} bytes a path; choose a shorter path")
        for name in (METRICS, PLOT):
            if (out / name).is_dir():
                raise OutputDirError(f"output_dir {out} holds a folder {name}, where the run writes its file (what "
                                     "is not the run's is never removed); move it away, or choose another output_dir")
        mark = out / RUN_FILE
        run_id = None
        if mark.is_file():
            try:
                run_id = json.loads(mark.read_text())["run_id"]
                if not isinstance(run_id, str):
                    raise TypeError("run_id is not text")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise OutputDirError(f"{mark} is damaged ({e}); remove it if {out} holds nothing of yours, or "
                                     "choose another output_dir") from e
            own = cls(out, run_id)
            branch = resume not in (None, "auto") and resume_run is not None and resume_run != run_id
            if (resume is None or branch) and own.checkpoints():
                if not overwrite:
                    raise OutputDirError(
                        f"output_dir {out} holds checkpoints of an earlier run (newest {own.checkpoints()[-1].name}); "
                        + (f"resuming {resume}, another run's, there would put two histories in one folder: "
                           "set resume_from_checkpoint: auto to continue the run the folder holds (this one, if it "
                           "started there), choose another output_dir, or set overwrite_output_dir: true to start "
                           "it there as a new run" if branch else
                           "set resume_from_checkpoint: auto to continue it, overwrite_output_dir: true to start a "
                           "new run there, or choose another output_dir"))
                run_id = None  # a new run: the earlier one's checkpoints are no longer ours to rotate
            elif branch:
                run_id = None  # (a branch where no checkpoint of the folder's run is: a run of its own)
        elif out.is_dir() and not overwrite:
            shown = sorted(p.name for p in out.iterdir()  # (the error logs: a failed start's, any rank's; the mark
                           # being written, or just written since the look for it above: rank 0 taking the folder
                           # as another rank of its job looks; a run of its own decides again under the lock)
                           if p.name not in (LOCK_FILE, RUN_FILE + ".tmp") and not (p.name == RUN_FILE and p.is_file())
                           and not (p.name.startswith(ERROR_LOG[:-4]) and p.suffix == ".log"))
            if shown:
                raise OutputDirError(
                    f"output_dir {out} is not empty ({', '.join(shown[:4])}{', ...' if len(shown) > 4 else ''}) and "
                    "was not written by slideformer; choose another output_dir, or set overwrite_output_dir: true to "
                    "train there (what the run writes replaces what has its names: checkpoint-N, metrics.jsonl, "
                    "loss.png; nothing else is touched)")
        own = cls(out, run_id or uuid.uuid4().hex)
        own.fresh, own.overwrite, own.resume, own.resume_run = run_id is None, overwrite, resume, resume_run
        own.created = not out.exists()
        own._look()
        own.begun = not own.fresh
        return own

    def _look(self, made_lock: bool = False) -> None:
        """What the folder holds that ``close`` must not remove (another run's, or the user's): taken at
        ``check``, and again under the lock (another run may have written there in between), less the lock
        file this run made."""
        out = self.path
        self.found = {n for n in (RUN_FILE, LOCK_FILE, *TRACKER_DIRS) if (out / n).exists()} - \
            ({LOCK_FILE} if made_lock else set())
        self.events = set((out / TENSORBOARD).glob("events.out.tfevents.*"))  # (TensorBoard's files found)

    def open(self) -> "OutputDir":
        """Take the folder: a lock held until ``close`` (a second run into it is refused; the kernel drops
        the lock with the process), and a new run's mark where no earlier run's is there (``begin`` replaces
        that one)."""
        out = self.path
        try:
            out.mkdir(parents=True, exist_ok=True)
            made_lock = not (out / LOCK_FILE).exists()
            self._lock = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            self.close()  # (a folder it made goes again)
            raise OSError(e.errno, f"cannot write to output_dir {out}: {e.strerror}; make it writable or choose "
                                   "another output_dir") from e
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # (the lock and the folder's files are the other run's: nothing here to undo)
            os.close(self._lock)
            self._lock = None
            raise OutputDirError(f"output_dir {out} is in use by another slideformer run; wait for it to end, or "
                                 "choose another output_dir") from None
        self._look(made_lock)
        try:  # decided again under the lock: another run may have taken the folder since check()
            again = OutputDir.check(out, resume=self.resume, overwrite=self.overwrite, resume_run=self.resume_run)
        except BaseException:
            self.close()
            raise
        if not (self.fresh and again.fresh):
            self.run_id, self.fresh, self.begun = again.run_id, again.fresh, again.begun
        if self.fresh and RUN_FILE not in self.found:  # (nothing of an earlier run to keep)
            try:
                self._replace(out / RUN_FILE, lambda p: _write_atomic(p, json.dumps({"run_id": self.run_id}) + "\n"))
            except OSError:
                self.close()
                raise
        return self

    def begin(self) -> None:
        """The new run writes its first metric or checkpoint: from here the folder holds its history, not an
        earlier one's. Its mark replaces an earlier run's, and the metrics and (where an earlier slideformer
        run wrote them) TensorBoard events found go (this run's start with it). Once; a resumed run has
        begun."""
        self._still_held()
        if self.begun:
            return
        out = self.path
        if RUN_FILE in self.found:
            earlier = (out / RUN_FILE).read_bytes()
            theirs = events_suffix(json.loads(earlier)["run_id"])
            self._replace(out / RUN_FILE, lambda p: _write_atomic(p, json.dumps({"run_id": self.run_id}) + "\n"))
            try:
                for f in (f for f in self.events if f.name.endswith(theirs)):  # (a file of the user's stays)
                    self._replace(f, lambda p: p.unlink(missing_ok=True))
                self._replace(out / METRICS, lambda p: p.unlink(missing_ok=True))
                self._replace(out / PLOT, lambda p: p.unlink(missing_ok=True))  # (its curve, not this run's)
            except OSError:  # (the earlier run's mark back: its checkpoints stay its own, resumable)
                with contextlib.suppress(OSError):
                    _write_atomic(out / RUN_FILE, earlier.decode())
                raise
        else:
            self._replace(out / METRICS, lambda p: p.unlink(missing_ok=True))
        self.begun = True

    def _still_held(self) -> None:
        """The folder is still the one this run took (its lock and mark), not removed, moved or replaced under
        it: else the run stops, writing nothing more (a save would make a folder no run marks or locks)."""
        if getattr(self, "_lock", None) is None:
            return
        try:  # (before a new run's first write the mark may be an earlier run's, which begin replaces)
            lock, held = os.stat(self.path / LOCK_FILE), os.fstat(self._lock)
            ours = (lock.st_dev, lock.st_ino) == (held.st_dev, held.st_ino) and (
                json.loads((self.path / RUN_FILE).read_text())["run_id"] == self.run_id if self.begun
                else (self.path / RUN_FILE).is_file())
        except (OSError, ValueError, KeyError, TypeError):
            ours = False
        if not ours:
            raise OutputDirError(f"output_dir {self.path} was removed, moved or replaced during the run (its "
                                 f"{LOCK_FILE} or {RUN_FILE} is not this run's): stopped, writing nothing more there; "
                                 "put the folder back and resume with resume_from_checkpoint: auto, or start over")

    def _replace(self, path: Path, act) -> None:
        """``act(path)``; its OSError as one naming the file (a full disk, a read-only folder)."""
        try:
            act(path)
        except OSError as e:
            raise OSError(e.errno, f"cannot write {path}: {e.strerror}; make output_dir writable, free space there, "
                                   "or choose another output_dir") from e

    def close(self) -> None:
        """Release the folder. A new run that ends before it wrote a checkpoint or a metric (with an error, or
        with nothing to train) leaves the folder as it found it: no mark or lock file it made, no trackers'
        folder it made (else the folder, unmarked, would refuse the same run again), no folder it made."""
        if not self.begun:
            held = getattr(self, "_lock", None) is not None  # (only under its lock: no other run's)
            for name in {RUN_FILE, LOCK_FILE} - self.found if held else ():
                (self.path / name).unlink(missing_ok=True)
            for f in set((self.path / TENSORBOARD).glob("events.out.tfevents.*")) - self.events if held else ():
                if f.name.endswith(events_suffix(self.run_id)):
                    f.unlink(missing_ok=True)  # (its own writer's, beside those found)
            for name in set(TRACKER_DIRS) - self.found if held else ():  # (made by this run: all of it is its own)
                if (self.path / name).is_dir() and not (self.path / name).is_symlink():
                    shutil.rmtree(self.path / name, ignore_errors=True)
            if self.created:
                with contextlib.suppress(OSError):
                    self.path.rmdir()  # (only if empty)
        if getattr(self, "_lock", None) is not None:
            os.close(self._lock)
            self._lock = None

    def foreign_ahead(self, start: int, end: int) -> list[Path]:
        """Checkpoint folders of steps ``start`` < N <= ``end`` that this run did not write: a save of that step
        would replace one."""
        own = {p.name for p in self.checkpoints()}
        return sorted((p for p in self.path.iterdir() if (n := _step_of(p)) is not None and start < n <= end
                       and p.name not in own), key=_step_of) if self.path.is_dir() else []

    def unreplaceable_ahead(self, start: int, end: int, every: int) -> list[Path]:
        """What a save of a step ``start`` < N <= ``end`` (``end`` and every ``every``-th: those a run saves
        unless stopped) would find in its way and never replace, even under overwrite_output_dir: a
        ``checkpoint-N`` (or its ``.tmp``) that is not a checkpoint folder (a save replaces only checkpoints:
        checkpoint/state.py ``is_checkpoint_dir``)."""
        found = []
        for p in self.path.iterdir() if self.path.is_dir() else ():
            name = p.name[:-len(".tmp")] if p.name.endswith(".tmp") else p.name
            n = _step_of_name(name)
            if n is None or name != f"{CKPT_PREFIX}{n}" or is_checkpoint_dir(p):  # (checkpoint-03 is no save's name)
                continue
            if start < n <= end and (n == end or (every and n % every == 0)):
                found.append((n, p))
        return [p for _, p in sorted(found)]

    def checkpoints_after(self, step: int) -> list[Path]:
        """This run's checkpoints of steps past ``step``, oldest first."""
        return [p for p in self.checkpoints() if _step_of(p) > step]

    def holds(self, path) -> str | None:
        """The entry of the folder that a run writes, replaces or rotates away (a checkpoint, metrics.jsonl,
        loss.png, the trackers' folders) where ``path`` is or lies in; None where it lies in none."""
        if not os.path.exists(path):  # (a Hub name)
            return None
        try:
            rel = Path(path).resolve().relative_to(self.path.resolve())
        except (ValueError, OSError):
            return None
        top = rel.parts[0] if rel.parts else None
        if top in (METRICS, PLOT, RUN_FILE, *TRACKER_DIRS) or \
                (top is not None and _step_of_name(top.removesuffix(".tmp")) is not None):
            return top
        return None

    def checkpoints(self) -> list[Path]:
        """This run's checkpoints, oldest first (a checkpoint whose metadata cannot be read is not counted
        as ours: it is never deleted)."""
        found = []
        for p in self.path.iterdir() if self.path.is_dir() else ():
            step = _step_of(p)
            if step is None or p.is_symlink():  # (a link is the user's, wherever it points)
                continue
            try:
                if read_meta(p)["trainer"].get("run_id") == self.run_id:
                    found.append((step, p))
            except CorruptCheckpointError:
                continue
        return [p for _, p in sorted(found)]

    def latest_intact(self) -> tuple[Path | None, list[Path]]:
        """The newest of this run's checkpoints whose files all pass their checksums, and those passed
        over as damaged (each said on stderr; one whose metadata is damaged counts too, since whose it
        is cannot be told)."""
        found = sorted((s, p) for p in self.path.iterdir() if (s := _step_of(p)) is not None)
        damaged = []
        for _, p in reversed(found):
            if not (p / "state" / "trainer.json").exists():
                continue  # not a slideformer checkpoint at all (or stripped of its metadata): not ours to judge
            try:
                if read_meta(p)["trainer"].get("run_id") != self.run_id:
                    continue
                verify_checkpoint(p)
                return p, damaged
            except CorruptCheckpointError as e:
                damaged.append(p)
                print(f"slideformer: not resuming from {p}: {e}", file=sys.stderr)
        return None, damaged

    def rotate(self, keep: int, step: int) -> None:
        """Delete this run's checkpoints but the newest ``keep`` up to ``step`` (the one just saved): the files
        their saves wrote (a file put there by hand stays, said once: the folder is no longer a checkpoint, so
        no later rotation sees it). Later ones (passed over as damaged when resuming: a save of their step
        replaces them) and damaged ones are neither kept in their place nor deleted."""
        ours = [p for p in self.checkpoints() if _step_of(p) <= step and p.name not in self.passed_over]
        for old in ours[:-keep]:
            try:
                kept, why = remove_checkpoint(old)
            except OSError as e:  # (the new checkpoint is saved: what could not be removed stays, said)
                kept, why = [Path(e.filename or old)], f"removing it failed ({e.strerror or e})"
            if kept:
                print(f"slideformer: {old.name} rotated out; {len(kept)} file(s) kept there, as {why} "
                      f"({kept[0].relative_to(old) if kept[0] != old else old.name})", file=sys.stderr)

    def log(self, rec: dict) -> None:
        """``rec`` appended to the run's metrics (the run's first write ``begin``s it); an OSError names the
        file (a full disk)."""
        self.begin()
        path = self.path / METRICS
        try:
            with open(path, "a") as f:
                f.write(json.dumps(rec, allow_nan=False) + "\n")
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(path)) from e

    def trim_metrics(self, step: int) -> None:
        """Drop logged records past ``step`` (a resumed run logs those steps again)."""
        path = self.path / METRICS
        if not path.is_file():
            return
        keep = []
        for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except (ValueError, AttributeError):
                continue
        _write_atomic(path, "".join(f"{line}\n" for line in keep))
