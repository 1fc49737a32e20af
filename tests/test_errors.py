"""Bad input gets a clear error, not a stack trace from deep inside."""
import math

import pytest
import torch
from transformers import GPT2Config

from slideformer import BatchError, ConfigError, EngineConfig, Placement, SlideEngine, Tuning, UnsupportedModelError

from tiny import batch, build, engine_config

CPU = dict(device="cpu", compute_dtype=torch.float32)


def test_an_architecture_without_the_parts_names_what_is_missing():
    """Support is found by structure: GPT-2 has no rotary positions and keeps its layers elsewhere; what a
    config asks of the model-level compute that the engine does not repeat (MiniCPM's scaled residuals, as a
    config key) is named as what is not supported yet."""
    from transformers import LlamaConfig

    with pytest.raises(UnsupportedModelError, match="'gpt2': no model.embed_tokens.*model.rotary_emb.*such as llama"):
        SlideEngine.from_config(GPT2Config(n_layer=1, n_embd=16, n_head=2), engine_config(**CPU))
    small = dict(vocab_size=97, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=32)
    with pytest.raises(UnsupportedModelError, match="scaled residuals \\(scale_depth=1.4\\): not supported yet"):
        SlideEngine.from_config(LlamaConfig(**small, scale_depth=1.4), engine_config(**CPU))
    from transformers import MixtralConfig

    with pytest.raises(UnsupportedModelError, match="router_jitter_noise=0.1.*recompute"):
        SlideEngine.from_config(MixtralConfig(**small, router_jitter_noise=0.1), engine_config(**CPU))


def test_batch_longer_than_positions():
    with SlideEngine(build("llama"), engine_config(**CPU)) as eng:
        with pytest.raises(BatchError, match="sequence length 65 exceeds.*max_position_embeddings 64"):
            eng.train_step(batch(97, s=65))


