"""The NVMe tier: the optimizer state of some units lives in files under ``offload_dir``.

Each unit on the tier has one file holding its fields, one after another: exp_avg and exp_avg_sq, and
with ``nvme_master`` the fp32 master weights too (4096-byte padded). It is reserved with
posix_fallocate at start, so a disk too small fails at once with the size it needs, not hours in.
The runtime reads a unit's state into one of a few RAM buffers ahead of its update and writes it back
behind it (engine/runtime.py owns those threads); this class only moves bytes.

I/O uses O_DIRECT where the filesystem supports it (page cache would spend the RAM the tier saves),
else buffered I/O followed by POSIX_FADV_DONTNEED. Every write records a CRC32 of the file's bytes
and every read checks it, so a corrupted or truncated state file is detected, never trained on.
"""
from __future__ import annotations

import errno
import os
import zlib
from pathlib import Path

import torch

ALIGN = 4096
IO_CHUNK = 64 << 20


class TierError(OSError):
    """The NVMe tier cannot hold or return the state (full disk, failed write, corrupt file)."""


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


def _write_all(fd: int, view: memoryview, offset: int, direct: bool) -> None:
    """``view`` to ``fd`` at ``offset`` in IO_CHUNK pieces (raises OSError), then out of the page cache."""
    done = 0
    while done < len(view):
        done += os.pwritev(fd, [view[done: done + IO_CHUNK]], offset + done)
    if not direct:  # page cache would spend the RAM the file saves
        os.posix_fadvise(fd, offset, len(view), os.POSIX_FADV_DONTNEED)


def _read_all(fd: int, view: memoryview, offset: int, direct: bool) -> int:
    """Fill ``view`` from ``fd`` at ``offset``; returns the bytes read (fewer: the file ends early)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done: done + IO_CHUNK]], offset + done)
        if got <= 0:
            break
        done += got
    if not direct:
        os.posix_fadvise(fd, offset, len(view), os.POSIX_FADV_DONTNEED)
    return done


def _crc(view: memoryview, crc: int = 0) -> int:
    for s in range(0, len(view), IO_CHUNK):
        crc = zlib.crc32(view[s: s + IO_CHUNK], crc)  # releases the GIL for large buffers
    return crc


class NvmeTier:
    def __init__(self, directory: str | os.PathLike, numels: dict[int, int], buffers: int,
                 dtype: torch.dtype = torch.float32, fields: int = 2):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.numels = numels
        self.dtype = dtype  # fp32 state, or bf16 moments (compact optimizer state)
        self.fields = fields  # 2: exp_avg, exp_avg_sq; 3: and the master
        self.nbytes = {u: -(-fields * n * dtype.itemsize // ALIGN) * ALIGN for u, n in numels.items()}
        need = sum(self.nbytes.values())
        self.files: dict[int, Path] = {}
        self._fds: dict[int, int] = {}
        self.direct = True
        self.crc: dict[int, int] = {}
        zero_crc: dict[int, int] = {}
        for u, size in self.nbytes.items():
            path = self.dir / f"slideformer-{os.getpid()}-unit{u}.state"
            fd = self._open(path)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                self.close()
                raise TierError(e.errno, f"offload_dir {self.dir}: cannot reserve {need / 2**30:.1f} GiB for the "
                                f"optimizer state on the NVMe tier ({e.strerror}); free space there, lower the "
                                "fraction of units on the tier, or point offload_dir elsewhere") from e
            self.files[u], self._fds[u] = path, fd
            if size not in zero_crc:
                zero_crc[size] = self._zero_crc(size)
            self.crc[u] = zero_crc[size]  # fallocate'd space reads as zeros: the moments' initial value
            # (a master on the tier is written before training starts: see HostStore.set_master)
        width = max(self.nbytes.values())
        self.buffers = [aligned_empty(width, torch.uint8).zero_() for _ in range(buffers)]

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

    def views(self, unit: int, buf: int) -> tuple[torch.Tensor, ...]:
        """The fields of ``unit`` (exp_avg, exp_avg_sq[, master]) inside RAM buffer ``buf``."""
        n = self.numels[unit]
        return tuple(self.buffers[buf].view(self.dtype)[: self.fields * n].split(n))

    def read(self, unit: int, buf: int) -> None:
        view = memoryview(self.buffers[buf].numpy())[: self.nbytes[unit]]
        done = _read_all(self._fds[unit], view, 0, self.direct)
        if done < len(view):
            raise TierError(errno.EIO, f"NVMe state file {self.files[unit]} is truncated at byte {done}")
        if _crc(view) != self.crc[unit]:
            raise TierError(errno.EIO, f"NVMe state file {self.files[unit]} is corrupt (CRC32 mismatch): the "
                            "state read back is not what was written; resume from the last checkpoint")

    def write(self, unit: int, buf: int) -> None:
        view = memoryview(self.buffers[buf].numpy())[: self.nbytes[unit]]
        crc = _crc(view)
        try:
            _write_all(self._fds[unit], view, 0, self.direct)
        except OSError as e:
            raise TierError(e.errno, f"writing NVMe state file {self.files[unit]} failed ({e.strerror}); "
                            "training stops here, the last checkpoint is intact") from e
        self.crc[unit] = crc

    def copy_out(self, unit: int) -> tuple[torch.Tensor, ...]:
        """The unit's fields as new tensors (for checkpoints; the pipeline must be idle)."""
        self.read(unit, 0)
        return tuple(t.clone() for t in self.views(unit, 0))

    def copy_in(self, unit: int, **fields: torch.Tensor) -> None:
        """Replace some of the unit's fields (``exp_avg``, ``exp_avg_sq``, ``master``), keeping the others
        (initialisation and checkpoint restore; the pipeline must be idle)."""
        self.read(unit, 0)
        views = dict(zip(("exp_avg", "exp_avg_sq", "master"), self.views(unit, 0)))
        for name, t in fields.items():
            views[name].copy_(t)
        self.write(unit, 0)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        for f in self.files.values():
            f.unlink(missing_ok=True)
        self._fds.clear()
        self.files.clear()


