"""Layer inputs saved by the forward for the recompute in backward: kept on the GPU or offloaded.

Offloaded inputs go device-to-host on the runtime's d2h stream as soon as the layer that produced them
is enqueued, into one pinned host arena that is registered once and grown only when a step has more
tokens than any before it. In backward each offloaded input comes back on the h2d stream one layer
ahead of its use. Which layers stay on the GPU is the caller's decision (the last ones, which backward
needs first, are the natural choice). On the CPU the copies are plain copies, so offload is exact.

With ``nvme_dir`` the offloaded inputs go on to a file instead (host/nvme.py ``NvmeScratch``): each
layer's inputs land in one of a few pinned staging buffers, the runtime's disk writer thread writes
them out and frees the buffer; in backward its disk reader thread reads a layer back into a staging
buffer one layer ahead, and the h2d copy follows when the layer is taken. RAM holds the staging
buffers only, at the disk's speed (about 1 GB/s written and read again per step).

Hand-offs: the d2h copy waits for an event recorded after the producing compute; the copier holds the
GPU tensor until the visit after next, when the compute stream waits for the copy and lets it go
(engine/copier.py ``to_host``), so its block is reused in stream order. The restored
tensor is allocated one layer ahead from the compute stream's pool (engine/copier.py ``device_empty``
says why); the h2d copy waits for the compute stream's work enqueued by then (which may still read that
block) and for the d2h copy's event (it reads the same host bytes), and is recorded on the h2d stream;
compute waits for the h2d event. On NVMe the tensor is allocated when the read is asked (one layer
ahead), the copy follows the read, and a staging buffer is reused only after the disk write that reads
it, or the h2d copy that reads it, has finished.
"""
from __future__ import annotations

import math
import threading

import torch

from ..host import pinned
from ..host.nvme import ALIGN, NvmeScratch, aligned_empty

STAGING_BUFFERS = 3  # NVMe: one being written, one being read back, one being copied to the GPU


