"""SIGINT and SIGTERM, handled from the process's first line (the CLI installs ``Signals`` before it
imports torch): until training starts each ends the run at once, since nothing is there to save; once
training, the first asks the loop to stop after its step and save, and a second ends the run at once
(the last checkpoint kept). A run ends with 128 + the signal's number. No torch here: this module is
imported before it."""
from __future__ import annotations

import signal
import threading


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM ended the run before a step could finish (start-up, or a second signal)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Signals:
    """The handler for both signals, installed while the object is entered (main thread only: Python
    delivers signals there; elsewhere it does nothing)."""

    def __init__(self):
        self.requested: int | None = None
        self._training = False
        self._old: dict = {}

    def __enter__(self) -> "Signals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        if not self._training or self.requested is not None:
            self.requested = signum
            raise Interrupted(signum)
        self.requested = signum

    def training(self) -> None:
        """From now on a first signal stops the loop after its step; one that arrived before (and that a
        library swallowed) ends the run now."""
        if self.requested is not None:
            raise Interrupted(self.requested)
        self._training = True

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
