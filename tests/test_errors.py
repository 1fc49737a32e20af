"""Bad input gets a clear error, not a stack trace from deep inside."""
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
])
def test_bad_batches(bad, match):
    with SlideEngine(build("llama"), engine_config(**CPU)) as eng:
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

    monkeypatch.setattr(engine_mod, "host_memory", lambda: 2**14)  # a 16 KiB machine
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
