"""No silent hangs, no surprise OOM: two watchers the training loop runs beside its steps.

``Watchdog``: a copy that never completes, an update or disk operation that never returns, or a GPU kernel
that never ends all look the same from outside: no step finishes. The loop marks progress after every step,
evaluation batch and checkpoint (which gets an hour at least); where none comes within the limit, the watchdog prints one line saying so and
the stacks of every thread (which wait is stuck), and ends the process with ``EXIT_HANG``. It never saves:
the state in memory is that of a step that did not finish, and the last checkpoint, written atomically, is
intact. The limit is the user's (``watchdog_seconds``) or, by default, generous against the run's own
pace: ten times its slowest step so far, at least ten minutes, and at least half an hour before the first
step has finished (start-up, compilation, pinning).

``MemoryGuard``: samples the process's resident memory a few times a second. Where it passes 97% of the
host budget (``host_memory_limit``, else the machine's RAM less the margin the planner keeps), the loop
saves a checkpoint after the step and stops with a line naming the settings that need less RAM, before
the kernel's OOM killer ends the run with nothing said.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time

EXIT_HANG = 6
SAVE_LIMIT_S = 3600.0  # a checkpoint: the whole training state written (hundreds of GB for the largest models)
MIN_LIMIT_S = 600.0
FIRST_STEP_LIMIT_S = 1800.0
PACE = 10.0
GUARD_FRACTION = 0.97


class Watchdog:
    def __init__(self, seconds: float | None, what: str, poll_s: float = 0.5):
        """``seconds``: the limit (None: by the run's pace; 0: off). ``what`` ends the line it prints (the
        last checkpoint)."""
        self.fixed, self.what = seconds, what
        self._slowest = 0.0
        self._last = time.monotonic()
        self._done_steps = 0
        self._floor = 0.0  # a longer limit while a long operation runs (``allowing``)
        self._stop = threading.Event()
        self._thread = None
        if seconds != 0:
            self._thread = threading.Thread(target=self._watch, args=(poll_s,), name="slideformer-watchdog",
                                            daemon=True)
            self._thread.start()

    @property
    def limit(self) -> float:
        if self.fixed:  # (a checkpoint still gets its hour: a short limit is meant for steps, not saves)
            return max(self.fixed, self._floor)
        floor = MIN_LIMIT_S if self._done_steps else FIRST_STEP_LIMIT_S
        return max(floor, PACE * self._slowest, self._floor)

    @contextlib.contextmanager
    def allowing(self, seconds: float):
        """At least ``seconds`` for what runs inside (a checkpoint of a large model on a slow disk)."""
        self._floor = seconds
        try:
            yield
        finally:
            self._floor = 0.0
            self.progress(stepped=False)

    def progress(self, stepped: bool = True) -> None:
        """Something finished (a step; or, ``stepped=False``, an evaluation or a checkpoint)."""
        now = time.monotonic()
        if stepped:
            self._slowest = max(self._slowest, now - self._last)
            self._done_steps += 1
        self._last = now

    def _watch(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            idle = time.monotonic() - self._last
            if idle > self.limit:
                print(f"slideformer: no progress for {_secs(idle)} s (the limit: {_secs(self.limit)} s): a copy, an update, a "
                      f"disk operation, a GPU kernel or (data parallel) another rank did not finish; the stacks of "
                      f"every thread follow; "
                      f"{self.what()}. Exit code {EXIT_HANG}. A run slower than this needs watchdog_seconds set "
                      "higher (0: off)", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(EXIT_HANG)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _secs(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def rss_bytes() -> int:
    """The process's resident memory now (not its peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class MemoryGuard:
    def __init__(self, budget: int, poll_s: float = 0.2):
        """``budget``: the process's RAM allowance in bytes (0: off)."""
        self.budget = budget
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None
        if budget:
            self._thread = threading.Thread(target=self._watch, args=(poll_s,), name="slideformer-memory-guard",
                                            daemon=True)
            self._thread.start()

    def _watch(self, poll_s: float) -> None:
        while True:
            self.peak = max(self.peak, rss_bytes())
            if self._stop.wait(poll_s):
                return

    def tripped(self) -> bool:
        """Whether resident memory has passed GUARD_FRACTION of the budget since the start."""
        self.peak = max(self.peak, rss_bytes())
        return bool(self.budget) and self.peak > GUARD_FRACTION * self.budget

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
