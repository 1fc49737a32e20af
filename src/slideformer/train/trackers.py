"""Experiment tracking (``report_to``): where the loop's scalars and the run's metadata go.

TensorBoard (the default) writes under ``output_dir/tensorboard``; Weights & Biases and MLflow go through their
own clients, optional extras imported only when asked for. Their own settings choose where runs go (WANDB_MODE,
WANDB_PROJECT; MLFLOW_TRACKING_URI); without a tracking URI, MLflow writes under ``output_dir/mlruns``. A
resumed run logs its steps from where its checkpoint left off (TensorBoard drops the events after it).
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

TRACKERS = ("tensorboard", "wandb", "mlflow")


def parse(report_to) -> list[str]:
    """``report_to`` as a list: a name, a list of names, "none" or an empty list."""
    from ..config import ConfigError

    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    names = [n for n in names if n != "none"]
    import importlib.util

    for n in names:
        if n not in TRACKERS:
            raise ConfigError(f"report_to: {n!r} is not a tracker; use {', '.join(TRACKERS)} or none")
        if importlib.util.find_spec(n) is None:  # (each tracker's client module has its name)
            raise ConfigError(f"report_to: {n} needs its client, which is not installed: pip install "
                              f"{'mlflow-skinny' if n == 'mlflow' else n} (or pip install 'slideformer[tracking]')")
    return names


def client(name: str):
    """The tracker's client module (TensorBoard's writer module for tensorboard), imported; a ConfigError naming
    report_to where it is missing or installed broken (a protobuf mismatch fails as its code runs). Called
    before the model loads too (``preflight``), so that a run is refused before that wait."""
    from ..config import ConfigError

    module = {"tensorboard": "torch.utils.tensorboard"}.get(name, name)
    package = {"mlflow": "mlflow-skinny"}.get(name, name)
    import importlib
    import importlib.util

    try:
        return importlib.import_module(module)
    except Exception as e:
        if isinstance(e, ImportError) and importlib.util.find_spec(name) is None:
            raise ConfigError(f"report_to: {name} needs its client (pip install {package})") from None
        raise ConfigError(f"report_to: {name} is installed but cannot be imported ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:200]}); reinstall it, or leave {name} out of "
                          "report_to") from None


def preflight(names: list[str], out: Path) -> None:
    """What opening the trackers would refuse, found before the model loads: a client that cannot be
    imported, TensorBoard's folder a file or one this process cannot write in."""
    from .outdir import TENSORBOARD

    for name in names:
        client(name)
    tb = out / TENSORBOARD
    if "tensorboard" in names and tb.exists() and not tb.is_dir():
        raise OSError(20, f"cannot write TensorBoard's events in {tb}: it is a file; move it away, or leave "
                          "tensorboard out of report_to")
    if "tensorboard" in names and tb.is_dir() and not os.access(tb, os.W_OK | os.X_OK):  # (read-only too)
        raise OSError(13, f"cannot write TensorBoard's events in {tb}: not writable; make it writable, or leave "
                          "tensorboard out of report_to")


