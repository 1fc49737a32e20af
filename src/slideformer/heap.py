"""Python's cyclic garbage collector in a training process.

A run holds a few hundred thousand long-lived objects (torch's and transformers' modules, the kernels'
caches, the engine), and a full collection walks all of them: about 0.1 s, during which the thread
driving the GPU enqueues nothing, so the GPU idles once its queue drains. ``settle`` moves what exists
after the first step into the collector's permanent generation (``gc.freeze``): later collections walk
only what came after. What is frozen is still freed by reference counting; reference cycles among those
objects wait for ``release`` at the run's end (the trainer's), which gives them back to the collector.
``Pauses`` measures the collector's time over a span (the benchmark records it for its timed steps).
"""
from __future__ import annotations

import gc
import time


def settle() -> bool:
    """Freeze what exists (after a run's first step: its kernels are built by then); whether it did. Not
    where the caller froze objects itself (a server before it forks, say): ``release`` would let go of
    theirs too. No collection first: it would walk everything once more, and the cycles already garbage
    wait for ``release`` with the rest."""
    if gc.get_freeze_count():
        return False
    gc.freeze()
    return True


def release() -> None:
    """What ``settle`` froze, back to the collector (a run's end: its engine may be freed now)."""
    gc.unfreeze()


class Pauses:
    """The collector's time while entered: ``seconds`` in all, ``full`` the number of full collections."""

    def __init__(self):
        self.seconds, self.full, self._start = 0.0, 0, None

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.full += info["generation"] == 2
            self._start = None

    def __enter__(self) -> "Pauses":
        gc.callbacks.append(self._on)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on)
