"""train/launch.py: `slideformer train nproc_per_node=N` runs N ranks itself, as torchrun would, with each
rank's documented exit code, and a Ctrl-C that the ranks save on (gloo on the CPU)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from slideformer.config import ConfigError
from slideformer.train.config import load_config
from slideformer.train.launch import processes

from tiny import children

COMMON = ["progress=false", "logging_steps=1", "gradient_accumulation_steps=2", "max_grad_norm=1.0"]


def _slideformer(tmp_path, *args: str, new_session: bool = False) -> subprocess.Popen:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", SLIDEFORMER_TEST_TAG=str(tmp_path))  # (see _left_running)
    env.pop("OMP_NUM_THREADS", None)  # (the launcher's share of the cores)
    return subprocess.Popen([sys.executable, "-m", "slideformer", "train", *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=new_session)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")])])
def test_two_processes_train_the_global_batch_as_one_process(tmp_path, device):
    """Over gloo on the CPU, over NCCL on two GPUs (fp32; the GPU's sums in another order: 1e-4)."""
    from slideformer.train.loop import train

    common = [*COMMON, f"device={device}", "bf16=false"]
    p = _slideformer(tmp_path, *common, "max_steps=3", "micro_batch_size=2", "nproc_per_node=2",
                     f"output_dir={tmp_path / 'two'}")
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0, out
    assert "(rank 0 of 2)" in out and "Traceback" not in out
    one = train(load_config(None, common + ["max_steps=3", "micro_batch_size=4", f"output_dir={tmp_path / 'one'}"]))
    logged = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logged] == pytest.approx([h["loss"] for h in one["history"]],
                                                         rel=1e-5 if device == "cpu" else 1e-4)
    assert [c.name for c in (tmp_path / "two").glob("checkpoint-*")] == ["checkpoint-3"]


def test_a_ranks_error_is_one_line_and_its_exit_code(tmp_path):
    """torchrun would exit 1 with its failure table and a traceback; here the ranks' line and code (2: bad
    data), the line once though every rank read the same file, and no process left."""
    (tmp_path / "bad.jsonl").write_text("not json\n")
    p = _slideformer(tmp_path, *COMMON, "device=cpu", "max_steps=3", "nproc_per_node=2",
                     f"dataset={tmp_path / 'bad.jsonl'}", f"output_dir={tmp_path / 'o'}", new_session=True)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 2, out
    assert out.count("bad.jsonl:1: not valid JSON") == 1, out
    assert "Traceback" not in out and "ChildFailedError" not in out and "torch.distributed" not in out, out
    time.sleep(0.5)
    assert _left_running(tmp_path) == []  # nothing the launcher started is left


def test_a_dataset_smaller_than_the_ranks_is_refused_with_the_fix(tmp_path):
    """One sample for two ranks: the second would have no row of the step; refused with one line (exit 2),
    where one process trains on what there is."""
    (tmp_path / "one.jsonl").write_text('{"text": "a single record of text"}\n')
    p = _slideformer(tmp_path, *COMMON, "device=cpu", "max_steps=2", "micro_batch_size=2", "nproc_per_node=2",
                     f"dataset={tmp_path / 'one.jsonl'}", f"output_dir={tmp_path / 'o'}", new_session=True)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 2, out
    assert out.count("the dataset has 1 sample(s), fewer than the 2 processes") == 1, out
    assert "use nproc_per_node: 1 or more data" in out and "Traceback" not in out, out


def _left_running(tmp_path) -> list[int]:
    """The processes started for this test still running: the ranks run in sessions of their own, so they
    are found by the tag in their environment."""
    tag = f"SLIDEFORMER_TEST_TAG={tmp_path}".encode() + b"\0"
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if tag in f.read():
                    left.append(int(pid))
        except OSError:
            pass
    return left


def _at_step_2(tmp_path, act) -> tuple[subprocess.Popen, str]:
    """A two-rank job that trains on, ``act(launcher)`` once step 2 is said; the launcher and all it said."""
    p = _slideformer(tmp_path, *COMMON, "device=cpu", "max_steps=100000", "micro_batch_size=2", "nproc_per_node=2",
                     f"output_dir={tmp_path / 'o'}", new_session=True)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if line.startswith("step 2/"):
            act(p)
            break
    return p, "".join(seen) + p.communicate(timeout=120)[0]


@pytest.mark.parametrize("sig,code,ranks_too", [("SIGINT", 130, False), ("SIGTERM", 143, True),
                                                  ("SIGHUP", 129, True)])
def test_a_signal_saves_the_step_on_every_rank_and_exits_with_its_code(tmp_path, sig, code, ranks_too):
    """A signal to the launcher reaches each rank (in a session of its own) through it; a job scheduler's to
    every process (or `pkill -f`) reaches each rank twice at once, which is still one request to stop after
    the step (signals.py)."""
    def send(p):
        ranks = children(p.pid) if ranks_too else []
        assert len(ranks) == (2 if ranks_too else 0), ranks
        for pid in [p.pid, *ranks]:
            os.kill(pid, getattr(signal, sig))
    p, out = _at_step_2(tmp_path, send)
    assert p.returncode == code, out
    assert f"{sig}: stopped after step" in out and "again" not in out and "Traceback" not in out, out
    saved = list((tmp_path / "o").glob("checkpoint-*"))
    assert len(saved) == 1 and (saved[0] / "state" / "trainer.json").is_file(), out


