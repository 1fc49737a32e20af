"""A step whose gradient norm or loss is not finite: dropped under clipping (no state changes), and
never saved in a checkpoint either way."""
import pytest
import torch

from slideformer.config import Placement, Tuning
from slideformer import EngineConfig, SlideEngine
from slideformer.checkpoint.state import NonFiniteStateError
from slideformer.engine import engine as engine_mod

from tiny import batch, build


def poison_next_step(monkeypatch, what: str):
    """The next loss head call returns a NaN gradient (``what="grad"``) or a NaN loss (``"loss"``)."""
    real = engine_mod.chunked_head_loss
    armed = {"on": True}

    def head(*a, **k):
        part, gh = real(*a, **k)
        if armed.pop("on", False):
            if what == "grad":
                gh = gh * float("nan")
            else:
                part = part * float("nan")
        return part, gh

    monkeypatch.setattr(engine_mod, "chunked_head_loss", head)


def masters(eng):
    return {k: v.clone() for k, v in eng.state_dict().items()}


@pytest.mark.parametrize("spares", [0, 2])  # updates waiting for the norm; speculative ones run before it
@pytest.mark.parametrize("what", ["grad", "loss"])
@pytest.mark.parametrize("resident", [0, 1])
@pytest.mark.parametrize("gpu_first", [False, True])  # (the first streamed layer's update on the device)
def test_a_nonfinite_step_is_dropped_under_clipping(monkeypatch, spares, what, resident, gpu_first):
    """A, with a poisoned step between two good ones, ends bit-identical to B, which never saw it."""
    model = build("llama")
    cfg = EngineConfig(device="cpu", compute_dtype=torch.float32, lr=1e-2, max_grad_norm=1.0,
                       placement=Placement(speculative_layers=spares, resident_layers=resident,
                                           gpu_first_update=gpu_first), tuning=Tuning(loss_kernel="torch"))
    with SlideEngine(model, cfg) as a, SlideEngine(model, cfg) as b:
        a.train_step(batch(97, seed=0))
        b.train_step(batch(97, seed=0))
        before = masters(a)
        poison_next_step(monkeypatch, what)
        a.train_step(batch(97, seed=1))
        assert a.last_step_dropped and a.store.step == 1
        after = masters(a)
        assert all(torch.equal(before[k], after[k]) for k in before)
        a.train_step(batch(97, seed=2))
        b.train_step(batch(97, seed=2))
        assert not a.last_step_dropped and a.store.step == b.store.step == 2
        ma, mb = masters(a), masters(b)
        assert all(torch.equal(ma[k], mb[k]) for k in ma)
        assert (a.runtime.visiting is not None and a.runtime.visiting.updates == 2) == gpu_first
        if spares:  # (undone after the verdict, or, where the worker had not begun them by then, never run:
            # which of the two depends on the threads' timing, so either counts)
            spec = a.runtime.updates.speculation
            assert spec["dropped"] + spec["late"] > 0, spec


def test_a_nonfinite_state_is_never_saved(tmp_path, monkeypatch):
    """Without clipping the poisoned update is applied as gradients land; saving that state is refused
    before anything is renamed into place, and the previous checkpoint stays."""
    model = build("llama")
    cfg = EngineConfig(device="cpu", compute_dtype=torch.float32, tuning=Tuning(loss_kernel="torch"))
    with SlideEngine(model, cfg) as eng:
        eng.train_step(batch(97))
        eng.save_checkpoint(tmp_path / "ck", {"n": 1})
        poison_next_step(monkeypatch, "grad")
        eng.train_step(batch(97, seed=1))
        assert not eng.last_step_dropped and eng.last_grad_norm != eng.last_grad_norm  # NaN: applied
        with pytest.raises(NonFiniteStateError, match="holds NaN"):
            eng.save_checkpoint(tmp_path / "ck", {"n": 2})
        assert not (tmp_path / "ck.tmp").exists()
        assert eng.load_checkpoint(tmp_path / "ck")["n"] == 1  # intact, and it restores a finite state
        assert all(torch.isfinite(v).all() for v in eng.state_dict().values())


@pytest.mark.gpu
@pytest.mark.parametrize("spares", [0, 2])
@pytest.mark.parametrize("gpu_first", [False, True])
def test_a_nonfinite_step_is_dropped_on_cuda(monkeypatch, spares, gpu_first):
    """The same on the GPU, streams and events included: the poisoned step leaves no trace."""
    model = build("llama")
    cfg = EngineConfig(device="cuda", compute_dtype=torch.float32, lr=1e-2, max_grad_norm=1.0,
                       placement=Placement(speculative_layers=spares, resident_layers=1, gpu_first_update=gpu_first),
                       tuning=Tuning(loss_kernel="torch"))
    with SlideEngine(model, cfg) as a, SlideEngine(model, cfg) as b:
        a.train_step(batch(97, seed=0))
        b.train_step(batch(97, seed=0))
        poison_next_step(monkeypatch, "grad")
        a.train_step(batch(97, seed=1))
        assert a.last_step_dropped
        a.train_step(batch(97, seed=2))
        b.train_step(batch(97, seed=2))
        ma, mb = masters(a), masters(b)
        assert all(torch.equal(ma[k], mb[k]) for k in ma)
        assert (a.runtime.visiting is not None and a.runtime.visiting.updates == 2) == gpu_first


