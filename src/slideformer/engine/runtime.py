"""Runtime: the one owner of streams, events, window slots and the worker threads (optimizer and loader
here; the disk's reader and writer in its ``DiskIO``, engine/disk.py; the resident units' GPU state in
its ``ResidentState``, engine/resident.py), which it starts and stops.

Hand-offs, and what makes each safe:
- host weights -> slot (loader thread, h2d stream): the main thread queues a load request with the
  slot's current ``used`` event; the loader waits for the unit's ``updated`` flag (set by the
  optimizer after its AdamW step) so the copy reads fresh weights, casts them into pinned staging in
  "staged" mode, and enqueues the copy behind ``used``, so it never overwrites weights a queued kernel
  still reads. It then records ``loaded`` and sets the request's ``issued`` flag.
- slot -> compute: the main thread waits for ``issued`` (the copy is enqueued), then the compute
  stream waits for ``loaded``.
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
  state (``HostStore.spares``; ``reserve_spare`` in the main thread) and kept, with its gradient buffer,
  until the verdict (``resolve_speculation``, queued behind the step's jobs). If the norm is within
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

On the CPU (``device="cpu"``) every copy is a plain synchronous copy, its flags are set by the main
thread, and there are no events, but the worker thread, the flags and the order of operations are the
same, so CI exercises this code.
"""
from __future__ import annotations

import queue
import sys
import threading
import time
from dataclasses import dataclass

import torch

from ..config import EngineConfig
from ..host.store import HostStore
from ..model.adapter import ModelAdapter
from ..optim.adamw import Landing, adamw_compact_, adamw_update_, compact_seed, resolve_backend
from ..window.schedule import Visit, next_update
from ..window.slots import Slot
from .disk import DiskIO, Failure
from .profile import NullProfiler, StepProfiler
from .resident import ResidentState

STAGING_ELEMS = 32 * 2**20  # "staged" host weights: cast the master in 32M-element chunks
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


@dataclass
class UpdateJob:
    unit: int
    grads: "SentGrads"
    step: int
    lr: float
    grad_coef: float | None  # None: the step is dropped; the unit's state stays as it is
    spare: int | None = None  # speculative (clipping): written into this spare state, kept until the verdict


@dataclass
class _Verdict:
    """Clipping's coefficient, once backward has ended: whether the speculative updates stand (None: a
    non-finite norm or loss; the step is dropped, no unit's state changes)."""
    grad_coef: float | None


@dataclass
class SentGrads:
    buffer: int  # index into HostStore.grad_buffers, returned to the pool after the update
    landing: Landing  # when each chunk is on the host

    def landed(self) -> bool:
        """The first chunk is on the host: the update can start."""
        return self.landing.landed(0)


