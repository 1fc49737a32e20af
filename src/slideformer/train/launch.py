"""``nproc_per_node``: one process per GPU from one command, without typing torchrun.

`slideformer train` with ``nproc_per_node`` above 1 runs itself again under torch's elastic launcher
(torchrun's, in this process) as N ranks on this machine; the ranks are the data parallel of parallel.py.
This process then does what torchrun's would (it starts, watches and stops the ranks), with three
differences a user sees:

- the exit code is a rank's documented one (``exit_code`` says which rank's), where torchrun exits 1 with a
  table and a traceback; each rank's one-line error is said once, as it comes, and a line that several
  ranks say alike (bad data, a bad config: every rank reads them) once in all (``say``, ``_Echo``);
- a signal to this process reaches the ranks, which finish their step and save; they get as long as a
  checkpoint may take (``SAVE_LIMIT_S``), not torchrun's 30 seconds before it kills them, and the exit
  code is theirs (a save that failed says so);
- each rank's CPU threads are its share of the cores (torchrun sets one), where OMP_NUM_THREADS is unset.

Under torchrun itself the key only has to agree with it: torchrun's --nproc-per-node decides.

Every rank of a job (ours or torchrun's) ends through ``end_rank``: it leaves its exit code where the launcher
reads it (``EXIT_DIR``, ours only), and ends without the interpreter's finalization.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import threading

from ..config import ConfigError
from ..signals import EXIT_DIR, leave_code, past_hangup  # (a rank's side: signals.py, before torch)
from ..watchdog import SAVE_LIMIT_S

LAUNCHER = "SLIDEFORMER_LAUNCHER_PID"  # (environment: our launcher's process, which its ranks end with)


def local_gpus(device: str | None) -> int:
    """The GPUs a rank each could take on this machine (none where ``device`` is the CPU)."""
    import torch

    return torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0


def processes(asked, device: str | None) -> int:
    """How many processes `train` runs on this machine: ``asked`` (a number, or "auto": one per GPU), 1 in a
    process that a launcher started (its count decides)."""
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if local is not None and (world is None or not local.isdigit() or not world.isdigit() or int(local) > int(world)):
        world_is = world if world is not None else "not"
        raise ConfigError(f"LOCAL_WORLD_SIZE={local} is set, but WORLD_SIZE is {world_is}: "
                          "a launcher (torchrun) sets both alike; unset LOCAL_WORLD_SIZE (left from another job), "
                          "or start under a launcher")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or local is not None:
        if asked != "auto" and asked != 1 and (local is None or asked != int(local)):
            started = f"started {local} processes on this machine" if local is not None else \
                "set WORLD_SIZE without LOCAL_WORLD_SIZE"
            raise ConfigError(f"nproc_per_node: {asked}, but a launcher (torchrun) {started}: leave nproc_per_node "
                              "out under a launcher (its process count decides), or run `slideformer train` "
                              "without one")
        return 1
    gpus = local_gpus(device)
    if asked == "auto":
        return max(1, gpus)
    if device != "cpu" and asked > max(1, gpus):
        raise ConfigError(f"nproc_per_node: {asked} processes, one per GPU, but this machine has {gpus} GPU(s): set "
                          f"nproc_per_node: {max(1, gpus)} (or auto), or device: cpu for ranks on the CPU")
    return asked


def check_room(n: int, host_memory_limit) -> None:
    """``n`` processes that the machine's RAM (or host_memory_limit, the machine's, shared) cannot hold even
    without training state are refused before they start: each would take its seconds to import torch and
    read the data, then refuse alike (plan/memory.py ``check_host_fits``, each rank's own check)."""
    from types import SimpleNamespace

    from ..machine import host_memory
    from ..plan.memory import check_host_fits, parse_bytes

    share = parse_bytes(host_memory_limit) // n if host_memory_limit else None
    check_host_fits({}, host_memory() // n, SimpleNamespace(host_memory_limit=share), prefix="offload.", ranks=n)


def launch(n: int, argv: list[str]) -> int:
    """Run ``python -m slideformer *argv`` as ``n`` ranks on this machine; their exit code."""
    import dataclasses
    import logging
    import tempfile
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from ..machine import cores

    # (the launcher's log lines: each rank prints its own, and a failure's exit code is returned below; each
    # of its loggers has a level of its own)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores() // n))
    kw = dict(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=str(uuid.uuid4()), rdzv_backend="c10d",
              rdzv_endpoint="localhost:0", max_restarts=0)
    fields = {f.name for f in dataclasses.fields(LaunchConfig)}
    if "shutdown_timeout" in fields:  # (not in every torch)
        kw["shutdown_timeout"] = int(SAVE_LIMIT_S)
    if "signals_to_handle" in fields and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        kw["signals_to_handle"] = "SIGTERM,SIGINT,SIGQUIT"  # (nohup: the agent would take SIGHUP and pass it on)
    # (a second signal: torch's agent sends the ranks SIGTERM, which stops them at once, and waits for them again;
    # only a third ends that wait early, and what the ranks still leave here is then not waited for)
    with tempfile.TemporaryDirectory(prefix="slideformer-exit-", ignore_cleanup_errors=True) as codes:
        os.environ[EXIT_DIR] = codes  # (the ranks inherit it)
        os.environ[LAUNCHER] = str(os.getpid())
        echo = _Echo(codes)
        try:
            elastic_launch(LaunchConfig(**kw), sys.executable)("-m", "slideformer", *argv)
        except ChildFailedError as e:  # (in the order the launcher saw them end; those it ended itself last)
            ended = [f.exitcode if f.exitcode >= 0 else 128 - f.exitcode for f in e.failures.values()]
            # (a rank's own error, or one killed by another signal: the others' SIGTERM is the launcher's
            # ending them after it, no news)
            first = any(0 < c < 128 and c != 7 or c > 128 and c != 128 + signal.SIGTERM for c in ended)
            echo.stop(stops=not first)
            for rank, f in sorted(e.failures.items()):  # (a rank ended by a signal it does not handle says nothing)
                if f.exitcode < 0 and not (first and -f.exitcode == signal.SIGTERM):
                    name = signal.Signals(-f.exitcode).name if -f.exitcode in signal.valid_signals() else \
                        f"signal {-f.exitcode}"
                    with past_hangup():
                        print(f"error: rank {rank} of {n} was killed by {name}" + (
                            " (the kernel's out-of-memory killer sends it when the machine's RAM runs out: see "
                            "`dmesg`; lower offload.host_memory_limit or nproc_per_node)"
                            if -f.exitcode == signal.SIGKILL else ""), file=sys.stderr, flush=True)
            return exit_code(ended)
        except SignalException:
            # the ranks have finished their step and saved, or failed to, or were killed when the wait ran out
            # (no code left: 128 + SIGKILL)
            return exit_code([_left(codes, r) for r in range(n)])
        finally:
            echo.stop()
            del os.environ[EXIT_DIR], os.environ[LAUNCHER]
    return 0


class _Echo:
    """The launcher's thread that says its ranks' error lines (``say``) on its stderr as they come, each
    distinct line once; ``stop`` says those left and ends it. A rank's line that a signal stopped it is held
    to the end: where another rank failed first, the signal was the launcher's ending it, no news."""

    STOPPED = re.compile(r"SIG[A-Z]+( again)?: ")

    def __init__(self, folder: str):
        self.folder, self.said, self.held = folder, set(), []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slideformer-echo", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self._sweep()

    def _sweep(self) -> None:
        try:  # (in the order they were left: a cause before the other ranks' line that they lost it)
            found = sorted((e.stat().st_mtime_ns, e.path) for e in os.scandir(self.folder)
                           if e.name.startswith("line-") and not e.name.endswith(".tmp"))
        except OSError:
            return
        for _, path in found:
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    line = f.read()
            except OSError:
                continue
            if line not in self.said:
                self.said.add(line)
                if self.STOPPED.match(line):
                    self.held.append(line)
                    continue
                with past_hangup():
                    print(line, file=sys.stderr, flush=True)

    def stop(self, stops: bool = True) -> None:
        """The lines left said, and the stop lines held with them where ``stops``."""
        self._stop.set()
        self._thread.join()
        self._sweep()
        held, self.held = self.held, []
        for line in held if stops else ():
            with past_hangup():
                print(line, file=sys.stderr, flush=True)


def exit_code(codes: list[int]) -> int:
    """The job's exit code from its ranks' (in the order they ended, where known): a rank's own error (1 to 127
    but 7) before 7 (it lost another rank: a consequence) before an end by a signal (128 + N: the launcher's
    SIGTERM to the others once one had failed, or the user's), the first of each; 0 if every rank's is."""
    failed = [c for c in codes if c != 0]
    if not failed:
        return 0
    return min(failed, key=lambda c: (0 if 0 < c < 128 and c != 7 else 1 if c == 7 else 2, failed.index(c)))


def follow_launcher() -> None:
    """A rank of our launcher is sent SIGTERM by the kernel when the launcher dies (Linux's parent-death
    signal): killed outright, it could not pass a signal on, and the ranks, each in a session of its own,
    would train on unseen and keep the folder locked. As for any signal, the step finishes and is saved."""
    parent = os.environ.get(LAUNCHER)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # (1: PR_SET_PDEATHSIG)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # (it was gone before the request)
        os.kill(os.getpid(), signal.SIGTERM)


def _left(folder: str, rank: int) -> int:
    try:
        with open(os.path.join(folder, str(rank))) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 128 + 9


def end_rank(code: int):
    """A rank's end: its code left for our launcher, the process's exit handlers run (an NVMe tier's files
    removed), then ``os._exit``, not the interpreter's finalization: a gloo thread may still be releasing a
    finished collective, which takes the GIL, and during finalization that aborts the process (SIGABRT) or
    waits forever. What the run wrote is closed by now (train's finally)."""
    import atexit

    leave_code(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # (a closed pipe: nothing more can be said there)
            pass
    os._exit(code)
