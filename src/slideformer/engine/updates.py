"""The CPU optimizer: one worker thread that updates each unit as its gradient lands, speculatively
under clipping (engine/runtime.py's docstring has the hand-offs), and the pool of host gradient buffers
and spare states it shares with the thread that sends gradients.

Owns each unit's ``updated`` flag: cleared when its gradient is sent, set once its update stands, so a
load of the unit's weights (the runtime's loader) waits for fresh ones.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch

from ..config import EngineConfig
from ..host.store import HostStore
from ..model.adapter import ModelAdapter
from ..optim.adamw import (Landing, Rows, Undecayed, adamw_8bit_, adamw_compact_, adamw_update_, compact_seed,
                           resolve_backend)
from ..window.schedule import next_update
from .copier import on_device
from .disk import DiskIO, Failure
from .profile import NullProfiler, StepProfiler


@dataclass
class UpdateJob:
    unit: int
    grads: "SentGrads | None"  # None: the rows ``rest`` names, with a zero gradient (else that part of these)
    step: int
    lr: float
    grad_coef: float | None  # None: the step is dropped; the unit's state stays as it is
    spare: int | None = None  # speculative (clipping): written into this spare state, kept until the verdict
    rest: Rows | None = None  # an embedding's rows its step did not touch (engine/embedding.py)

    def numel(self, unit_numel: int) -> int:
        """The elements of its gradient: none (zeros), the touched rows packed, or the whole unit."""
        if self.grads is None:
            return 0
        rows = self.grads.rows
        return unit_numel if rows is None else rows.ids.numel() * rows.length

    @property
    def background(self) -> bool:
        """Due only by the next step: run when nothing else is ready."""
        return self.grads is None


@dataclass
class _Verdict:
    """Clipping's coefficient, once backward has ended: whether the speculative updates stand (None: a
    non-finite norm or loss; the step is dropped, no unit's state changes)."""
    grad_coef: float | None


@dataclass
class SentGrads:
    buffer: int  # index into HostStore.grad_buffers, returned to the pool after the update
    landing: Landing  # when each chunk is on the host
    rows: Rows | None = None  # an embedding's touched rows, packed (engine/embedding.py); None: the whole unit

    def landed(self) -> bool:
        """The first chunk is on the host: the update can start."""
        return self.landing.landed(0)



