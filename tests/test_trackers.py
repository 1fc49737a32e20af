"""report_to (train/trackers.py): TensorBoard, Weights & Biases and MLflow, the last two in their offline modes."""
import pytest

from slideformer.config import ConfigError
from slideformer.train.config import load_config
from slideformer.train.loop import train

FAST = ["progress=false", "device=cpu", "micro_batch_size=4", "logging_steps=1", "max_steps=3"]


def test_every_tracker_gets_the_scalars_and_the_runs_metadata(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    cfg = load_config(None, FAST + [f"output_dir={out}", "val_size=0.1", "eval_steps=3"])
    cfg.report_to = ["tensorboard", "wandb", "mlflow"]
    losses = [h["loss"] for h in train(cfg.validate())["history"]]
    assert list((out / "tensorboard").glob("events.*"))
    # wandb, offline: a run whose record (the .wandb file `wandb sync` uploads) holds the scalars and the config
    (run,) = (out / "wandb").glob("offline-run-*")
    (record,) = run.glob("run-*.wandb")
    data = record.read_bytes()
    assert all(key in data for key in (b"train/loss", b"train/epoch", b"eval/perplexity", b"eval/tokens",
                                       b"learning_rate", b"versions"))
    # mlflow, a file store under output_dir: every step's loss, and the run's metadata as parameters
    from mlflow.tracking import MlflowClient

    client = MlflowClient((out / "mlruns").resolve().as_uri())
    (r,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [m.value for m in client.get_metric_history(r.info.run_id, "train_loss")] == pytest.approx(losses)
    assert r.data.params["versions.slideformer"] and "model.params" in r.data.params


def test_wandb_without_a_login_is_one_line(tmp_path, monkeypatch):
    """No W&B login: a config error naming the fixes, not an unexpected one; offline, a resumed run logs a
    W&B run of its own."""
    import wandb

    wandb.teardown()  # (its settings are read once a process, at its first run)
    for k in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="report_to: wandb could not start its run .*WANDB_MODE=offline"):
        train(load_config(None, FAST + [f"output_dir={out}", "report_to=wandb"]))
    wandb.teardown()
    monkeypatch.setenv("WANDB_MODE", "offline")
    train(load_config(None, FAST + [f"output_dir={out}", "report_to=wandb", "overwrite_output_dir=true"]))
    train(load_config(None, FAST + [f"output_dir={out}", "report_to=wandb", "max_steps=4"]))
    runs = sorted((out / "wandb").glob("offline-run-*"))
    # (a resumed run is a W&B run of its own: W&B drops steps below its last, which a resumed run logs again)
    assert len(runs) == 2 and len({r.name.rsplit("-", 1)[1] for r in runs}) == 2
    wandb.teardown()


def test_an_unreachable_mlflow_server_is_one_line_and_a_rerun_continues(tmp_path, monkeypatch):
    """MLflow's server not answering: a config error naming the URI and the fix (not an unexpected one), with
    no MLflow run left active in the process and the folder as it was, so the fixed command runs."""
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # (the discard port: refused at once)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"report_to: mlflow could not start its run at http://127.0.0.1:9 .*"
                                          "MLFLOW_TRACKING_URI"):
        train(load_config(None, FAST + [f"output_dir={out}", "report_to=[tensorboard, mlflow]"]))
    assert mlflow.active_run() is None and not out.exists()
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert train(load_config(None, FAST + [f"output_dir={out}", "report_to=mlflow"]))["status"] == "finished"


def test_none_and_unknown_trackers(tmp_path):
    out = tmp_path / "run"
    train(load_config(None, FAST + [f"output_dir={out}", "report_to=none"]))
    assert not (out / "tensorboard").exists()
    with pytest.raises(ConfigError, match="report_to: 'comet' is not a tracker"):
        load_config(None, ["report_to=comet"])


