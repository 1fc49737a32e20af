"""Runtime: the one owner of the window slots, the copier (streams and events, engine/copier.py) and the
worker threads, which it starts and stops: the loader here; the CPU optimizer in its ``Updates``
(engine/updates.py); the disk's reader and writer in its ``DiskIO`` (engine/disk.py); the resident
units' GPU state in its ``ResidentState`` (engine/resident.py).

Hand-offs, and what makes each safe:
- host weights -> slot (loader thread, h2d stream): the main thread queues a load request with the
  slot's current ``used`` event; the loader waits for the unit's ``updated`` flag (set by the
  optimizer after its AdamW step) so the copy reads fresh weights ("staged" mode: the fp32 master,
  cast on the GPU), and enqueues the copy behind ``used``, so it never overwrites weights a queued
  kernel still reads. It then records ``loaded`` and sets the request's ``issued`` flag.
- NVMe weights -> slot (compact state's master on the tier): the loader reads them, once the unit's last
  update is written (engine/disk.py ``read_weights``), into the next of two pinned buffers, which it reuses
  only after the copy that last read it has finished; or copies them from the buffer the disk reader
  filled for the unit's update, which nothing writes before that update, after this step's gradient.
- an embedding's rows -> slot (by rows, engine/embedding.py): the loader takes one of the embedding's
  host gradient buffers from the pool, gathers the step's rows into it and waits for their copy before
  giving it back. It asks only after the unit's ``updated`` flag, which its update sets after returning
  that buffer, and the next gradient into it is sent at the loss head (tied) or the end of backward. A
  tied matrix is then loaded whole over those rows, behind the embedding's forward (the slot's ``used``),
  and the head's compute waits for it (``wait_loaded``); the untouched rows' update, which writes the
  host weights that copy reads, writes only once the head's gradient lands, after the head's compute.
  A head that reads that slot (tied) marks it ``used`` behind it (``end_read``): in evaluation no visit
  of the embedding follows the head, and the next step's load writes the slot's first rows.
- slot -> compute: the main thread waits for ``issued`` (the copy is enqueued), then the compute
  stream waits for ``loaded``. Under data parallel (parallel.py) only the unit's owner loads it; at the
  visit every rank then takes the owner's copy by a broadcast issued behind that wait, in stream order.
- slot grads -> host grads (d2h stream): the d2h stream waits for an event recorded on the compute
  stream after the unit's last backward kernel; it records ``grads_sent``, which the compute stream
  waits for before writing that slot's gradients again.
- slot grads -> host buffer: the main thread takes a free host gradient buffer (waiting on a condition
  that the worker signals when it returns one after an update).
- host grads -> optimizer (worker thread): the gradient is copied in chunks (``grad_chunk_elems``); after
  each chunk the d2h stream writes the send's ticket into that chunk's flag in pinned memory
  (``optim.Landing``). The worker makes one kernel call per unit, which updates each chunk as soon as
  its flag shows, so the update overlaps the rest of the copy without the worker taking the GIL per
  chunk; it then sets the unit's ``updated`` flag. That a flag's arrival implies its chunk's bytes have
  landed rests on what CUDA events rest on too: copies on one stream run one after the other, and the
  copy engine finishes one before it starts the next.
  Among the jobs whose first chunk has landed it takes the lowest unit first (``schedule.next_update``):
  that is the order the next forward needs them in, so updates still running when backward ends overlap
  that forward.
- Speculative updates (clipping): exact clipping scales every gradient by a coefficient known only when
  backward ends. Rather than leave the CPU idle until then, the engine submits a decoder layer's update
  as soon as its gradient lands with the coefficient 1, written out of place into a spare copy of the
  state (``HostStore.spares``; ``Updates.reserve_spare`` in the main thread) and kept, with its gradient buffer,
  until the verdict (``Updates.resolve``, queued behind the step's jobs). If the norm is within
  the limit the coefficient is exactly 1: the spare becomes the unit's state (``HostStore.adopt``) and
  its ``updated`` flag is set; otherwise the spare is dropped and the update runs again, in place,
  from the untouched state with the real coefficient. Either way the result is the exact update's.
- NVMe state -> optimizer: the worker picks only units whose state is in a RAM buffer (``disk.ready``),
  takes it (``disk.take``), updates it in place and gives it back (``disk.give_back``: its write, then
  the buffer is free); engine/disk.py has the reads' order and flags. The same two disk threads carry
  offloaded activations to and from NVMe (engine/activations.py).
- Errors: the first failure in any thread is kept and raised in the main thread at its next wait;
  the other threads then skip their work but still release what they hold, so nothing hangs.

- The GIL: the worker and loader threads release it inside their kernels and copies, and need it back
  for a moment after each; the runtime shortens the interpreter's switch interval while it runs
  (``SWITCH_INTERVAL_S``), or the GPU-driving thread would keep them waiting up to 5 ms each time.

On the CPU (``device="cpu"``) the copier copies synchronously, sets the flags from the main thread and
returns no events, but the worker thread, the flags and the order of operations are the same, so CI
exercises this code.
"""
from __future__ import annotations

