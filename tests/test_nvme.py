"""The NVMe tier: training with moments in files equals training with them in RAM; failures are clear."""
import errno
import os
from dataclasses import replace

import pytest
import torch

from slideformer.config import Placement
from slideformer import EngineConfig, SlideEngine
from slideformer.host.nvme import TierError

from test_engine_parity import engine_train
from tiny import batch, build, engine_config, kill_during_second_save

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
        with SlideEngine.from_pretrained(tmp_path / "hf", engine_config(**cfg)) as e:
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
        EngineConfig(device="cpu", placement=Placement(nvme_master=True)).validate()
    # fp32 state's staged layers: the window reads their master from the tier (test_state_on_the_tier_...)
    EngineConfig(device="cpu", offload_dir=str(tmp_path), placement=Placement(nvme_master=True, host_weights="staged")).validate()


@pytest.mark.parametrize("state,master,buffers", [("compact", False, 4), ("8bit", False, 4), ("compact", True, 4),
                                                  ("8bit", True, 4), ("8bit", True, 1), ("fp32", True, 4),
                                                  ("fp32", True, 1)])
def test_state_on_the_tier_trains_like_ram(tmp_path, state, master, buffers):
    """bf16 moments (compact optimizer state) on the tier: half the disk, the same training; 8-bit moments
    (codes and block scales): a quarter and a little. With nvme_master the master's hi and lo halves go
    too, and the window reads the weights (the hi half) from disk, or from a buffer holding the layer's state
    read ahead for its update (fewer of those with one buffer): RAM keeps no byte of those layers; with
    clipping and two micro-batches a step, still the same training. fp32 state with staged layers: their
    fp32 master goes, the window reads it from disk the same way and casts it: RAM keeps no byte either."""
    from slideformer.optim.formats import moment_bytes, moment_dtype

    model = build("qwen3-tied")
    steps = [[batch(97, seed=s), batch(97, b=3, seed=s + 9)] if master else batch(97, seed=s) for s in range(3)]
    kw = dict(device="cpu", lr=1e-2, compute_dtype=torch.bfloat16, optimizer_state=state, host_grad_buffers=1,
              max_grad_norm=0.5 if master else None, **({"host_weights": "staged"} if state == "fp32" else {}))

    def run(**extra):
        with SlideEngine(model, engine_config(**kw, **extra)) as e:
            losses = [e.train_step(b) for b in steps]
            rep = e.memory_report()
            e.save_checkpoint(tmp_path / f"ck{bool(extra):d}")
            rep["from_tier"] = e.store.weights_on_tier(e.adapter.layer_unit(0).index)
            return losses, {k: v.clone() for k, v in e.state_dict().items()}, rep, e.adapter.layer_unit(0).numel

    la, a, ram, _ = run()
    lb, b, rep, layer = run(offload_dir=str(tmp_path / "nvme"), nvme_master=master, nvme_buffers=buffers)
    assert rep["from_tier"] == master and not ram["from_tier"]  # (the window's loads read the files)
    per_layer = moment_bytes(state, layer) + (4 * layer if master else 0)
    assert 3 * per_layer <= rep["nvme_disk"] < 3 * per_layer + 3 * 4 * 4096  # (each field 4 KiB-aligned)
    if master:  # the master (and the weights) of all three layers left RAM
        assert ram["host_master"] - rep["host_master"] == 3 * 4 * layer
    assert la == lb
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the checkpoint written from the tier holds the same moments as the one written from RAM
    with SlideEngine(model, engine_config(**kw)) as x, SlideEngine(model, engine_config(**kw)) as y:
        x.load_checkpoint(tmp_path / "ck0")
        y.load_checkpoint(tmp_path / "ck1")
        u = x.adapter.layer_unit(1).index
        assert torch.equal(x.store.exp_avg_sq[u], y.store.exp_avg_sq[u]) and x.store.exp_avg_sq[u].dtype == moment_dtype(state)
        assert x.store.exp_avg_sq[u].any()
    if master:  # resumed onto the tier (hi, lo and moments written there) and in RAM: the same next steps
        tier = dict(offload_dir=str(tmp_path / "nvme"), nvme_master=True)
        with SlideEngine(model, engine_config(**kw)) as x, SlideEngine(model, engine_config(**kw, **tier)) as y:
            x.load_checkpoint(tmp_path / "ck0")
            y.load_checkpoint(tmp_path / "ck0")
            assert [x.train_step(b) for b in steps[:2]] == [y.train_step(b) for b in steps[:2]]
            assert all(torch.equal(v, y.state_dict()[k]) for k, v in x.state_dict().items())


