"""Disk I/O of a training run: a reader and a writer thread, each running the jobs queued for it in
order (the NVMe tier's state; offloaded activations on NVMe, engine/activations.py). Two threads, so
that a read waiting for a free buffer never blocks the write that frees one.

The NVMe tier's hand-offs: ``begin_step`` queues the step's reads in the order its updates will want
them; a read goes to the reader only once a RAM buffer is free for it (the reader never waits for one:
activation reads share it, and backward may need those before any buffer comes free). The read sets the
unit's ``ready`` flag; the optimizer worker ``take``s the buffer, updates it in place and ``give_back``s
it, which queues its write; the buffer is free again when the write has finished, and the unit's file is
read again (next step) only after that write (its ``written`` flag). The window's loads of weights on the
tier (compact state's master there) read that one field on the loader thread (``read_weights``), once the
unit's last update is on disk (its ``stored`` flag: cleared when the update takes its buffer, set when the
write has finished), or from the buffer its state was read ahead into for its update, where that read is in.

Failures are the run's (``Failure``): the first is kept, every wait here ends when one is recorded, and
each job still releases what it holds."""
from __future__ import annotations

import collections
import queue
import threading

from .copier import on_device


class Failure:
    """The first failure in any of the run's threads; later ones are its consequences."""

    def __init__(self):
        self.first: BaseException | None = None

    def record(self, e: BaseException) -> None:
        if self.first is None:
            self.first = e

    def raise_if_any(self) -> None:
        """In the main thread: the first failure, as the error that says the state may be inconsistent."""
        if self.first is not None:
            raise RuntimeError("a worker thread (the CPU optimizer, weight loader or disk) failed; training state is "
                               "not consistent") from self.first

    def wait(self, done: threading.Event) -> bool:
        """Wait for another thread's ``done`` flag; False if a failure means it may never come."""
        while not done.wait(0.05):
            if self.first is not None:
                return False
        return True


class DiskIO:
    def __init__(self, tier, failure: Failure, device="cpu"):
        self.tier, self.failure = tier, failure
        self._reads: queue.Queue = queue.Queue()
        self._writes: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=on_device(self._work, device, failure), args=(q,), name=name,
                                          daemon=True)
                         for q, name in ((self._reads, "slideformer-disk-read"), (self._writes, "slideformer-disk-write"))]
        for th in self._threads:
            th.start()
        if tier is not None:
            self._free = [True] * len(tier.buffers)
            self._cv = threading.Condition()
            self._buf: dict[int, int] = {}
            self._pending: collections.deque[int] = collections.deque()
            self._ready = {u: threading.Event() for u in tier.numels}
            self._written = {u: threading.Event() for u in tier.numels}
            self._stored = {u: threading.Event() for u in tier.numels}
            for e in (*self._written.values(), *self._stored.values()):
                e.set()

    # -- the two threads -----------------------------------------------------------------------------
    def submit_read(self, job) -> None:
        self._reads.put(job)

    def submit_write(self, job) -> None:
        self._writes.put(job)

    def join_writes(self) -> None:
        self._writes.join()

    def _work(self, jobs: queue.Queue) -> None:
        while (job := jobs.get()) is not None:
            try:
                job()
            except BaseException as e:  # each job also releases what it holds in its own finally
                self.failure.record(e)
            finally:
                jobs.task_done()

    def close(self) -> None:
        """Stop both threads after their queued jobs (the writes finish)."""
        self._reads.put(None)
        self._writes.put(None)
        for th in self._threads:
            th.join()

    # -- the NVMe tier ---------------------------------------------------------------------------------
    def begin_step(self, update_order: list[int]) -> None:
        """Queue this step's tier reads in the order its updates will want them."""
        if self.tier is not None:
            with self._cv:
                self._pending.extend(u for u in update_order if u in self._ready)
            self._schedule()

    def ready(self, unit: int) -> bool:
        """Whether the unit's state is in a RAM buffer (the optimizer picks such units first)."""
        return self._ready[unit].is_set()

    def take(self, unit: int) -> int | None:
        """The buffer holding the unit's state, once read; None if the read failed (its error is kept)."""
        self.failure.wait(self._ready[unit])
        self._ready[unit].clear()
        buf = self._buf.pop(unit, None)
        if buf is not None:  # (the file is behind the buffer until the update's write: loads wait for it)
            self._stored[unit].clear()
        return buf

    def give_back(self, unit: int, buf: int) -> None:
        """The buffer goes back to its file (then to the free list)."""
        self._writes.put(lambda: self._write(unit, buf))

    def read_weights(self, unit: int, dst) -> object | None:
        """The unit's master (compact state: the weights the window reads): from the buffer its state was read
        ahead into for its update where that read is done, else from its file into ``dst`` once its last
        update is written; None if a failure means it may never be (its error is kept).

        A buffer that is ``ready`` holds the unit's current state, and nothing writes it before the update
        takes it, which waits for this step's gradient of the unit, which the GPU computes only once the
        weights loaded from it have arrived."""
        if not self.failure.wait(self._stored[unit]) or self.failure.first is not None:
            return None
        if self._ready[unit].is_set() and (buf := self._buf.get(unit)) is not None:
            return self.tier.views(unit, buf)["master"] if self.failure.first is None else None
        return self.tier.read_field(unit, "master", dst)

    def _schedule(self) -> None:
        with self._cv:
            while self._pending and True in self._free:
                buf = self._free.index(True)
                self._free[buf] = False
                unit = self._pending.popleft()
                self._reads.put(lambda u=unit, b=buf: self._read(u, b))

    def _read(self, unit: int, buf: int) -> None:
        try:
            if self.failure.wait(self._written[unit]) and self.failure.first is None:
                self._written[unit].clear()
                self.tier.read(unit, buf)
        except BaseException as e:
            self.failure.record(e)  # before the flag: whoever it wakes sees the error
        finally:
            self._buf[unit] = buf
            self._ready[unit].set()

    def _write(self, unit: int, buf: int) -> None:
        try:
            if self.failure.first is None:
                self.tier.write(unit, buf)
        except BaseException as e:
            self.failure.record(e)
        finally:
            self._written[unit].set()
            self._stored[unit].set()
            with self._cv:
                self._free[buf] = True
            self._schedule()
