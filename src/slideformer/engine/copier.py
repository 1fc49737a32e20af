"""The window's copies and the events that order them, one implementation per device.

``CudaCopier`` owns the three streams (compute, h2d, d2h): a load waits on the slot's ``used`` event
and records ``loaded``; a gradient send waits on the compute stream and records ``grads_sent``, and
writes the send's ticket into each chunk's landing flag behind that chunk's bytes (engine/runtime.py
has the hand-offs). ``CpuCopier`` copies synchronously and returns no events, so the runtime's order of
operations is the same on both and CI runs it.

GPU tensors copied to the host (offloaded layer inputs, a visiting unit's state) go back to the compute
stream's pool in stream order, as many visits later as their copy should take: the compute stream waits for it,
then the copier lets them go (``to_host``). The allocator's own way, ``record_stream``, frees such a block
only once it sees the copy done, and the thread that drives the GPU runs far ahead of it in the forward:
the blocks of a dozen layers' inputs would sit pending there, and under a GPU cap the allocator would
wait for the device and unmap its whole cache to find room (an allocation retry).
"""
from __future__ import annotations

from collections import deque

import torch

from .profile import NullProfiler, StepProfiler


class CpuCopier:
    cuda = False
    compute = None
    gpu_bytes = 0

    def __init__(self, device: torch.device, profiler: StepProfiler | NullProfiler):
        self.device, self.profiler = device, profiler

    def load(self, dst: torch.Tensor, src: torch.Tensor, staged: bool, used, after=None) -> None:
        dst.copy_(src)  # (a staged unit's master is cast here)

    def begin_visit(self, loaded) -> None:
        pass

    def end_visit(self, unit: int):
        return None

    def read_done(self):
        return None

    def wait(self, event) -> None:
        pass

    def send(self, dst: torch.Tensor, src: torch.Tensor, flags: torch.Tensor, ticket: int, chunk: int):
        dst.copy_(src)
        flags.fill_(ticket)
        return None

    def to_host(self, views: list[torch.Tensor], tensors: list[torch.Tensor], visits: int = 1):
        for v, t in zip(views, tensors):
            v.copy_(t)
        return None

    def device_empty(self, like: list[tuple[torch.Size, torch.dtype]]):
        return [torch.empty(shape, dtype=dtype) for shape, dtype in like], None

    def to_device(self, views: list[torch.Tensor], after, into=None):
        out = (into or self.device_empty([(v.shape, v.dtype) for v in views]))[0]
        for o, v in zip(out, views):
            o.copy_(v)
        return out, None

    def consume(self, tensors: list[torch.Tensor], ready) -> None:
        pass

    def copy_on_device(self, dst: torch.Tensor, src: torch.Tensor, after: list):
        dst.copy_(src)
        return None

    def release_copied(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CudaCopier:
    cuda = True

    def __init__(self, device: torch.device, profiler: StepProfiler | NullProfiler, staging_elems: int = 0):
        self.device, self.profiler = device, profiler
        self.compute = torch.cuda.current_stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self._ticket = torch.zeros((), dtype=torch.int64, device=device)
        # "staged" units cross PCIe as their (pinned) master and are cast on the GPU, piece by piece through
        # one staging buffer: in stream order on the h2d stream, so no CPU work and no host buffer
        self._staging = torch.empty(staging_elems, dtype=torch.float32, device=device) if staging_elems else None
        self._visit = (None, None)
        self._ended = 0  # visits ended so far (``end_visit``)
        self._copied: deque[tuple[int, object, list[torch.Tensor]]] = deque()  # (due visit, copy's event, tensors)

    @property
    def gpu_bytes(self) -> int:
        return 0 if self._staging is None else self._staging.numel() * 4

    def load(self, dst: torch.Tensor, src: torch.Tensor, staged: bool, used, after=None):
        """Enqueue ``src`` -> ``dst`` on the h2d stream behind ``used`` (the slot's last reader) and ``after``
        (a copy that writes ``src``); returns ``loaded``. Runs on the loader thread."""
        with torch.cuda.stream(self.h2d):
            for e in (used, after):
                if e is not None:
                    self.h2d.wait_event(e)
            start = self.profiler.mark(self.h2d)
            if staged:
                self._copy_staged(src, dst)
            else:
                dst.copy_(src, non_blocking=True)
            loaded = self.h2d.record_event()
            self.profiler.copy("h2d", start, self.profiler.mark(self.h2d))
        return loaded

    def _copy_staged(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        buf = self._staging
        for start in range(0, src.numel(), buf.numel()):
            m = min(buf.numel(), src.numel() - start)
            buf[:m].copy_(src[start: start + m], non_blocking=True)
            dst[start: start + m].copy_(buf[:m])  # the cast, a kernel on the h2d stream behind the copy

    def begin_visit(self, loaded) -> None:
        """The compute stream waits for the slot's weights."""
        start = self.profiler.mark(self.compute)
        if loaded is not None:
            self.compute.wait_event(loaded)
        self._visit = (start, self.profiler.mark(self.compute))

    def end_visit(self, unit: int):
        """The slot's ``used`` event: its next load waits for it. Tensors copied to the host that are due go
        back to the pool behind it (``to_host``)."""
        used = self.compute.record_event()
        self.profiler.visit(unit, *self._visit, self.profiler.mark(self.compute))
        self._ended += 1
        while self._copied and self._copied[0][0] <= self._ended:
            self._let_go(self._copied.popleft())
        return used

    def _let_go(self, entry) -> None:
        """The compute stream waits for the copy; the tensors' blocks are then the compute stream's to reuse,
        in stream order (nothing enqueued before this point reads them after their copy)."""
        _, copied, tensors = entry
        self.compute.wait_event(copied)
        tensors.clear()

    def release_copied(self) -> None:
        """Every tensor still held for its copy to the host goes back to the pool now, in stream order (the
        memory is needed before the visits that would let it go: a plan without room for it)."""
        while self._copied:
            self._let_go(self._copied.popleft())

    def read_done(self):
        """An event after the compute stream's work so far: a slot another visit read (a tied head, the
        embedding's matrix) is ``used`` until then."""
        return self.compute.record_event()

    def wait(self, event) -> None:
        """The compute stream waits for ``event`` (a slot's gradients sent before it writes them again)."""
        if event is not None:
            self.compute.wait_event(event)

    def send(self, dst: torch.Tensor, src: torch.Tensor, flags: torch.Tensor, ticket: int, chunk: int):
        """Copy ``src`` (the slot's gradients) to ``dst`` in chunks on the d2h stream, after the compute
        stream's work so far, each chunk's flag set to ``ticket`` behind it; returns ``grads_sent``."""
        done = self.compute.record_event()
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(done)
            start = self.profiler.mark(self.d2h)
            self._ticket.fill_(ticket)  # a kernel on this stream: ordered before the flag copies below
            for k, a in enumerate(range(0, src.numel(), chunk)):
                dst[a: a + chunk].copy_(src[a: a + chunk], non_blocking=True)
                flags[k].copy_(self._ticket, non_blocking=True)
            sent = self.d2h.record_event()
            self.profiler.copy("d2h", start, self.profiler.mark(self.d2h))
        return sent

    def to_host(self, views: list[torch.Tensor], tensors: list[torch.Tensor], visits: int = 1):
        """Offload ``tensors`` (layer inputs; allocated on the compute stream, whose order alone frees them
        safely) into pinned ``views`` on the d2h stream after the compute stream's work so far; returns the
        event the copies record. The copier holds ``tensors`` until ``visits`` more visits have ended (the
        module docstring says why): enough for the copy to be done by then, so the compute stream's wait for
        it costs nothing, and no more (their memory is held). It lets them go in the order of the copies,
        never before what was copied earlier: the d2h stream finishes them in that order, so a later one's
        wait would be as long (the planner counts what waits behind a long copy: plan.memory
        ``back_visits``)."""
        produced = self.compute.record_event()
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(produced)
            for v, t in zip(views, tensors):
                v.copy_(t, non_blocking=True)
            copied = self.d2h.record_event()
        self._copied.append((self._ended + visits + 1, copied, list(tensors)))
        return copied

    def device_empty(self, like: list[tuple[torch.Size, torch.dtype]]):
        """GPU tensors of these shapes and dtypes for ``to_device`` to fill, and the event it waits for first.

        They come from the compute stream's pool, where the rest of a step's tensors are: the caching
        allocator reuses a free block only for its own stream, so under a GPU cap a pool of the h2d
        stream's would hold memory that the compute stream could take back only by emptying the cache (an
        allocation retry, which waits for the device). A block of the compute stream's pool may still be
        read by compute work already enqueued: the event is recorded after that work. (Taken ahead of the
        copy, as the NVMe path's reads do, the copy then waits for less.)"""
        with torch.cuda.stream(self.compute):
            out = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in like]
        return out, self.compute.record_event()

    def to_device(self, views: list[torch.Tensor], after, into=None):
        """GPU tensors filled from ``views`` on the h2d stream, behind ``after``; and their event. ``into``:
        ``device_empty``'s tensors and event, else new ones. The copies are recorded on the h2d stream, so
        that a block goes back to the compute stream's pool only after them."""
        out, free = into or self.device_empty([(v.shape, v.dtype) for v in views])
        with torch.cuda.stream(self.h2d):
            self.h2d.wait_event(free)
            if after is not None:
                self.h2d.wait_event(after)
            for o, v in zip(out, views):
                o.copy_(v, non_blocking=True)
                o.record_stream(self.h2d)
            return out, self.h2d.record_event()

    def consume(self, tensors: list[torch.Tensor], ready) -> None:
        """The compute stream waits for ``ready`` before it reads ``tensors`` (from ``to_device``: its own
        pool's, so nothing more to record)."""
        if ready is not None:
            self.compute.wait_event(ready)

    def copy_on_device(self, dst: torch.Tensor, src: torch.Tensor, after: list):
        """``src`` (a GPU tensor, cast to ``dst``'s dtype) -> ``dst`` on the h2d stream behind the events
        ``after``; returns the copy's event (a load's ``loaded``)."""
        with torch.cuda.stream(self.h2d):
            for e in after:
                if e is not None:
                    self.h2d.wait_event(e)
            dst.copy_(src)
            src.record_stream(self.h2d)
            return self.h2d.record_event()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
        self._copied.clear()  # (every copy is done)


def on_device(target, device, failure):
    """``target`` for a thread of its own, run on ``device`` (the creating thread's GPU where it has no index).
    CUDA's current device is per thread and a new thread starts on GPU 0: a rank on GPU 1 whose worker
    thread records, waits on or leaves a stream would otherwise open a context on GPU 0 (as torch's
    DataLoader does for its pinning thread). What escapes ``target`` is recorded in ``failure`` (engine/disk.py
    Failure) before the thread ends: the main thread, waiting on a flag this thread would have set, stops at
    it instead of waiting for good."""
    device = torch.device(device)
    index = None if device.type != "cuda" else device.index if device.index is not None else \
        torch.cuda.current_device()

    def run(*args, **kwargs):
        if index is not None:
            torch.cuda.set_device(index)
        try:
            return target(*args, **kwargs)
        except BaseException as e:
            failure.record(e)
            raise
    return run


def copier_for(device: torch.device, profiler, staging_elems: int) -> CpuCopier | CudaCopier:
    if device.type == "cuda":
        return CudaCopier(device, profiler, staging_elems)
    return CpuCopier(device, profiler)
