"""Bad input gets a clear error, not a stack trace from deep inside."""
import math

import pytest
import torch
from transformers import GPT2Config

from slideformer import BatchError, ConfigError, EngineConfig, Placement, SlideEngine, Tuning, UnsupportedModelError

from tiny import batch, build, engine_config, within

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


@pytest.mark.parametrize("name,config,refusal", [
    # a final norm with a bias (a LayerNorm): the loss head takes a weight only
    ("stablelm", dict(), "a final norm with parameters \\['bias', 'weight'\\]"),
    # routing by a trained buffer (DeepSeek-V3's e_score_correction_bias), which no slot holds
    ("deepseek_v3", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1,
                         topk_group=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
     "hold buffers \\(mlp.gate.e_score_correction_bias\\)"),
    ("granitemoe", dict(num_local_experts=4, num_experts_per_tok=2), "without an mlp module"),
    ("qwen3_next", dict(), "layers of type linear_attention: not supported yet"),
    # (a composite config: its causal LM built from its text part, whose keys the checks would not read)
    ("qwen3_5", dict(), "a composite config whose causal LM is built from its Qwen3_5TextConfig part"),
    ("seed_oss", dict(residual_dropout=0.1, attention_dropout=0.0), "residual_dropout=0.1"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "bidirectional attention"),
    # (trainable, through the attention transformers runs for it: the refusal says which)
    ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2), "set attn_implementation: eager"),
])
def test_a_family_the_engine_would_run_wrongly_is_refused_naming_what(name, config, refusal):
    """Support is found by structure; where a model's layers or forward need what the engine does not do
    (a biased final norm, trained buffers, a block under another name than mlp, attention that is not full
    or sliding, noise in the forward, bidirectional masks), the refusal names it, not a crash deep inside
    a step or a run that trains something else than the model."""
    from transformers import AutoConfig

    small = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    cfg = AutoConfig.for_model(name, **small, **config)
    with pytest.raises(UnsupportedModelError, match=refusal):
        SlideEngine.from_config(cfg, engine_config(**CPU))


def test_an_expert_count_no_layer_uses_trains_as_a_dense_model():
    """Qwen3-MoE with every layer dense (``mlp_only_layers``) names experts its layers do not have: trained
    as the dense model it is (the planner's expert sizes asked a layer with experts: a StopIteration)."""
    from transformers import Qwen3MoeConfig

    from test_engine_parity import engine_train, reference_train

    small = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**small, mlp_only_layers=[0, 1])).float()
    steps = [batch(97, seed=s) for s in range(2)]
    state, losses = engine_train(model, steps, lr=1e-2)
    ref, ref_losses = reference_train(model, steps, lr=1e-2)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert all(torch.allclose(state[k], v, rtol=0, atol=1e-5) for k, v in ref.state_dict().items())


@pytest.mark.parametrize("budget", [None, "1GiB"])
def test_a_batch_is_read_as_transformers_reads_it(budget, monkeypatch):
    """pack_batch's own dict (its int examples_used beside the tensors) and one row of position_ids for
    every row, as transformers broadcasts it, train as the plain batch does, under a GPU budget too (where
    the planner's split, here a row per micro-batch, took every key as rows: an IndexError, and a second
    micro-batch with no positions)."""
    from dataclasses import replace

    from slideformer.data.batches import pack_batch
    from slideformer.engine import engine as engine_mod

    real_fit = engine_mod.fit
    monkeypatch.setattr(engine_mod, "fit", lambda *a, **k: replace(real_fit(*a, **k), micro_batch=1))

    rng = torch.Generator().manual_seed(0)
    examples = [(x, x) for x in (torch.randint(0, 97, (int(n),), generator=rng).tolist() for n in (5, 9, 7, 11, 3))]
    packed = pack_batch(examples, rows=3, length=16, pad_id=0)
    ids = torch.randint(0, 97, (2, 16), generator=rng)
    shared = {"input_ids": ids, "position_ids": torch.arange(16).unsqueeze(0)}
    losses = []
    for step in (packed, shared, {k: v for k, v in packed.items() if k != "examples_used"},
                 {"input_ids": ids, "position_ids": torch.arange(16).expand(2, -1)}):
        with SlideEngine(build("llama"), engine_config(**CPU, gpu_memory_limit=budget)) as eng:
            losses.append((eng.train_step(step), eng.train_step(step)))
    assert losses[0] == losses[2] and losses[1] == losses[3]


