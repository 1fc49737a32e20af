"""Datasets larger than RAM: records read, rendered and tokenized when a step asks for them.

Tokenized up front, a sample costs about 17 bytes of RAM per byte of its JSONL (Python lists of ints), so
a 1 GB file would take 17 GB. Read lazily, RAM holds an index instead: 8 bytes a JSONL line (where it
starts; the line is read back with one ``pread``), or nothing for what ``datasets`` reads (its Arrow
files are memory-mapped: page cache, which the kernel reclaims). A record becomes a sample when the
trainer's seeded order reaches it, so the order, epochs and resume are those of tokenizing up front
wherever every record is a sample; one that is malformed (under skip_bad_records) or has no target token
within cutoff_len is met then, skipped and counted once.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .formats import LOADERS, DataError, _hub_name, check_readable, open_parquet, open_through_datasets, read_records

CHUNK = 16 << 20  # bytes scanned for line ends at a time
BLANK = object()  # a JSONL line of whitespace: no record (as read_records skips it)


class JsonlLines:
    """The lines of a JSONL file, by index: (where, record); (where, None) for a line that is not JSON under
    ``skip_bad`` (else DataError, naming the file and line); (where, BLANK) for a blank line."""

    def __init__(self, path: Path, skip_bad: bool):
        self.path, self.skip_bad, self._fd = Path(path), skip_bad, None
        starts, at = [np.zeros(1, np.int64)], 0
        try:
            with open(self.path, "rb") as f:
                while chunk := f.read(CHUNK):
                    starts.append(np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10).astype(np.int64) + at + 1)
                    at += len(chunk)
        except OSError as e:
            raise DataError(f"dataset file {self.path}: cannot read it ({e.strerror})") from e
        starts = np.concatenate(starts)
        self.starts = starts[starts < at]  # (a newline at the end starts no line; an empty file has none)
        self.size = at

    def _raw(self, k: int) -> bytes:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        end = int(self.starts[k + 1]) if k + 1 < len(self.starts) else self.size
        return os.pread(self._fd, end - int(self.starts[k]), int(self.starts[k]))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, k: int) -> tuple[str, object]:
        where = f"{self.path}:{k + 1}"
        try:
            line = self._raw(k).decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not UTF-8 text (byte {e.start} of the line); save the file as UTF-8") from e
        except OSError as e:
            raise DataError(f"dataset file {self.path}: cannot read it ({e.strerror})") from e
        if not line.strip():
            return where, BLANK
        try:
            return where, json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            if self.skip_bad:
                return where, None
            why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else "nested too deeply"
            raise DataError(f"{where}: not valid JSON ({why}); fix the line, or set skip_bad_records: true to "
                            "skip such lines") from None

    def __del__(self):
        if self._fd is not None:
            os.close(self._fd)


class ArrowRows:
    """What ``datasets`` reads, by index, as (where, record): rows of its memory-mapped Arrow table."""

    def __init__(self, data, name: str, tag: str):
        self.data, self.name, self.tag = data, name, tag

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[str, dict]:
        return f"{self.name}[{self.tag} {i}]", dict(self.data[int(i)])


def open_records(path, skip_bad: bool = False, split: str | None = None, subset: str | None = None):
    """``read_records``' records, read when indexed: JSONL by line, Parquet and what ``datasets`` reads by
    row; a JSON list (which only parses whole) as read_records reads it."""
    p = Path(path)
    if p.is_dir() or p.suffix in LOADERS or (not p.exists() and _hub_name(str(path))):
        data, tag = open_through_datasets(str(path), p, split, subset)
        return ArrowRows(data, str(path), tag)
    check_readable(p)
    if p.suffix == ".parquet":
        return ArrowRows(open_parquet(p), str(p), "record")
    if p.suffix == ".json":
        return read_records(p, skip_bad)
    return JsonlLines(p, skip_bad)


def source_bytes(path) -> int:
    """The bytes of a dataset's files (a folder's, summed); 0 for a Hub name, which is read as ``datasets``
    caches it (memory-mapped)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return 0


class LazyExamples:
    """The samples of several sources' records, by index (each source's records in turn), made when asked
    for and not kept: ``make(spec, where, record)`` -> (ids, labels, truncated), None without a target token,
    DataError where malformed. Reads as None where a record is no sample (blank, malformed under
    ``skip_bad``, no target); ``skipped``, ``dropped`` and ``truncated`` count the records met, each once."""

    def __init__(self, sources: list, make, skip_bad: bool):
        self.sources, self.make, self.skip_bad = sources, make, skip_bad
        self.ends = np.cumsum([len(records) for records, _ in sources])
        self._met = np.zeros(int(self.ends[-1]) if len(self.ends) else 0, np.bool_)
        self.skipped = self.dropped = self.truncated = 0

    def __len__(self) -> int:
        return len(self._met)

    def __getitem__(self, i: int):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        s = int(np.searchsorted(self.ends, i, side="right"))
        records, spec = self.sources[s]
        where, rec = records[i - (int(self.ends[s - 1]) if s else 0)]
        first, self._met[i] = not self._met[i], True
        if rec is BLANK:
            return None
        if rec is None:  # a line that is not JSON, under skip_bad
            self.skipped += first
            return None
        try:
            made = self.make(spec, where, rec)
        except DataError:
            if not self.skip_bad:
                raise
            self.skipped += first
            return None
        if made is None:
            self.dropped += first
            return None
        ids, labels, truncated = made
        self.truncated += first and truncated
        return ids, labels


class Subset:
    """Some of a sequence's items (val_size's held-out samples, and the rest), by index; a slice is a list."""

    def __init__(self, base, indices):
        self.base, self.indices = base, np.asarray(indices, np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.base[int(j)] for j in self.indices[i]]
        return self.base[int(self.indices[i])]

    @property
    def skipped(self) -> int:
        return self.base.skipped

    @property
    def dropped(self) -> int:
        return self.base.dropped