def test_a_rank_killed_outright_is_named_with_the_likely_cause(tmp_path):
    """SIGKILL to one rank (the kernel's out-of-memory killer): it says nothing itself, and the others only
    that they lost it; the launcher, which saw how it ended, names the rank, the signal and the likely cause."""
    def kill_rank1(p):
        rank1 = next(r for r in children(p.pid) if "RANK=1" in open(f"/proc/{r}/environ").read().split("\0"))
        os.kill(rank1, signal.SIGKILL)
    p, out = _at_step_2(tmp_path, kill_rank1)
    assert p.returncode == 7, out
    assert "error: rank 1 of 2 was killed by SIGKILL (the kernel's out-of-memory killer" in out, out
    assert "Traceback" not in out


def test_ranks_whose_launcher_is_killed_save_their_step_and_end(tmp_path):
    """SIGKILL to the launcher (an OOM killer, `kill -9`) passes nothing on; the kernel then sends each rank
    SIGTERM (the parent-death signal), so none trains on alone holding the folder: they save and end."""
    p = _slideformer(tmp_path, *COMMON, "device=cpu", "max_steps=100000", "micro_batch_size=2", "nproc_per_node=2",
                     f"output_dir={tmp_path / 'o'}", new_session=True)
    for line in p.stdout:
        if line.startswith("step 2/"):
            assert len(children(p.pid)) == 2
            os.kill(p.pid, signal.SIGKILL)
            break
    p.wait(timeout=60)
    deadline = time.time() + 120
    while _left_running(tmp_path) and time.time() < deadline:
        time.sleep(0.5)
    left = _left_running(tmp_path)
    for pid in left:  # (not to leave them to the rest of the suite)
        os.kill(pid, signal.SIGKILL)
    assert left == []
    saved = list((tmp_path / "o").glob("checkpoint-*"))
    assert len(saved) == 1 and (saved[0] / "state" / "trainer.json").is_file()


def test_under_nohup_the_launcher_leaves_sighup_ignored(monkeypatch):
    """torch's agent would take SIGHUP (ignored or not) and pass it on to the ranks, which would save and stop."""
    import signal

    from torch.distributed import launcher

    from slideformer.train import launch as mod

    seen = []

    def fake(config, entrypoint):
        seen.append(config)
        return lambda *a: None

    monkeypatch.setattr(launcher.api, "elastic_launch", fake)
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert mod.launch(2, ["train"]) == 0
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert mod.launch(2, ["train"]) == 0
    finally:
        signal.signal(signal.SIGHUP, before)
    if not hasattr(seen[0], "signals_to_handle"):
        pytest.skip("this torch's launcher has no signals_to_handle")
    assert "SIGHUP" not in seen[0].signals_to_handle and "SIGTERM" in seen[0].signals_to_handle
    assert "SIGHUP" in seen[1].signals_to_handle


