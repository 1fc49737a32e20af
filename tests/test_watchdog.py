"""No silent hangs, no surprise OOM (watchdog.py): each fires on an injected fault, in a process of its own."""
import subprocess
import sys
import textwrap

from slideformer.checkpoint.state import read_meta
from slideformer.watchdog import EXIT_HANG, FIRST_STEP_LIMIT_S, MIN_LIMIT_S, PACE, SAVE_LIMIT_S, Watchdog

RUN = """
import sys, time, torch
from slideformer import SlideEngine
from slideformer.cli import main
real = SlideEngine.train_step
calls = []
def step(self, batch, **kw):
    calls.append(1)
    if len(calls) == 3:
        {fault}
    return real(self, batch, **kw)
SlideEngine.train_step = step
sys.exit(main(["train", "progress=false", "device=cpu", "micro_batch_size=4", "max_steps=5", "save_steps=1",
               "output_dir={out}", {extra}]))
"""


def run(tmp_path, fault: str, extra: str, timeout: float):
    code = textwrap.dedent(RUN).format(fault=fault, out=tmp_path / "run", extra=extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_the_watchdog_ends_a_stalled_run_with_every_threads_stack(tmp_path):
    """The third step never returns (an injected stall): within the 3 s limit the run ends with exit 6, one line
    saying what happened, the stack of every thread (the stuck one's included), and step 2's checkpoint intact."""
    p = run(tmp_path, "time.sleep(600)", '"watchdog_seconds=3"', timeout=120)
    assert p.returncode == EXIT_HANG, p.stderr[-2000:]
    assert "no progress for" in p.stderr and "checkpoint-2) is intact" in p.stderr
    assert "Thread 0x" in p.stderr and "line 10 in step" in p.stderr  # (the stuck frame: the injected sleep)
    assert read_meta(tmp_path / "run" / "checkpoint-2")["step"] == 2


def test_the_memory_guard_saves_and_stops_before_the_oom_killer(tmp_path):
    """The third step allocates 3 GiB (an injected leak) under a host budget 2.5 GiB above what the process
    held at start: the run finishes that step, saves it, and stops with exit 3 and the settings to change."""
    fault = "globals()['leak'] = torch.ones(3 << 30, dtype=torch.uint8)"
    extra = ('"offload.host_memory_limit=" + str(__import__("slideformer.watchdog", fromlist=["x"]).rss_bytes() '
             '+ (5 << 29))')
    p = run(tmp_path, fault, extra, timeout=300)
    assert p.returncode == 3, p.stderr[-2000:]
    assert "host memory: the process reached" in p.stderr and "offload.host_memory_limit" in p.stderr
    assert read_meta(tmp_path / "run" / "checkpoint-3")["step"] == 3


def test_the_limit_follows_the_runs_pace():
    """(Every watchdog made here is closed: one left running would end the test process.)"""
    dog, fixed, off = Watchdog(None, lambda: ""), Watchdog(300, lambda: ""), Watchdog(0, lambda: "")
    try:
        assert dog.limit == FIRST_STEP_LIMIT_S
        dog._last -= 100.0  # a 100 s step
        dog.progress()
        assert abs(dog.limit - max(MIN_LIMIT_S, PACE * 100.0)) < 1.0
        with dog.allowing(SAVE_LIMIT_S):  # a checkpoint
            assert dog.limit == SAVE_LIMIT_S
        assert dog.limit < SAVE_LIMIT_S
        assert fixed.limit == 300 and off._thread is None
        with fixed.allowing(SAVE_LIMIT_S):  # (a limit set for steps does not cut a checkpoint short)
            assert fixed.limit == SAVE_LIMIT_S
        assert fixed.limit == 300
    finally:
        for d in (dog, fixed, off):
            d.close()
