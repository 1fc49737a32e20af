"""HostStore: the one owner of every unit's host-side training state.

Per unit, flat 1-D tensors laid out as in ``UnitSpec``:
- ``master``   fp32 weights, the source of truth;
- ``exp_avg``, ``exp_avg_sq``  fp32 Adam moments;
- ``weights``  the compute-dtype copy the GPU window reads ("persistent" mode; pinned under CUDA).
  With fp32 compute it *is* the master. In "staged" mode it is absent and the window casts the
  master through shared pinned staging at copy time instead (2 bytes/param less RAM, more CPU work);
- ``grad_buffers``  compute-dtype gradients arriving from the GPU (pinned under CUDA). The embedding
  and head units own one each; decoder layers either own one each (needed when clipping, which holds
  every gradient until backward ends) or share a ring of ``layer_grad_buffers`` that the runtime hands
  out and the optimizer returns: 4 layer buffers instead of 32 save 12 GB for an 8B model.

Every buffer is allocated and zeroed once here; nothing else allocates host training state, so
``bytes_by_category`` is the whole account.
"""
from __future__ import annotations

import torch

from ..model.adapter import UnitSpec
from . import pinned


def _arena(units: list, dtype: torch.dtype, pin: bool, registered: list) -> list[torch.Tensor]:
    """One allocation per category (pinned in place when the GPU reads or writes it), split into per-unit views."""
    total = sum(u.numel for u in units)
    flat = torch.zeros(total, dtype=dtype)  # alignment padding must be zero: the optimizer updates it too
    if pin and total:
        pinned.pin(flat, "the host training state", "use host_weights='staged' or host_grad_buffers to need less")
        registered.append(flat)
    return list(flat.split([u.numel for u in units]))


class HostStore:
    def __init__(self, units: list[UnitSpec], compute_dtype: torch.dtype, pin: bool, host_weights: str = "persistent",
                 layer_grad_buffers: int | None = None, nvme_dir=None, nvme_units: set[int] = frozenset(),
                 nvme_buffers: int = 4, compact: bool = False):
        self.units = units
        self.compute_dtype = compute_dtype
        self.pin = pin
        self.host_weights = host_weights
        self._registered: list[torch.Tensor] = []
        # Compact state (optimizer_state="compact"): the master is hi + lo, both bf16, and hi doubles as the
        # weights the GPU reads; moments are bf16. 8 bytes per parameter instead of 12 (+2).
        self.compact = compact
        master_dtype = torch.bfloat16 if compact else torch.float32
        self.master = _arena(units, master_dtype, pin and compute_dtype == master_dtype, self._registered)
        self.master_lo = _arena(units, torch.bfloat16, False, self._registered) if compact else None
        moment_dtype = torch.bfloat16 if compact else torch.float32
        # Moments in RAM for units not on the NVMe tier (None for those that are: see host/nvme.py).
        in_ram = [u for u in units if u.index not in nvme_units]
        m = iter(_arena(in_ram, moment_dtype, False, self._registered))
        v = iter(_arena(in_ram, moment_dtype, False, self._registered))
        self.exp_avg = [None if u.index in nvme_units else next(m) for u in units]
        self.exp_avg_sq = [None if u.index in nvme_units else next(v) for u in units]
        self.tier = None
        if nvme_units:
            from .nvme import NvmeMoments

            self.tier = NvmeMoments(nvme_dir, {u: units[u].numel for u in sorted(nvme_units)}, nvme_buffers,
                                    moment_dtype)
        if compute_dtype == master_dtype:
            self.weights: list[torch.Tensor] | None = self.master
        elif host_weights == "persistent":
            self.weights = _arena(units, compute_dtype, pin, self._registered)
        else:
            self.weights = None
        layers = [u for u in units if u.kind == "layer"]
        if layer_grad_buffers is None or layer_grad_buffers >= len(layers):
            shapes = units  # every unit owns its buffer
            self.grad_owner = [[u.index] for u in units]
        else:
            others = [u for u in units if u.kind != "layer"]
            shapes = others + [layers[0]] * layer_grad_buffers
            ring = list(range(len(others), len(shapes)))
            self.grad_owner = [ring if u.kind == "layer" else [others.index(u)] for u in units]
        self.grad_buffers = _arena(shapes, compute_dtype, pin, self._registered)
        self.step = 0  # optimizer steps applied

    def moments(self, unit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A unit's (exp_avg, exp_avg_sq), read from the tier if it lives there (checkpoints only)."""
        if self.exp_avg[unit] is not None:
            return self.exp_avg[unit], self.exp_avg_sq[unit]
        return self.tier.copy_out(unit)

    def set_moments(self, unit: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        if self.exp_avg[unit] is not None:
            self.exp_avg[unit].copy_(exp_avg)
            self.exp_avg_sq[unit].copy_(exp_avg_sq)
        else:
            self.tier.copy_in(unit, exp_avg, exp_avg_sq)

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
        for t in self._registered:
            pinned.unpin(t)
        self._registered.clear()

    def view(self, unit: int, tensors: list[torch.Tensor], spec) -> torch.Tensor:
        return tensors[unit][spec.offset: spec.offset + spec.numel].view(spec.shape)

    def param(self, unit: int, spec) -> torch.Tensor:
        """One parameter's master value in fp32 (hi + lo for compact state)."""
        hi = self.view(unit, self.master, spec)
        return hi if self.master_lo is None else hi.float() + self.view(unit, self.master_lo, spec).float()

    def refresh_weights(self, unit: int) -> None:
        """Re-derive the compute copy of ``unit`` from its master (after load or update)."""
        if self.weights is not None and self.weights is not self.master:
            self.weights[unit].copy_(self.master[unit])

    def bytes_by_category(self) -> dict[str, int]:
        def total(ts):
            return sum(t.numel() * t.element_size() for t in ts) if ts is not None else 0

        own_weights = self.weights is not None and self.weights is not self.master
        ram = [t for t in self.exp_avg + self.exp_avg_sq if t is not None]
        return {
            "master": total(self.master) + total(self.master_lo),
            "moments": total(ram),
            "nvme_buffers": 0 if self.tier is None else sum(b.numel() for b in self.tier.buffers),
            "weights": total(self.weights) if own_weights else 0,
            "grads": total(self.grad_buffers),
        }