class Runtime:
    def __init__(self, adapter: ModelAdapter, store: HostStore, cfg: EngineConfig, plan: list[Visit]):
        self.adapter, self.store, self.cfg = adapter, store, cfg
        self.device = torch.device(cfg.device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(self.device)
            self.h2d = torch.cuda.Stream(self.device)
            self.d2h = torch.cuda.Stream(self.device)
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
        self._staging: list[tuple[torch.Tensor, object]] = []
        staged = [adapter.units[u].numel for u in store.staged]
        if staged:
            n = min(STAGING_ELEMS, max(staged))
            self._staging = [(torch.empty(n, dtype=dt, pin_memory=self.cuda), None) for _ in range(2)]
        self.profiler: StepProfiler | NullProfiler = StepProfiler(self.cuda) if cfg.tuning.profile else NullProfiler()
        # Resident units train on the GPU; their state is there only (engine/resident.py).
        self.resident = ResidentState(self.slots["resident"], {u: adapter.units[u].numel for u in resident},
                                      store.compact, cfg, self.compute if self.cuda else None, self.profiler)
        store.attach_gpu(self.resident)
        self._visit_start = None
        # Optimizer worker: one thread; its kernels release the GIL and use their own threads, so the
        # updates overlap the Python thread driving the GPU.
        self._updated = [threading.Event() for _ in adapter.units]
        for e in self._updated:
            e.set()
        self.failure = Failure()  # the first failure in any thread (engine/disk.py)
        self.optimizer_backend = resolve_backend(cfg.tuning.optimizer_backend)
        needs_scratch = dt != torch.float32 and self.optimizer_backend == "torch"
        cpu_units = [u.numel for u in adapter.units if not store.is_resident(u.index)]  # (those the CPU updates)
        self._scratch = torch.empty(max(cpu_units, default=0) if needs_scratch else 0, dtype=torch.float32)
        # Host gradient buffers: free flags under a condition; the main thread takes, the worker returns.
        # Each has a row of landing flags, one per chunk; tickets number the sends.
        self._grad_free = [True] * len(store.grad_buffers)
        chunks = -(-max(u.numel for u in adapter.units) // cfg.tuning.grad_chunk_elems)
        self._landing_flags = torch.zeros(len(store.grad_buffers), chunks, dtype=torch.int64, pin_memory=self.cuda)
        self._abort = torch.zeros(1, dtype=torch.int64)
        self._tickets = 0
        self._ticket = torch.zeros((), dtype=torch.int64, device=self.device) if self.cuda else None
        self._grad_cv = threading.Condition()
        # Spare states for speculative updates: the main thread reserves, the worker gives back.
        self._spares_free = list(range(len(store.spares)))
        self._spares_lock = threading.Lock()
        self._speculated: list[UpdateJob] = []  # done, awaiting the verdict (worker thread only)
        # Units whose speculative update stood ("kept"), ran again ("redone"), or had not started by the
        # verdict and ran in place ("late"): how much of the CPU update clipping still serialises; and
        # those of steps dropped for a non-finite norm ("dropped").
        self.speculation = {"kept": 0, "redone": 0, "late": 0, "dropped": 0}
        self._jobs: queue.Queue[UpdateJob | _Verdict | None] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="slideformer-optimizer", daemon=True)
        self._worker.start()
        self._loads: queue.Queue[tuple | None] = queue.Queue()
        self._loader = threading.Thread(target=self._load_work, name="slideformer-loader", daemon=True)
        self._loader.start()
        self.disk = DiskIO(store.tier, self.failure)  # (engine/disk.py)
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
    def load(self, unit: int, slot: Slot) -> None:
        """Ask the loader thread to bring ``unit``'s weights into ``slot``; returns at once."""
        slot.unit = unit
        slot.issued = threading.Event()
        # The slot's last reader is enqueued before this request (window.schedule guarantees it), so the
        # event captured now is the one the copy must wait for.
        self._loads.put((unit, slot, slot.used, slot.issued))

    def _load_work(self) -> None:
        """Loader thread: waits for each unit's update, casts (staged mode) and enqueues its h2d copy,
        so the Python thread that drives the GPU never blocks on either."""
        while (job := self._loads.get()) is not None:
            unit, slot, used, issued = job
            try:
                if self._error is None:
                    self._load_now(unit, slot, used)
            except BaseException as e:
                self._fail(e)
            finally:
                issued.set()

    def _load_now(self, unit: int, slot: Slot, used) -> None:
        if not self._updated[unit].is_set():
            with self.profiler.timed("loader_wait_optimizer"):
                self.wait_flag(self._updated[unit])
        if not self.wait_flag(self._updated[unit]) or self._error is not None:
            return
        n = self.adapter.units[unit].numel
        dst, w = slot.params[:n], self.store.weights[unit]  # (w None: staged, cast from the master)
        if not self.cuda:
            dst.copy_(w if w is not None else self.store.master[unit])
            return
        with torch.cuda.stream(self.h2d):
            if used is not None:
                self.h2d.wait_event(used)
            start = self._mark(self.h2d)
            if w is not None:
                dst.copy_(w, non_blocking=True)
            else:
                self._copy_staged(self.store.master[unit], dst)
            slot.loaded = self.h2d.record_event()
            self.profiler.copy("h2d", start, self._mark(self.h2d))

    def _copy_staged(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        # Double-buffered: staging buffer k is rewritten only after its previous h2d copy finished.
        for i, start in enumerate(range(0, src.numel(), self._staging[0][0].numel())):
            buf, ev = self._staging[i % 2]
            if ev is not None:
                ev.synchronize()
            m = min(buf.numel(), src.numel() - start)
            buf[:m].copy_(src[start: start + m])
            dst[start: start + m].copy_(buf[:m], non_blocking=True)
            self._staging[i % 2] = (buf, self.h2d.record_event())

    def begin_compute(self, slot: Slot) -> None:
        if slot.issued is not None:  # the loader has enqueued (CPU: done) the copy, and recorded ``loaded``
            if not slot.issued.is_set():
                with self.profiler.timed("wait_load"):
                    slot.issued.wait()
            slot.issued = None
            self._raise_worker_error()
        self._visit_start = self._mark(self.compute) if self.cuda else None
        if self.cuda and slot.loaded is not None:
            self.compute.wait_event(slot.loaded)
        self._visit_ready = self._mark(self.compute) if self.cuda else None

    def end_compute(self, slot: Slot, unit: int) -> None:
        if self.cuda:
            slot.used = self.compute.record_event()
            self.profiler.visit(unit, self._visit_start, self._visit_ready, self._mark(self.compute))

    def _mark(self, stream):
        return self.profiler.mark(stream)

    def begin_grads(self, slot: Slot) -> None:
        if self.cuda and slot.grads_sent is not None:
            self.compute.wait_event(slot.grads_sent)

    # -- gradients out, updates on the CPU ---------------------------------------------------------
    def send_grads(self, unit: int, slot: Slot) -> SentGrads:
        """Copy ``slot``'s finished gradients to a host buffer; the optimizer waits for the returned event."""
        self._updated[unit].clear()  # the unit's next load must wait for this step's update
        buf = self._take_grad_buffer(unit)
        n = self.adapter.units[unit].numel
        dst = self.store.grad_buffers[buf][:n]
        step = self.cfg.tuning.grad_chunk_elems
        self._tickets += 1
        flags = self._landing_flags[buf]
        landing = Landing(flags, self._tickets, step, self._abort)
        if not self.cuda:
            dst.copy_(slot.grads[:n])
            flags.fill_(self._tickets)
            return SentGrads(buf, landing)
        done = self.compute.record_event()
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(done)
            start = self._mark(self.d2h)
            self._ticket.fill_(self._tickets)  # a kernel on this stream: ordered before the flag copies below
            for k, a in enumerate(range(0, n, step)):
                dst[a: a + step].copy_(slot.grads[a: min(n, a + step)], non_blocking=True)
                flags[k].copy_(self._ticket, non_blocking=True)
            slot.grads_sent = self.d2h.record_event()
            self.profiler.copy("d2h", start, self._mark(self.d2h))
        return SentGrads(buf, landing)

    def _take_grad_buffer(self, unit: int) -> int:
        with self._grad_cv:
            while True:
                self._raise_worker_error()
                free = [b for b in self.store.grad_owner[unit] if self._grad_free[b]]
                if free:
                    self._grad_free[free[0]] = False
                    return free[0]
                # all taken: the worker returns one after its next update (it never waits on this thread)
                with self.profiler.timed("wait_grad_buffer"):
                    self._grad_cv.wait()

    def _return_grad_buffer(self, buf: int) -> None:
        with self._grad_cv:
            self._grad_free[buf] = True
            self._grad_cv.notify_all()

    def submit_update(self, job: UpdateJob) -> None:
        self._raise_worker_error()
        self._jobs.put(job)

    def reserve_spare(self, unit: int) -> int | None:
        """A spare state for a speculative update of ``unit``, if the unit can take one and one is free."""
        if not self.store.can_spare(unit):
            return None
        with self._spares_lock:
            return self._spares_free.pop() if self._spares_free else None

    def resolve_speculation(self, grad_coef: float | None) -> None:
        """The step's clipping coefficient: queued behind the step's speculative updates (module docstring)."""
        self._raise_worker_error()
        self._jobs.put(_Verdict(grad_coef))

    def _free_spare(self, spare: int) -> None:
        with self._spares_lock:
            self._spares_free.append(spare)

    def _judge(self, verdict: _Verdict, pending: list[UpdateJob]) -> None:
        """Worker thread: settle every speculative update of the step, done or still pending."""
        keep = verdict.grad_coef == 1.0  # (exactly: the clip coefficient is clamped to 1.0)
        for job in self._speculated:
            if keep and self._error is None:
                self.store.adopt(job.unit, job.spare)  # the unit's old state becomes the spare
                self._free_spare(job.spare)
                self._return_grad_buffer(job.grads.buffer)
                self._updated[job.unit].set()
                self.speculation["kept"] += 1
            else:  # again, in place, with the real coefficient (dropped, or after a failure: only released)
                self._free_spare(job.spare)
                pending.append(UpdateJob(job.unit, job.grads, job.step, job.lr, verdict.grad_coef))
                self.speculation["redone" if verdict.grad_coef is not None else "dropped"] += 1
        self._speculated = []
        for job in pending:  # not run yet: they run in place, with the coefficient
            if job.spare is not None:
                self._free_spare(job.spare)
                job.spare, job.grad_coef = None, verdict.grad_coef
                self.speculation["late"] += 1

    def _work(self) -> None:
        pending: list[UpdateJob] = []
        stopping = False
        while pending or not stopping:
            # Block only when there is nothing to do; otherwise take whatever else has arrived.
            try:
                while True:
                    job = self._jobs.get(block=not pending and not stopping)
                    if job is None:
                        stopping = True
                    elif isinstance(job, _Verdict):
                        self._judge(job, pending)
                    else:
                        pending.append(job)
                    if stopping and not pending:
                        return
            except queue.Empty:
                pass
            ready = [j.grads.landed() and self._moments_ready(j.unit) for j in pending]
            job = pending.pop(next_update([j.unit for j in pending], ready))
            self._run_update(job)

    def _moments_ready(self, unit: int) -> bool:
        return not self.store.on_tier(unit) or self.disk.ready(unit)

    def _run_update(self, job: UpdateJob) -> None:
        tier_buf, kept = None, False
        try:
            if self._error is None:
                s, c = self.store, self.cfg
                master = s.master[job.unit]
                if s.on_tier(job.unit):  # its state is (being) read ahead
                    tier_buf = self.disk.take(job.unit)
                    if tier_buf is None or self._error is not None:  # a read failed: its error is kept
                        return
                    exp_avg, exp_avg_sq, *rest = s.tier.views(job.unit, tier_buf)
                    if rest:
                        master = rest[0]
                else:
                    exp_avg, exp_avg_sq = s.exp_avg[job.unit], s.exp_avg_sq[job.unit]
                n = self.adapter.units[job.unit].numel
                grad = s.grad_buffers[job.grads.buffer][:n]
                out = s.weights[job.unit] if s.weights is not s.master else None  # (None: staged)
                src = None
                if job.spare is not None:  # out of place, into the spare; the unit's state is read only
                    src = tuple(s.state_fields(job.unit).values())
                    dst = s.spares[job.spare]
                    master, exp_avg, exp_avg_sq = dst["master"], dst["exp_avg"], dst["exp_avg_sq"]
                    # (the separate compute copy is written in place: nothing reads it before the verdict,
                    # which rewrites it if the update does not stand)
                t0 = time.perf_counter()
                if job.grad_coef is None:  # a dropped step: the state (tier buffer too) goes back unchanged,
                    waited = 0.0  # and the compute copy, which a speculative update wrote in place, is put back
                    if out is not None:
                        out.copy_(master)
                elif s.compact:
                    lo = s.master_lo[job.unit] if job.spare is None else s.spares[job.spare]["master_lo"]
                    waited = adamw_compact_(master, lo, grad, exp_avg, exp_avg_sq,
                                   step=job.step, lr=job.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay,
                                   grad_coef=job.grad_coef, seed=compact_seed(c.seed, job.unit),
                                   backend=self.optimizer_backend, threads=c.tuning.optimizer_threads, landing=job.grads.landing,
                                   src=src)
                else:
                    cast_out = out is not None and out.dtype in (torch.bfloat16, torch.float16)
                    waited = adamw_update_(master, grad, exp_avg, exp_avg_sq, step=job.step, lr=job.lr,
                                  betas=c.betas, eps=c.eps, weight_decay=c.weight_decay, grad_coef=job.grad_coef,
                                  out=out if cast_out else None, scratch=self._scratch,
                                  backend=self.optimizer_backend, threads=c.tuning.optimizer_threads,
                                  landing=job.grads.landing, src=src)
                    if out is not None and not cast_out:  # an fp32 copy of a master on the tier
                        out.copy_(master)
                # (the span includes waits for chunks still in flight, also counted on their own)
                self.profiler.span("optimizer", job.unit, t0, time.perf_counter(), waited=waited)
                if job.spare is not None:
                    self._speculated.append(job)  # its buffer and flag wait for the verdict
                    kept = True
        except BaseException as e:  # surfaced to the main thread at its next wait
            self._fail(e)
        finally:
            if tier_buf is not None:
                self.disk.give_back(job.unit, tier_buf)  # the buffer returns after its write
            if not kept:
                if job.spare is not None:
                    self._free_spare(job.spare)
                self._return_grad_buffer(job.grads.buffer)
                self._updated[job.unit].set()

    def _fail(self, e: BaseException) -> None:
        self.failure.record(e)

    def wait_updated(self, unit: int) -> None:
        self._updated[unit].wait()
        self._raise_worker_error()

    def synchronize(self) -> None:
        """Wait until every queued update has been applied and written (before reading or saving state)."""
        for u in range(len(self._updated)):
            self.wait_updated(u)
        self.disk.join_writes()
        self._raise_worker_error()

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            raise RuntimeError("the CPU optimizer or weight loader failed; training state is not consistent") \
                from self._error

    def gpu_bytes(self) -> int:
        slots = [s for g, group in self.slots.items() for s in (group.values() if g == "resident" else group)]
        return sum(s.nbytes for s in slots) + self.resident.nbytes()

    def close(self, abort: bool = False) -> None:
        """Stop the threads after their queued work; ``abort`` (after a failure in the main thread) first
        makes every thread skip its remaining work and ends any wait for gradient chunks that a failed
        GPU will never deliver: the host state may then be part-updated (resume from a checkpoint)."""
        if self._closed:
            return
        self._closed = True
        if abort:  # every thread's waits end, and their remaining work is skipped
            self._fail(RuntimeError("the engine was closed after a failure in the calling thread"))
            self._abort.fill_(1)
        _SWITCH_INTERVAL.release()
        # The optimizer first: its last jobs may still need the tier's reads; then the disk threads,
        # which finish their queued writes; the loader last (pending loads wait for those updates).
        self._jobs.put(None)
        self._worker.join()
        self.disk.close()
        self._loads.put(None)
        self._loader.join()
        if self.cuda:
            torch.cuda.synchronize(self.device)