def test_tier_accounting_and_checkpoint_round_trip(tmp_path):
    model = build("qwen2")
    eng = SlideEngine(model, engine_config(**CPU, offload_dir=str(tmp_path / "nvme")))
    with eng:
        eng.train_step(batch(97))
        rep = eng.memory_report()
        layer = eng.adapter.layer_unit(0).numel
        assert rep["nvme_disk"] >= 3 * 2 * layer * 4  # every layer's two moments
        assert rep["host_moments"] == 2 * 4 * (eng.adapter.embed_unit.numel + eng.adapter.head_unit.numel)
        eng.save_checkpoint(tmp_path / "ck", {"next": 1})
        st = eng.store.unit_state(eng.adapter.layer_unit(1).index)
        tier_m = st["exp_avg"], st["exp_avg_sq"]
    ram = SlideEngine(model, engine_config(**CPU))
    with ram:
        ram.load_checkpoint(tmp_path / "ck")
        u = ram.adapter.layer_unit(1).index
        assert torch.equal(ram.store.exp_avg[u], tier_m[0]) and torch.equal(ram.store.exp_avg_sq[u], tier_m[1])
        assert torch.count_nonzero(tier_m[1]) > 0


def test_full_disk_is_refused_at_start(tmp_path, monkeypatch):
    def full(fd, off, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(TierError, match=r"cannot reserve .* [GM]iB .*No space left on device.*offload_dir"):
        SlideEngine(build("llama"), engine_config(**CPU, offload_dir=str(tmp_path)))


@pytest.mark.parametrize("weights", [False, True])
def test_corrupt_state_file_is_detected(tmp_path, weights):
    """A flipped byte in a moment, or (compact state's master on the tier) in the weights the window's
    loader reads before any update does: the read that meets it stops training, naming the file."""
    cfg = dict(CPU, compute_dtype=torch.bfloat16, optimizer_state="compact", nvme_master=True) if weights else CPU
    eng = SlideEngine(build("llama"), engine_config(**cfg, offload_dir=str(tmp_path)))
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
        assert ("in master" if weights else "in exp_avg") in str(info.value.__cause__)


def test_failed_write_stops_training_clearly(tmp_path, monkeypatch):
    from slideformer.host import nvme

    def broken(self, unit, buf):
        raise TierError(errno.EIO, f"writing NVMe state file for unit {unit} failed (Input/output error)")

    eng = SlideEngine(build("llama"), engine_config(**CPU, offload_dir=str(tmp_path)))
    with eng:
        monkeypatch.setattr(nvme.NvmeTier, "write", broken)
        with pytest.raises(RuntimeError) as info:
            eng.train_step(batch(97))
            eng.synchronize()
        assert "Input/output error" in str(info.value.__cause__)


def test_close_right_after_a_step_does_not_hang(tmp_path):
    """close() without synchronize(): updates still waiting for tier reads must finish, not deadlock."""
    import threading

    eng = SlideEngine(build("llama"), engine_config(**CPU, offload_dir=str(tmp_path), nvme_buffers=1, host_grad_buffers=1))
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
    with SlideEngine(model, engine_config(device="cpu", compute_dtype=torch.float32, **cfg, loss_kernel="torch")) as e:
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

    cfg = engine_config(**CPU, offload_dir=str(tmp_path), offload_activations=True, gpu_activation_layers=0, activations_to_nvme=True)

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
        EngineConfig(device="cpu", placement=Placement(activations_to_nvme=True)).validate()


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
    eng = SlideEngine(build("llama"), engine_config(**CPU, offload_dir=str(tmp_path), nvme_buffers=1))
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


# What a run leaves under offload_dir: each tier and scratch keeps its files in a directory of its own,
# locked while its process lives; a new one removes those whose lock is free, and nothing else.

_HOLDER = """
import sys, time
from slideformer.host.nvme import NvmeScratch, NvmeTier
tier = NvmeTier(sys.argv[1], {0: 1 << 18}, 1)  # 2 MiB: two fp32 moments
scratch = NvmeScratch(sys.argv[1], "activations")
scratch.reserve(2, 1 << 20)
print("ready", tier.dir.name, scratch.dir.name, flush=True)
time.sleep(600)
"""


def _holder(offload_dir):
    """A python process holding a tier and a scratch under ``offload_dir``: the process and their directories."""
    import select
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(offload_dir)], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline() if select.select([p.stdout], [], [], 120)[0] else ""
    if not line.startswith("ready"):
        p.kill()
        p.wait()
        pytest.fail(f"the holder process did not start: {line!r}")
    return p, [offload_dir / name for name in line.split()[1:]]