@pytest.mark.parametrize("what", ["grad", "loss"])
def test_a_dropped_step_leaves_the_compute_copy_as_it_was(monkeypatch, what):
    """bf16 compute keeps a host copy of the weights apart from the master, which a speculative update
    writes in place: a dropped step must put it back, or the next steps train on weights no master holds."""
    model = build("llama")
    cfg = EngineConfig(device="cpu", compute_dtype=torch.bfloat16, lr=1e-2, max_grad_norm=1.0, placement=Placement(speculative_layers=2), tuning=Tuning(loss_kernel="torch"))
    with SlideEngine(model, cfg) as a, SlideEngine(model, cfg) as b:
        a.train_step(batch(97, seed=0))
        b.train_step(batch(97, seed=0))
        poison_next_step(monkeypatch, what)
        a.train_step(batch(97, seed=1))
        assert a.last_step_dropped
        la, lb = a.train_step(batch(97, seed=2)), b.train_step(batch(97, seed=2))
        assert la == lb
        a.synchronize(), b.synchronize()
        assert all(torch.equal(wa, wb) for wa, wb in zip(a.store.weights, b.store.weights) if wa is not None)
        ma, mb = masters(a), masters(b)
        assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_weights_that_are_not_finite_are_never_exported(tmp_path, monkeypatch):
    """An export of NaN weights over a good one is refused before any file is replaced (it wrote the good
    shards' replacements and left a mixed folder); float16's range is named where only the cast overflows."""
    import errno
    from pathlib import Path

    from safetensors.torch import load_file

    from slideformer.checkpoint import export

    monkeypatch.setattr(export, "MAX_SHARD_BYTES", 20_000)  # (several files: the NaN is in a later one)
    model = build("llama")
    cfg = EngineConfig(device="cpu", compute_dtype=torch.float32, tuning=Tuning(loss_kernel="torch"))
    with SlideEngine(model, cfg) as eng:
        eng.train_step(batch(97))
        eng.save_pretrained(tmp_path / "hf", dtype=torch.float32)
        good = {f.name: f.read_bytes() for f in (tmp_path / "hf").iterdir()}
        assert sum(n.endswith(".safetensors") for n in good) > 2
        eng.synchronize()
        last = eng.store.unit_params(len(eng.adapter.units) - 2)  # (the last layer: a later file)
        key = next(iter(last))
        last[key].view(-1)[0] = float("nan")
        with pytest.raises(NonFiniteStateError, match=f"{key} holds NaN or infinite values in float32; nothing was"):
            eng.save_pretrained(tmp_path / "hf", dtype=torch.float32)
        assert {f.name: f.read_bytes() for f in (tmp_path / "hf").iterdir()} == good
        last[key].view(-1)[0] = 1e6  # (finite, past float16's 65504)
        with pytest.raises(NonFiniteStateError, match="in float16 \\(past float16's range: export in bfloat16"):
            eng.save_pretrained(tmp_path / "hf", dtype=torch.float16)
        assert {f.name: f.read_bytes() for f in (tmp_path / "hf").iterdir()} == good
        calls = {"n": 0}
        real_save = export.save_file

        def fills_up(tensors, path, **k):  # (a full disk at the third file, after part of it)
            calls["n"] += 1
            if calls["n"] == 3:
                Path(path).write_bytes(b"partial")
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_save(tensors, path, **k)

        monkeypatch.setattr(export, "save_file", fills_up)
        with pytest.raises(OSError, match="No space left"):
            eng.save_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
        assert {f.name: f.read_bytes() for f in (tmp_path / "hf").iterdir()} == good  # (no .tmp left either)
        monkeypatch.setattr(export, "save_file", real_save)
        (tmp_path / "hf" / "model.safetensors").symlink_to(tmp_path / "hf" / "config.json")  # (stale, as a link)
        eng.save_pretrained(tmp_path / "hf", dtype=torch.bfloat16)  # (written whole: every file replaced)
        assert not (tmp_path / "hf" / "model.safetensors").is_symlink() and (tmp_path / "hf" / "config.json").is_file()
        weights = {}
        for f in (tmp_path / "hf").glob("*.safetensors"):  # (the float32 export's extra shards removed)
            part = load_file(f)
            assert all(t.dtype == torch.bfloat16 for t in part.values()), f
            weights.update(part)
        assert weights[key].dtype == torch.bfloat16 and weights[key].view(-1)[0] == 1e6 // 4096 * 4096