@pytest.mark.parametrize("bad,match", [
    ({"input_ids": torch.tensor([[1, 2, 500]])}, r"token ids must lie in \[0, 97\)"),
    ({"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2]])}, "labels shape"),
    ({"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.full((1, 3), -100)}, "every label"),
    ({"tokens": [1, 2]}, "expected a dict with 'input_ids'"),
    ({"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 2)}, "attention_mask shape"),
    ({"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 97]])},
     r"labels must be -100 \(ignored\) or token ids in \[0, 97\), got 97"),
    ({"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, -1, 2]])}, "got -1"),
    ({"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1.0, 2.0, 3.0]])}, "labels must be an integer"),
    ({"input_ids": torch.tensor([[1, 2], [3, 4], [5, 6]]), "labels": torch.tensor([[1, 2, 3], [4, 5, 6]])},
     r"labels shape \(2, 3\) differs"),  # (as many values, transposed: refused, not reshaped)
    ({"input_ids": torch.tensor([[1, 2], [3, 4], [5, 6]]), "attention_mask": torch.ones(2, 3)}, "attention_mask shape"),
    ([batch(97), {"input_ids": torch.zeros(0, 16, dtype=torch.long)}], r"micro-batch 1: input_ids of shape \(0, 16\) hold no token"),
])
@pytest.mark.parametrize("budget", [None, "1GiB"])
def test_bad_batches(bad, match, budget):
    """Refused as given, also under a GPU budget, where the planner splits the step into its micro-batches
    (nothing is reshaped or dropped before the check)."""
    with SlideEngine(build("llama"), engine_config(**CPU, gpu_memory_limit=budget)) as eng:
        with pytest.raises(BatchError, match=match):
            eng.train_step(bad)
        eng.train_step(batch(97))  # the engine is still usable after a refused batch


@pytest.mark.parametrize("kw,match", [
    (dict(window_slots=1), "window_slots must be a number of slots >= 2"),
    (dict(window_slots="auto"), "window_slots must be a number of slots >= 2"),
    (dict(window_slots=2, prefetch_depth=2), "raise window_slots or lower prefetch_depth"),
    (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(host_weights="disk"), "host_weights"),
    (dict(host_memory_limit="lots"), "host_memory_limit: cannot read a memory size"),
    (dict(host_memory_limit=0), "host_memory_limit: a memory size must be > 0"),
    (dict(host_memory_limit=float("inf")), "host_memory_limit: a memory size must be finite"),
    (dict(host_memory_limit=True), "host_memory_limit: cannot read a memory size"),
    (dict(optimizer_state="4bit"), "optimizer_state must be one of 'fp32', 'compact', '8bit', got '4bit'"),
    (dict(lr="1e-5"), "lr must be a number, got '1e-5'"),
    (dict(lr=float("nan")), "lr must be a finite number >= 0"),
    (dict(eps=float("nan")), "eps must be a finite number > 0"),
    (dict(eps=float("inf")), "eps must be a finite number > 0"),
    (dict(weight_decay=float("nan")), "weight_decay must be a finite number >= 0"),
    (dict(weight_decay=float("inf")), "weight_decay must be a finite number >= 0"),
    (dict(max_grad_norm=float("nan")), "max_grad_norm must be a finite number > 0"),
    (dict(max_grad_norm=float("inf")), "max_grad_norm must be a finite number > 0"),
    (dict(betas=(0.9, 0.99, 0.9)), r"betas must be two numbers \(beta1, beta2\)"),
    (dict(compute_dtype="int8"), "compute_dtype must be bfloat16, float16 or float32, got 'int8'"),
    (dict(optimizer_state="8bit", compute_dtype=torch.float32), "optimizer_state='8bit' keeps the weights the GPU "
                                                                "reads in bf16: set compute_dtype=torch.bfloat16"),
    (dict(optimizer_state="8bit", compute_dtype=torch.bfloat16, grad_chunk_elems=1000),
     "blocks of 128: grad_chunk_elems must be a multiple of it, got 1000"),
])
def test_config_errors_name_the_fix(kw, match):
    with pytest.raises(ConfigError, match=match):
        engine_config(**{**CPU, **kw}).validate()


def test_prefetch_depth_defaults_to_what_the_window_allows():
    """Two visits ahead by default, one with two slots: setting window_slots alone never fails validation."""
    assert engine_config(**CPU).validate().placement.lookahead == 2
    assert engine_config(**{**CPU, "window_slots": 2}).validate().placement.lookahead == 1
    assert engine_config(**{**CPU, "prefetch_depth": 1}).validate().placement.lookahead == 1


def test_cuda_requested_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    with pytest.raises(ConfigError, match="device='cpu'"):
        EngineConfig(device="cuda").validate()


def test_optimizer_failure_surfaces(monkeypatch):
    from slideformer.engine import updates

    def boom(*a, **k):
        raise MemoryError("simulated")

    monkeypatch.setattr(updates, "adamw_update_", boom)
    with SlideEngine(build("llama"), engine_config(**CPU)) as eng:
        with pytest.raises(RuntimeError, match="CPU optimizer or weight loader failed") as info:
            eng.train_step(batch(97))  # the failure surfaces in this step or at the next wait
            eng.train_step(batch(97))
        assert isinstance(info.value.__cause__, MemoryError)


def test_engine_refuses_a_host_state_over_the_ram_before_allocating(monkeypatch):
    """A library user gets the planner's message, not the OOM killer: master, moments and gradient
    buffers are counted against the RAM before the host store exists."""
    from slideformer.engine import engine as engine_mod
    from slideformer.host import store
    from slideformer.plan import DoesNotFit

    from slideformer.plan.memory import HOST_SHARE, PROCESS_BYTES

    # (a machine whose RAM holds the process itself and 64 KiB more)
    monkeypatch.setattr(engine_mod, "host_memory", lambda: int((PROCESS_BYTES + 2**16) / HOST_SHARE) + 1)
    monkeypatch.setattr(store.HostStore, "__init__", lambda *a, **k: pytest.fail("allocated before refusing"))
    with pytest.raises(DoesNotFit, match=r"host state needs about .* MiB of host RAM \(master .*moments .*offload_dir"):
        SlideEngine(build("llama"), EngineConfig(device="cpu", compute_dtype=torch.float32))


def _raised(fn):
    try:
        fn()
    except BaseException as e:
        return e
    return None


@pytest.mark.parametrize("family,clip", [("llama", None), ("qwen3-tied", None), ("llama", 1e-3),
                                         ("qwen3-tied", 1e-3)])
def test_a_step_that_raises_midway_stops_the_engine(tmp_path, family, clip):
    """A step that raises in its backward has updated the units whose backward had ended and not the
    others, and it leaves offloaded inputs fetched for a backward that never took them. Stepping on, or
    saving, that state would be silent damage (the next step trained on those inputs: its weights came
    out unlike an intact engine's): the engine refuses to step, evaluate, save, load or hand out its
    weights, naming the way back. What the step left waiting (clipping's updates, a tied embedding's
    update by rows, sent at the head) is skipped: close returns. A new engine from the last checkpoint
    trains as one that never failed."""
    import threading

    from slideformer import StepFailed

    model = build(family)
    cfg = EngineConfig(**CPU, lr=1e-2, max_grad_norm=clip,
                       placement=Placement(offload_activations=True, gpu_activation_layers=0, speculative_layers=2),
                       tuning=Tuning(loss_kernel="torch"))
    with SlideEngine(model, cfg) as a:
        a.train_step(batch(97, seed=0))
        ck = a.save_checkpoint(tmp_path / "ck")
        real, armed = a._run_layer, {"on": True}

        def run(layer, i, x, mb):  # the second layer's backward (the first's inputs are fetched by then)
            if torch.is_grad_enabled() and i == 1 and armed.pop("on", False):
                raise RuntimeError("injected")
            return real(layer, i, x, mb)

        a._run_layer = run
        with pytest.raises(RuntimeError, match="injected"):
            a.train_step(batch(97, seed=1))
        def within(fn):  # what fn raised; it must not wait for what the step left queued (skipped)
            box = {}
            t = threading.Thread(target=lambda: box.update(e=_raised(fn)), daemon=True)
            t.start()
            t.join(30)
            assert not t.is_alive(), f"{fn.__name__} still waits for what the failed step left"
            return box["e"]

        assert "cannot synchronize" in str(within(a.synchronize))
        assert within(a.close) is None
        with pytest.raises(StepFailed, match="cannot train: step 2 raised RuntimeError midway.*build a new engine"):
            a.train_step(batch(97, seed=1))
        with pytest.raises(StepFailed, match="cannot evaluate"):
            a.evaluate(batch(97, seed=1))
        with pytest.raises(StepFailed, match="cannot read the weights"):
            a.state_dict()
        with pytest.raises(StepFailed, match="cannot save"):
            a.save_checkpoint(tmp_path / "bad")
        with pytest.raises(StepFailed, match="cannot load a checkpoint"):
            a.load_checkpoint(ck)
        assert not (tmp_path / "bad").exists()
    with SlideEngine(model, cfg) as b, SlideEngine(model, cfg) as c:
        b.load_checkpoint(ck)
        c.train_step(batch(97, seed=0))
        for seed in (1, 2):
            assert b.train_step(batch(97, seed=seed)) == c.train_step(batch(97, seed=seed))
        mb, mc = b.state_dict(), c.state_dict()
        assert all(torch.equal(mb[k], mc[k]) for k in mb)


def test_a_library_callers_mistakes_are_named(tmp_path):
    """The engine's own API: a config that is not an EngineConfig, a model folder that is not one, a learning
    rate that is not one, a trainer state that cannot be saved, and an engine used after close (which hung
    waiting on its stopped threads); a dtype by name is read as the dtype."""
    from slideformer.checkpoint import CheckpointError

    cfg = engine_config(**{**CPU, "compute_dtype": "float32"}).validate()
    assert cfg.compute_dtype is torch.float32
    with pytest.raises(ConfigError, match="cfg must be a slideformer.EngineConfig, got dict"):
        SlideEngine(build("llama"), {"lr": 1e-5})
    (tmp_path / "empty").mkdir()
    for folder, said in ((tmp_path / "missing", "no such folder"), (tmp_path / "empty", "no config.json")):
        with pytest.raises(CheckpointError, match=said):
            SlideEngine.from_pretrained(folder, engine_config(**CPU))
    eng = SlideEngine(build("llama"), engine_config(**CPU))
    for lr in (-1, "1e-5", float("inf")):
        with pytest.raises(ConfigError, match="learning rate must be a finite number >= 0"):
            eng.set_lr(lr)
    with pytest.raises(ConfigError, match="trainer_state must be JSON"):
        eng.save_checkpoint(tmp_path / "ck", {"t": torch.ones(2)})
    assert not (tmp_path / "ck").exists() and not (tmp_path / "ck.tmp").exists()
    eng.close()
    eng.close()  # (again: nothing)
    for call in (lambda: eng.train_step(batch(97)), lambda: eng.evaluate(batch(97)),
                 lambda: eng.save_checkpoint(tmp_path / "ck")):
        with pytest.raises(RuntimeError, match="the engine is closed"):
            call()


def test_a_save_replaces_only_a_checkpoint(tmp_path):
    """save_checkpoint replaces a checkpoint of the same name, never a user's file or folder there (it moved
    a file aside and removed a folder whole); save_pretrained never writes into a checkpoint, whose checksums
    its files would break."""
    from slideformer.checkpoint import CheckpointError
    from slideformer.checkpoint.state import verify_checkpoint

    (tmp_path / "notes.py").write_text("mine")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("mine")
    with SlideEngine(build("llama"), engine_config(**CPU)) as eng:
        eng.train_step(batch(97))
        for taken in ("notes.py", "folder"):
            with pytest.raises(CheckpointError, match=f"{taken} exists and is not a slideformer checkpoint"):
                eng.save_checkpoint(tmp_path / taken)
        assert (tmp_path / "notes.py").read_text() == (tmp_path / "folder" / "notes.txt").read_text() == "mine"
        assert not (tmp_path / "notes.py.old").exists()
        eng.save_checkpoint(tmp_path / "ck")
        eng.train_step(batch(97))
        eng.save_checkpoint(tmp_path / "ck")  # (its own: replaced)
        verify_checkpoint(tmp_path / "ck")
        with pytest.raises(CheckpointError, match="is a slideformer checkpoint"):
            eng.save_pretrained(tmp_path / "ck")
        verify_checkpoint(tmp_path / "ck")


def test_hugging_face_weights_are_written_in_a_float_dtype_only(tmp_path):
    """save_pretrained takes bfloat16, float16 or float32 (a dtype or its name), as export --dtype does: an
    integer dtype would write weights that load but are zeros."""
    with SlideEngine(build("llama"), engine_config(**CPU)) as eng:
        with pytest.raises(ConfigError, match="save_pretrained's dtype must be bfloat16, float16 or float32, got torch.int8"):
            eng.save_pretrained(tmp_path / "int8", dtype=torch.int8)
        assert not (tmp_path / "int8").exists()
        eng.save_pretrained(tmp_path / "bf16", dtype="bf16")
        import json

        assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_the_engine_keeps_its_own_copy_of_the_config():
    """A config changed after the engine is built (to build another) reaches neither the engine nor its
    checks: the engine trains as configured."""
    from tiny import batch, build, engine_config

    cfg = engine_config(device="cpu", compute_dtype=torch.float32, lr=1e-2)
    eng = SlideEngine(build("llama"), cfg)
    with eng:
        cfg.eps, cfg.max_grad_norm = -1.0, 1.0
        assert eng.cfg.eps != -1.0 and eng.cfg.max_grad_norm is None
        assert math.isfinite(eng.train_step(batch(97)))