def _dead_pid():
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _snapshot(root):
    out = []
    for dirpath, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            p = os.path.join(dirpath, name)
            out.append((os.path.relpath(p, root), os.path.islink(p),
                        None if os.path.isdir(p) or os.path.islink(p) else open(p, "rb").read()))
    return sorted(out)


def test_a_killed_runs_directory_is_removed_by_the_next_tier(tmp_path, capsys):
    from slideformer.host.nvme import NvmeTier

    p, dirs = _holder(tmp_path)
    try:
        assert len(dirs) == 2 and all(d.is_dir() for d in dirs)
        NvmeTier(tmp_path, {0: 1024}, 1).close()  # the holder lives: its lock is held, its files stay
        assert all((d / "owner.lock").exists() for d in dirs) and capsys.readouterr().err == ""
    finally:
        p.kill()  # SIGKILL: no close(), no cleanup
        p.wait()
    assert all(d.is_dir() for d in dirs) and len(list(tmp_path.iterdir())) == 2
    tier = NvmeTier(tmp_path, {0: 1024}, 1)
    lines = capsys.readouterr().err.splitlines()
    assert not any(d.exists() for d in dirs) and list(tmp_path.iterdir()) == [tier.dir]
    tier.close()
    assert len(lines) == 2
    for d in dirs:
        (line,) = [x for x in lines if x.endswith(f"({d})")]
        assert line.startswith("slideformer: removed 2.0 MiB of NVMe tier files left by a process that ended")


def test_a_live_owners_directory_is_kept(tmp_path, capsys):
    """A directory whose lock is held (here by this process, through a descriptor of its own, as another
    run would) is kept with its files, by a tier and a scratch alike; once the lock is free it goes."""
    import fcntl

    from slideformer.host.nvme import NvmeScratch, NvmeTier

    d = tmp_path / "slideformer-999999999-0123456789ab"
    d.mkdir()
    (d / "unit0.state").write_bytes(bytes(8192))
    fd = os.open(d / "owner.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        tier = NvmeTier(tmp_path, {0: 1024}, 1)
        scratch = NvmeScratch(tmp_path, "activations")  # also leaves this process's own tier alone
        assert (d / "unit0.state").read_bytes() == bytes(8192) and tier.dir.is_dir() and scratch.dir.is_dir()
        assert len({d, tier.dir, scratch.dir}) == 3
        scratch.close()
        tier.close()
        assert (d / "unit0.state").exists() and capsys.readouterr().err == ""
    finally:
        os.close(fd)
    NvmeTier(tmp_path, {0: 1024}, 1).close()
    assert not d.exists() and not list(tmp_path.iterdir())
    assert f"left by a process that ended ({d})" in capsys.readouterr().err


def test_files_not_ours_are_never_touched(tmp_path, capsys):
    from slideformer.host.nvme import NvmeScratch, NvmeTier

    dead = _dead_pid()
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "mydata").mkdir()
    (tmp_path / "mydata" / f"slideformer-{dead}-unit0.state").write_bytes(b"nested, not ours")
    (tmp_path / "mydata" / f"slideformer-{dead}-0123456789ab").mkdir()
    (tmp_path / f"slideformer-{dead}-0123456789ab").write_text("a file, not a directory")
    (tmp_path / f"slideformer-{dead}-abcdefabcdef").symlink_to(tmp_path / "mydata")
    (tmp_path / f"slideformer-{dead}-0123456789AB").mkdir()
    (tmp_path / f"slideformer-{dead}-0123456789ab.old").mkdir()
    (tmp_path / f"slideformer-{dead}-unit0.state.bak").write_text("x")
    (tmp_path / f"slideformer-{dead}-activations.scratch").mkdir()  # a directory, not a file
    (tmp_path / "slideformer-notes.txt").write_text("x")
    (tmp_path / f".slideformer-{dead}-0123456789ab").mkdir()
    before = _snapshot(tmp_path)
    tier = NvmeTier(tmp_path, {0: 1024}, 1)
    scratch = NvmeScratch(tmp_path, "activations")
    scratch.close()
    tier.close()
    assert _snapshot(tmp_path) == before
    assert capsys.readouterr().err == ""


