"""A slot of the GPU window: flat parameter and gradient buffers for one unit at a time.

Slots are allocated once and reused for the life of the engine, so GPU memory for weights and
gradients is fixed after construction. The events that make reuse safe are set by the Runtime,
which owns the streams; a slot only carries them.
"""
from __future__ import annotations

import torch
from torch import nn

from ..model.adapter import UnitSpec


class Slot:
    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.params = torch.zeros(numel, dtype=dtype, device=device)
        self.grads = torch.zeros(numel, dtype=dtype, device=device)
        self.unit: int | None = None
        # Set by Runtime (CUDA only; None means nothing to wait for):
        self.loaded = None  # h2d stream: weights landed
        self.used = None  # compute stream: the last compute that read the weights is done
        self.grads_sent = None  # d2h stream: the last gradient copy out of ``grads`` is done
        self.issued = None  # threading.Event: the loader has enqueued this slot's pending copy
        self.shared_by = None  # data parallel: the rank whose copy of the pending load every rank takes
        self._views: dict[tuple, tuple[dict[str, nn.Parameter], list[torch.Tensor]]] = {}

    def views(self, unit: UnitSpec) -> tuple[dict[str, nn.Parameter], list[torch.Tensor]]:
        """Parameters (for binding into a module) and gradient views laid out as ``unit``.

        Cached by layout: all decoder layers share one, so a layer slot builds its views once.
        """
        key = tuple((p.local, p.shape, p.offset) for p in unit.params)
        if key not in self._views:
            params = {p.local: nn.Parameter(self.params[p.offset: p.offset + p.numel].view(p.shape))
                      for p in unit.params}
            grads = [self.grads[p.offset: p.offset + p.numel].view(p.shape) for p in unit.params]
            self._views[key] = (params, grads)
        return self._views[key]

    @property
    def nbytes(self) -> int:
        return 2 * self.params.numel() * self.params.element_size()
