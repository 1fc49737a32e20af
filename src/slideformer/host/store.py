"""HostStore: the one owner of every unit's host-side training state.

Per unit, flat 1-D tensors laid out as in ``UnitSpec``:
- ``master``   fp32 weights, the source of truth;
- ``exp_avg``, ``exp_avg_sq``  Adam moments in the state format's layout (optim/formats.py: fp32, bf16, or
  8-bit codes followed by their block scales in one byte buffer);
- ``weights``  the compute-dtype copy the GPU window reads (pinned under CUDA). With fp32 compute it
  *is* the master. ``staged_units`` have none (``weights[u] is None``): their master (pinned, in an arena
  apart from the others') crosses PCIe and is cast on the GPU at copy time instead (2 bytes/param less
  RAM, twice the PCIe bytes);
- ``grad_buffers``  compute-dtype gradients arriving from the GPU (pinned under CUDA). The embedding
  and head units (when streamed) own one each; streamed decoder layers either own one each (needed when
  clipping, which holds every gradient until backward ends) or share a ring of ``host_grad_buffers``
  that the runtime hands out and the optimizer returns: 4 layer buffers instead of 32 save 12 GB for an
  8B model.

- ``spares``  extra copies of a decoder layer's optimizer state (``spare_states`` of them), into which
  the optimizer writes an update it may have to take back: under clipping it updates layers before the
  global norm is known (engine/runtime.py). ``adopt`` swaps a spare in as the unit's state, and the
  unit's old buffers become that spare, so no state is copied.

Units on the NVMe tier (host/nvme.py) have no moments here (``exp_avg[u] is None``), and with
``nvme_master`` no master either. With compact state the master's hi half is their compute copy, so it
lives on the tier too (``weights[u] is None``) and the window's loads read it from disk into one of two
pinned ``tier_weights`` buffers (engine/runtime.py); with fp32 state their bf16 copy stays in RAM, unless
they are staged (``host_weights``), when the loads read the fp32 master the same way and cast it on the
GPU. RAM then holds no byte a parameter for those units, only buffers.
Units trained on the GPU (``resident_units``: resident layers, resident embedding and head) have nothing here:
their state lives on the GPU only (engine/runtime.py owns it), and a host mirror would cost 14-16 bytes a
parameter for nothing (~77 of 108 GiB of RSS at Llama-8B b8 with 23 layers and the edges resident).
Units another rank owns (``foreign_units``, data parallel: parallel.py) have nothing here either.
Readers and writers of whole-unit state (checkpoints, loaders, export) go through ``unit_state``,
``set_unit_state``, ``set_master`` and ``unit_params``, which read or write the tier or the GPU (through
the owner ``attach_gpu`` names) as needed.

Every buffer is allocated and zeroed once here; nothing else allocates host training state, so
``bytes_by_category`` is the whole account.
"""
from __future__ import annotations

import functools

import torch

from ..model.adapter import UnitSpec
from ..optim import formats
from ..optim.formats import compact_master
from . import pinned
from .nvme import aligned_empty


def _some(units: list, which: list, dtype: torch.dtype, pin: bool, registered: list,
          size=lambda n: n) -> list[torch.Tensor | None]:
    """An arena for ``which`` of ``units``, as a list over all of them (None for the others); ``size`` maps a
    unit's parameter count to its buffer's elements."""
    it = iter(_arena(which, dtype, pin, registered, size))
    chosen = {u.index for u in which}
    return [next(it) if u.index in chosen else None for u in units]


def _arena(units: list, dtype: torch.dtype, pin: bool, registered: list, size=lambda n: n) -> list[torch.Tensor]:
    """One allocation per category (pinned in place when the GPU reads or writes it), split into per-unit views."""
    sizes = [size(u.numel) for u in units]
    total = sum(sizes)
    flat = torch.zeros(total, dtype=dtype)  # alignment padding must be zero: the optimizer updates it too
    if pin and total:
        pinned.pin(flat, "the host training state", "raise the locked-memory limit (ulimit -l), or need less pinned "
                   "memory: fewer host_grad_buffers, or host_weights='persistent' where it was staged")
        registered.append(flat)
    return list(flat.split(sizes))


