"""Datasets larger than RAM: records read, rendered and tokenized when a step asks for them.

Tokenized up front, a sample costs about 17 bytes of RAM per byte of its JSONL (Python lists of ints), so
a 1 GB file would take 17 GB. Read lazily, RAM holds an index instead: 8 bytes a JSONL line (where it
starts; the line is read back with one ``pread``), or nothing for what ``datasets`` reads (its Arrow
files are memory-mapped: page cache, which the kernel reclaims). A record becomes a sample when the
trainer's seeded order reaches it. That order is over records whichever way they are read (a record that
is no sample, up front, keeps its place as None), so the epochs and resume do not depend on it; a record
that is malformed (under skip_bad_records) or has no target token within cutoff_len is met when reached,
passed over and counted once.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .formats import (COMPRESSIONS, NOT_JSON, DataError, check_one_dataset, check_readable, compressed_json,
                      jsonl_record, open_parquet, open_through_datasets, read_by_datasets, read_records)

CHUNK = 4 << 20  # bytes scanned for line ends at a time
_SPACE = np.zeros(256, np.bool_)
_SPACE[[9, 10, 11, 12, 13, 32]] = True  # (ASCII whitespace: a line of only these is blank)


class JsonlLines:
    """The records of a JSONL file (its lines that are not blank, as read_records has them), by index:
    (where, record), or (where, NOT_JSON) for a line that is not JSON under ``skip_bad`` (else DataError,
    naming the file and line). RAM: 8 bytes a record (where its line starts), and the blank lines' numbers.
    The file is opened for each read: nothing stays open (a dataset may be thousands of files), and a copy
    in another process reads it as well. A file changed since its lines were counted (size or modification
    time) is refused at the next read: its lines would be other records, or cut mid-line."""

    def __init__(self, path: Path, skip_bad: bool):
        self.path, self.skip_bad = Path(path), skip_bad
        starts, blank = [], []  # (records' line starts; blank lines' 0-based numbers)
        line_start, pending, lines, at = 0, 0, 0, 0  # (the unfinished line: its start and non-space bytes)
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                self.stamp = (st.st_size, st.st_mtime_ns)  # (what each read checks: the file indexed)
                while chunk := f.read(CHUNK):
                    b = np.frombuffer(chunk, np.uint8)
                    nl = np.flatnonzero(b == 10)
                    if len(nl):
                        filled = np.cumsum(~_SPACE[b], dtype=np.int64)[nl]  # non-space bytes up to each line end
                        counts = np.diff(filled, prepend=0)
                        counts[0] += pending
                        line_starts = np.concatenate([[line_start], nl[:-1] + at + 1])
                        starts.append(line_starts[counts > 0])
                        blank.append(np.flatnonzero(counts == 0) + lines)
                        lines += len(nl)
                        line_start, pending = int(nl[-1]) + at + 1, int(np.count_nonzero(~_SPACE[b[nl[-1] + 1:]]))
                    else:
                        pending += int(np.count_nonzero(~_SPACE[b]))
                    at += len(chunk)
        except OSError as e:
            raise OSError(e.errno, f"dataset file {self.path}: cannot read it ({e.strerror})") from e
        if line_start < at:  # (a last line without a newline)
            (starts if pending else blank).append(np.array([line_start if pending else lines], np.int64))
        self.starts = np.concatenate(starts).astype(np.int64) if starts else np.zeros(0, np.int64)
        blank = np.concatenate(blank).astype(np.int64) if blank else np.zeros(0, np.int64)
        self._blank_at = blank - np.arange(len(blank))  # (the record index each blank line comes before)
        self.size = at

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[str, object]:
        i = int(i)
        lineno = i + 1 + int(np.searchsorted(self._blank_at, i, side='right'))
        where = f"{self.path}:{lineno}"
        start = int(self.starts[i])
        end = int(self.starts[i + 1]) if i + 1 < len(self.starts) else self.size
        try:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                st = os.fstat(fd)
                raw = os.pread(fd, end - start, start)
            finally:
                os.close(fd)
        except OSError as e:
            raise OSError(e.errno, f"dataset file {self.path}: cannot read it ({e.strerror})") from e
        if (st.st_size, st.st_mtime_ns) != self.stamp or self.size != self.stamp[0]:
            raise DataError(f"dataset file {self.path} changed while the run read it (its size or modification "
                            "time is not what it was when its lines were counted): its records are no longer the "
                            "ones the run ordered; put the file back as it was and resume, or start a new run")
        # (the record's own line: blank ones may follow)
        return where, jsonl_record(raw.split(b"\n", 1)[0], Path(self.path), lineno, self.skip_bad)


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
    if read_by_datasets(path):
        data, tag = open_through_datasets(str(path), p, split, subset)
        return ArrowRows(data, str(path), tag)
    check_readable(p)
    check_one_dataset(p, split, subset)
    if p.suffix.lower() == ".parquet":
        return ArrowRows(open_parquet(p), str(p), "record")
    if p.suffix.lower() == ".json" or compressed_json(p):  # (read whole: a JSON list parses so, a stream reads so)
        return read_records(p, skip_bad)
    return JsonlLines(p, skip_bad)


def source_bytes(path) -> int:
    """The bytes of a dataset's files (a folder's, summed), as read: a Parquet file's uncompressed; for a
    Hub name, whose size is not known before ``datasets`` fetches it, more than any RAM (its memory-mapped
    cache is read by row)."""
    p = Path(path)
    if p.is_file():
        return _read_bytes(p)
    if p.is_dir():
        return sum(_read_bytes(f) for f in p.rglob("*") if f.is_file())
    return 1 << 62


COMPRESSED_TEXT = 10  # (what a compressed text file may hold a byte of it: JSON compresses 3-10 fold)


def _read_bytes(f: Path) -> int:
    """A file's bytes once read: a Parquet file's columns uncompressed (its footer says; text compresses
    several-fold, and its samples are made from what it holds), a compressed file's as much as it may hold."""
    size = f.stat().st_size
    if f.suffix.lower() in (*COMPRESSIONS, ".zst"):
        return size * COMPRESSED_TEXT
    if f.suffix.lower() != ".parquet":
        return size
    try:
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(f).metadata
        return max(size, sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)))
    except (OSError, ValueError, ImportError):  # (not Parquet after all, or no pyarrow: reading it says so)
        return size


class LazyExamples:
    """The samples of several sources' records, by index (each source's records in turn), made when asked
    for and not kept: ``make(spec, where, record)`` -> (ids, labels, truncated), None without a target token,
    DataError where malformed. Reads as None where a record is no sample (malformed under ``skip_bad``, no
    target); ``skipped``, ``dropped`` and ``truncated`` count the records met, each once."""

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
        if rec is NOT_JSON:  # a line that is not JSON, under skip_bad
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

    @property
    def truncated(self) -> int:
        return self.base.truncated