import queue
import sys
import threading

import torch

from .. import parallel
from ..config import EngineConfig
from ..host.store import HostStore
from ..model.adapter import ModelAdapter
from ..optim.adamw import Landing, Rows
from ..window.schedule import Visit
from ..window.slots import Slot
from .copier import copier_for, on_device
from .disk import DiskIO, Failure
from .profile import NullProfiler, StepProfiler
from .updates import SentGrads, Updates
from .resident import ResidentState, VisitingUpdate

ROWS_PIECE = 2048  # staged embedding rows gathered and cast this many at a time (32 MiB of fp32 at hidden 4096)
STAGING_ELEMS = 16 * 2**20  # "staged" host weights: the master crosses in 16M-element (64 MiB) pieces, cast on the GPU
# How long one thread may hold the GIL while another waits for it (Python's default is 5 ms). The worker
# and loader threads need it back after each kernel call and copy; at the default the GPU-driving thread
# would keep them waiting up to 5 ms each time.
SWITCH_INTERVAL_S = 2e-4


class _SwitchInterval:
    """The switch interval belongs to the process: the first open runtime shortens it, the last one to
    close puts back what it found."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0
        self._saved = sys.getswitchinterval()

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, SWITCH_INTERVAL_S))
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                sys.setswitchinterval(self._saved)


_SWITCH_INTERVAL = _SwitchInterval()


class Runtime:
    def __init__(self, adapter: ModelAdapter, store: HostStore, cfg: EngineConfig, plan: list[Visit],
                 owner: list[int] | None = None, gpu_updated: int | None = None):
        """``owner``: each unit's rank under data parallel (parallel.py), else None. ``gpu_updated``: a host
        unit whose update may run on the GPU (engine/resident.py ``VisitingUpdate``)."""
        self.adapter, self.store, self.cfg, self.owner = adapter, store, cfg, owner
        self.device = torch.device(cfg.device)
        cuda = self.device.type == "cuda"
        dt = cfg.compute_dtype
        # The plan says which slots exist: each group's slots are as large as its largest unit.
        resident = sorted({v.unit for v in plan if v.group == "resident"})
        sizes: dict[str, tuple[int, int]] = {}
        for v in plan:
            if v.group != "resident":
                k, numel = sizes.get(v.group, (0, 0))
                sizes[v.group] = (max(k, v.slot + 1), max(numel, adapter.units[v.unit].numel))
        self.slots = {g: [Slot(numel, dt, self.device) for _ in range(k)] for g, (k, numel) in sizes.items()}
        self.slots["resident"] = {u: Slot(adapter.units[u].numel, dt, self.device) for u in resident}
        self.profiler: StepProfiler | NullProfiler = StepProfiler(cuda, self.device) if cfg.tuning.profile \
            else NullProfiler()
        staged = [adapter.units[u].numel for u in store.staged]
        self.copier = copier_for(self.device, self.profiler, min(STAGING_ELEMS, max(staged, default=0)))
        # Resident units train on the GPU; their state is there only (engine/resident.py).
        self.resident = ResidentState(self.slots["resident"], {u: adapter.units[u] for u in resident},
                                      store.state_format, cfg, self.copier.compute, self.profiler)
        store.attach_gpu(self.resident)
        self.visiting = VisitingUpdate(adapter.units[gpu_updated], store, self.copier, cfg, self.profiler) \
            if gpu_updated is not None else None
        self.failure = Failure()  # the first failure in any thread (engine/disk.py)
        self.disk = DiskIO(store.tier, self.failure, self.device)  # (engine/disk.py)
        self.updates = Updates(adapter, store, cfg, self.disk, self.failure, self.profiler)
        # Each host gradient buffer has a row of landing flags, one per chunk; tickets number the sends.
        chunks = -(-max(u.numel for u in adapter.units) // cfg.tuning.grad_chunk_elems)
        self._landing_flags = torch.zeros(len(store.grad_buffers), chunks, dtype=torch.int64, pin_memory=cuda)
        self._abort = torch.zeros(1, dtype=torch.int64)
        self._tickets = 0
        self._tier_turn, self._tier_copied = 0, [None, None]  # (the loader's: see _load_from_tier)
        self._loads: queue.Queue[tuple | None] = queue.Queue()
        self._loader = threading.Thread(target=on_device(self._load_work, self.device, self.failure),
                                        name="slideformer-loader", daemon=True)
        self._loader.start()
        self._closed = False
        _SWITCH_INTERVAL.acquire()

    # -- hand-offs shared with engine/activations.py ----------------------------------------------------
    def submit_read(self, job) -> None:
        self.disk.submit_read(job)

    def submit_write(self, job) -> None:
        self.disk.submit_write(job)

    def wait_flag(self, done: threading.Event) -> bool:
        """Wait for another thread's ``done`` flag (a write, an update); False if a failure elsewhere
        means it may never come."""
        return self.failure.wait(done)

    @property
    def _error(self) -> BaseException | None:
        return self.failure.first

    def begin_step(self, update_order: list[int]) -> None:
        self.disk.begin_step(update_order)

    # -- weights into the window ------------------------------------------------------------------
    def load(self, unit: int, slot: Slot, rows: torch.Tensor | None = None) -> None:
        """Ask the loader thread to bring ``unit``'s weights into ``slot``; returns at once. ``rows``: only
        those rows of an embedding, packed (``_load_rows``). Under data parallel the owner's copy is
        broadcast to every rank at the visit (``begin_compute``), and another rank's unit is not loaded
        here."""
        slot.unit = unit
        slot.shared_by = None if self.owner is None else self.owner[unit]
        if not self.store.owns(unit):
            slot.issued = None
            return
        if self._visiting(unit) and self.visiting.fresh and rows is None:  # (its new weights are on the GPU)
            n = self.adapter.units[unit].numel
            slot.loaded, slot.issued = self.visiting.load(slot.params[:n], slot.used), None
            return
        slot.issued = threading.Event()
        # The slot's last reader is enqueued before this request (window.schedule guarantees it), so the
        # event captured now is the one the copy must wait for.
        self._loads.put((unit, slot, slot.used, slot.issued, rows))

    def _load_work(self) -> None:
        """Loader thread: waits for each unit's update and enqueues its h2d copy (staged mode: and cast),
        so the Python thread that drives the GPU never blocks on either. Of the loads asked, the first
        whose unit is updated goes first (not one from the NVMe tier, whose reads keep their order): at a
        step's start the first layer's weights cross while the embedding's update ends. Loads of one unit
        or one slot never wait together: the next is asked only after the visit that took the last."""
        pending: list[tuple] = []
        closing = False
        while pending or not closing:
            try:  # whatever has been asked; block for more only when nothing is pending
                while not closing:
                    job = self._loads.get(block=not pending)
                    if job is None:
                        closing = True
                    else:
                        pending.append(job)
            except queue.Empty:
                pass
            if not pending:  # (closing)
                continue
            i = next((i for i, job in enumerate(pending) if self.updates.updated[job[0]].is_set()
                      and not self.store.weights_on_tier(job[0])), None)
            if i is None:
                head = pending[0][0]
                if self._error is None and not self.store.weights_on_tier(head):
                    with self.profiler.timed("loader_wait_optimizer"):  # (then look again for new loads)
                        self.updates.updated[head].wait(1e-3)
                    continue
                i = 0
            unit, slot, used, issued, rows = pending.pop(i)
            try:
                if self._error is None:
                    self._load_now(unit, slot, used, rows)
            except BaseException as e:
                self._fail(e)
            finally:
                issued.set()

    def _load_now(self, unit: int, slot: Slot, used, rows: torch.Tensor | None = None) -> None:
        if not self.updates.updated[unit].is_set():
            with self.profiler.timed("loader_wait_optimizer"):
                self.wait_flag(self.updates.updated[unit])
        if not self.wait_flag(self.updates.updated[unit]) or self._error is not None:
            return
        if rows is not None:
            slot.loaded = self._load_rows(unit, slot, rows, used)
            return
        n = self.adapter.units[unit].numel
        if self.store.weights_on_tier(unit):
            slot.loaded = self._load_from_tier(unit, slot.params[:n], used)
            return
        w = self.store.weights[unit]  # (None: staged, cast from the master)
        slot.loaded = self.copier.load(slot.params[:n], w if w is not None else self.store.master[unit],
                                       staged=w is None, used=used,
                                       after=self.visiting.landed if self._visiting(unit) else None)

    def _load_rows(self, unit: int, slot: Slot, rows: torch.Tensor, used):
        """An embedding's rows a step touches, packed into the slot (engine/embedding.py): gathered on the
        host into one of the unit's pinned gradient buffers (free from its update to its next gradient),
        copied like weights; the buffer goes back once the copy has landed."""
        V, H = self.adapter.units[unit].params[0].shape
        w = self.store.weights[unit]  # (None: staged, the master's rows cast here)
        src = (w if w is not None else self.store.master[unit])[: V * H].view(V, H)
        n = rows.numel() * H
        buf = self.updates.take_grad_buffer(unit)
        try:
            dst = self.store.grad_buffers[buf][:n].view(-1, H)
            if dst.dtype == src.dtype:
                torch.index_select(src, 0, rows, out=dst)
            else:  # (in pieces: a bounded fp32 temporary)
                for a in range(0, rows.numel(), ROWS_PIECE):
                    dst[a: a + ROWS_PIECE].copy_(src.index_select(0, rows[a: a + ROWS_PIECE]))
            loaded = self.copier.load(slot.params[:n], dst.view(-1), staged=False, used=used)
            if loaded is not None:
                loaded.synchronize()
        finally:
            self.updates.return_grad_buffer(buf)
        return loaded

    def _load_from_tier(self, unit: int, dst: torch.Tensor, used):
        """Weights on the NVMe tier (compact state's master, or fp32 state's for a staged unit): read into the
        next of the two pinned ``tier_weights`` buffers (once the copy that last read it has finished), then
        copied to the slot like host weights (the fp32 master cast on the way, like a staged unit's)."""
        k = 1 - self._tier_turn
        if self._tier_copied[k] is not None:
            self._tier_copied[k].synchronize()
            self._tier_copied[k] = None
        with self.profiler.timed("loader_read_tier"):
            src = self.disk.read_weights(unit, self.store.tier_weights[k])
        if src is None:
            return None
        loaded = self.copier.load(dst, src, staged=src.dtype != dst.dtype, used=used)  # (fp32 master: cast there)
        if src.data_ptr() == self.store.tier_weights[k].data_ptr():  # (else a buffer read ahead for the update)
            self._tier_turn, self._tier_copied[k] = k, loaded
        return loaded

    def _visiting(self, unit: int) -> bool:
        return self.visiting is not None and unit == self.visiting.unit

    def begin_compute(self, slot: Slot) -> None:
        self._issued(slot)
        self.copier.begin_visit(slot.loaded)
        if slot.shared_by is not None:  # (the owner's load has landed: in stream order, before the broadcast)
            parallel.share(slot.params[: self.adapter.units[slot.unit].numel], slot.shared_by)
            slot.shared_by = None

    def wait_loaded(self, slot: Slot) -> None:
        """A visit that reads a second slot (a tied head, the embedding's whole matrix loaded during the
        forward; one rank): the compute stream waits for that slot's pending load too."""
        self._issued(slot)
        self.copier.wait(slot.loaded)

    def end_read(self, slot: Slot) -> None:
        """A visit read that second slot too: the slot's next load waits for what the visit enqueued."""
        slot.used = self.copier.read_done()

    def _issued(self, slot: Slot) -> None:
        if slot.issued is not None:  # the loader has enqueued (CPU: done) the copy, and recorded ``loaded``
            if not slot.issued.is_set():
                with self.profiler.timed("wait_load"):
                    slot.issued.wait()
            slot.issued = None
            self._raise_worker_error()

    def end_compute(self, slot: Slot, unit: int) -> None:
        slot.used = self.copier.end_visit(unit)
        if self._visiting(unit):  # its next visit after an update has read the new weights: the state goes back
            self.visiting.send_back(self.visiting.back_visits)

    def begin_grads(self, slot: Slot) -> None:
        self.copier.wait(slot.grads_sent)

    # -- gradients out, updates on the CPU ---------------------------------------------------------
    def send_grads(self, unit: int, slot: Slot, rows: Rows | None = None) -> SentGrads:
        """Copy ``slot``'s finished gradients to a host buffer; the optimizer waits for the returned event.
        ``rows``: the slot holds only those rows' gradient, packed (an embedding's, engine/embedding.py)."""
        self.updates.updated[unit].clear()  # the unit's next load must wait for this step's update
        buf = self.updates.take_grad_buffer(unit)
        n = self.adapter.units[unit].numel if rows is None else rows.ids.numel() * rows.length
        dst = self.store.grad_buffers[buf][:n]
        step = self.cfg.tuning.grad_chunk_elems
        self._tickets += 1
        flags = self._landing_flags[buf]
        landing = Landing(flags, self._tickets, step, self._abort)
        slot.grads_sent = self.copier.send(dst, slot.grads[:n], flags, self._tickets, step)
        return SentGrads(buf, landing, rows)

    def synchronize(self) -> None:
        """Wait until every queued update has been applied and written (before reading or saving state)."""
        for u in range(len(self.updates.updated)):
            self.updates.wait_updated(u)
        if self.visiting is not None:
            self.visiting.synchronize()
        self.disk.join_writes()
        self._raise_worker_error()

    def _fail(self, e: BaseException) -> None:
        self.failure.record(e)

    def _raise_worker_error(self) -> None:
        self.failure.raise_if_any()

    def gpu_bytes(self) -> int:
        slots = [s for g, group in self.slots.items() for s in (group.values() if g == "resident" else group)]
        return sum(s.nbytes for s in slots) + self.resident.nbytes() + self.copier.gpu_bytes

    def abort(self, why: BaseException) -> None:
        """After a failure in the calling thread: every thread skips its remaining work, letting go of what it
        holds, and every wait ends, for gradient chunks a failed GPU will never deliver too."""
        self._fail(why)
        self._abort.fill_(1)

    def close(self, abort: bool = False) -> None:
        """Stop the threads after their queued work; ``abort`` (after a failure in the main thread) first
        makes every thread skip its remaining work and ends any wait for gradient chunks that a failed
        GPU will never deliver: the host state may then be part-updated (resume from a checkpoint)."""
        if self._closed:
            return
        self._closed = True
        if abort:
            self.abort(RuntimeError("the engine was closed after a failure in the calling thread"))
        _SWITCH_INTERVAL.release()
        # The optimizer first: its last jobs may still need the tier's reads; then the disk threads,
        # which finish their queued writes; the loader last (pending loads wait for those updates).
        self.updates.close()
        self.disk.close()
        self._loads.put(None)
        self._loader.join()
        self.copier.synchronize()
