"""SIGINT, SIGTERM and SIGHUP, handled from the process's first line: until training starts each ends
the run at once, since nothing is there to save; once training, the first asks the loop to stop after
its step and save, and a second ends the run at once (the last checkpoint kept). A run ends with 128 +
the signal's number. A repeat within ``SAME_REQUEST_S`` of the first is the same request, not a second one:
a job scheduler's signal to every process of a job (or `pkill -f`) reaches a rank directly and again
through its launcher (torchrun's agent, ``nproc_per_node``'s), which passes on the signal it got.

The handler is one per process (``Signals`` entered again while active shares the first). The CLI's
entry point enters it with ``hard=True`` before anything heavy is imported: a signal during start-up
then prints its line and leaves with ``os._exit``, since raising inside torch's import (a C extension
half-initialised) can crash the interpreter. Elsewhere (a library caller, the tests) start-up signals
raise ``Interrupted``. No torch here: this module is imported before it.

SIGHUP is a closed terminal (an ssh session that dropped). Its writes then fail (EIO), and a run whose
progress line failed would not reach its save, so the hung-up terminal's descriptors are pointed at
/dev/null first; a live terminal (a `kill -HUP`) keeps printing. SIGHUP is taken only from its default
(ending the process): one that started with it ignored (`nohup`) was asked to outlive its terminal, and a
library caller's own handler stays its own."""
from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time