class Updates:
    def __init__(self, adapter: ModelAdapter, store: HostStore, cfg: EngineConfig, disk: DiskIO, failure: Failure,
                 profiler: StepProfiler | NullProfiler):
        self.adapter, self.store, self.cfg, self.disk, self.failure = adapter, store, cfg, disk, failure
        self.profiler = profiler
        self.updated = [threading.Event() for _ in adapter.units]
        # and of the rows an embedding's step did not touch (engine/embedding.py): cleared when that part is
        # queued, set once it has run. Loads need not wait for it (the next load follows the touched rows'
        # update, queued after it), but whoever reads the whole state does.
        self.rest_done = [threading.Event() for _ in adapter.units]
        for e in self.updated + self.rest_done:
            e.set()
        self.backend = resolve_backend(cfg.tuning.optimizer_backend)
        self.undecayed = [Undecayed(u.no_decay) for u in adapter.units]  # (the embedding has none: rows need none)
        needs_scratch = cfg.compute_dtype != torch.float32 and self.backend == "torch"
        cpu_units = [u.numel for u in adapter.units if not store.is_resident(u.index)]  # (those the CPU updates)
        self._scratch = torch.empty(max(cpu_units, default=0) if needs_scratch else 0, dtype=torch.float32)
        # Host gradient buffers: free flags under a condition; the sending thread takes, the worker returns.
        self._grad_free = [True] * len(store.grad_buffers)
        self._grad_cv = threading.Condition()
        # Spare states for speculative updates: the main thread reserves, the worker gives back.
        self._spares_free = list(range(len(store.spares)))
        self._spares_lock = threading.Lock()
        self._speculated: list[UpdateJob] = []  # done, awaiting the verdict (worker thread only)
        # Units whose speculative update stood ("kept"), ran again ("redone"), or had not started by the
        # verdict and ran in place ("late"): how much of the CPU update clipping still serialises; and
        # those of steps dropped for a non-finite norm ("dropped").
        self.speculation = {"kept": 0, "redone": 0, "late": 0, "dropped": 0}
        # One thread: its kernels release the GIL and use their own threads, so the updates overlap the
        # Python thread driving the GPU.
        self._jobs: queue.Queue[UpdateJob | _Verdict | None] = queue.Queue()
        self._worker = threading.Thread(target=on_device(self._work, cfg.device, failure),
                                        name="slideformer-optimizer", daemon=True)
        self._worker.start()

    @property
    def _error(self) -> BaseException | None:
        return self.failure.first

    def _fail(self, e: BaseException) -> None:
        self.failure.record(e)

    def _raise_worker_error(self) -> None:
        self.failure.raise_if_any()

    def take_grad_buffer(self, unit: int) -> int:
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

    def return_grad_buffer(self, buf: int) -> None:
        with self._grad_cv:
            self._grad_free[buf] = True
            self._grad_cv.notify_all()

    def submit(self, job: UpdateJob) -> None:
        self._raise_worker_error()
        if job.rest is not None:
            self.rest_done[job.unit].clear()
        self._jobs.put(job)

    def reserve_spare(self, unit: int) -> int | None:
        """A spare state for a speculative update of ``unit``, if the unit can take one and one is free."""
        if not self.store.can_spare(unit):
            return None
        with self._spares_lock:
            return self._spares_free.pop() if self._spares_free else None

    def resolve(self, grad_coef: float | None) -> None:
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
                self.return_grad_buffer(job.grads.buffer)
                self.updated[job.unit].set()
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
            units = [j.unit for j in pending]
            # (a unit's jobs in the order they came: an embedding's rows of one step, then the next step's)
            ready = [(j.grads is None or j.grads.landed()) and self._moments_ready(j.unit)
                     and j.unit not in units[:i] for i, j in enumerate(pending)]
            background = [j.background and j.unit not in units[i + 1:] for i, j in enumerate(pending)]
            job = pending.pop(next_update(units, ready, background))
            self._run_update(job)

    def _moments_ready(self, unit: int) -> bool:
        return not self.store.on_tier(unit) or self.disk.ready(unit)

    def _run_update(self, job: UpdateJob) -> None:
        tier_buf, kept = None, False
        try:
            if self._error is None:
                s, c = self.store, self.cfg
                st = s.state_fields(job.unit)  # (None where the tier holds a field)
                if s.on_tier(job.unit):  # its state is (being) read ahead
                    tier_buf = self.disk.take(job.unit)
                    if tier_buf is None or self._error is not None:  # a read failed: its error is kept
                        return
                    st.update(s.tier.views(job.unit, tier_buf))
                master, exp_avg, exp_avg_sq = st["master"], st["exp_avg"], st["exp_avg_sq"]
                rows = job.rest or job.grads.rows
                n = job.numel(self.adapter.units[job.unit].numel)
                grad = s.grad_buffers[0 if job.grads is None else job.grads.buffer][:n]  # (a zero gradient: none)
                landing = None if job.grads is None else job.grads.landing
                out = s.weights[job.unit] if s.weights is not s.master else None  # (None: staged)
                src = None
                if job.spare is not None:  # out of place, into the spare; the unit's state is read only
                    src = tuple(s.state_fields(job.unit).values())
                    dst = s.spares[job.spare]
                    master, exp_avg, exp_avg_sq = dst["master"], dst["exp_avg"], dst["exp_avg_sq"]
                    # (the separate compute copy is written in place: nothing reads it before the verdict,
                    # which rewrites it if the update does not stand)
                t0 = time.perf_counter()
                undecayed, saved = self.undecayed[job.unit], None
                if job.grad_coef is not None:  # (the master the update starts from: src's where out of place)
                    start = src if src is not None else (master, st.get("master_lo"))
                    saved = undecayed.before(c.weight_decay, start[0], start[1] if s.compact else None)
                if job.grad_coef is None:  # a dropped step: the state (tier buffer too) goes back unchanged,
                    # and the compute copy, which a speculative update wrote in place, is put back; the buffer
                    # only once the whole gradient has landed (its next user may read it before the copy's end)
                    waited = 0.0 if landing is None else landing.wait(n)
                    if out is not None:
                        out.copy_(master)
                elif s.compact:
                    lo = st["master_lo"] if job.spare is None else s.spares[job.spare]["master_lo"]
                    common = dict(step=job.step, lr=job.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay,
                                  grad_coef=job.grad_coef, backend=self.backend,
                                  threads=c.tuning.optimizer_threads, landing=landing, src=src, rows=rows)
                    if s.state_format == "8bit":
                        waited = adamw_8bit_(master, lo, grad, exp_avg, exp_avg_sq, **common)
                    else:
                        waited = adamw_compact_(master, lo, grad, exp_avg, exp_avg_sq,
                                                seed=compact_seed(c.seed, job.unit), **common)
                    undecayed.after(saved, job.lr, c.weight_decay, master, lo)
                else:
                    cast_out = out is not None and out.dtype in (torch.bfloat16, torch.float16)
                    waited = adamw_update_(master, grad, exp_avg, exp_avg_sq, step=job.step, lr=job.lr,
                                  betas=c.betas, eps=c.eps, weight_decay=c.weight_decay, grad_coef=job.grad_coef,
                                  out=out if cast_out else None, scratch=self._scratch,
                                  backend=self.backend, threads=c.tuning.optimizer_threads,
                                  landing=landing, src=src, rows=rows)
                    undecayed.after(saved, job.lr, c.weight_decay, master, out=out if cast_out else None)
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
                if job.grads is not None:
                    self.return_grad_buffer(job.grads.buffer)
                if job.rest is not None:  # (the rest of an embedding's rows: its touched rows' job sets the flag)
                    self.rest_done[job.unit].set()
                else:
                    self.updated[job.unit].set()

    def wait_updated(self, unit: int) -> None:
        """Until every queued part of the unit's update has run (or a failure means it may never)."""
        for done in (self.updated[unit], self.rest_done[unit]):
            self.failure.wait(done)
        self._raise_worker_error()

    def close(self) -> None:
        """Stop the worker after its queued jobs."""
        self._jobs.put(None)
        self._worker.join()
