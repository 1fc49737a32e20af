"""The NVMe tier: training with moments in files equals training with them in RAM; failures are clear."""
import errno
import os

import pytest
import torch

from slideformer import EngineConfig, SlideEngine
from slideformer.host.nvme import TierError

from test_engine_parity import engine_train
from tiny import batch, build

CPU = dict(device="cpu", compute_dtype=torch.float32, lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("fraction,buffers,clip,master", [(1.0, 1, None, False), (0.5, 2, None, False),
                                                          (1.0, 2, 0.05, False), (1.0, 1, None, True),
                                                          (0.5, 2, 0.05, True)])
def test_tier_trains_like_ram(tmp_path, fraction, buffers, clip, master):
    """Moments (and with nvme_master the fp32 master) in files: the same training as in RAM."""
    model = build("llama")
    steps = [batch(97, seed=s) for s in range(3)]
    a, la = engine_train(model, steps, lr=1e-2, max_grad_norm=clip, host_grad_buffers=1)
    b, lb = engine_train(model, steps, lr=1e-2, max_grad_norm=clip, host_grad_buffers=1, offload_dir=str(tmp_path),
                         nvme_fraction=fraction, nvme_buffers=buffers, nvme_master=master)
    assert la == lb
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not list(tmp_path.iterdir())  # files removed at close


def test_master_on_the_tier_loads_saves_and_resumes(tmp_path):
    """Weights loaded from a Hugging Face directory go to the tier unit by unit; a checkpoint written
    from the tier resumes in RAM (and back) as the same training."""
    model = build("llama")
    model.save_pretrained(tmp_path / "hf")
    steps = [batch(97, seed=s) for s in range(4)]
    tier = dict(**CPU, offload_dir=str(tmp_path / "nvme"), nvme_master=True)

    def run(cfg, resume=None, save=None, todo=steps):
        with SlideEngine.from_pretrained(tmp_path / "hf", EngineConfig(**cfg)) as e:
            if resume:
                e.load_checkpoint(resume)
            losses = [e.train_step(b) for b in todo]
            if save:
                e.save_checkpoint(save)
            return losses, {k: v.clone() for k, v in e.state_dict().items()}, e.memory_report()

    ref_losses, ref, ram_rep = run(CPU)
    l1, _, rep = run(tier, save=tmp_path / "ck", todo=steps[:2])
    assert rep["host_master"] < ram_rep["host_master"] and rep["nvme_disk"] > 0
    l2, state, _ = run(CPU, resume=tmp_path / "ck", todo=steps[2:])  # from the tier into RAM
    assert l1 + l2 == ref_losses and all(torch.equal(state[k], ref[k]) for k in ref)
    run(CPU, save=tmp_path / "ck_ram", todo=steps[:2])
    l3, state, _ = run(tier, resume=tmp_path / "ck_ram", todo=steps[2:])  # from RAM into the tier
    assert l3 == l2 and all(torch.equal(state[k], ref[k]) for k in ref)


def test_master_on_the_tier_needs_what_it_relies_on(tmp_path):
    from slideformer.config import ConfigError

    with pytest.raises(ConfigError, match="offload_dir"):
        EngineConfig(device="cpu", nvme_master=True).validate()
    with pytest.raises(ConfigError, match="persistent"):
        EngineConfig(device="cpu", nvme_master=True, offload_dir=str(tmp_path), host_weights="staged").validate()


def test_compact_state_on_the_tier_trains_like_ram(tmp_path):
    """bf16 moments (compact optimizer state) on the tier: half the disk, the same training."""
    model = build("qwen3-tied")
    steps = [batch(97, seed=s) for s in range(3)]
    kw = dict(device="cpu", lr=1e-2, compute_dtype=torch.bfloat16, optimizer_state="compact", host_grad_buffers=1)

    def run(**extra):
        with SlideEngine(model, EngineConfig(**kw, **extra)) as e:
            losses = [e.train_step(b) for b in steps]
            disk = e.memory_report()["nvme_disk"]
            e.save_checkpoint(tmp_path / f"ck{len(extra)}")
            return losses, {k: v.clone() for k, v in e.state_dict().items()}, disk, e.adapter.layer_unit(0).numel

    la, a, _, _ = run()
    lb, b, disk, layer = run(offload_dir=str(tmp_path / "nvme"))
    assert 3 * 2 * layer * 2 <= disk < 3 * 2 * layer * 2 + 3 * 4096  # two bf16 moments per layer
    assert la == lb
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the checkpoint written from the tier holds the same moments as the one written from RAM
    with SlideEngine(model, EngineConfig(**kw)) as x, SlideEngine(model, EngineConfig(**kw)) as y:
        x.load_checkpoint(tmp_path / "ck0")
        y.load_checkpoint(tmp_path / "ck1")
        u = x.adapter.layer_unit(1).index
        assert torch.equal(x.store.exp_avg_sq[u], y.store.exp_avg_sq[u]) and x.store.exp_avg_sq[u].dtype == torch.bfloat16


def test_tier_accounting_and_checkpoint_round_trip(tmp_path):
    model = build("qwen2")
    eng = SlideEngine(model, EngineConfig(**CPU, offload_dir=str(tmp_path / "nvme")))
    with eng:
        eng.train_step(batch(97))
        rep = eng.memory_report()
        layer = eng.adapter.layer_unit(0).numel
        assert rep["nvme_disk"] >= 3 * 2 * layer * 4  # every layer's two moments
        assert rep["host_moments"] == 2 * 4 * (eng.adapter.embed_unit.numel + eng.adapter.head_unit.numel)
        eng.save_checkpoint(tmp_path / "ck", {"next": 1})
        st = eng.store.unit_state(eng.adapter.layer_unit(1).index)
        tier_m = st["exp_avg"], st["exp_avg_sq"]
    ram = SlideEngine(model, EngineConfig(**CPU))
    with ram:
        ram.load_checkpoint(tmp_path / "ck")
        u = ram.adapter.layer_unit(1).index
        assert torch.equal(ram.store.exp_avg[u], tier_m[0]) and torch.equal(ram.store.exp_avg_sq[u], tier_m[1])
        assert torch.count_nonzero(tier_m[1]) > 0


def test_full_disk_is_refused_at_start(tmp_path, monkeypatch):
    def full(fd, off, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(TierError, match=r"cannot reserve .* GiB .*No space left on device.*offload_dir"):
        SlideEngine(build("llama"), EngineConfig(**CPU, offload_dir=str(tmp_path)))


def test_corrupt_state_file_is_detected(tmp_path):
    eng = SlideEngine(build("llama"), EngineConfig(**CPU, offload_dir=str(tmp_path)))
    with eng:
        eng.train_step(batch(97))
        eng.synchronize()
        f = next(iter(eng.store.tier.files.values()))
        with open(f, "r+b") as fh:
            fh.seek(100)
            b = fh.read(1)
            fh.seek(100)
            fh.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(RuntimeError) as info:
            eng.train_step(batch(97, seed=1))
            eng.synchronize()
        assert isinstance(info.value.__cause__, TierError) and "corrupt" in str(info.value.__cause__)


def test_failed_write_stops_training_clearly(tmp_path, monkeypatch):
    from slideformer.host import nvme

    def broken(self, unit, buf):
        raise TierError(errno.EIO, f"writing NVMe state file for unit {unit} failed (Input/output error)")

    eng = SlideEngine(build("llama"), EngineConfig(**CPU, offload_dir=str(tmp_path)))
    with eng:
        monkeypatch.setattr(nvme.NvmeTier, "write", broken)
        with pytest.raises(RuntimeError) as info:
            eng.train_step(batch(97))
            eng.synchronize()
        assert "Input/output error" in str(info.value.__cause__)


def test_close_right_after_a_step_does_not_hang(tmp_path):
    """close() without synchronize(): updates still waiting for tier reads must finish, not deadlock."""
    import threading

    eng = SlideEngine(build("llama"), EngineConfig(**CPU, offload_dir=str(tmp_path), nvme_buffers=1,
                                                   host_grad_buffers=1))
    eng.train_step(batch(97))
    t = threading.Thread(target=eng.close)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()


def test_next_steps_read_waits_for_this_steps_write(tmp_path, monkeypatch):
    """A slow disk: the next step's read-ahead of a unit must not overtake the write of its new moments."""
    import time

    from slideformer.host.nvme import NvmeTier

    write = NvmeTier.write

    def slow_write(self, unit, buf):
        time.sleep(0.03)
        write(self, unit, buf)

    model = build("llama")
    steps = [batch(97, seed=s) for s in range(4)]
    a, la = engine_train(model, steps, lr=1e-2, host_grad_buffers=1)
    monkeypatch.setattr(NvmeTier, "write", slow_write)
    b, lb = engine_train(model, steps, lr=1e-2, host_grad_buffers=1, offload_dir=str(tmp_path), nvme_buffers=4)
    assert la == lb
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("keep", [0, 2])
def test_activations_on_nvme_are_bit_identical(tmp_path, keep):
    """Offloaded layer inputs through a file (3 staging buffers, the disk threads) train exactly as kept."""
    model = build("qwen2-tied")
    steps = [[batch(97, seed=s), batch(97, b=3, s=9, seed=s + 7)] for s in range(2)]  # uneven micro-batches
    a, la = engine_train(model, steps, lr=1e-2)
    cfg = dict(lr=1e-2, offload_activations=True, gpu_activation_layers=keep, offload_dir=str(tmp_path),
               activations_to_nvme=True)
    with SlideEngine(model, EngineConfig(device="cpu", compute_dtype=torch.float32, loss_kernel="torch", **cfg)) as e:
        lb = [e.train_step(b) for b in steps]
        b = {k: v.clone() for k, v in e.state_dict().items()}
        rep = e.memory_report()
        layers = model.config.num_hidden_layers - keep
        assert rep["nvme_activations"] >= layers * 17 * model.config.hidden_size * 4  # 2x12 + 3x9... tokens
        assert rep["host_activations"] == 3 * e.activations._staging[0].numel() * 4  # staging only
    assert la == lb
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not list(tmp_path.iterdir())  # the file is removed at close


def test_activations_on_nvme_fail_clearly(tmp_path, monkeypatch):
    from slideformer.host import nvme

    cfg = EngineConfig(**CPU, offload_activations=True, gpu_activation_layers=0, offload_dir=str(tmp_path),
                       activations_to_nvme=True)

    def full(fd, off, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    with SlideEngine(build("llama"), cfg) as eng, monkeypatch.context() as m:
        m.setattr(os, "posix_fallocate", full)
        with pytest.raises(TierError, match="activations on NVMe .*No space left"):
            eng.train_step(batch(97))

    def broken(self, index, buf):
        raise TierError(errno.EIO, "activations: injected write failure")

    monkeypatch.setattr(nvme.NvmeScratch, "write", broken)
    eng = SlideEngine(build("llama"), cfg)
    with pytest.raises(RuntimeError, match="failed") as err:
        with eng:
            eng.train_step(batch(97))
    assert "injected write failure" in repr(err.value.__cause__) or "injected" in str(err.value)


def test_activations_on_nvme_need_offload_dir():
    from slideformer.config import ConfigError

    with pytest.raises(ConfigError, match="offload_dir"):
        EngineConfig(device="cpu", activations_to_nvme=True).validate()


def _finishes(fn, seconds=60):
    """Run ``fn`` in a thread; the test fails (instead of hanging CI) if it does not return in time."""
    import threading

    out = {}
    th = threading.Thread(target=lambda: out.update(result=fn()), daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), "hung"
    return out.get("result")


def test_tier_reads_never_hold_up_activation_reads(tmp_path):
    """One tier buffer for three tier layers, activations on NVMe too: backward needs activation reads
    before any tier buffer comes free, so a tier read waiting for a buffer must not hold the disk reader."""
    model = build("llama")
    steps = [batch(97, seed=s) for s in range(2)]
    a, la = engine_train(model, steps, lr=1e-2)
    b, lb = _finishes(lambda: engine_train(model, steps, lr=1e-2, offload_dir=str(tmp_path), nvme_buffers=1,
                                           offload_activations=True, gpu_activation_layers=0, activations_to_nvme=True))
    assert la == lb and all(torch.equal(a[k], b[k]) for k in a)


def test_failure_mid_step_closes_cleanly_with_the_tier(tmp_path, monkeypatch):
    """An error in the calling thread mid-forward: closing must not wait forever on tier reads whose
    updates will never come, and the caller sees its own error."""
    eng = SlideEngine(build("llama"), EngineConfig(**CPU, offload_dir=str(tmp_path), nvme_buffers=1))
    fwd = SlideEngine._fwd

    def boom(self, st, unit, slot):
        if unit.layer == 1:
            raise MemoryError("simulated OOM in forward")
        return fwd(self, st, unit, slot)

    def run():
        with pytest.raises(MemoryError, match="simulated"):
            with eng:
                eng.train_step(batch(97))  # the first step reads nothing yet: fail in the second
                monkeypatch.setattr(SlideEngine, "_fwd", boom)
                eng.train_step(batch(97, seed=1))
        return True

    assert _finishes(run)