def test_a_split_step_checks_its_shapes_before_it_splits(monkeypatch):
    """Under a GPU budget the planner splits the step by rows: labels or a mask with other rows than input_ids
    are refused as given (they were sliced to fit and trained), and a mapping that is not a dict (a tokenizer's
    BatchEncoding) trains as the dict does."""
    from collections import UserDict
    from dataclasses import replace

    from slideformer.engine import engine as engine_mod

    real_fit = engine_mod.fit
    monkeypatch.setattr(engine_mod, "fit", lambda *a, **k: replace(real_fit(*a, **k), micro_batch=1))
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    with SlideEngine(build("llama"), engine_config(**CPU, gpu_memory_limit="1GiB")) as eng:
        for bad, said in (({"labels": torch.ones(3, 4, dtype=torch.long)},
                           r"labels shape \(3, 4\) differs from input_ids \(2, 4\)"),
                          ({"attention_mask": torch.ones(5, 4)}, r"attention_mask shape \(5, 4\) differs")):
            with pytest.raises(BatchError, match=said):
                eng.train_step({"input_ids": ids, **bad})
        as_dict = eng.evaluate({"input_ids": ids, "labels": ids}).loss
        assert eng.evaluate(UserDict({"input_ids": ids, "labels": ids})).loss == as_dict
        # (a collator's keys near those it reads, with those keys there: not read, not refused)
        extra = {"labels_mask": ids, "label": ids, "prompt_attention_mask": ids, "token_type_ids": ids * 0}
        assert eng.evaluate({"input_ids": ids, "labels": ids, **extra}).loss == as_dict


def test_a_model_the_engine_cannot_train_as_given_is_refused(monkeypatch):
    """SlideEngine(model): frozen parameters (it would train them), weights never loaded, a tensor its config
    does not imply (it was broadcast or zero-filled into place), a path or a wrapper; torch.compile's wrapper
    is the model. A failed load gives back the threads it started."""
    import threading

    from slideformer.checkpoint import CheckpointError

    frozen = build("llama")
    frozen.model.embed_tokens.weight.requires_grad_(False)
    with pytest.raises(ConfigError, match=r"1 frozen parameter\(s\) \(requires_grad False, e.g. model.embed_tokens"):
        SlideEngine(frozen, engine_config(**CPU))
    with torch.device("meta"):
        meta = build("llama")
    with pytest.raises(CheckpointError, match="on the meta device: its weights were never loaded"):
        SlideEngine(meta, engine_config(**CPU))
    with pytest.raises(ConfigError, match=r"got str; for a model folder use SlideEngine.from_pretrained\(path\)"):
        SlideEngine("models/llama", engine_config(**CPU))
    with pytest.raises(ConfigError, match="a torch module with a config.*got ModuleDict"):
        SlideEngine(torch.nn.ModuleDict({"inner": build("llama")}), engine_config(**CPU))

    class Wrapper(torch.nn.Module):  # (as PEFT's: the model's config, its names under a prefix, the base frozen)
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

    with pytest.raises(CheckpointError, match=r"no parameter model.embed_tokens.weight \(it is wrapped"):
        SlideEngine(Wrapper(build("llama").requires_grad_(False)), engine_config(**CPU))
    before = threading.active_count()
    wider = build("llama")
    wider.config.vocab_size = 120  # (the 97-row embedding's rows 97-119 were left at zero)
    with pytest.raises(CheckpointError,
                       match=r"model.embed_tokens.weight has shape \(97, 32\), its config implies \(120, 32\)"):
        SlideEngine(wider, engine_config(**CPU))
    assert threading.active_count() == before
    model = build("llama")
    with SlideEngine(torch.compile(model), engine_config(**CPU)) as eng:
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in eng.state_dict().items())