GRACE_S = 5.0  # how long a signal that ends the run waits for the main thread before the watcher ends it
SAME_REQUEST_S = 1.0  # a launcher passes its signal on within milliseconds; a person's second Ctrl-C comes later
HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP ended the run before a step could finish (start-up, or a second signal)."""

    def __init__(self, signum: int, training: bool = False, what: str | None = None):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.training, self.what = signum, training, what

    def line(self) -> str:
        name = signal.Signals(self.signum).name
        if self.what:
            return f"{name}: {self.what}"
        if self.training:
            return (f"{name} again: stopped at once, mid-step; the checkpoints saved before it are kept (a save it "
                    "cut short is none: resume_from_checkpoint: auto passes over it)")
        return f"{name}: stopped before a training step had finished; nothing was saved"


class Signals:
    _active: "Signals | None" = None  # the process's handler while one is entered (signals are process-wide)

    def __init__(self, hard: bool = False):
        self.hard = hard
        self.requested: int | None = None
        self._first_at = 0.0  # (time.monotonic() of the first signal)
        self._training = False
        self._old: dict = {}
        self._old_unraisable = sys.unraisablehook
        self._shared: "Signals | None" = None
        self._terminal: list[int] = []  # (stdout's and stderr's descriptors that were a terminal at entry)
        self._undoing: str | None = None  # (inside ``undoable``: what a signal's line says; "": the start-up line)
        self._acted_at: float | None = None  # (when the Python handler last ended the run, or raised to end it)
        self._wakeup: tuple[int, int] | None = None  # (the pipe the C handler writes signal numbers to)

    def __enter__(self) -> "Signals":
        active = Signals._active
        self._shared = active  # (``with`` calls __exit__ on this object, not on what __enter__ returns)
        if active is not None:
            return active
        if threading.current_thread() is threading.main_thread():
            for sig in HANDLED:
                if sig == signal.SIGHUP and signal.getsignal(sig) is not signal.SIG_DFL:
                    continue  # (ignored: nohup; or a library caller's own, as a service's reload)
                self._old[sig] = signal.signal(sig, self._on_signal)
            self._terminal = [fd for fd in (1, 2) if os.isatty(fd)]
            self._old_unraisable, sys.unraisablehook = sys.unraisablehook, self._unraisable
            Signals._active = self
            if self.hard:
                self._watch_signals()
        return self

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGHUP:
            self._leave_terminal()
        first = self.requested is None
        if first:
            self._first_at = time.monotonic()
        elif self._training and time.monotonic() - self._first_at < SAME_REQUEST_S:
            return  # the first signal again, passed on by a launcher: still stop after the step
        if self._undoing is not None and not self._training:
            if first:  # (a second one while the work undoes itself is the same request: the undoing goes on)
                self.requested, self._acted_at = signum, time.monotonic()
                raise Interrupted(signum, what=self._undoing)
            return
        self.requested = signum
        if self._training and first:
            return  # the loop stops after its step and saves
        self._acted_at = time.monotonic()
        if self.hard and not self._training:
            _leave(Interrupted(signum))
        raise Interrupted(signum, self._training)

    def _unraisable(self, what) -> None:
        """The handler's raise landed in a finalizer (an object's __del__ run by the collector), which cannot
        raise: Python would print a traceback and go on as if no signal had come. It is sent again, to be
        raised where the code can stop."""
        if isinstance(what.exc_value, Interrupted) and Signals._active is self:
            if not what.exc_value.training:  # (a second signal in training stays the second)
                self.requested = None
            self._acted_at = None
            # (from a thread, a moment later: a signal raised in the hook itself would be lost the same way)
            threading.Timer(0.01, _thread.interrupt_main, (what.exc_value.signum,)).start()
            return
        self._old_unraisable(what)

    def _watch(self, fd: int) -> None:
        """The watcher thread: the signals' numbers, as the interpreter's C handler writes them (at once, even
        while the main thread is inside a C call: a collective waiting on a rank that hangs or never
        arrives, a rendezvous). A signal that ends the run (at start-up, or a second one once training)
        that the Python handler has not acted on within ``GRACE_S`` (the main thread is blocked; or what it
        began, the undoing after a raise, has hung since) ends it from here, saying that nothing could be
        undone."""
        first = None  # (when this thread saw a training run's first signal: that one only asks for a save)
        while True:
            try:
                got = os.read(fd, 64)
            except OSError:
                got = b""
            if not got:  # (the write end closed: __exit__)
                os.close(fd)
                return
            now = time.monotonic()
            for signum in got:
                if signum not in HANDLED or signal.getsignal(signum) != self._on_signal:
                    continue  # (another handler took the signal over: a launcher's own, torch's agent)
                if self._training and (first is None or now - first < SAME_REQUEST_S):
                    first = first or now
                    continue
                time.sleep(GRACE_S)
                acted = self._acted_at
                if (acted is None or acted < now - GRACE_S) and Signals._active is self:
                    _leave(Interrupted(signum, what=f"stopped at once: the process was inside a call that did not "
                                                    f"return within {GRACE_S:g} s; what it was writing may be left "
                                                    "(a checkpoint cut short is passed over on resume)"))

    def _leave_terminal(self) -> bool:
        gone = [fd for fd in self._terminal if not os.isatty(fd)]
        for fd in gone:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
        self._terminal = [fd for fd in self._terminal if fd not in gone]
        return bool(gone)

    def _watch_signals(self) -> None:
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:
            os.close(r), os.close(w)
            return
        self._wakeup = (r, w)
        global _FORK_HOOKED
        if not _FORK_HOOKED:  # (a forked child, a data-loading worker, writes its own signals elsewhere: else a
            _FORK_HOOKED = True  # pool's SIGTERM to its workers would reach this process's watcher)
            os.register_at_fork(after_in_child=_no_wakeup)
        threading.Thread(target=self._watch, args=(r,), name="slideformer-signals", daemon=True).start()

    @property
    def started(self) -> bool:
        """Whether training has begun (a signal now saves a checkpoint first)."""
        return self._training

    def training(self) -> None:
        """From now on a first signal stops the loop after its step; one that arrived before (and that a
        library swallowed) ends the run now."""
        if self.requested is not None:
            raise Interrupted(self.requested)
        self._training = True

    def __exit__(self, *exc) -> None:
        """The handlers back as the entry found them, at the entry that installed them: entries that share
        it end before it in its thread; one in another thread (a run in a worker thread beside the main
        thread's) that outlives it goes on under the caller's handlers, which must not stay this run's."""
        if self._shared is not None:
            return
        self._training = False
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if Signals._active is self:
            Signals._active = None
            sys.unraisablehook = self._old_unraisable
        if self._wakeup is not None:  # (the watcher reads the end of the pipe and stops)
            signal.set_wakeup_fd(self._old_wakeup)
            os.close(self._wakeup[1])
            self._wakeup = None


_FORK_HOOKED = False


def _no_wakeup() -> None:
    with contextlib.suppress(ValueError, OSError):  # (a fork from another thread than the main one: none set)
        signal.set_wakeup_fd(-1)


def _leave(e: Interrupted) -> None:
    """End the process now for ``e``: its line said and its exit code left where a launcher of ours reads
    them (a rank of its job, ``EXIT_DIR``: here, not in train/launch.py, which may still be importing torch),
    else the line on stderr (written to its descriptor: Python's stream may be mid-write in the main thread)."""
    code = 128 + e.signum
    try:
        if not say(e.line()):
            os.write(2, (e.line() + "\n").encode("utf-8", "backslashreplace"))
        leave_code(code)
    except Exception:  # (stderr gone: a closed pipe; nothing stops the exit)
        pass
    finally:
        os._exit(code)


# What a rank of our launcher's job (train/launch.py) leaves for it: its one-line error and its exit code.
EXIT_DIR = "SLIDEFORMER_EXIT_DIR"  # (environment: the folder our launcher reads its ranks' exit codes from)


def say(line: str) -> bool:
    """A rank's error line, left for our launcher to say (``_Echo``); False outside its jobs (the caller prints
    it), or where it cannot be left."""
    folder = os.environ.get(EXIT_DIR)
    if not folder:
        return False
    path = os.path.join(folder, f"line-{os.environ.get('RANK', '0')}")
    try:  # (a name's undecodable bytes written as stderr would: escaped)
        with open(path + ".tmp", "w", encoding="utf-8", errors="backslashreplace") as f:
            f.write(line)
        os.replace(path + ".tmp", path)  # (whole, or not there: the launcher never reads half a line)
    except (OSError, ValueError):
        return False
    return True


def leave_code(code: int) -> None:
    """A rank's exit code, left where our launcher reads it (nothing outside its jobs)."""
    folder = os.environ.get(EXIT_DIR)
    if folder:
        try:
            with open(os.path.join(folder, os.environ.get("RANK", "0")), "w") as f:
                f.write(str(code))
        except OSError:
            pass


@contextlib.contextmanager
def undoable(what: str = ""):
    """Around work that undoes itself on an error (an export's staged files dropped, what it renamed put
    back; a run's folder released before training starts): a signal here raises Interrupted, even where the
    process's handler would end it at once (torch is imported by then), its line ``what`` (the work stopped,
    and what it left; empty: the start-up line); a further signal is ignored while the work undoes itself.
    Training, once started, handles its signals as always."""
    active = Signals._active
    if active is None:
        yield
        return
    if active.requested is not None:
        raise Interrupted(active.requested, what=what)
    active._undoing = what
    try:
        yield
    finally:
        active._undoing = None


@contextlib.contextmanager
def past_hangup():
    """Around a write to the terminal: where it fails because the terminal hung up (in the moment before its
    SIGHUP, or where a launcher took SIGHUP from us: torch's agent), the terminal's descriptors are pointed at
    /dev/null and the run goes on; any other failure is raised."""
    try:
        yield
    except OSError:
        if Signals._active is None or not Signals._active._leave_terminal():
            raise
