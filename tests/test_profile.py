"""engine/profile.py: what a counting window holds (the benchmark's steady state)."""
import time

from slideformer.engine.profile import StepProfiler


def test_window_counts_host_work_inside_it_only():
    """Work that began before reset() counts from the reset; what ends after close() counts up to it; what
    is recorded after close() (the drain after the timed steps) does not count. A span's wait for gradient
    chunks counts in proportion to the part kept."""
    prof = StepProfiler(cuda=False)
    prof.reset()
    since = prof._since
    prof.span("optimizer", 3, since - 0.02, since + 0.02, waited=0.01)  # half of it in the window
    with prof.timed("wait_load"):
        time.sleep(0.01)
    prof.close()
    until = prof._until
    prof.span("optimizer", 4, until - 0.005, until + 0.015)  # straddles the close: its first 5 ms
    prof.span("optimizer", 5, until + 1.0, until + 2.0, waited=1.0)  # the drain
    s = prof.summary()
    assert abs(s["host_optimizer_s"] - 0.025) < 1e-9
    assert abs(s["host_optimizer_wait_landing_s"] - 0.005) < 1e-9
    assert s["host_wait_load_s"] >= 0.01
    assert [u for _, u, _, _ in prof._spans] == [3, 4]


def test_reset_reopens_a_closed_window():
    prof = StepProfiler(cuda=False)
    prof.close()
    prof.span("x", 0, time.perf_counter(), time.perf_counter() + 1.0)
    assert prof.summary() == {}
    prof.reset()
    t = prof._since
    prof.span("x", 0, t, t + 2.0)
    assert prof.summary() == {"host_x_s": 2.0}