class HostStore:
    def __init__(self, units: list[UnitSpec], compute_dtype: torch.dtype, pin: bool, staged_units: set[int] = frozenset(),
                 host_grad_buffers: int | None = None, nvme_dir=None, nvme_units: set[int] = frozenset(),
                 nvme_buffers: int = 4, state: str = "fp32", nvme_master: bool = False, spare_states: int = 0,
                 resident_units: set[int] = frozenset(), foreign_units: set[int] = frozenset(),
                 gpu_updated_units: set[int] = frozenset()):
        """``gpu_updated_units``: host units whose update runs on the GPU (engine/resident.py ``VisitingUpdate``):
        their master and moments are pinned, since they cross PCIe both ways every step."""
        self.units = units
        self.resident_units, self.nvme_units = frozenset(resident_units), frozenset(nvme_units)
        self.gpu_updated_units = frozenset(gpu_updated_units)  # (their state stays pinned: never a spare's)
        self.foreign_units = frozenset(foreign_units)
        self.gpu = None  # the GPU units' state owner (attach_gpu): copy_out(unit) and copy_in(unit, **fields)
        host = [u for u in units if u.index not in self.resident_units | self.foreign_units]
        self.compute_dtype = compute_dtype
        self.pin = pin
        self._registered: list[torch.Tensor] = []
        self.tier = None
        try:  # (what was pinned is unpinned, and the tier's files removed, if anything below fails)
            # Compact state (optimizer_state "compact" or "8bit"): the master is hi + lo, both bf16, and hi doubles
            # as the weights the GPU reads; moments are bf16, or 8-bit codes and block scales in one byte buffer
            # (optim/formats.py). 8 or 6.06 bytes per parameter instead of 12 (+2).
            self.state_format = state
            self.compact = compact = compact_master(state)
            master_dtype = torch.bfloat16 if compact else torch.float32
            self.master_dtype = master_dtype
            # Moments (and with nvme_master the master) in RAM for host units not on the NVMe tier; None elsewhere.
            in_ram = [u for u in host if u.index not in nvme_units]
            self.nvme_master = nvme_master and bool(nvme_units)
            # Pinned where the GPU reads it: as the weights (fp32 compute), or to cast them there (staged units,
            # whose masters get an arena of their own: the others' stay pageable).
            with_master = in_ram if self.nvme_master else host
            on_tier_master = [u for u in host if u.index in nvme_units] if self.nvme_master else []
            read = [u for u in with_master if compute_dtype == master_dtype or u.index in staged_units
                    or u.index in gpu_updated_units]
            pinned_part = _some(units, read, master_dtype, pin, self._registered)
            read_ix = {u.index for u in read}
            rest = _some(units, [u for u in with_master if u.index not in read_ix], master_dtype, False, self._registered)
            self.master = [a if a is not None else b for a, b in zip(pinned_part, rest)]
            pin_master = pin and bool(read)  # (a spare becomes some layer's master)
            self.master_lo = _some(units, with_master, torch.bfloat16, False, self._registered) if compact else None
            self.moment_dtype = moment_dtype = formats.moment_dtype(state)
            self.moment_numel = size = functools.partial(formats.moment_numel, state)
            crossing = [u for u in in_ram if u.index in gpu_updated_units]
            others = [u for u in in_ram if u.index not in gpu_updated_units]

            def moments():  # (pinned where they cross PCIe)
                return [a if a is not None else b for a, b in zip(
                    _some(units, crossing, moment_dtype, pin, self._registered, size),
                    _some(units, others, moment_dtype, False, self._registered, size))]
            self.exp_avg = moments()
            self.exp_avg_sq = moments()
            if nvme_units:
                from .nvme import NvmeTier

                fields = {"master": (master_dtype, None)} if self.nvme_master else {}
                if self.nvme_master and compact:
                    fields["master_lo"] = (torch.bfloat16, None)
                fields.update(exp_avg=(moment_dtype, size), exp_avg_sq=(moment_dtype, size))
                self.tier = NvmeTier(nvme_dir, {u: units[u].numel for u in sorted(nvme_units)}, nvme_buffers, fields)
            # Compact state's weights on the tier: two pinned buffers the window's loads read them into (one
            # filling while the other's copy to the GPU runs). The tier's own buffers are pinned too: a load
            # copies the weights straight from one that holds the unit's state, read ahead for its update.
            # fp32 state's staged tier layers have no bf16 copy either: their fp32 master is read the same way,
            # and cast on the GPU as a staged unit's is.
            self.tier_weights: list[torch.Tensor] = []
            read_from_tier = [u for u in on_tier_master if compact or u.index in staged_units]
            if read_from_tier:
                width = max(self.tier.field_bytes(u.index, "master") for u in read_from_tier)
                self.tier_weights = [aligned_empty(width, torch.uint8) for _ in range(2)]
                for t in self.tier_weights + self.tier.buffers if pin else []:
                    pinned.pin(t, "the NVMe tier's buffers", "raise the locked-memory limit (ulimit -l), or fewer "
                               "nvme_buffers")
                    self._registered.append(t)
            if compute_dtype == master_dtype and (compact or not self.nvme_master):
                self.weights: list[torch.Tensor | None] = self.master
                self.staged = frozenset()
            else:
                self.weights = _some(units, [u for u in host if u.index not in staged_units], compute_dtype, pin,
                                     self._registered)
                self.staged = frozenset(u.index for u in host if u.index in staged_units)  # cast at copy time
            # Gradient buffers for the units the CPU updates (a GPU unit's gradient stays in its slot).
            layers = [u for u in host if u.kind == "layer"]
            if host_grad_buffers is None or host_grad_buffers >= len(layers):
                shapes = host  # every unit owns its buffer
                own = {u.index: [i] for i, u in enumerate(host)}
                self.host_grad_buffers = len(layers)
            else:
                others = [u for u in host if u.kind != "layer"]
                shapes = others + [layers[0]] * host_grad_buffers
                ring = list(range(len(others), len(shapes)))
                own = {u.index: [i] for i, u in enumerate(others)} | {u.index: ring for u in layers}
                self.host_grad_buffers = host_grad_buffers
            self.grad_owner = [own.get(u.index, []) for u in units]
            self.grad_buffers = _arena(shapes, compute_dtype, pin, self._registered)
            # Spare states, for decoder layers in RAM (all of one size): the master half is pinned as the master
            # is, since a spare becomes a unit's master.
            # (at most one a layer this store updates: under several ranks, its own layers)
            spare_units = [layers[0]] * min(spare_states, len(layers)) if layers and len({u.numel for u in layers}) == 1 \
                else []
            fields = {"master": _arena(spare_units, master_dtype, pin_master, self._registered)}
            if compact:
                fields["master_lo"] = _arena(spare_units, torch.bfloat16, False, self._registered)
            fields["exp_avg"] = _arena(spare_units, moment_dtype, False, self._registered, size)
            fields["exp_avg_sq"] = _arena(spare_units, moment_dtype, False, self._registered, size)
            self.spares = [{k: v[i] for k, v in fields.items()} for i in range(len(spare_units))]
            self.step = 0  # optimizer steps applied
        except BaseException:
            self.close()
            raise

    # -- spare states (speculative updates) -----------------------------------------------------------
    def can_spare(self, unit: int) -> bool:
        """Whether the unit's state can be written to a spare: a decoder layer in RAM."""
        u = self.units[unit]
        return bool(self.spares) and u.kind == "layer" and not self.on_tier(unit) and not self.is_resident(unit) \
            and u.numel == self.spares[0]["master"].numel() and unit not in self.gpu_updated_units

    def state_fields(self, unit: int) -> dict[str, torch.Tensor]:
        """The unit's optimizer state in RAM (the buffers an update reads and writes), by spare field name."""
        out = {"master": self.master[unit]}
        if self.master_lo is not None:
            out["master_lo"] = self.master_lo[unit]
        out.update(exp_avg=self.exp_avg[unit], exp_avg_sq=self.exp_avg_sq[unit])
        return out

    def adopt(self, unit: int, spare: int) -> None:
        """Make spare ``spare`` the unit's state and the unit's old state that spare (a swap of buffers).
        With a shared master and compute copy (compact state, fp32 compute) the weights follow."""
        self.spares[spare], new = self.state_fields(unit), self.spares[spare]
        for field, t in new.items():  # (the field names are the state lists' names)
            getattr(self, field)[unit] = t

    # -- whole-unit state, wherever it lives (checkpoints, loaders, export; the pipeline must be idle) --
    def attach_gpu(self, owner) -> None:
        """Name the owner of the GPU units' state (the runtime): ``copy_out(unit, *names)`` gives host copies
        of it by this store's field names, ``copy_in(unit, **fields)`` writes any of them."""
        self.gpu = owner

    def on_tier(self, unit: int) -> bool:
        return unit in self.nvme_units

    def weights_on_tier(self, unit: int) -> bool:
        """Whether the window reads the unit's weights from the tier (compact state's master there)."""
        return self.weights[unit] is None and self.master[unit] is None and self.on_tier(unit)

    def is_resident(self, unit: int) -> bool:
        return unit in self.resident_units

    def owns(self, unit: int) -> bool:
        """Whether this process keeps the unit's state (not another rank's unit: parallel.py)."""
        return unit not in self.foreign_units

    def unit_layout(self, unit: int) -> dict[str, tuple[int, torch.dtype]]:
        """The names, sizes and dtypes of the unit's saved state."""
        n = self.units[unit].numel
        lay = {"master": (n, self.master_dtype)}
        if self.master_lo is not None:
            lay["master_lo"] = (n, torch.bfloat16)
        lay.update(exp_avg=(self.moment_numel(n), self.moment_dtype), exp_avg_sq=(self.moment_numel(n), self.moment_dtype))
        return lay

    def unit_state(self, unit: int) -> dict[str, torch.Tensor]:
        """master (+ master_lo), exp_avg, exp_avg_sq: views of RAM, or copies read from the tier or the GPU."""
        if self.is_resident(unit):
            return self.gpu.copy_out(unit)
        st = {"master": self.master[unit]}
        if self.master_lo is not None:
            st["master_lo"] = self.master_lo[unit]
        if self.on_tier(unit):
            st.update(self.tier.copy_out(unit))
        else:
            st.update(exp_avg=self.exp_avg[unit], exp_avg_sq=self.exp_avg_sq[unit])
        return st

    def set_unit_state(self, unit: int, st: dict[str, torch.Tensor]) -> None:
        """Restore what ``unit_state`` gave (a checkpoint), and the compute copy from it."""
        if self.is_resident(unit):
            return self.gpu.copy_in(unit, **st)
        on_tier = self.tier.fields if self.on_tier(unit) else {}
        for k in self.unit_layout(unit):
            if k not in on_tier:
                getattr(self, k)[unit].copy_(st[k])
        if on_tier:
            self.tier.copy_in(unit, **{k: st[k] for k in on_tier})
        self.refresh_weights(unit, st["master"])

    def set_master(self, unit: int, master: torch.Tensor) -> None:
        """Set a unit's whole master (initialisation, loading weights), and the compute copy from it."""
        if self.is_resident(unit):
            self.gpu.copy_in(unit, master=master)
        elif self.master[unit] is None:
            self.tier.copy_in(unit, master=master)
        else:
            self.master[unit].copy_(master)
        self.refresh_weights(unit, master)

    def unit_params(self, unit: int) -> dict[str, torch.Tensor]:
        """Each parameter's master value in fp32 (hi + lo for compact state), by checkpoint key."""
        if self.is_resident(unit):
            st = self.gpu.copy_out(unit, "master", "master_lo")
            hi, lo = st["master"], st.get("master_lo")
        else:
            st = self.tier.copy_out(unit, *[k for k in ("master", "master_lo") if k in self.tier.fields]) \
                if self.master[unit] is None else {}
            hi = st.get("master", self.master[unit])
            lo = None if self.master_lo is None else st.get("master_lo", self.master_lo[unit])
        out = {}
        for spec in self.units[unit].params:
            v = hi[spec.offset: spec.offset + spec.numel].view(spec.shape)
            if lo is not None:
                v = v.float() + lo[spec.offset: spec.offset + spec.numel].view(spec.shape).float()
            out[spec.key] = v
        return out

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
        for t in self._registered:
            pinned.unpin(t)
        self._registered.clear()

    def refresh_weights(self, unit: int, master: torch.Tensor | None = None) -> None:
        """Re-derive the compute copy of ``unit`` from its master (after load or update); ``master`` when
        the caller holds it (a master on the tier is not in ``self.master``)."""
        if self.weights is not self.master and self.weights[unit] is not None:
            self.weights[unit].copy_(self.master[unit] if master is None else master)

    def bytes_by_category(self) -> dict[str, int]:
        def total(ts):
            return sum(t.numel() * t.element_size() for t in ts) if ts is not None else 0

        own_weights = self.weights is not self.master
        ram = [t for t in self.exp_avg + self.exp_avg_sq if t is not None]
        return {
            "master": total([t for t in self.master if t is not None])
            + total([t for t in self.master_lo or [] if t is not None]),
            "spares": sum(total(list(sp.values())) for sp in self.spares),
            "moments": total(ram),
            "nvme_buffers": 0 if self.tier is None else sum(b.numel() for b in self.tier.buffers + self.tier_weights),
            "weights": total([t for t in self.weights if t is not None]) if own_weights else 0,
            "grads": total(self.grad_buffers),
        }