def test_tensorboard_shows_one_curve_after_a_run_killed_before_its_first_checkpoint(tmp_path):
    """A run killed before its first checkpoint starts again from step 0 in the same folder: its earlier steps'
    events are purged from TensorBoard's view (as a resumed run's past its checkpoint), not shown twice."""
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from slideformer.train.trackers import Trackers

    for value, steps in ((9.0, (1, 2, 3)), (1.0, (1, 2))):
        t = Trackers(["tensorboard"], tmp_path, 0, {"run": "x"})
        for s in steps:
            t.scalars({"loss": value + s}, s, "train")
        t.close()
        time.sleep(1.1)  # (event files are named by the second they were opened in: read in that order)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.0), (2, 3.0)]
    # a new run over this one, killed before its first write (purge False: OutputDir.begin not reached),
    # hides none of it
    Trackers(["tensorboard"], tmp_path, 0, {"run": "y"}, purge=False).close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.0), (2, 3.0)]


@pytest.mark.parametrize("package,module,error", [("tensorboard", "torch.utils.tensorboard", TypeError),
                                                   ("mlflow", "mlflow", TypeError), ("mlflow", "mlflow", ImportError)])
def test_a_tracker_installed_broken_is_one_line_naming_it(tmp_path, monkeypatch, capsys, package, module, error):
    """A tracker installed but failing as it is imported (a protobuf mismatch: a TypeError, or an ImportError of
    a name inside it): one line naming report_to and the package (was exit 1, "unexpected TypeError ...
    please report it", or "pip install" it)."""
    import sys

    from slideformer.cli import main

    import importlib.machinery

    class Broken:  # (found, and failing as its code runs)
        def find_spec(self, name, path=None, target=None):
            return importlib.machinery.ModuleSpec(name, self) if name == module else None

        def create_module(self, spec):
            return None

        def exec_module(self, mod):
            raise error("Descriptors cannot be created directly.")

    from slideformer.train import loop

    def no_tokenizer(*a, **k):
        raise AssertionError("refused after the tokenizer, the data and the model")

    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Broken()] + sys.meta_path)
    monkeypatch.setattr(loop, "load_tokenizer", no_tokenizer)  # (refused before the model loads)
    out = tmp_path / "o"
    assert main(["train"] + FAST + [f"output_dir={out}", f"report_to={package}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"report_to: {package} is installed but cannot be imported ({error.__name__}" in err
    assert not out.exists()


def test_a_tensorboard_folder_it_cannot_write_is_one_line_naming_it(tmp_path, capsys):
    """TensorBoard's own OSError (its folder a file here; a full or read-only disk alike) names the folder and
    the fix, not a bare strerror or a bytes path."""
    from slideformer.cli import main

    out = tmp_path / "o"
    out.mkdir()
    (out / "tensorboard").write_text("not a folder")
    assert main(["train"] + FAST + [f"output_dir={out}", "report_to=tensorboard", "overwrite_output_dir=true"]) == 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write TensorBoard's events in {out / 'tensorboard'}" in err
    assert "leave tensorboard out of report_to" in err and (out / "tensorboard").read_text() == "not a folder"


def test_a_tracker_failing_mid_run_is_said_once_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    """A full disk under tensorboard/ (or a tracking server gone) at step 2: one line naming the tracker and
    the error, the run trains to its end and saves (stopping would lose the steps since the last checkpoint),
    and metrics.jsonl holds every step."""
    import errno
    import json

    import mlflow
    from torch.utils.tensorboard import SummaryWriter

    from slideformer.cli import main

    real, calls = SummaryWriter.add_scalar, []

    def full(self, *a, **k):
        calls.append(a)
        if a[-1] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(SummaryWriter, "add_scalar", full)
    monkeypatch.setattr(mlflow, "log_metrics", lambda *a, **k: (_ for _ in ()).throw(ConnectionError("server gone")))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "o"
    assert main(["train"] + FAST + [f"output_dir={out}", "report_to=[tensorboard,mlflow]", "max_steps=4"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "report_to" in line]
    assert len(err) == 2 and "report_to mlflow failed at step 1 (ConnectionError: server gone)" in err[0]
    assert "report_to tensorboard failed at step 2" in err[1] and "No space left on device" in err[1]
    assert max(a[-1] for a in calls) == 2  # (written no more)
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert (out / "checkpoint-4").is_dir()


def test_mlflow_runs_say_how_each_attempt_ended_and_which_run_they_belong_to(tmp_path, monkeypatch):
    """An interrupted attempt is KILLED (resumable), its resume a run of its own tagged with the same
    slideformer.run_id, FINISHED at the end; a run that stops on an error is FAILED, not FINISHED."""
    from mlflow.tracking import MlflowClient

    from slideformer.cli import main
    from test_train import interrupt_at_step

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    real = interrupt_at_step(monkeypatch, 2)
    assert main(["train"] + FAST + [f"output_dir={out}", "report_to=mlflow", "max_steps=4"]) == 130
    from slideformer.engine import SlideEngine

    monkeypatch.setattr(SlideEngine, "train_step", real)
    try:  # (a caller's own exception being handled is not the run's: it finishes)
        raise RuntimeError("the caller's")
    except RuntimeError:
        assert main(["train"] + FAST + [f"output_dir={out}", "report_to=mlflow", "max_steps=4"]) == 0
    bad = tmp_path / "bad"
    assert main(["train"] + FAST + [f"output_dir={bad}", "report_to=mlflow", "learning_rate=1e6",
                                    "max_grad_norm=null", "warmup_ratio=0", "max_steps=6"]) == 4

    def runs(folder):
        client = MlflowClient((folder / "mlruns").resolve().as_uri())
        found = client.search_runs([e.experiment_id for e in client.search_experiments()])
        return sorted((r.info.start_time, r.info.status, r.data.tags.get("slideformer.run_id")) for r in found)

    (_, first, a), (_, second, b) = runs(out)
    assert (first, second) == ("KILLED", "FINISHED") and a == b and a
    assert [r[1] for r in runs(bad)] == ["FAILED"]


def test_a_tensorboard_folder_it_may_not_write_in_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """A read-only tensorboard/ (a mount, another user's): one line naming it, before any model is loaded."""
    import os

    from slideformer.cli import main
    from slideformer.engine import SlideEngine

    out = tmp_path / "o"
    (out / "tensorboard").mkdir(parents=True)
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: os.path.basename(p) != "tensorboard" and
                        access(p, mode, **k))
    monkeypatch.setattr(SlideEngine, "from_config", lambda *a, **k: pytest.fail("the model loaded"))
    assert main(["train"] + FAST + [f"output_dir={out}", "report_to=tensorboard", "overwrite_output_dir=true"]) == 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write TensorBoard's events in {out / 'tensorboard'}: not writable" in err


def test_runs_in_one_process_leave_the_callers_trackers_as_they_were(tmp_path, monkeypatch):
    """A notebook's sweep: a caller's own MLflow run stays active (a training run is its child) and its
    tracking URI, environment and W&B run are as they were; a signal while the trackers open leaves no run
    or writer behind, and the next run starts."""
    import os
    import signal
    import threading

    import mlflow
    import wandb

    from slideformer.signals import Interrupted

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    before = mlflow.get_tracking_uri()
    threads = set(threading.enumerate())
    real = mlflow.log_params
    monkeypatch.setattr(mlflow, "log_params", lambda *a, **k: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(Interrupted):
        train(load_config(None, FAST + [f"output_dir={tmp_path / 'cut'}", "report_to=[tensorboard, mlflow]"]))
    monkeypatch.setattr(mlflow, "log_params", real)
    assert mlflow.active_run() is None and set(threading.enumerate()) <= threads
    assert mlflow.get_tracking_uri() == before and "MLFLOW_TRACKING_URI" not in os.environ
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # (the caller's own store, in a folder of theirs)
    mlflow.set_tracking_uri((tmp_path / "theirs").as_uri())
    mine = wandb.init(project="mine", dir=str(tmp_path))
    try:
        with mlflow.start_run() as theirs:
            for k in range(2):
                train(load_config(None, FAST + [f"output_dir={tmp_path / f'run{k}'}", "report_to=[mlflow, wandb]"]))
                assert mlflow.active_run().info.run_id == theirs.info.run_id
                mine.log({"still": k})  # (not finished by the training's own W&B run)
        client = mlflow.tracking.MlflowClient()
        children = client.search_runs([theirs.info.experiment_id],
                                      f"tags.mlflow.parentRunId = '{theirs.info.run_id}'")
        assert sorted(r.info.status for r in children) == ["FINISHED", "FINISHED"]
        assert client.get_run(theirs.info.run_id).info.status == "FINISHED"
        assert mlflow.get_tracking_uri() == (tmp_path / "theirs").as_uri()
    finally:
        mine.finish()
        mlflow.set_tracking_uri(None)  # (unset, as a process starts)
