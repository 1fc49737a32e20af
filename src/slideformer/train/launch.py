"""``nproc_per_node``: one process per GPU from one command, without typing torchrun.

`slideformer train` with ``nproc_per_node`` above 1 runs itself again under torch's elastic launcher
(torchrun's, in this process) as N ranks on this machine; the ranks are the data parallel of parallel.py.
This process then does what torchrun's would (it starts, watches and stops the ranks), with three
differences a user sees:

- the exit code is the documented one of the rank that failed first, where torchrun exits 1 with a table
  and a traceback; each rank prints its own one-line error;
- a signal to this process reaches the ranks, which finish their step and save; they get as long as a
  checkpoint may take (``SAVE_LIMIT_S``), not torchrun's 30 seconds before it kills them;
- each rank's CPU threads are its share of the cores (torchrun sets one), where OMP_NUM_THREADS is unset.

Under torchrun itself the key only has to agree with it: torchrun's --nproc-per-node decides.
"""
from __future__ import annotations

import os
import sys

from ..config import ConfigError
from ..watchdog import SAVE_LIMIT_S


def processes(asked, device: str | None) -> int:
    """How many processes `train` runs on this machine: ``asked`` (a number, or "auto": one per GPU), 1 in a
    process that a launcher started (its count decides)."""
    if "WORLD_SIZE" in os.environ or "LOCAL_WORLD_SIZE" in os.environ:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is not None and asked != "auto" and asked != 1 and asked != int(local):
            raise ConfigError(f"nproc_per_node: {asked}, but torchrun started {local} processes on this machine: "
                              "leave nproc_per_node out under torchrun (its --nproc-per-node decides), or run "
                              "`slideformer train` without torchrun")
        return 1
    import torch

    gpus = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0
    if asked == "auto":
        return max(1, gpus)
    if device != "cpu" and asked > max(1, gpus):
        raise ConfigError(f"nproc_per_node: {asked} processes, one per GPU, but this machine has {gpus} GPU(s): set "
                          f"nproc_per_node: {max(1, gpus)} (or auto), or device: cpu for ranks on the CPU")
    return asked


def launch(n: int, argv: list[str]) -> int:
    """Run ``python -m slideformer *argv`` as ``n`` ranks on this machine; their exit code."""
    import dataclasses
    import logging
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # (the launcher's log lines: each rank prints its own, and a failure's exit code is returned below; each
    # of its loggers has a level of its own)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    kw = dict(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=str(uuid.uuid4()), rdzv_backend="c10d",
              rdzv_endpoint="localhost:0", max_restarts=0)
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:  # (not in every torch)
        kw["shutdown_timeout"] = int(SAVE_LIMIT_S)
    try:
        elastic_launch(LaunchConfig(**kw), sys.executable)("-m", "slideformer", *argv)
    except ChildFailedError as e:
        return _first_exit_code(e.failures)
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


def _first_exit_code(failures: dict) -> int:
    """The exit code of the rank that failed first. Once one has, the launcher ends the others with SIGTERM, and
    records how they ended too, all within the same second (its timestamps' unit): in a tie, a rank's own code
    (1 to 127) comes before one a signal gave (128 + N, or -N for a death by signal N), then the lowest rank."""
    def code(f) -> int:
        return f.exitcode if f.exitcode >= 0 else 128 - f.exitcode

    first = min(failures.items(), key=lambda kv: (kv[1].timestamp, not 0 < code(kv[1]) < 128, kv[0]))[1]
    return code(first)
