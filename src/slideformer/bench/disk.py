"""The disk under an offload_dir, as the NVMe tier uses it: O_DIRECT reads and writes of 64 MiB pieces from
aligned buffers, by 1..N threads at once, writes alone, reads alone, and both at once (the tier's step).

    python -m slideformer.bench.disk --dir /tmp/nvme --gib 8 --threads 1,2,4,8

One JSON line: GB/s per pattern and thread count. The files are removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..host.nvme import IO_CHUNK, _open, aligned_empty


def _pass(fds: list[int], size: int, threads: int, write: bool, buf) -> float:
    """Every file, whole, in IO_CHUNK pieces spread over ``threads``; returns GB/s."""
    view = memoryview(buf.numpy())
    jobs = [(fd, off) for fd in fds for off in range(0, size, IO_CHUNK)]

    def one(job):
        fd, off = job
        n = min(IO_CHUNK, size - off)
        return os.pwritev(fd, [view[:n]], off) if write else os.preadv(fd, [view[:n]], off)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        done = sum(ex.map(one, jobs))
    return done / (time.perf_counter() - t0) / 1e9


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--gib", type=float, default=8.0, help="bytes per pattern (two files of half this each)")
    ap.add_argument("--threads", default="1,2,4,8")
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    size = int(args.gib * 2**30 / 2) // IO_CHUNK * IO_CHUNK
    paths = [os.path.join(args.dir, f"disk-bench-{os.getpid()}-{i}") for i in range(4)]
    fds, direct = [], True
    rec: dict = {"dir": args.dir, "bytes": 2 * size}
    buf = aligned_empty(IO_CHUNK, torch.uint8).fill_(7)
    try:
        for p in paths:
            fd, direct = _open(p, direct)
            os.posix_fallocate(fd, 0, size)
            fds.append(fd)
        rec["direct"] = direct
        _pass(fds[2:], size, 8, True, buf)  # the read files' contents, written once
        for t in (int(x) for x in args.threads.split(",")):
            rec[f"write_t{t}_gbs"] = _pass(fds[:2], size, t, True, buf)
            rec[f"read_t{t}_gbs"] = _pass(fds[2:], size, t, False, buf)
            with ThreadPoolExecutor(2) as ex:  # the tier's step: reads and writes at once
                t0 = time.perf_counter()
                w = ex.submit(_pass, fds[:2], size, t, True, buf)
                r = ex.submit(_pass, fds[2:], size, t, False, aligned_empty(IO_CHUNK, buf.dtype))
                w.result(), r.result()
                rec[f"both_t{t}_gbs_each"] = 2 * size / (time.perf_counter() - t0) / 1e9
    finally:
        for fd in fds:
            os.close(fd)
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)
    print(json.dumps(rec), flush=True)
    return rec


if __name__ == "__main__":
    main()
