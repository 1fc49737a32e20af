"""Opt-in step profiling: where a step's time goes. All timing code lives here.

On CUDA, events on the compute stream bracket each visit: the time between "visit start" and
"weights ready" is the GPU waiting for weights; from there to "visit end" is compute. Gaps between
visits are the GPU idle because the Python thread was blocked (mostly waiting for the CPU
optimizer's update of the next unit) or launching kernels. Copy-stream busy time comes from events
around each copy. Host-side waits are wall-clock times measured in the thread that waits.

``timeline()`` gives the same records one by one (the order in which the CPU optimizer took its
units and when, each GPU visit's wait and compute): what the per-category sums cannot show, such as
whether the optimizer idles while the next forward runs. All times are relative to the first visit's
start: the GPU's from its events, the host's through an anchor event recorded on the idle GPU when the
timeline is taken (its host time read as it completes, to within tens of microseconds), so a CPU update
can be placed against the visit whose gradient it waited for. Each GPU visit also carries the
allocator's peak so far (its count is kept as kernels are enqueued, so no sync; since the last
``torch.cuda.reset_peak_memory_stats``): the visit where it last rises holds a step's GPU memory peak,
which is what the planner's memory model is checked on (work after the last visit is not attributed).
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict

import torch


class NullProfiler:
    """What the runtime records into when profiling is off: every recorder does nothing, so the runtime
    calls them unconditionally."""
    enabled = False

    def mark(self, stream):
        return None

    def visit(self, *a) -> None:
        pass

    def copy(self, *a) -> None:
        pass

    def span(self, *a, **k) -> None:
        pass

    def timed(self, key: str):
        return contextlib.nullcontext()


class StepProfiler:
    enabled = True

    def __init__(self, cuda: bool, device=None):
        self.cuda, self.device = cuda, device
        self._lock = threading.Lock()  # the main, loader and optimizer threads record; reset() swaps it all
        self.reset()

    def reset(self) -> None:
        """Count from now; safe while work is in flight (what started before counts from now on)."""
        with self._lock:
            self._visits: list[tuple] = []  # (unit, start, ready, end) events, and the peak allocated bytes
            self._copies: dict[str, list[tuple]] = defaultdict(list)
            self.host: dict[str, float] = defaultdict(float)
            self._spans: list[tuple] = []  # (key, unit, start, end) wall-clock seconds
            self._since, self._until = time.perf_counter(), None

    def close(self) -> None:
        """Stop counting: a window opened with reset() between two steps of a running pipeline then holds
        the steps in between and not the drain after them (the benchmark's steady state)."""
        with self._lock:
            self._until = time.perf_counter()

    # -- recorders (called by Runtime) ------------------------------------------------------------
    def mark(self, stream):
        if not self.cuda:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def visit(self, unit: int, start, ready, end) -> None:
        peak = torch.cuda.max_memory_allocated(self.device) if self.cuda else 0
        with self._lock:
            if self.cuda and self._until is None:
                self._visits.append((unit, start, ready, end, peak))

    def copy(self, kind: str, start, end) -> None:
        with self._lock:
            if self.cuda and self._until is None:
                self._copies[kind].append((start, end))

    def span(self, key: str, unit: int, start: float, end: float, waited: float = 0.0) -> None:
        """One timed piece of host work (perf_counter seconds), summed into ``key`` and kept for the
        timeline: the part inside the counting window. ``waited``: seconds of it spent waiting (for
        gradient chunks), summed into ``key``_wait_landing in proportion to the part kept."""
        with self._lock:
            if (kept := self._count(key, start, end)) is not None:
                if waited:
                    self.host[f"{key}_wait_landing"] += waited * (kept[1] - kept[0]) / (end - start)
                self._spans.append((key, unit, *kept))

    @contextlib.contextmanager
    def timed(self, key: str):
        """A wait, summed into ``key``: the part inside the counting window."""
        t = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            with self._lock:
                self._count(key, t, end)

    def _count(self, key: str, start: float, end: float) -> tuple[float, float] | None:
        """Sum the part of [start, end] inside the counting window into ``key`` (under the lock)."""
        s, e = max(start, self._since), min(end, self._until or end)
        if e <= s:
            return None
        self.host[key] += e - s
        return s, e

    # -- summary ----------------------------------------------------------------------------------
    def summary(self) -> dict[str, float]:
        """Seconds per category between the last reset and close (or now; call after a synchronize)."""
        with self._lock:
            out = {f"host_{k}_s": v for k, v in self.host.items()}
        if self.cuda and self._visits:
            ms = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731
            # to the last GPU work: a visit, or a resident unit's AdamW after it (clipping, the embedding)
            adamw = self._copies.get("gpu_adamw", [])
            out["gpu_span_s"] = max([ms(self._visits[0][1], self._visits[-1][3])]
                                    + [ms(self._visits[0][1], e) for _, e in adamw[-1:]])
            out["gpu_wait_weights_s"] = sum(ms(s, r) for _, s, r, _, _ in self._visits)
            out["gpu_compute_s"] = sum(ms(r, e) for _, _, r, e, _ in self._visits)
            for kind, pairs in self._copies.items():
                out[f"{kind}_busy_s"] = sum(ms(s, e) for s, e in pairs)
            # resident units' AdamW runs on the compute stream between visits: busy, not idle
            out["gpu_idle_s"] = out["gpu_span_s"] - out["gpu_wait_weights_s"] - out["gpu_compute_s"] \
                - out.get("gpu_adamw_busy_s", 0.0)
        return out

    def timeline(self) -> dict[str, list]:
        """Each record between the last reset and close, in milliseconds (call after a synchronize): GPU
        visits as [unit, start, weights ready, end, the allocator's peak so far in bytes] from the first
        visit, the resident units' AdamW on the GPU (between visits) as [start, end] and host spans as [what,
        unit, start, end], both on that clock (the module says how the host's is aligned)."""
        out: dict[str, list] = {"gpu": [], "gpu_adamw": [], "host": []}
        h0 = min((s for _, _, s, _ in self._spans), default=0.0)  # (without GPU visits: the first host record)
        if self.cuda and self._visits:
            t0 = self._visits[0][1]
            out["gpu"] = [[u] + [round(t0.elapsed_time(e), 3) for e in (s, r, e_)] + [peak]
                          for u, s, r, e_, peak in self._visits]
            out["gpu_adamw"] = [[round(t0.elapsed_time(a), 3), round(t0.elapsed_time(b), 3)]
                                for a, b in self._copies.get("gpu_adamw", [])]
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record(torch.cuda.current_stream(self.device))
            anchor.synchronize()
            h0 = time.perf_counter() - t0.elapsed_time(anchor) / 1e3  # the first visit's start, on the host clock
        out["host"] = [[k, u, round(1e3 * (s - h0), 3), round(1e3 * (e - h0), 3)] for k, u, s, e in self._spans]
        return out