def test_how_many_processes(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert processes(1, None) == 1
    assert processes(3, "cpu") == 3  # (ranks on the CPU: gloo)
    assert processes("auto", "cpu") == 1
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)
    assert processes("auto", None) == 4 and processes(2, "cuda") == 2
    with pytest.raises(ConfigError, match="has 4 GPU"):
        processes(8, None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # (a leftover: it halved the global batch, one process training)
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE=2 is set, but WORLD_SIZE is not"):
        processes(2, "cpu")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE=2 is set, but WORLD_SIZE is 1"):
        processes(2, "cpu")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("WORLD_SIZE", "1")  # (a cluster's environment, not a launcher's)
    assert processes(3, "cpu") == 3
    monkeypatch.setenv("WORLD_SIZE", "2")  # under a launcher: its count decides, where it says it
    assert processes(1, None) == processes("auto", None) == 1
    with pytest.raises(ConfigError, match="without LOCAL_WORLD_SIZE"):
        processes(2, None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert processes("auto", None) == processes(2, None) == processes(1, None) == 1
    with pytest.raises(ConfigError, match="started 2 processes"):
        processes(4, None)
    for bad in (0, -1, "two", True, 1.5):
        with pytest.raises(ConfigError, match="nproc_per_node"):
            load_config(None, [f"nproc_per_node={bad}"])


def test_more_processes_than_the_ram_holds_are_refused_before_they_start(tmp_path, monkeypatch, capsys):
    """Each rank refused alike after importing torch and reading the data (16 on two cores: a minute); the
    launcher refuses first, with the budget's name and the fix, exit 3. Within it, the ranks start."""
    import slideformer.machine
    from slideformer.cli import main
    from slideformer.train import launch

    monkeypatch.setattr(slideformer.machine, "host_memory", lambda: 8 * 2**30)
    monkeypatch.setattr(launch, "launch", lambda n, argv: 0)  # (not started: what is refused, is before)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    out = f"output_dir={tmp_path / 'o'}"
    assert main(["train", "device=cpu", "nproc_per_node=8", out]) == 3
    assert "the 8 processes on this machine take about 16.0 GiB of host RAM themselves" in capsys.readouterr().err
    assert main(["train", "device=cpu", "nproc_per_node=2", "offload.host_memory_limit=3GiB", out]) == 3
    assert "set it to at least 4.0 GiB or fewer processes (nproc_per_node)" in capsys.readouterr().err
    assert main(["train", "device=cpu", "nproc_per_node=2", out]) == 0


def test_the_exit_code_is_the_cause_not_its_consequences():
    """A rank's own error before 7 (it lost another rank) before an end by signal (the launcher's SIGTERM to
    the rest, once one had failed), the first of each, in the order the ranks ended."""
    from slideformer.train.launch import exit_code

    assert exit_code([3, 7]) == 3 and exit_code([7, 3]) == 3  # (a rank lost the one that failed first)
    assert exit_code([2, 143]) == 2 and exit_code([134, 2]) == 2
    assert exit_code([7, 143, 137]) == 7
    assert exit_code([137, 143]) == 137  # (killed: the first)
    assert exit_code([143, 143]) == 143 and exit_code([130, 5]) == 5  # (a signal, and a save that failed)
    assert exit_code([0, 0]) == 0 and exit_code([0, 143]) == 143


def test_the_same_signal_again_at_once_is_the_same_request(monkeypatch):
    """Within SAME_REQUEST_S of the first a repeat changes nothing; later it ends the run at once."""
    from slideformer import signals as mod

    now = [100.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: now[0])
    s = mod.Signals()
    s._training = True
    s._on_signal(signal.SIGINT, None)
    assert s.requested == signal.SIGINT
    now[0] += mod.SAME_REQUEST_S / 2
    s._on_signal(signal.SIGINT, None)  # the launcher's copy: no exception
    now[0] += mod.SAME_REQUEST_S
    with pytest.raises(mod.Interrupted) as e:
        s._on_signal(signal.SIGINT, None)
    assert e.value.training and "again" in e.value.line()


def test_the_launcher_says_each_distinct_line_of_its_ranks_once(tmp_path, monkeypatch, capsys):
    """What ranks say alike (every rank reads the same bad file) comes out once; a rank's own cause and the
    other ranks' consequence both come out; outside a job of ours a rank prints its line itself."""
    from slideformer import signals
    from slideformer.train import launch

    monkeypatch.setenv(launch.EXIT_DIR, str(tmp_path))
    echo = launch._Echo(str(tmp_path))
    for rank, line in enumerate(["error: data.jsonl:1: not valid JSON", "error: data.jsonl:1: not valid JSON",
                                 "error: rank 3's GPU ran out of memory", "error: another rank failed"]):
        monkeypatch.setenv("RANK", str(rank))
        assert signals.say(line)
    monkeypatch.setenv("RANK", "4")  # (a file name's undecodable bytes, as Python holds them: escaped)
    assert signals.say("error: /data/\udcff.jsonl: not valid JSON")
    echo.stop()
    said = capsys.readouterr().err.splitlines()
    assert sorted(said) == ["error: /data/\\udcff.jsonl: not valid JSON", "error: another rank failed",
                            "error: data.jsonl:1: not valid JSON", "error: rank 3's GPU ran out of memory"]
    assert said.index("error: rank 3's GPU ran out of memory") < said.index("error: another rank failed")
    # a rank's line that a signal stopped it: said at the end, unless another rank failed first (the
    # signal was then the launcher's ending it)
    stopped = "SIGTERM: stopped before a training step had finished; nothing was saved"
    for stops in (True, False):
        (tmp_path / str(stops)).mkdir()
        monkeypatch.setenv(launch.EXIT_DIR, str(tmp_path / str(stops)))
        echo = launch._Echo(str(tmp_path / str(stops)))
        assert signals.say(stopped)
        time.sleep(0.3)  # (the thread's sweeps hold it)
        assert capsys.readouterr().err == ""
        echo.stop(stops=stops)
        echo.stop()  # (the launcher's finally: nothing twice)
        assert capsys.readouterr().err == (stopped + "\n" if stops else "")
    monkeypatch.delenv(launch.EXIT_DIR)
    assert not signals.say("error: anything")


def test_a_rank_signalled_before_the_launcher_module_loads_leaves_its_exit_code(tmp_path):
    """A signal in a rank's first seconds (train/launch.py still importing torch): its line and exit code
    (143) are left for our launcher, which otherwise took the rank for killed (137: the OOM killer's)."""
    code = ("from slideformer.signals import Interrupted, _leave\n"
            "import sys; assert 'slideformer.train.launch' not in sys.modules\n"
            "_leave(Interrupted(15))\n")
    env = {**os.environ, "SLIDEFORMER_EXIT_DIR": str(tmp_path), "RANK": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 143 and (tmp_path / "1").read_text() == "143"
    assert "SIGTERM" in (tmp_path / "line-1").read_text() and not done.stderr
