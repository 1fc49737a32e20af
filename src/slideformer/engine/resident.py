"""The state of the units trained on the GPU (resident layers, and the embedding and head when resident):
fp32 master and moments, or for compact state the master's bf16 lo half and bf16 moments (its hi half is
the weights the unit's slot holds), or for 8-bit state that lo half and 8-bit moments (optim/formats.py).
It lives here only; the host store reads and writes it through ``copy_out`` and ``copy_in``.

Updates run on the compute stream right after a unit's gradient completes (``update``), so the next
kernel that reads the unit's slot (the next step's forward) runs after them in stream order; copies of
the state queue on the same stream, behind any pending update, whatever stream their caller is in."""
from __future__ import annotations

import contextlib

import torch

from ..kernels.compact_adamw import compact_adamw_
from ..optim import formats
from ..optim.adamw import Undecayed, adamw_8bit_, compact_seed
from ..window.slots import Slot

RESIDENT_PIECE = 32 * 2**20  # elements per fused AdamW call: the fp32 gradient it needs is that large, not the unit's


class ResidentState:
    def __init__(self, slots: dict[int, Slot], units: dict, state: str, cfg, compute_stream, profiler):
        """``units``: the UnitSpec of each resident unit (model/adapter.py), by index."""
        self.slots, self.cfg, self.format = slots, cfg, state
        numels = {u: spec.numel for u, spec in units.items()}
        self.compact = compact = formats.compact_master(state)
        self.compute, self.profiler = compute_stream, profiler  # (compute_stream None: on the CPU)
        self.device = cfg.device
        dtype = torch.bfloat16 if compact else torch.float32

        def zeros(u, s):  # master (compact: its lo half), exp_avg, exp_avg_sq
            n, mt = numels[u], formats.moment_dtype(state)
            return [torch.zeros(n, dtype=dtype, device=s.params.device)] + \
                [torch.zeros(formats.moment_numel(state, n), dtype=mt, device=s.params.device) for _ in range(2)]
        self.state = {u: zeros(u, s) for u, s in sorted(slots.items())}
        self.undecayed = {u: Undecayed(units[u].no_decay) for u in slots}
        # torch's fused AdamW takes the step as a device tensor: filled by a kernel, never copied from the host
        self._step = {} if compact else {u: torch.zeros((), dtype=torch.float32, device=s.params.device)
                                         for u, s in slots.items()}

    def __contains__(self, unit: int) -> bool:
        return unit in self.state

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.state.values() for t in ts)

    def _views(self, unit: int) -> dict[str, torch.Tensor]:
        """The unit's state by the store's field names."""
        master, m, v = self.state[unit]
        weights = self.slots[unit].params[: master.numel()]
        st = {"master": weights, "master_lo": master} if self.compact else {"master": master}
        return st | {"exp_avg": m, "exp_avg_sq": v}

    def _on_compute(self):
        return torch.cuda.stream(self.compute) if self.compute is not None else contextlib.nullcontext()

    def copy_out(self, unit: int, *names: str) -> dict[str, torch.Tensor]:
        """Host copies of the unit's state (``names`` of it, or all), after its pending update."""
        with self._on_compute():
            return {k: t.to("cpu", copy=True) for k, t in self._views(unit).items() if not names or k in names}

    def copy_in(self, unit: int, **fields: torch.Tensor) -> None:
        """Write any of the unit's state fields (initial weights, a checkpoint); the slot's weights follow
        the master."""
        views = self._views(unit)
        with self._on_compute():
            for name, t in fields.items():
                if name in views:
                    views[name].copy_(t)
            if "master" in fields and not self.compact:
                self.slots[unit].params[: views["master"].numel()].copy_(views["master"])

    def update(self, unit: int, step: int, lr: float, grad_coef: float) -> None:
        """AdamW for the unit from its slot's gradient, enqueued on the compute stream."""
        master, m, v = self.state[unit]
        slot = self.slots[unit]
        n, c = master.numel(), self.cfg
        start = self.profiler.mark(self.compute) if self.compute is not None else None
        undecayed = self.undecayed[unit]
        if self.compact:
            saved = undecayed.before(c.weight_decay, slot.params[:n], master)
        if self.format == "8bit":  # the CPU worker's arithmetic, by the PyTorch reference in pieces of whole blocks
            adamw_8bit_(slot.params[:n], master, slot.grads[:n], m, v, step=step, lr=lr, betas=c.betas, eps=c.eps,
                        weight_decay=c.weight_decay, grad_coef=grad_coef, backend="torch")
        elif self.compact:  # the CPU worker's arithmetic and rounding bits, one Triton pass on the device
            compact_adamw_(slot.params[:n], master, slot.grads[:n], m, v, step=step, lr=lr, betas=c.betas, eps=c.eps,
                           weight_decay=c.weight_decay, grad_coef=grad_coef, seed=compact_seed(c.seed, unit))
        else:
            fused_adamw_(master, m, v, slot, self._step[unit], step, lr, grad_coef, c, undecayed)
        if self.compact:
            undecayed.after(saved, lr, c.weight_decay, slot.params[:n], master)
        if self.compute is not None:  # GPU work between visits: not idle time
            self.profiler.copy("gpu_adamw", start, self.profiler.mark(self.compute))