def test_batch_longer_than_positions():
    with SlideEngine(build("llama"), engine_config(**CPU)) as eng:
        with pytest.raises(BatchError, match="sequence length 65 exceeds.*max_position_embeddings 64"):
            eng.train_step(batch(97, s=65))


@pytest.mark.parametrize("bad,match", [
    ({"input_ids": torch.tensor([[1, 2, 500]])}, r"token ids must lie in \[0, 97\)"),
    ({"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2]])}, "labels shape"),
    ({"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.full((1, 3), -100)}, "every label"),
    ({"tokens": [1, 2]}, "expected a dict with 'input_ids'"),
    ({"input_ids": torch.tensor([[1, 2, 3]]), "label": torch.tensor([[1, 2, 3]])},
     "'label' is not a key the engine reads; did you mean 'labels'"),
    ({"input_ids": torch.tensor([[1, 2, 3]]), "atention_mask": torch.ones(1, 3)}, "did you mean 'attention_mask'"),
    ({"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 2)}, "attention_mask shape"),
    ({"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 97]])},
     r"labels must be -100 \(ignored\) or token ids in \[0, 97\), got 97"),
    ({"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, -1, 2]])}, "got -1"),
    ({"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1.0, 2.0, 3.0]])}, "labels must be an integer"),
    ({"input_ids": torch.tensor([[1, 2], [3, 4], [5, 6]]), "labels": torch.tensor([[1, 2, 3], [4, 5, 6]])},
     r"labels shape \(2, 3\) differs"),  # (as many values, transposed: refused, not reshaped)
    ({"input_ids": torch.tensor([[1, 2], [3, 4], [5, 6]]), "attention_mask": torch.ones(2, 3)}, "attention_mask shape"),
    ([batch(97), {"input_ids": torch.zeros(0, 16, dtype=torch.long)}], r"micro-batch 1: input_ids of shape \(0, 16\) hold no token"),
    ({"input_ids": [[1, 2, 3], [4, 5]]}, "batch: input_ids must be a tensor or a rectangular list of integers, got list"),
    ({"input_ids": torch.ones(1, 3, dtype=torch.long, device="meta")}, "input_ids is a meta tensor"),
    ({"input_ids": torch.tensor([[1, 2, 3]]), "labels": [[1, "2", 3]]}, "labels must be a tensor or a rectangular"),
    ({"input_ids": torch.tensor([[1, 2], [3, 4], [5, 6]]), "position_ids": torch.tensor([[0, 1, 0], [1, 0, 1]])},
     r"position_ids must be integers of shape \(3, 2\) \(or \(1, 2\) for every row\), got \(2, 3\)"),
    ({"input_ids": torch.tensor([[1, 2, 3]]), "position_ids": torch.tensor([[0.0, 1.0, 2.0]])},
     "position_ids must be integers of shape"),
    ({"input_ids": torch.tensor([[1, 2, 3]]), "position_ids": torch.tensor(0)}, "position_ids must be integers of shape"),
    ({"input_ids": torch.tensor([[1, 2, 3]] * 2), "position_ids": torch.arange(6).view(1, 2, 3)},
     "position_ids must be integers of shape"),
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
    (dict(window_slots="auto"), "window_slots must be an integer, got 'auto'"),
    (dict(window_slots=2, prefetch_depth=2), "raise window_slots or lower prefetch_depth"),
    (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(host_weights="disk"), "host_weights"),
    (dict(host_memory_limit="lots"), "host_memory_limit: cannot read a memory size"),
    (dict(host_memory_limit=0), "host_memory_limit: a memory size must be > 0"),
    (dict(host_memory_limit=float("inf")), "host_memory_limit: a memory size must be finite"),
    (dict(host_memory_limit=True), "host_memory_limit: cannot read a memory size"),
    (dict(optimizer_state="4bit"), "optimizer_state must be 'fp32', 'compact' or '8bit', got '4bit'"),
    (dict(lr="1e-5"), "lr must be a number, got '1e-5'"),
    (dict(lr=float("nan")), "lr must be a finite number >= 0"),
    (dict(eps=float("nan")), "eps must be a finite number > 0"),
    (dict(eps=float("inf")), "eps must be a finite number > 0"),
    (dict(weight_decay=float("nan")), "weight_decay must be a finite number >= 0"),
    (dict(weight_decay=float("inf")), "weight_decay must be a finite number >= 0"),
    (dict(max_grad_norm=float("nan")), "max_grad_norm must be a finite number > 0"),
    (dict(max_grad_norm=float("inf")), "max_grad_norm must be a finite number > 0"),
    (dict(betas=(0.9, 0.99, 0.9)), "betas must be two numbers, got"),
    (dict(device="CPU"), "device must be 'cuda' or 'cpu'"),
    (dict(device="gpu"), "device must be 'cuda' or 'cpu'"),
    (dict(offload_activations="no"), "offload_activations must be True or False, got 'no'"),
    (dict(mid_layers=0.5), "mid_layers must be an integer, got 0.5"),
    (dict(host_grad_buffers=2.5), "host_grad_buffers must be an integer or None, got 2.5"),
    (dict(seed=None), "seed must be an integer, got None"),
    (dict(host_weights=True), "host_weights must be 'persistent', 'staged' or an integer, got True"),
    (dict(loss_kernel="triton"), "loss_kernel must be 'torch' or 'fused', got 'triton'"),
    (dict(offload_dir=3), "offload_dir must be text, a path or None, got 3"),
    (dict(compute_dtype="int8"), "compute_dtype must be bfloat16, float16 or float32, got 'int8'"),
    (dict(compute_dtype=torch.float16), "compute_dtype=float16 would train without loss scaling"),
    (dict(optimizer_state="8bit", compute_dtype=torch.float32), "optimizer_state='8bit' keeps the weights the GPU "
                                                                "reads in bf16: set compute_dtype=torch.bfloat16"),
    (dict(optimizer_state="8bit", compute_dtype=torch.bfloat16, grad_chunk_elems=1000),
     "blocks of 128: grad_chunk_elems must be a multiple of it, got 1000"),
])
def test_config_errors_name_the_fix(kw, match):
    with pytest.raises(ConfigError, match=match):
        engine_config(**{**CPU, **kw}).validate()


def test_an_offload_dir_that_is_a_file_is_refused_before_any_work(tmp_path):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(ConfigError, match=f"offload_dir {tmp_path / 'f'} is a file, not a folder"):
        engine_config(**{**CPU, "offload_dir": tmp_path / "f"}).validate()
    assert (tmp_path / "f").read_text() == "mine"


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
        with pytest.raises(RuntimeError, match="the CPU optimizer, weight loader or disk. failed") as info:
            eng.train_step(batch(97))  # the failure surfaces in this step or at the next wait
            eng.train_step(batch(97))
        assert isinstance(info.value.__cause__, MemoryError)


def test_a_worker_threads_failure_anywhere_in_it_ends_the_wait_for_it(monkeypatch):
    """An error outside an update's own handling (choosing the next update) still reaches the main thread,
    which would otherwise wait for that update for good."""
    from slideformer.engine import updates

    def boom(*a, **k):
        raise RuntimeError("simulated")

    monkeypatch.setattr(updates, "next_update", boom)
    with within(120, "the main thread waited for a dead worker"):
        with SlideEngine(build("llama"), engine_config(**CPU)) as eng:
            with pytest.raises(RuntimeError, match="a worker thread .* failed") as info:
                eng.train_step(batch(97))
                eng.synchronize()
            assert str(info.value.__cause__) == "simulated"


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
    with pytest.raises(DoesNotFit, match=r"host state and its window's slots \(compute\) needs about .* MiB of host "
                                         r"RAM \(master .*moments .*offload_dir"):
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
    from slideformer.plan import DoesNotFit

    with pytest.raises(DoesNotFit, match="gpu_memory_limit=24: a number is bytes; for GiB write '24GiB'"):
        SlideEngine(build("llama"), engine_config(**CPU, gpu_memory_limit=24))
    (tmp_path / "empty").mkdir()
    for folder, said in ((tmp_path / "missing", "no such folder"), (tmp_path / "empty", "no config.json")):
        with pytest.raises(CheckpointError, match=said):
            SlideEngine.from_pretrained(folder, engine_config(**CPU))
    eng = SlideEngine(build("llama"), engine_config(**CPU))
    for lr in (-1, "1e-5", float("inf"), torch.ones(2), True):
        with pytest.raises(ConfigError, match="learning rate must be a finite number >= 0"):
            eng.set_lr(lr)
    import numpy as np

    for lr in (np.float32(2e-5), torch.tensor(3e-5), np.int64(0)):  # (a scheduler's or NumPy's scalar)
        eng.set_lr(lr)
        assert type(eng.lr) is float and eng.lr == float(lr)
    with pytest.raises(ConfigError, match="trainer_state must be JSON"):
        eng.save_checkpoint(tmp_path / "ck", {"t": torch.ones(2)})
    with pytest.raises(ConfigError, match="trainer_state must be a dict, got list"):
        eng.save_checkpoint(tmp_path / "ck", [1])
    with pytest.raises(ConfigError, match="trainer_state's lr .* must be a finite number >= 0, got 'x'"):
        eng.save_checkpoint(tmp_path / "ck", {"lr": "x"})  # (load_checkpoint would set it)
    with pytest.raises(ConfigError, match="save_checkpoint's dtype must be bfloat16, float16 or float32"):
        eng.save_checkpoint(tmp_path / "ck", dtype=torch.int8)
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
    for folder in ("folder", "project/state", "run.tmp/state"):  # (a folder of its own named state/ too)
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "notes.txt").write_text("mine")
    with SlideEngine(build("llama"), engine_config(**CPU)) as eng:
        eng.train_step(batch(97))
        for target, taken in (("notes.py",) * 2, ("folder",) * 2, ("project",) * 2, ("run", "run.tmp")):
            with pytest.raises(CheckpointError, match=f"{taken} exists and is not a slideformer checkpoint"):
                eng.save_checkpoint(tmp_path / target)
        assert (tmp_path / "notes.py").read_text() == "mine"
        assert all((tmp_path / f / "notes.txt").read_text() == "mine" for f in ("folder", "project/state", "run.tmp/state"))
        assert not (tmp_path / "notes.py.old").exists() and not (tmp_path / "project.old").exists()
        eng.save_checkpoint(tmp_path / "ck")
        eng.train_step(batch(97))
        eng.save_checkpoint(tmp_path / "ck")  # (its own: replaced)
        verify_checkpoint(tmp_path / "ck")
        with pytest.raises(CheckpointError, match="is a slideformer checkpoint"):
            eng.save_pretrained(tmp_path / "ck")
        verify_checkpoint(tmp_path / "ck")


def test_a_checkpoint_whose_saved_lr_is_not_one_is_refused_before_loading(tmp_path):
    """A trainer state whose lr is not a learning rate (saved by an older slideformer, which took a caller's
    {"lr": ...} unchecked) is refused before any unit is restored: it loaded the weights, then raised."""
    import json

    from slideformer.checkpoint.state import TRAINER, _meta_crc

    with SlideEngine(build("llama"), engine_config(**CPU)) as eng:
        eng.train_step(batch(97))
        eng.save_checkpoint(tmp_path / "ck", {"next": 1})
        meta_path = tmp_path / "ck" / "state" / TRAINER
        meta = json.loads(meta_path.read_text())
        meta["trainer"]["lr"] = {"base": 1e-5}
        meta["crc32"] = _meta_crc(meta)
        meta_path.write_text(json.dumps(meta))
        eng.train_step(batch(97, seed=1))
        before = {k: v.clone() for k, v in eng.state_dict().items()}
        with pytest.raises(ConfigError, match=r"ck: its lr must be a finite number >= 0, got \{'base': 1e-05\}"):
            eng.load_checkpoint(tmp_path / "ck")
        assert all(torch.equal(before[k], v) for k, v in eng.state_dict().items())
        assert math.isfinite(eng.train_step(batch(97, seed=2)))  # (still usable)


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


def test_a_second_thread_is_refused_while_one_is_inside_the_engine(monkeypatch):
    """Two threads' steps would interleave their visits and their updates of the same state: the second
    caller is refused (train, save, close) while the first is inside; the first finishes as it would alone."""
    import threading

    from slideformer.engine import engine as engine_mod

    inside, go = threading.Event(), threading.Event()
    real = engine_mod.SlideEngine._end_step

    def slow_end(self, st):
        inside.set()
        go.wait(30)
        return real(self, st)

    with SlideEngine(build("llama"), engine_config(**CPU)) as eng:
        monkeypatch.setattr(engine_mod.SlideEngine, "_end_step", slow_end)
        out = []
        first = threading.Thread(target=lambda: out.append(eng.train_step(batch(97))))
        first.start()
        assert inside.wait(30)
        for call, what in ((lambda: eng.train_step(batch(97)), "train"), (eng.synchronize, "synchronize"),
                           (lambda: eng.save_checkpoint("unused"), "save"), (eng.close, "close")):
            with pytest.raises(RuntimeError, match=f"cannot {what}: another thread is using this engine"):
                call()
        go.set()
        first.join(30)
        monkeypatch.undo()
        assert len(out) == 1 and math.isfinite(out[0]) and eng.store.step == 1
        assert math.isfinite(eng.train_step(batch(97)))  # (this thread's turn now)


def test_packed_rows_under_flash_attention_are_one_a_micro_batch():
    """transformers' flash attention reads restarting position_ids as sample bounds only in a batch of one
    row: of two, each sample would attend to those before it in its row. Refused there, with the fix; one
    row, or rows of one sample each, pass."""
    from transformers.modeling_flash_attention_utils import _is_packed_sequence

    from slideformer.data.batches import check_step

    pos = torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)
    assert not _is_packed_sequence(pos, batch_size=2) and _is_packed_sequence(pos[:1], batch_size=1)  # (the rule)
    rows = {"input_ids": torch.ones(2, 6, dtype=torch.long), "position_ids": pos}
    with pytest.raises(BatchError, match="2 rows of packed samples under flash attention.*one packed row a"):
        check_step(rows, 97, None, flash=True)
    assert check_step(rows, 97, None)[1] == 8  # (sdpa and eager: every row's mask keeps its samples apart)
    assert check_step({k: v[:1] for k, v in rows.items()}, 97, None, flash=True)[1] == 4
    assert check_step(dict(rows, position_ids=torch.arange(6)[None]), 97, None, flash=True)[1] == 10
    with SlideEngine(build("llama"), engine_config(**CPU)) as eng:
        eng.train_step(rows)
        eng.adapter.attn_implementation = "flash_attention_2"  # (the CPU runs none: the check comes before it)
        with pytest.raises(BatchError, match="under flash attention"):
            eng.train_step(rows)