class NvmeScratch:
    """One file of fixed-size records for transient data (offloaded activations), grown with
    posix_fallocate when a step needs more records or larger ones. Records are written and read whole,
    from 4096-aligned buffers (``aligned_empty``), each with a CRC32 checked on read."""

    def __init__(self, directory: str | os.PathLike, what: str):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.what = what
        self.path = self.dir / f"slideformer-{os.getpid()}-{what}.scratch"
        self.fd, self.direct = _open(self.path, True)
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
            raise TierError(e.errno, f"offload_dir {self.dir}: cannot reserve {records * record_bytes / 2**30:.1f} GiB "
                            f"for {self.what} on NVMe ({e.strerror}); free space there, or keep them in RAM") from e
        self.records, self.record_bytes = records, record_bytes
        self.crc.clear()

    def write(self, index: int, buf: torch.Tensor) -> None:
        view = memoryview(buf.view(torch.uint8).numpy())
        assert len(view) <= self.record_bytes and index < self.records
        self.crc.pop(index, None)  # until this write completes the record holds nothing valid (not last step's)
        crc = _crc(view)
        try:
            _write_all(self.fd, view, index * self.record_bytes, self.direct)
        except OSError as e:
            raise TierError(e.errno, f"writing {self.what} to {self.path} failed ({e.strerror}); training stops "
                            "here, the last checkpoint is intact") from e
        self.crc[index] = crc

    def read(self, index: int, buf: torch.Tensor) -> None:
        view = memoryview(buf.view(torch.uint8).numpy())
        if _read_all(self.fd, view, index * self.record_bytes, self.direct) < len(view):
            raise TierError(errno.EIO, f"{self.path} is truncated at record {index}")
        if _crc(view) != self.crc.get(index):
            raise TierError(errno.EIO, f"{self.what} read back from {self.path} (record {index}) are corrupt "
                            "(CRC32 mismatch)")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.path.unlink(missing_ok=True)
