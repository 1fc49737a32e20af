"""Layer inputs saved by the forward for the recompute in backward: kept on the GPU or offloaded.

Offloaded inputs go device-to-host on the runtime's d2h stream as soon as the layer that produced them
is enqueued, into one pinned host arena that is registered once and grown only when a step has more
tokens than any before it. In backward each offloaded input comes back on the h2d stream one layer
ahead of its use. Which layers stay on the GPU is the caller's decision (the last ones, which backward
needs first, are the natural choice). On the CPU the copies are plain copies, so offload is exact.

Hand-offs: the d2h copy waits for an event recorded after the producing compute; the GPU tensor is
marked used by the d2h stream (record_stream) so the allocator cannot reuse it early. The h2d copy
waits for the d2h copy's event (it reads the same host bytes); compute waits for the h2d event, and
the restored tensor is marked used by the compute stream.
"""
from __future__ import annotations

import torch

from ..host import pinned


class ActivationStore:
    def __init__(self, runtime, num_layers: int, offload_layers: set[int]):
        self.rt = runtime
        self.num_layers = num_layers
        self.offload_layers = set(offload_layers)
        self._arena: torch.Tensor | None = None
        self._registered = False
        self._gpu: dict[int, list[torch.Tensor]] = {}
        self._host: dict[int, tuple[list[torch.Tensor], object]] = {}  # layer -> (host views, d2h event)
        self._fetched: dict[int, tuple[list[torch.Tensor], object]] = {}  # layer -> (device tensors, h2d event)
        self._cursor = 0

    @property
    def host_bytes(self) -> int:
        return 0 if self._arena is None else self._arena.numel() * self._arena.element_size()

    def begin_step(self, tokens_per_layer: int, hidden: int, dtype: torch.dtype) -> None:
        """Make sure the arena holds every offloaded layer's inputs for this step."""
        need = len(self.offload_layers) * tokens_per_layer * hidden
        self._cursor = 0
        if need == 0 or (self._arena is not None and self._arena.numel() >= need and self._arena.dtype == dtype):
            return
        self.close()
        self._arena = torch.empty(need, dtype=dtype)
        if self.rt.cuda:
            pinned.pin(self._arena, "offloaded activations", "lower the batch or keep more activations on the GPU")
            self._registered = True

    def save(self, layer: int, tensors: list[torch.Tensor]) -> None:
        if layer not in self.offload_layers:
            self._gpu[layer] = tensors
            return
        views = []
        for t in tensors:
            n = t.numel()
            views.append(self._arena[self._cursor: self._cursor + n].view(t.shape))
            self._cursor += n
        if not self.rt.cuda:
            for v, t in zip(views, tensors):
                v.copy_(t)
            self._host[layer] = (views, None)
            return
        produced = self.rt.compute.record_event()
        with torch.cuda.stream(self.rt.d2h):
            self.rt.d2h.wait_event(produced)
            for v, t in zip(views, tensors):
                v.copy_(t, non_blocking=True)
                t.record_stream(self.rt.d2h)
            self._host[layer] = (views, self.rt.d2h.record_event())

    def prefetch(self, layer: int) -> None:
        """Start bringing ``layer``'s inputs back (no-op if they are on the GPU or already coming)."""
        if layer < 0 or layer not in self._host or layer in self._fetched:
            return
        views, saved = self._host.pop(layer)
        if not self.rt.cuda:
            self._fetched[layer] = ([v.clone() for v in views], None)
            return
        with torch.cuda.stream(self.rt.h2d):
            self.rt.h2d.wait_event(saved)
            out = [torch.empty(v.shape, dtype=v.dtype, device=self.rt.device) for v in views]
            for o, v in zip(out, views):
                o.copy_(v, non_blocking=True)
            self._fetched[layer] = (out, self.rt.h2d.record_event())

    def take(self, layer: int) -> list[torch.Tensor]:
        if layer in self._gpu:
            return self._gpu.pop(layer)
        self.prefetch(layer)  # not prefetched ahead (first offloaded layer, or depth 0): fetch now
        out, ready = self._fetched.pop(layer)
        if ready is not None:
            self.rt.compute.wait_event(ready)
            for o in out:
                o.record_stream(self.rt.compute)
        return out

    def close(self) -> None:
        if self._registered and self._arena is not None:
            pinned.unpin(self._arena)
        self._registered = False
        self._arena = None