def test_files_of_older_versions_and_cut_short_removals_are_removed(tmp_path, capsys):
    """Files older versions put straight into offload_dir go when their pid no longer runs; so do an owned
    directory whose removal was cut short (lock file gone) and one killed while being created."""
    from slideformer.host.nvme import NvmeTier

    dead, live = _dead_pid(), os.getpid()
    for name in (f"slideformer-{dead}-unit0.state", f"slideformer-{dead}-unit12.state",
                 f"slideformer-{dead}-activations.scratch", f"slideformer-{live}-unit0.state"):
        with open(tmp_path / name, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, 1 << 20)
    cut = tmp_path / f"slideformer-{dead}-00000000000a"
    cut.mkdir()
    (cut / "unit3.state").write_bytes(bytes(4096))
    pending = tmp_path / f".slideformer-{dead}-00000000000b.new"
    pending.mkdir()
    (pending / "owner.lock").touch()
    NvmeTier(tmp_path, {0: 1024}, 1).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"slideformer-{live}-unit0.state"]  # its pid runs
    err = capsys.readouterr().err.splitlines()
    assert f"slideformer: removed 3.0 MiB of NVMe tier files left by a process that ended " \
           f"({tmp_path / f'slideformer-{dead}-*'})" in err
    assert any(line.endswith(f"({cut})") for line in err) and len(err) == 2


def test_checksums_chain_across_pieces_and_a_write_that_moves_nothing_fails(tmp_path, monkeypatch):
    """The tier sums a unit's CRC32 piece by piece beside the I/O: over many pieces it is the whole unit's
    CRC and reads back clean; a write that moves nothing is an error, not a file whose CRC lies."""
    import zlib

    from slideformer.host import nvme
    from slideformer.host.nvme import NvmeTier

    monkeypatch.setattr(nvme, "IO_CHUNK", 4096)
    tier = NvmeTier(tmp_path, {0: 37 * 1024}, 1)  # fp32, two fields: 74 pieces of 4 KiB
    try:
        tier.buffers[0].view(torch.float32)[: 2 * 37 * 1024].uniform_()
        view = memoryview(tier.buffers[0].numpy())[: tier.nbytes[0]]
        tier.write(0, 0)
        half = len(view) // 2  # (each field's own CRC)
        assert (tier.crc[0, "exp_avg"], tier.crc[0, "exp_avg_sq"]) == (zlib.crc32(view[:half]), zlib.crc32(view[half:]))
        tier.read(0, 0)  # (the CRC summed beside the reads matches)
        monkeypatch.setattr(nvme.os, "pwritev", lambda fd, bufs, off: 0)
        with pytest.raises(TierError, match="a write moved nothing"):
            tier.write(0, 0)

        def eio(*a):
            raise OSError(errno.EIO, "Input/output error")
        monkeypatch.setattr(nvme.os, "preadv", eio)  # (a read that fails names its file, as a write does)
        with pytest.raises(TierError, match=f"reading NVMe state file {tier.files[0]} failed .Input/output error."):
            tier.read(0, 0)
    finally:
        monkeypatch.undo()
        tier.close()


