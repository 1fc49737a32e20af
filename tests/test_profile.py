"""engine/profile.py: what a counting window holds (the benchmark's steady state)."""
import time

from slideformer.engine.profile import StepProfiler


def test_window_counts_host_work_inside_it_only():
    """Work that began before reset() counts from the reset; what ends after close() counts up to it; what
    is recorded after close() (the drain after the timed steps) does not count."""
    prof = StepProfiler(cuda=False)
    prof.reset()
    since = prof._since
    prof.span("optimizer", 3, since - 1.0, since + 0.02)  # running since a second before the window
    with prof.timed("wait_load"):
        time.sleep(0.01)
    prof.close()
    until = prof._until
    prof.span("optimizer", 4, until - 0.005, until + 5.0)  # straddles the close: only its first 5 ms
    prof.span("optimizer", 5, until + 1.0, until + 2.0)  # the drain
    prof.add_host("optimizer_wait_landing", 7.0)  # recorded after the close
    s = prof.summary()
    assert abs(s["host_optimizer_s"] - 0.025) < 1e-9
    assert 0.01 <= s["host_wait_load_s"] < 0.05
    assert "host_optimizer_wait_landing_s" not in s
    assert [u for _, u, _, _ in prof._spans] == [3, 4]


def test_reset_reopens_a_closed_window():
    prof = StepProfiler(cuda=False)
    prof.close()
    prof.add_host("x", 1.0)
    prof.reset()
    prof.add_host("x", 2.0)
    assert prof.summary() == {"host_x_s": 2.0}
