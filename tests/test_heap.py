"""heap.py: what a run holds after its first step leaves the collector's generations; what comes after is
still collected, and the collector's pauses are measured."""
import gc

from slideformer import heap


class _Cycle:
    def __init__(self):
        self.me = self


def test_settle_freezes_what_exists_and_later_cycles_are_still_collected():
    kept = [_Cycle() for _ in range(100)]
    try:
        heap.settle()
        assert gc.get_freeze_count() >= len(kept)
        with heap.Pauses() as pauses:
            later = _Cycle()
            del later
            assert gc.collect() >= 1  # (the cycle made after settle: found and freed)
        assert pauses.full == 1 and pauses.seconds > 0
        assert not any(isinstance(o, _Cycle) and o not in kept for o in gc.get_objects())
    finally:
        heap.release()
    assert gc.get_freeze_count() == 0
    ref = __import__("weakref").ref(kept[0])
    del kept
    gc.collect()
    assert ref() is None  # (frozen cycles are collected once released)


def test_the_trainer_settles_after_its_first_step_and_releases_at_its_end(tmp_path, monkeypatch):
    """train/loop.py: frozen from the first step on (a full collection walks only what came after), and the
    collector's again once the run ends, so a caller's next run frees this one's engine."""
    from slideformer.train.config import load_config
    from slideformer.train.loop import train

    frozen = []
    real = heap.settle
    monkeypatch.setattr(heap, "settle", lambda: (real(), frozen.append(gc.get_freeze_count())))
    train(load_config(None, ["progress=false", "device=cpu", "micro_batch_size=4", "max_steps=3",
                             f"output_dir={tmp_path}"]))
    assert len(frozen) == 1 and frozen[0] > 10_000
    assert gc.get_freeze_count() == 0
