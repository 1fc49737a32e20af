"""The NVMe tier: the optimizer state of some units lives in files under ``offload_dir``.

Each unit on the tier has one file holding its fields, one after another, each 4096-byte aligned: with
``nvme_master`` the master first (fp32; or compact state's bf16 hi half, which is also the weights the
window reads, and its lo half), then exp_avg and exp_avg_sq. It is reserved with
posix_fallocate at start, so a disk too small fails at once with the size it needs, not hours in.
The runtime reads a unit's state into one of a few RAM buffers ahead of its update and writes it back
behind it (engine/runtime.py owns those threads); this class only moves bytes.

I/O uses O_DIRECT where the filesystem supports it (page cache would spend the RAM the tier saves),
else buffered I/O followed by POSIX_FADV_DONTNEED. Every write records a CRC32 of each field's bytes
and every read checks it, so a corrupted or truncated state file is detected, never trained on.

The files of each tier (and each ``NvmeScratch``) live in a directory of their own,
``offload_dir/slideformer-<pid>-<random hex>/`` (``OwnedDir``), whose owner holds an exclusive flock on
the ``owner.lock`` inside it while it is open. close() removes the directory, but a killed process
(SIGKILL, preemption) cannot, and a 14B model leaves hundreds of GB behind. The kernel drops the lock
with the process, so a directory whose lock can be taken has no live owner: every new ``OwnedDir``
removes those in its offload_dir, and says so on stderr. Directories whose lock is held (a live run
sharing offload_dir) and anything not named like ours are never touched. Nothing is reused: on
resume the tier's state is rebuilt from the checkpoint, which holds all of it.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
import sys
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..plan.memory import fmt_bytes

ALIGN = 4096
IO_CHUNK = 64 << 20


class TierError(OSError):
    """The NVMe tier cannot hold or return the state (full disk, failed write, corrupt file)."""


LOCK_FILE = "owner.lock"
_OWNED = re.compile(r"slideformer-(\d+)-[0-9a-f]{12}")
# an OwnedDir being created: it gets its final name only once its lock is held (see OwnedDir)
_PENDING = re.compile(r"\.slideformer-(\d+)-[0-9a-f]{12}\.new")
# files older versions put straight into offload_dir, owned by nothing but their pid
_LEGACY = re.compile(r"slideformer-(\d+)-(?:unit\d+\.state|[^/]+\.scratch)")

# The names of the directories this process holds open. The scan must not judge these by their lock:
# where flock is emulated with POSIX record locks (NFS, CIFS) a second fd of the same process takes the
# lock too, and closing that fd would drop the owner's lock. Touched only by OwnedDir.__init__/close.
_held: set[str] = set()
_held_lock = threading.Lock()


def _disk_usage(path: Path) -> int:
    """Bytes allocated to the files under ``path`` (a file or a directory; symlinks not followed)."""
    def size(p: str) -> int:
        try:
            st = os.lstat(p)
        except OSError:
            return 0
        return st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size

    if not path.is_dir() or path.is_symlink():
        return size(str(path))
    return sum(size(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def _report(freed: int, what: Path) -> None:
    print(f"slideformer: removed {fmt_bytes(freed)} of NVMe tier files left by a process that ended ({what})",
          file=sys.stderr, flush=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def _remove_if_ownerless(d: Path) -> int | None:
    """Remove the owned directory ``d`` unless its owner is alive; the bytes freed, or None if kept."""
    try:
        fd = os.open(d / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        fd = -1  # its lock file went first: a removal (close, or another scan) is running or was cut short
    except OSError:
        return None  # unreadable (another user's): not ours to judge
    try:
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held (EWOULDBLOCK): a live owner; any other error: no verdict, keep it
                return None
        freed = _disk_usage(d)
        shutil.rmtree(d, ignore_errors=True)
        return freed
    finally:
        if fd >= 0:
            os.close(fd)


def remove_stale(offload_dir: str | os.PathLike) -> int:
    """Remove what processes that ended left in ``offload_dir``: owned directories whose lock is free,
    and the files older versions put there directly whose pid no longer runs. Each removal is one line
    on stderr. Returns the bytes freed."""
    parent = Path(offload_dir)
    total = 0
    legacy: dict[int, list[Path]] = {}
    for entry in os.scandir(parent):
        path = Path(entry.path)
        if (m := _OWNED.fullmatch(entry.name)) and entry.is_dir(follow_symlinks=False):
            with _held_lock:
                if entry.name in _held:
                    continue
            freed = _remove_if_ownerless(path)
            if freed:
                _report(freed, path)
                total += freed
        elif (m := _PENDING.fullmatch(entry.name)) and entry.is_dir(follow_symlinks=False):
            if not _alive(int(m.group(1))):  # killed in the instant between mkdir and rename: no lock yet
                shutil.rmtree(path, ignore_errors=True)
        elif (m := _LEGACY.fullmatch(entry.name)) and entry.is_file(follow_symlinks=False):
            if not _alive(int(m.group(1))):
                legacy.setdefault(int(m.group(1)), []).append(path)
    for pid, files in legacy.items():
        freed = sum(_disk_usage(f) for f in files)
        for f in files:
            f.unlink(missing_ok=True)
        _report(freed, parent / f"slideformer-{pid}-*")
        total += freed
    return total


class OwnedDir:
    """A directory ``offload_dir/slideformer-<pid>-<hex>/`` that this process holds, for the files of one
    tier or scratch. Creating it first removes what ended processes left in offload_dir
    (``remove_stale``); close() removes it and everything in it, and so does the interpreter's exit where
    its owner never called close() (tens of GB left on a disk until the next run otherwise).

    It is made under a name the scan ignores, gets its lock file and lock there, and only then is renamed
    to its final name, so no scan ever sees it unlocked while its owner lives."""

    def __init__(self, offload_dir: str | os.PathLike):
        self.offload_dir = Path(offload_dir)
        # (the folders its own mkdir made go again at close where nothing else is in them: an offload_dir inside
        # a new output_dir would otherwise be taken for the user's by the next run there; one another process
        # made first is that one's)
        self._made: list[Path] = []
        self.name = f"slideformer-{os.getpid()}-{secrets.token_hex(6)}"
        self.path = self.offload_dir / self.name
        pending = self.offload_dir / f".{self.name}.new"
        for attempt in range(3):  # (another run that made the folder may remove it, empty, as this one starts)
            for p in reversed((self.offload_dir.absolute(), *self.offload_dir.absolute().parents)):
                if not p.exists():
                    with contextlib.suppress(FileExistsError):
                        p.mkdir()
                        self._made.insert(0, p)  # (deepest first)
            try:
                remove_stale(self.offload_dir)
                pending.mkdir(mode=0o700)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
            except BaseException:
                self._remove_made()
                raise
        self._fd = -1
        try:
            self._fd = os.open(pending / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # nobody else knows this file yet: taken at once
            with _held_lock:
                _held.add(self.name)
            os.rename(pending, self.path)
        except BaseException:
            self._release()
            shutil.rmtree(pending, ignore_errors=True)
            self._remove_made()
            raise
        atexit.register(self.close)

    def _remove_made(self) -> None:
        for made in self._made:  # (deepest first; one another run's files are in stays)
            with contextlib.suppress(OSError):
                made.rmdir()

    def _release(self) -> None:
        with _held_lock:
            _held.discard(self.name)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        """Remove the directory and what is left in it (the lock file last, still held), then drop the lock."""
        if self._fd < 0:
            return
        atexit.unregister(self.close)
        try:
            for entry in os.scandir(self.path):
                if entry.name == LOCK_FILE:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    Path(entry.path).unlink(missing_ok=True)
            (self.path / LOCK_FILE).unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        finally:
            shutil.rmtree(self.path, ignore_errors=True)
            self._release()
            self._remove_made()


def _open(path: Path, direct: bool) -> tuple[int, bool]:
    """A new file, with O_DIRECT where asked for and the filesystem has it; returns (fd, direct)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: the filesystem (tmpfs) has no O_DIRECT
                raise
    return os.open(path, flags, 0o600), False


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D tensor whose data starts on a 4096-byte boundary and whose byte size is a
    multiple of 4096 (O_DIRECT needs both)."""
    nbytes = -(-numel * dtype.itemsize // ALIGN) * ALIGN
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    return raw[(-raw.data_ptr()) % ALIGN:][:nbytes].view(dtype)


class Checksummed:
    """Reads and writes in IO_CHUNK pieces with the CRC32 of the bytes moved, summed beside the I/O: zlib's
    CRC runs at about 2 GB/s, near the disk's speed, so summed before a write or after a read it made
    each one take nearly twice the disk's time. A helper thread per direction sums piece k while the
    caller moves piece k+1 (zlib and the reads and writes release the GIL)."""

    def __init__(self):
        self._pools = {w: ThreadPoolExecutor(1, thread_name_prefix=f"slideformer-crc-{'write' if w else 'read'}")
                       for w in (False, True)}

    def move(self, fd: int, view: memoryview, offset: int, direct: bool, write: bool, what: str) -> tuple[int, int]:
        """``view`` to ``fd`` at ``offset``, or filled from it; then out of the page cache. Returns (bytes
        moved, their CRC32): a read moves fewer where the file ends early. A failure is a TierError naming
        ``what`` is moved (the file)."""
        pool, crc, done = self._pools[write], None, 0
        try:
            while done < len(view):
                piece = view[done: done + IO_CHUNK]
                n = os.pwritev(fd, [piece], offset + done) if write else os.preadv(fd, [piece], offset + done)
                if n <= 0:
                    if write:  # (a write that moves nothing would leave a file whose CRC says otherwise)
                        raise OSError(errno.EIO, f"a write moved nothing at byte {offset + done}")
                    break
                crc = pool.submit(_crc_after, crc, view[done: done + n])  # (in order: one thread a direction)
                done += n
            if not direct:  # page cache would spend the RAM the file saves
                os.posix_fadvise(fd, offset, len(view), os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise TierError(e.errno, f"{'writing' if write else 'reading'} {what} failed ({e.strerror}); training "
                            "stops here") from e
        return done, 0 if crc is None else crc.result()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown()


def _crc_after(previous, piece: memoryview) -> int:
    return zlib.crc32(piece, 0 if previous is None else previous.result())


def _crc(view: memoryview, crc: int = 0) -> int:
    for s in range(0, len(view), IO_CHUNK):
        crc = zlib.crc32(view[s: s + IO_CHUNK], crc)  # releases the GIL for large buffers
    return crc


MOMENTS = {"exp_avg": (torch.float32, None), "exp_avg_sq": (torch.float32, None)}


class NvmeTier:
    """The state files of the tier's units, in an ``OwnedDir`` of their own under ``directory`` (the
    offload_dir), and the RAM buffers they are read into and written from.

    ``fields`` names what a unit's file holds, in file order: name -> (dtype, elements for a unit of n
    parameters; None: n). Each field starts on a 4096-byte boundary and has a CRC32 of its own, so one
    field (the weights the window reads) can be read and checked alone."""

    def __init__(self, directory: str | os.PathLike, numels: dict[int, int], buffers: int,
                 fields: dict[str, tuple[torch.dtype, object]] = MOMENTS):
        self.offload_dir = Path(directory)
        self.numels = numels
        self.fields = dict(fields)
        # per unit: field -> (byte offset, elements, dtype); and the file's (and a buffer's) bytes
        self.layout: dict[int, dict[str, tuple[int, int, torch.dtype]]] = {}
        self.nbytes: dict[int, int] = {}
        for u, n in numels.items():
            at, lay = 0, {}
            for name, (dtype, size) in self.fields.items():
                k = n if size is None else size(n)
                lay[name] = (at, k, dtype)
                at += _padded(k * dtype.itemsize)
            self.layout[u], self.nbytes[u] = lay, at
        need = sum(self.nbytes.values())
        self.files: dict[int, Path] = {}
        self._fds: dict[int, int] = {}
        self.direct = True
        self.crc: dict[tuple[int, str], int] = {}  # (unit, field) -> the CRC32 of its padded bytes on disk
        self._sums = Checksummed()
        self.owned = OwnedDir(self.offload_dir)
        self.dir = self.owned.path
        try:
            zero_crc: dict[int, int] = {}
            for u, size in self.nbytes.items():
                path = self.dir / f"unit{u}.state"
                fd = self._open(path)
                self.files[u], self._fds[u] = path, fd
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    raise TierError(e.errno, f"offload_dir {self.offload_dir}: cannot reserve {fmt_bytes(need)} "
                                    f"for the optimizer state on the NVMe tier ({e.strerror}); free space there, lower "
                                    "the fraction of units on the tier, or point offload_dir elsewhere") from e
                for name, (_, k, dtype) in self.layout[u].items():
                    padded = _padded(k * dtype.itemsize)
                    if padded not in zero_crc:
                        zero_crc[padded] = self._zero_crc(padded)
                    # fallocate'd space reads as zeros: the moments' initial value (a master on the tier is
                    # written before training starts: see HostStore.set_master)
                    self.crc[u, name] = zero_crc[padded]
            width = max(self.nbytes.values())
            self.buffers = [aligned_empty(width, torch.uint8).zero_() for _ in range(buffers)]
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _zero_crc(size: int) -> int:
        zeros, crc = bytes(IO_CHUNK), 0
        for s in range(0, size, IO_CHUNK):
            crc = zlib.crc32(zeros[: min(IO_CHUNK, size - s)], crc)
        return crc

    def _open(self, path: Path) -> int:
        fd, self.direct = _open(path, self.direct)
        return fd

    @property
    def disk_bytes(self) -> int:
        return sum(self.nbytes.values())

    def field_bytes(self, unit: int, name: str) -> int:
        """The bytes a read of one field moves (4096-padded): the size its destination needs."""
        _, k, dtype = self.layout[unit][name]
        return _padded(k * dtype.itemsize)

    def views(self, unit: int, buf: int) -> dict[str, torch.Tensor]:
        """The fields of ``unit`` inside RAM buffer ``buf``, by name."""
        raw = self.buffers[buf]
        return {name: raw[at: at + k * dtype.itemsize].view(dtype) for name, (at, k, dtype) in self.layout[unit].items()}

    def read(self, unit: int, buf: int) -> None:
        """Every field of ``unit`` into RAM buffer ``buf``, each checked against its CRC."""
        for name, (at, _, _) in self.layout[unit].items():
            self._read_field(unit, name, self.buffers[buf][at: at + self.field_bytes(unit, name)])

    def read_field(self, unit: int, name: str, dst: torch.Tensor) -> torch.Tensor:
        """One field of ``unit`` into ``dst`` (4096-aligned bytes, at least ``field_bytes`` of them), checked;
        returns it as a view of ``dst`` in the field's dtype."""
        _, k, dtype = self.layout[unit][name]
        self._read_field(unit, name, dst.view(torch.uint8)[: self.field_bytes(unit, name)])
        return dst.view(torch.uint8)[: k * dtype.itemsize].view(dtype)

    def _read_field(self, unit: int, name: str, dst: torch.Tensor) -> None:
        view = memoryview(dst.numpy())
        done, crc = self._sums.move(self._fds[unit], view, self.layout[unit][name][0], self.direct, write=False,
                                    what=f"NVMe state file {self.files[unit]}")
        if done < len(view):
            raise TierError(errno.EIO, f"NVMe state file {self.files[unit]} is truncated in {name}")
        if (unit, name) not in self.crc:
            raise TierError(errno.EIO, f"NVMe state file {self.files[unit]} holds an incomplete write of {name} (a "
                            "write failed)")
        if crc != self.crc[unit, name]:
            raise TierError(errno.EIO, f"NVMe state file {self.files[unit]} is corrupt (CRC32 mismatch in {name}): "
                            "the state read back is not what was written")

    def write(self, unit: int, buf: int, names=None) -> None:
        """The fields of ``unit`` (``names`` of them, or all) from where they lie in RAM buffer ``buf``; each
        field's CRC is the one of what was written."""
        for name in names or self.layout[unit]:
            at = self.layout[unit][name][0]
            self.crc.pop((unit, name), None)  # until the write completes the field holds nothing valid
            view = memoryview(self.buffers[buf].numpy())[at: at + self.field_bytes(unit, name)]
            _, crc = self._sums.move(self._fds[unit], view, at, self.direct, write=True,
                                     what=f"NVMe state file {self.files[unit]}")
            self.crc[unit, name] = crc

    def copy_out(self, unit: int, *names: str) -> dict[str, torch.Tensor]:
        """The unit's fields (``names`` of them, or all) as new tensors, by name (for checkpoints and export;
        the pipeline must be idle): only those fields are read."""
        views = self.views(unit, 0)
        out = {}
        for name in names or self.layout[unit]:
            at = self.layout[unit][name][0]
            self._read_field(unit, name, self.buffers[0][at: at + self.field_bytes(unit, name)])
            out[name] = views[name].clone()
        return out

    def copy_in(self, unit: int, **fields: torch.Tensor) -> None:
        """Replace some of the unit's fields, keeping the others (initialisation and checkpoint restore; the
        pipeline must be idle): only those fields are written, nothing is read."""
        views = self.views(unit, 0)
        for name, t in fields.items():
            views[name].copy_(t)
        self.write(unit, 0, list(fields))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        for f in self.files.values():
            f.unlink(missing_ok=True)
        self._fds.clear()
        self.files.clear()
        try:
            self.owned.close()
        finally:
            self._sums.close()


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class NvmeScratch:
    """One file of fixed-size records for transient data (offloaded activations), in an ``OwnedDir`` of
    its own under ``directory`` (the offload_dir), grown with posix_fallocate when a step needs more
    records or larger ones. Records are written and read whole, from 4096-aligned buffers
    (``aligned_empty``), each with a CRC32 checked on read."""

    def __init__(self, directory: str | os.PathLike, what: str):
        self.offload_dir = Path(directory)
        self.what = what
        self._sums = Checksummed()
        self.owned = OwnedDir(self.offload_dir)
        self.dir = self.owned.path
        self.path = self.dir / f"{what}.scratch"
        try:
            self.fd, self.direct = _open(self.path, True)
        except BaseException:
            self.owned.close()
            raise
        self.record_bytes = 0
        self.records = 0
        self.crc: dict[int, int] = {}

    @property
    def disk_bytes(self) -> int:
        return self.record_bytes * self.records

    def reserve(self, records: int, record_bytes: int) -> None:
        """Room for ``records`` records of ``record_bytes`` (rounded up to 4096); a full disk fails here."""
        record_bytes = -(-record_bytes // ALIGN) * ALIGN
        if records <= self.records and record_bytes <= self.record_bytes:
            return
        records, record_bytes = max(records, self.records), max(record_bytes, self.record_bytes)
        try:
            os.posix_fallocate(self.fd, 0, records * record_bytes)
        except OSError as e:
            from ..plan.memory import fmt_bytes

            raise TierError(e.errno, f"offload_dir {self.offload_dir}: cannot reserve {fmt_bytes(records * record_bytes)} "
                            f"for {self.what} on NVMe ({e.strerror}); free space there, or keep them in RAM") from e
        self.records, self.record_bytes = records, record_bytes
        self.crc.clear()

    def write(self, index: int, buf: torch.Tensor) -> None:
        view = memoryview(buf.view(torch.uint8).numpy())
        assert len(view) <= self.record_bytes and index < self.records
        self.crc.pop(index, None)  # until this write completes the record holds nothing valid (not last step's)
        _, crc = self._sums.move(self.fd, view, index * self.record_bytes, self.direct, write=True,
                                 what=f"{self.what} in {self.path}")
        self.crc[index] = crc

    def read(self, index: int, buf: torch.Tensor) -> None:
        view = memoryview(buf.view(torch.uint8).numpy())
        done, crc = self._sums.move(self.fd, view, index * self.record_bytes, self.direct, write=False,
                                    what=f"{self.what} in {self.path}")
        if done < len(view):
            raise TierError(errno.EIO, f"{self.path} is truncated at record {index}")
        if crc != self.crc.get(index):
            raise TierError(errno.EIO, f"{self.what} read back from {self.path} (record {index}) are corrupt "
                            "(CRC32 mismatch)")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.path.unlink(missing_ok=True)
            try:
                self.owned.close()
            finally:
                self._sums.close()