def test_a_tier_never_closed_is_removed_at_exit(tmp_path):
    """A process that ends without closing its engine (a script, a benchmark) still takes its tier's files
    with it: they are as large as the model's moments."""
    import subprocess
    import sys

    code = ("import sys; from slideformer.host.nvme import NvmeTier; "
            f"t = NvmeTier({str(tmp_path / 'nvme')!r}, {{0: 1 << 20}}, 1); print(t.dir)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().startswith(str(tmp_path / "nvme" / "slideformer-"))
    assert not (tmp_path / "nvme").exists()  # (the folder it made too)
    (tmp_path / "mine").mkdir()  # (one it found stays, empty)
    out = subprocess.run([sys.executable, "-c", code.replace("'nvme'", "'mine'").replace("/nvme'", "/mine'")],
                         capture_output=True, text=True, check=True).stdout
    assert (tmp_path / "mine").is_dir() and not list((tmp_path / "mine").iterdir())


def test_close_removes_the_owned_directory(tmp_path, monkeypatch):
    from slideformer.host.nvme import NvmeScratch, NvmeTier

    tier = NvmeTier(tmp_path / "nvme", {0: 1024, 1: 2048}, 2)
    scratch = NvmeScratch(tmp_path / "nvme", "activations")
    scratch.reserve(3, 5000)
    assert tier.dir.parent == scratch.dir.parent == tmp_path / "nvme" and tier.dir != scratch.dir
    assert sorted(p.name for p in tier.dir.iterdir()) == ["owner.lock", "unit0.state", "unit1.state"]
    assert sorted(p.name for p in scratch.dir.iterdir()) == ["activations.scratch", "owner.lock"]
    tier.close()
    scratch.close()
    tier.close()  # twice: nothing more to do
    scratch.close()
    assert not list((tmp_path / "nvme").iterdir())

    def full(fd, off, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(TierError, match="cannot reserve"):
        NvmeTier(tmp_path / "nvme", {0: 1024}, 1)
    assert not list((tmp_path / "nvme").iterdir())  # a tier that failed to start leaves nothing either


@pytest.mark.parametrize("fmt,per_param,times", [("fp32", 14, 4), ("8bit", 6.06, 4), ("fp32", 14, 8)])
def test_the_ram_budget_holds_under_a_model_four_times_its_size(tmp_path, fmt, per_param, times):
    """host_memory_limit at a quarter of the model's training state (fp32 master and moments, bf16 copy: 14
    bytes a parameter; 8-bit: 6.06): the planner puts the tier layers' master and moments on NVMe
    (nvme_master, which it turns on where the moments alone are not enough; with 8-bit state the weights go
    with the master), the engine's host state stays within the budget by its own accounting, and training
    equals training with everything in RAM. At an eighth, fp32 state's bf16 copy of those layers would not
    fit either: they are staged, the window reading their fp32 master from the tier."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from slideformer.machine import Machine
    from slideformer.model import ModelAdapter
    from slideformer.plan import Auto, ModelShape, nvme_layer_count, resolve
    from slideformer.plan.memory import PROCESS_BYTES

    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=128, num_hidden_layers=48,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    shape = ModelShape.from_adapter(ModelAdapter(config, torch.bfloat16))
    budget = int(per_param * shape.params) // times
    cfg = EngineConfig(device="cpu", compute_dtype=torch.bfloat16, lr=1e-2, max_grad_norm=None,
                       offload_dir=str(tmp_path), optimizer_state=fmt)
    # (on the CPU the step's working set is RAM too: the limit holds it beside the state's budget)
    compute = resolve(cfg, Auto(), shape, 2, 12, Machine(ram=64 * 2**30)).host["compute"]
    cfg = replace(cfg, host_memory_limit=PROCESS_BYTES + budget + compute)
    plan = resolve(cfg, Auto(), shape, 2, 12, Machine(ram=64 * 2**30))
    assert plan.fits, plan.problem
    tiered = plan.config
    assert tiered.placement.nvme_master and nvme_layer_count(tiered, shape.layers) > 0
    assert sum(plan.host.values()) - plan.host["compute"] <= budget
    # (an eighth: the tier layers staged, and only they; a quarter: their bf16 copy kept)
    assert tiered.placement.host_weights == (nvme_layer_count(tiered, shape.layers) if times > 4 and fmt == "fp32"
                                             else "persistent")
    steps = [batch(97, seed=s) for s in range(3)]

    def train(c):
        with SlideEngine(model, c) as eng:
            losses = [eng.train_step(b) for b in steps]
            rep = eng.memory_report()
            return losses, {k: v.clone() for k, v in eng.state_dict().items()}, rep

    losses, state, rep = train(tiered)
    assert sum(v for k, v in rep.items() if k.startswith("host_")) <= budget
    assert rep["nvme_disk"] > 2 * budget
    ram_losses, ram_state, _ = train(EngineConfig(device="cpu", compute_dtype=torch.bfloat16, lr=1e-2,
                                                  max_grad_norm=None, optimizer_state=fmt))
    assert losses == ram_losses and all(torch.equal(state[k], ram_state[k]) for k in state)


def test_a_run_killed_while_saving_from_the_tier_resumes_the_same_training(tmp_path):
    """The master and moments live on the NVMe tier; the process is SIGKILLed in the middle of its second
    checkpoint (one unit's state file written). The first checkpoint is intact, its checksums hold, and a new
    process with the tier resumes from it into the same training as one that never stopped."""
    tier = dict(**CPU, offload_dir=str(tmp_path / "nvme"), nvme_master=True, nvme_fraction=1.0)
    steps = [batch(97, seed=s) for s in range(4)]
    kill_during_second_save(tmp_path / "ck", tier, 2)
    assert (tmp_path / "ck.tmp").exists()  # the interrupted save, never renamed over the first
    with SlideEngine(build("llama"), engine_config(**tier)) as eng:  # the run that never stopped
        ref_losses = [eng.train_step(b) for b in steps]
        ref = {k: v.clone() for k, v in eng.state_dict().items()}
    with SlideEngine(build("llama"), engine_config(**tier)) as eng:
        assert eng.load_checkpoint(tmp_path / "ck")["next"] == 2
        losses = [eng.train_step(b) for b in steps[2:]]
        state = {k: v.clone() for k, v in eng.state_dict().items()}
    assert losses == ref_losses[2:] and all(torch.equal(state[k], ref[k]) for k in ref)


def test_weights_come_from_the_buffer_read_ahead_or_from_the_file_once_written(tmp_path):
    """engine/disk.py read_weights: without a read-ahead, from the file into the caller's buffer; with the
    unit's state read ahead for its update, from that buffer; once the update has taken it, not before its
    write has finished (the file is behind until then); after a failure, nothing."""
    import threading

    from slideformer.engine.disk import DiskIO, Failure
    from slideformer.host.nvme import NvmeTier, aligned_empty

    bf16 = torch.bfloat16
    tier = NvmeTier(tmp_path, {0: 1024, 1: 1024}, 1, {"master": (bf16, None), "exp_avg": (bf16, None),
                                                      "exp_avg_sq": (bf16, None)})
    disk = DiskIO(tier, Failure())
    try:
        tier.copy_in(0, master=torch.full((1024,), 2.0))
        tier.copy_in(1, master=torch.full((1024,), 3.0))
        dst = aligned_empty(2048, torch.uint8)
        w = disk.read_weights(0, dst)
        assert w.data_ptr() == dst.data_ptr() and bool((w == 2).all())
        disk.begin_step([1, 0])  # one buffer: unit 1's state is read ahead, unit 0's waits for it
        assert disk.failure.wait(disk._ready[1])
        w = disk.read_weights(1, dst)
        assert w.data_ptr() == tier.views(1, 0)["master"].data_ptr() and bool((w == 3).all())
        buf = disk.take(1)  # the update: its new weights reach the file only with its write
        tier.views(1, buf)["master"].fill_(4.0)
        got = []
        reader = threading.Thread(target=lambda: got.append(disk.read_weights(1, dst).clone()))
        reader.start()
        reader.join(0.3)
        assert reader.is_alive() and not got  # waiting for the write
        disk.give_back(1, buf)
        reader.join(10)
        assert not reader.is_alive() and bool((got[0] == 4).all())
        disk.failure.record(RuntimeError("a failed copy elsewhere"))
        assert disk.read_weights(0, dst) is None
    finally:
        disk.close()
        tier.close()