class ActivationStore:
    def __init__(self, runtime, num_layers: int, offload_layers: set[int], nvme_dir=None):
        self.rt = runtime
        self.num_layers = num_layers
        self.offload_layers = set(offload_layers)
        self._arena: torch.Tensor | None = None
        self._registered = False
        self._gpu: dict[int, list[torch.Tensor]] = {}
        self._host: dict[int, tuple[list[torch.Tensor], object]] = {}  # layer -> (host views, d2h event)
        self._fetched: dict[int, tuple[list[torch.Tensor], object]] = {}  # layer -> (device tensors, h2d event)
        self._cursor = 0
        # NVMe: staging buffers (free ones, each with the event of the last copy reading it) and the file
        self.scratch = NvmeScratch(nvme_dir, "activations") if nvme_dir is not None else None
        self._staging: list[torch.Tensor] = []
        self._free: list[tuple[torch.Tensor, object]] = []
        self._free_cv = threading.Condition()
        self._record: dict[int, int] = {}
        self._disk: dict[int, tuple[list, threading.Event]] = {}  # layer -> (shapes, written)
        # layer -> (shapes, ready, {"buf"}, the GPU tensors and their event: copier.device_empty)
        self._reading: dict[int, tuple[list, threading.Event, dict, tuple]] = {}

    @property
    def host_bytes(self) -> int:
        tensors = self._staging if self.scratch is not None else [t for t in [self._arena] if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def disk_bytes(self) -> int:
        return 0 if self.scratch is None else self.scratch.disk_bytes

    def begin_step(self, tokens_per_layer: int, hidden: int, dtype: torch.dtype, mid_layers: int = 0) -> None:
        """Make sure the arena (or the file and staging buffers) hold every offloaded layer's inputs, and
        ``mid_layers`` more layers' worth (the engine's layers that save a second tensor a micro-batch: not
        on the disk, whose records hold one layer's inputs each)."""
        assert not (mid_layers and self.scratch is not None)
        per_layer = tokens_per_layer * hidden
        self._cursor = 0
        if self.scratch is not None:
            if not self.offload_layers:
                return
            self._record = {layer: i for i, layer in enumerate(sorted(self.offload_layers))}
            self.scratch.reserve(len(self._record), per_layer * dtype.itemsize)
            if not self._staging or self._staging[0].numel() < per_layer or self._staging[0].dtype != dtype:
                for _ in self._staging:
                    self._take_staging()  # every buffer back, and no copy still reading it
                self._drop_host()
                self._staging = [aligned_empty(per_layer, dtype) for _ in range(STAGING_BUFFERS)]
                for buf in self._staging:
                    if self.rt.copier.cuda:
                        pinned.pin(buf, "activation staging", "lower the batch or keep more activations on the GPU")
                self._registered = self.rt.copier.cuda
                self._free = [(buf, None) for buf in self._staging]
            return
        need = (len(self.offload_layers) + mid_layers) * per_layer
        if need == 0 or (self._arena is not None and self._arena.numel() >= need and self._arena.dtype == dtype):
            return
        self._drop_host()
        self._arena = torch.empty(need, dtype=dtype)
        if self.rt.copier.cuda:
            pinned.pin(self._arena, "offloaded activations", "lower the batch or keep more activations on the GPU")
            self._registered = True

    def save(self, layer: int, tensors: list[torch.Tensor]) -> None:
        if layer not in self.offload_layers:
            self._gpu[layer] = tensors
            return
        if self.scratch is not None:
            buf = self._take_staging()
            views, copied = self._to_host(buf, 0, tensors)
            written = threading.Event()
            self._disk[layer] = ([t.shape for t in tensors], written)
            record, n = self._record[layer], sum(t.numel() for t in tensors)

            def write():
                try:
                    if copied is not None:
                        copied.synchronize()
                    if self.rt._error is None:
                        self.scratch.write(record, _whole_blocks(buf, n))
                except BaseException as e:
                    self.rt._fail(e)  # before the flag: the read it wakes sees the error
                finally:
                    written.set()
                    self._release(buf)

            self.rt.submit_write(write)
            return
        views, copied = self._to_host(self._arena, self._cursor, tensors)
        self._cursor += sum(t.numel() for t in tensors)
        self._host[layer] = (views, copied)

    def _to_host(self, dst: torch.Tensor, start: int, tensors: list[torch.Tensor]):
        """Views of ``dst`` from ``start``, one per tensor, and the copies into them (event, or None: done)."""
        views = []
        for t in tensors:
            views.append(dst[start: start + t.numel()].view(t.shape))
            start += t.numel()
        return views, self.rt.copier.to_host(views, tensors)

    def prefetch(self, layer: int) -> None:
        """Start bringing ``layer``'s inputs back (no-op if they are on the GPU or already coming)."""
        if self.scratch is not None:
            if layer >= 0 and layer in self._disk:
                shapes, written = self._disk.pop(layer)
                ready, holder = threading.Event(), {}
                record, n = self._record[layer], sum(math.prod(s) for s in shapes)

                def read():
                    try:
                        holder["buf"] = buf = self._take_staging()
                        if self.rt.wait_flag(written) and self.rt._error is None:
                            self.scratch.read(record, _whole_blocks(buf, n))
                    except BaseException as e:
                        self.rt._fail(e)  # before the flag: take() sees the error
                    finally:
                        ready.set()

                # (the GPU tensors now, one layer ahead: their copy then waits only for compute enqueued so far)
                into = self.rt.copier.device_empty([(shape, self._staging[0].dtype) for shape in shapes])
                self._reading[layer] = (shapes, ready, holder, into)
                self.rt.submit_read(read)
            return
        if layer < 0 or layer not in self._host or layer in self._fetched:
            return
        views, saved = self._host.pop(layer)
        self._fetched[layer] = self.rt.copier.to_device(views, saved)

    def take(self, layer: int) -> list[torch.Tensor]:
        if layer in self._gpu:
            return self._gpu.pop(layer)
        self.prefetch(layer)  # not prefetched ahead (first offloaded layer, or depth 0): fetch now
        if self.scratch is not None:
            shapes, ready, holder, into = self._reading.pop(layer)
            self.rt.wait_flag(ready)
            if "buf" in holder and self.rt._error is not None:
                self._release(holder["buf"])
            self.rt._raise_worker_error()
            buf, start, views = holder["buf"], 0, []
            for s in shapes:
                views.append(buf[start: start + math.prod(s)].view(s))
                start += math.prod(s)
            out, ready_ev = self.rt.copier.to_device(views, None, into)
            self._release(buf, ready_ev)
        else:
            out, ready_ev = self._fetched.pop(layer)
        self.rt.copier.consume(out, ready_ev)
        return out

    # -- NVMe staging buffers -------------------------------------------------------------------------
    def _take_staging(self) -> torch.Tensor:
        with self._free_cv:
            while not self._free:
                if self.rt._error is not None:
                    raise RuntimeError("activation staging: another thread failed") from self.rt._error
                self._free_cv.wait(0.05)
            buf, last_reader = self._free.pop()
        if last_reader is not None:
            last_reader.synchronize()
        return buf

    def _release(self, buf: torch.Tensor, last_reader=None) -> None:
        with self._free_cv:
            self._free.append((buf, last_reader))
            self._free_cv.notify_all()

    def _drop_host(self) -> None:
        """Unpin and drop the arena or the staging buffers (no copy may still be using them)."""
        if self._registered:
            for t in self._staging if self.scratch is not None else [self._arena]:
                pinned.unpin(t)
        self._registered = False
        self._arena, self._staging, self._free = None, [], []

    def close(self) -> None:
        """After the runtime's threads have stopped: pinned memory back, the file removed."""
        self._drop_host()
        if self.scratch is not None:
            self.scratch.close()


def _whole_blocks(buf: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` elements of a staging buffer, extended to whole 4096-byte blocks (O_DIRECT)."""
    per_block = ALIGN // buf.element_size()
    return buf[: -(-n // per_block) * per_block]