class Trackers:
    def __init__(self, names: list[str], out: Path, start: int, meta: dict, purge: bool = True, run_id: str = ""):
        """Open each tracker and log ``meta`` (config, model, versions, machine) once. A resumed run is a W&B
        and an MLflow run of its own (W&B ignores steps below one it has logged, which a resumed run logs
        again), grouped (W&B) or tagged (MLflow, slideformer.run_id) by ``run_id`` with the attempts before
        it; a caller's own active run is left active (W&B: this one beside it; MLflow: this one its child).
        ``purge``: TensorBoard drops the folder's events past ``start`` from its view (False for a new run that has not
        yet written over an earlier run's folder: that run's events stay until it does, and go then). ``run_id``
        names TensorBoard's files (``events_suffix``: which files a later run may remove)."""
        self._tb = self._wandb = self._mlflow = None
        self._undo: list = []  # (what this run set in the process for mlflow, undone as it closes)
        try:  # (a failure or a signal while they open: those opened are closed, nothing left in the process)
            self._open(names, out, start, meta, purge, run_id)
        except BaseException:
            self.close("failed")
            raise

    def _open(self, names: list[str], out: Path, start: int, meta: dict, purge: bool, run_id: str) -> None:
        from ..config import ConfigError
        from .outdir import MLRUNS, TENSORBOARD, events_suffix

        if "tensorboard" in names:
            SummaryWriter = client("tensorboard").SummaryWriter
            # (an earlier attempt's steps past ``start``, a killed one's too, are dropped from the view)
            self._tb_dir = out / TENSORBOARD
            with self._writing():
                self._tb = SummaryWriter(str(self._tb_dir), purge_step=start + 1 if purge else None,
                                         filename_suffix=events_suffix(run_id) if run_id else "")
                self._tb.add_text("run", "\n".join(f"    {k}: {v}" for k, v in _flat(meta).items()), start)
        if "wandb" in names:
            wandb = client("wandb")
            # (a caller's own run stays theirs: this one is made beside it, not by finishing it)
            beside = {"reinit": "create_new"} if wandb.run is not None else {}
            try:
                self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "slideformer"), name=out.name,
                                         dir=str(out), config=meta, group=run_id or None, **beside)
            except Exception as e:  # (no login, no network: wandb's own errors, before any step)
                raise ConfigError(f"report_to: wandb could not start its run ({type(e).__name__}: "
                                  f"{(str(e).splitlines() or [''])[0][:200]}); log in (wandb login, or "
                                  "WANDB_API_KEY), set WANDB_MODE=offline, or leave wandb out of report_to") from None
        if "mlflow" in names:
            mlflow = client("mlflow")
            # (a file store, a user's or ours, is allowed: mlflow-skinny has no database one)
            if "MLFLOW_ALLOW_FILE_STORE" not in os.environ:
                os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
                self._undo.append(lambda: os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None))
            # (set each run: mlflow keeps a URI set in the process, an earlier run's folder, over the variable)
            if uri := os.environ.get("MLFLOW_TRACKING_URI"):
                mlflow.set_tracking_uri(uri)
            else:  # (its variable too, which mlflow sets with it: both unset again as the run closes)
                mlflow.set_tracking_uri((out / MLRUNS).resolve().as_uri())
                self._undo.append(lambda: mlflow.set_tracking_uri(None))
            try:  # (a caller's own active run: this one is its child, and it stays active after)
                mlflow.start_run(run_name=out.name, tags={"slideformer.run_id": run_id} if run_id else None,
                                 nested=mlflow.active_run() is not None)
                self._mlflow = mlflow  # (from here closing ends this run)
                mlflow.log_params({k: str(v)[:500] for k, v in _flat(meta).items()})
            except Exception as e:  # (an unreachable or refusing server: mlflow's own errors, before any step)
                raise ConfigError(f"report_to: mlflow could not start its run at {mlflow.get_tracking_uri()} "
                                  f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}); check "
                                  "MLFLOW_TRACKING_URI and the server, or leave mlflow out of report_to") from None

    def scalars(self, values: dict, step: int, prefix: str) -> None:
        """``values`` (None entries skipped) as ``prefix/name`` at ``step``. A tracker that fails here (a full
        disk, a server gone) is said once and written no more: the run goes on, metrics.jsonl holds every
        record, and stopping would cost the steps since the last checkpoint."""
        values = {f"{prefix}/{k}": float(v) for k, v in values.items() if v is not None}
        if self._tb is not None:
            with self._dropping("tensorboard", f"at step {step}"):
                with self._writing():
                    for k, v in values.items():
                        self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            with self._dropping("wandb", f"at step {step}"):
                self._wandb.log(values, step=step)
        if self._mlflow is not None:
            with self._dropping("mlflow", f"at step {step}"):
                self._mlflow.log_metrics({k.replace("/", "_"): v for k, v in values.items()}, step=step)

    @contextlib.contextmanager
    def _dropping(self, name: str, when: str):
        try:
            yield
        except Exception as e:
            print(f"slideformer: report_to {name} failed {when} ({type(e).__name__}: "
                  f"{(str(e).splitlines() or [''])[0][:300]}): written no more this run; metrics.jsonl has every "
                  "record", file=sys.stderr, flush=True)
            attr = {"tensorboard": "_tb", "wandb": "_wandb", "mlflow": "_mlflow"}[name]
            client = getattr(self, attr)
            setattr(self, attr, None)
            with contextlib.suppress(Exception):  # (its file, thread or run let go, as far as it can be)
                client.close() if name == "tensorboard" else client.finish() if name == "wandb" else \
                    client.end_run("FAILED")

    @contextlib.contextmanager
    def _writing(self):
        """TensorBoard's OSError (its writer's, often without a file name) as one naming its folder."""
        try:
            yield
        except OSError as e:
            raise OSError(e.errno, f"cannot write TensorBoard's events in {self._tb_dir}: {e.strerror or e}; free "
                                   "space there, make it writable, or leave tensorboard out of report_to") from e

    def close(self, outcome: str = "finished") -> None:
        """Each tracker closed, once; W&B and MLflow mark the run by ``outcome``: finished, interrupted
        (resumable: MLflow's KILLED) or failed (W&B: a non-zero exit code either way). What the run set in
        the process for mlflow is put back."""
        if self._tb is not None:
            with self._dropping("tensorboard", "as the run closed it"), self._writing():
                self._tb.close()
            self._tb = None
        if self._wandb is not None:
            with self._dropping("wandb", "as the run closed it"):
                self._wandb.finish(exit_code=0 if outcome == "finished" else 1)
            self._wandb = None
        if self._mlflow is not None:
            with self._dropping("mlflow", "as the run closed it"):
                self._mlflow.end_run({"finished": "FINISHED", "interrupted": "KILLED"}.get(outcome, "FAILED"))
            self._mlflow = None
        while self._undo:
            self._undo.pop()()


def _flat(meta: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in meta.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def run_meta(cfg, engine, device: str) -> dict:
    """What a run is, logged once: its config, the model, the versions and the machine."""
    import dataclasses
    import platform

    import torch
    import transformers

    from .. import __version__
    from ..machine import describe

    return {"config": {k: str(v) for k, v in dataclasses.asdict(cfg).items()},
            "model": {"params": engine.adapter.num_params, "model_type": engine.adapter.model_type,
                      "engine": engine.describe()},
            "versions": {"slideformer": __version__, "torch": torch.__version__,
                         "transformers": transformers.__version__, "python": platform.python_version()},
            "machine": {**describe(), "device": device}}