def fused_adamw_(master, m, v, slot: Slot, step_t: torch.Tensor, step: int, lr: float, grad_coef: float, c,
                 undecayed: Undecayed) -> None:
    """fp32 AdamW from the slot's gradient (torch's fused kernel, in pieces: the fp32 gradient it needs is
    that large, not the unit's), then the slot's weights from the new master."""
    n = master.numel()
    saved = undecayed.before(c.weight_decay, master)
    step_t.fill_(float(step))
    for a in range(0, n, RESIDENT_PIECE):
        b = min(n, a + RESIDENT_PIECE)
        g = slot.grads[a:b].float()
        if grad_coef != 1.0:
            g.mul_(grad_coef)
        torch._fused_adamw_([master[a:b]], [g], [m[a:b]], [v[a:b]], [], [step_t], lr=lr, beta1=c.betas[0],
                            beta2=c.betas[1], weight_decay=c.weight_decay, eps=c.eps, amsgrad=False, maximize=False)
    undecayed.after(saved, lr, c.weight_decay, master)
    slot.params[:n].copy_(master)


class VisitingUpdate:
    """The first streamed decoder layer's update on the GPU (``Placement.gpu_first_update``).

    Its gradient completes last of the layers and the next forward needs its weights first, so a CPU
    update of it would stall the GPU at every step boundary. Instead its fp32 master and moments cross to
    the GPU while backward reaches it (``fetch``), the update runs on the compute stream as a resident
    unit's does (``update``), the next load of the unit copies the new weights from the GPU's master
    (``load``), and the state goes back to the host store once that forward has read them (``send_back``).
    The state crosses beside the step boundary, never through it: the fetch queues behind the unit's own
    restored input, and the copy back waits until the CPU's boundary jobs (the embedding's touched rows)
    are done, since 2.6 GB of DMA into host memory at the boundary would slow them (Llama-8B's layer).
    The host store stays the state's owner: whoever reads it (a checkpoint, the next fetch, a load from
    the host, a CPU update in a step that does not visit) sends a pending state back and waits for
    ``landed`` first (``synchronize``, or in stream order). The unit's ``updated`` flag is never cleared
    for this: no host thread takes part."""

    def __init__(self, spec, store, copier, cfg, profiler):
        """``spec``: the unit's UnitSpec (model/adapter.py)."""
        self.unit, self.store, self.copier, self.cfg, self.profiler = spec.index, store, copier, cfg, profiler
        self.undecayed = Undecayed(spec.no_decay)
        self._step = torch.zeros((), dtype=torch.float32, device=cfg.device)
        self._fetched = None  # ([master, exp_avg, exp_avg_sq] on the GPU, their copy's event)
        self._updated = None  # the same after an update, until send_back
        self._fresh = None  # the new master on the GPU and the update's event, until a load has read it
        self.landed = None  # the event after the last send_back's copies (None on the CPU: copies are done)
        self.updates = 0  # updates run on the GPU (tests check the path is taken)
        self.back_visits = 1  # forward visits the copy back takes (plan.memory ``back_visits``: the engine's, a step)

    def _host(self) -> list[torch.Tensor]:
        st = self.store.state_fields(self.unit)
        return [st["master"], st["exp_avg"], st["exp_avg_sq"]]

    def fetch(self) -> None:
        """The state to the GPU on the h2d stream, behind the last send_back."""
        self.send_back()
        self._fetched = self.copier.to_device(self._host(), self.landed)

    def update(self, slot: Slot, step: int, lr: float, grad_coef: float) -> None:
        """AdamW from the slot's gradient into the fetched state and the slot's weights, on the compute stream."""
        (master, m, v), ready = self._fetched
        self._fetched = None
        cuda = self.copier.compute is not None
        start = self.profiler.mark(self.copier.compute) if cuda else None
        self.copier.consume([master, m, v], ready)
        fused_adamw_(master, m, v, slot, self._step, step, lr, grad_coef, self.cfg, self.undecayed)
        done = self.copier.read_done()
        slot.used = done  # (the update wrote the slot after its visit ended)
        self._updated, self._fresh = [master, m, v], (master, done)
        self.updates += 1
        if cuda:  # GPU work between visits: not idle time
            self.profiler.copy("gpu_adamw", start, self.profiler.mark(self.copier.compute))

    def end_step(self) -> None:
        """After a step: a state fetched for a step that was dropped is let go (the updated one stays until
        ``send_back``)."""
        self._fetched = None

    def send_back(self, visits: int = 0) -> None:
        """The updated state to the host store on the d2h stream, behind the compute enqueued so far; its GPU
        memory goes back to the pool ``visits`` visits after the next (copier ``to_host``): in the forward,
        after the copy's time (``back_visits``), elsewhere at the next visit's end. (The unit is
        staged: no host copy of its weights to refresh.)"""
        if self._updated is not None:
            self.landed = self.copier.to_host(self._host(), self._updated, visits)
            self._updated = None

    @property
    def fresh(self) -> bool:
        return self._fresh is not None

    def load(self, dst: torch.Tensor, used):
        """The unit's next load, from the GPU's master (cast to the slot's dtype); returns ``loaded``."""
        master, done = self._fresh
        self._fresh = None
        return self.copier.copy_on_device(dst, master, [used, done])

    def release(self) -> None:
        """Nothing of the unit's stays on the GPU: the state goes back, and the next load is from the host
        (a plan without room for it; after a checkpoint is loaded, whose state the host store then holds)."""
        self.send_back()
        self._fresh = None
        self.copier.release_copied()

    def synchronize(self) -> None:
        self.send_back()
        if self.landed is not None:
            self.landed.synchronize()
