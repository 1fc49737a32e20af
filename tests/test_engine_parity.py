"""The streamed engine trains exactly like plain PyTorch (fp32, CPU): the project's core test."""
import copy
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM

from slideformer import EngineConfig, SlideEngine, lr_at
from slideformer.config import ConfigError, Placement, Tuning

from tiny import BY_STRUCTURE, FAMILIES, attention, batch, build, engine_config


def decay_groups(model, weight_decay: float) -> list[dict]:
    """The parameters as transformers' Trainer groups them: weight decay on all but biases and norms."""
    from transformers import Trainer

    decayed = set(Trainer.get_decay_parameter_names(None, model))
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n in decayed], "weight_decay": weight_decay},
            {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0}]


def reference_train(model, batches, *, lr, weight_decay=0.0, max_grad_norm=None, lrs=None, betas=(0.9, 0.999),
                    eps=1e-8):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(decay_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, fused=True)
    losses = []
    for k, b in enumerate(batches):
        if lrs is not None:
            for g in opt.param_groups:
                g["lr"] = lrs[k]
        if isinstance(b, list):  # micro-batches, each one's mean weighted by its share of the step's targets
            targets = [int((m["labels"][:, 1:] != -100).sum()) for m in b]
            loss = 0.0
            for m, n in zip(b, targets):
                part = model(**m).loss * (n / sum(targets))
                part.backward()
                loss += part.item()
        else:
            out = model(**b)
            out.loss.backward()
            loss = out.loss.item()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss)
    return model, losses


def rows_apart(batches: list[dict], rows: int = 1) -> list[list[dict]]:
    """Each batch's rows as micro-batches of ``rows`` (the last, or half the batch), the last first: the
    reference's sums in other orders, for its own noise (``assert_same``'s ``noise_model``). A step given as
    micro-batches has each of them split so, the last first."""
    def size(b):
        n = len(b["input_ids"])
        return -(-n // 2) if rows == "half" else rows

    def parts(b):
        if isinstance(b, list):
            return [p for m in reversed(b) for p in parts(m)]
        return [{k: v[i: i + size(b)] for k, v in b.items()} for i in reversed(range(0, len(b["input_ids"]), size(b)))]

    return [parts(b) for b in batches]


def _rows_flipped(batches: list) -> list:
    """Each batch (or micro-batch) with its rows in reverse order: the same sums in another order."""
    return [[_rows_flipped([m])[0] for m in b] if isinstance(b, list) else {k: v.flip(0) for k, v in b.items()}
            for b in batches]


def reference_noise(model, batches, **kw) -> list:
    """PyTorch's training again in other exact orders of its sums, for its own noise (``assert_same``'s
    ``noise_model``; one order's distance alone is a single draw, on some CPUs a small one). A
    Mixture-of-Experts model: through transformers' eager experts (a loop over experts, not its grouped
    products; the router's loss is the whole batch's, so the rows stay together) with its rows as given and
    reversed, and through its own experts with the rows reversed. Any other: each batch's rows as
    micro-batches of one row and of half the batch (kernels of other shapes round otherwise: on some CPUs
    the larger part of the noise), the last first. In all, each input that several linears read in turn is
    summed over those linears before its other uses (as the engine's recompute sums them:
    model/recompute.py)."""
    model = linears_read_one_alias(copy.deepcopy(model))
    if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        grouped = reference_train(model, _rows_flipped(batches), **kw)[0]  # (its own experts, rows reversed)
        model.config._experts_implementation = "eager"
        return [reference_train(model, b, **kw)[0] for b in (batches, _rows_flipped(batches))] + [grouped]
    return [reference_train(model, rows_apart(batches, rows), **kw)[0] for rows in (1, "half")]


def linears_read_one_alias(model):
    """``model`` with each input that linears read in turn passed to them as one alias (a view): backward
    sums their input gradients at the alias, then adds that to the input's other uses' gradients."""
    last = {}

    def alias(module, args):
        x = args[0]
        seen = last.get("input")
        if seen is None or seen[0]() is not x:
            seen = last["input"] = (weakref.ref(x), x.view_as(x))
        return (seen[1],) + args[1:]

    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(alias)
    return model


def engine_train(model, steps, *, lrs=None, **cfg):
    # The autograd loss head runs the reference's own ops, so parity holds to rounding; the fused
    # head (the default) is held to it in test_fused_loss_head_matches_pytorch.
    cfg.setdefault("loss_kernel", "torch")
    cfg.setdefault("compute_dtype", torch.float32)
    eng = SlideEngine(model, engine_config(device="cpu", **cfg))
    losses = []
    with eng:
        for k, b in enumerate(steps):
            if lrs is not None:
                eng.set_lr(lrs[k])
            losses.append(eng.train_step(b))
        state = {k: v.clone() for k, v in eng.state_dict().items()}
    return state, losses


def assert_same(state, ref_model, losses, ref_losses, noise_model=None, atol=1e-4):
    """Each tensor within 1e-5 relative (||a - b|| / ||b||); no element off by more than ``atol``.

    Micro-batch accumulation sums in another order than one large batch, and Adam divides by
    sqrt(v), so an element whose gradient is near zero may differ by more than its own 1e-5.
    ``noise_model``: the reference trained again on the same batches in other exact orders of its sums
    (``reference_noise``: a model or a list of them); each tensor's bounds are then also three times its
    largest distance from the reference among them (fp32's noise, which on some CPUs' kernels passes 1e-5
    for a tensor or two)."""
    ref = ref_model.state_dict()
    noises = [m.state_dict() for m in (noise_model if isinstance(noise_model, list) else [noise_model])
              if m is not None]
    for key, v in state.items():
        r = ref[key]
        rel = float((v - r).norm() / r.norm())
        near = [n[key] for n in noises if key in n]
        rel_bound = max([1e-5] + [3 * float((n - r).norm() / r.norm()) for n in near])
        abs_bound = max([atol] + [3 * float((n - r).abs().max()) for n in near])
        assert rel <= rel_bound, f"{key}: relative error {rel:.2e} (bound {rel_bound:.2e})"
        torch.testing.assert_close(v, r, rtol=0, atol=abs_bound, msg=lambda m: f"{key}: {m}")
    assert losses == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(BY_STRUCTURE))
def test_families_match_pytorch(family):
    model = build(family)
    batches = [batch(model.config.vocab_size, seed=s) for s in range(3)]
    state, losses = engine_train(model, batches, lr=1e-2)
    ref, ref_losses = reference_train(model, batches, lr=1e-2)
    assert_same(state, ref, losses, ref_losses, reference_noise(model, batches, lr=1e-2))
    # training moved every parameter (a test that could not fail is a defect)
    init = model.state_dict()
    assert all(not torch.equal(state[k], init[k]) for k in state)


@pytest.mark.parametrize("slots,depth", [(2, 1), (3, 2), (5, 1)])
def test_window_shapes_do_not_change_training(slots, depth):
    model = build("qwen2")
    batches = [batch(97, seed=s) for s in range(3)]
    state, losses = engine_train(model, batches, lr=1e-2, window_slots=slots, prefetch_depth=depth)
    ref, ref_losses = reference_train(model, batches, lr=1e-2)
    assert_same(state, ref, losses, ref_losses)


@pytest.mark.parametrize("family", ["llama", "qwen3-tied", "olmo2", "phi3", "granite", "cohere", "gemma3", "gemma2",
                                    "qwen3-moe", "mixtral", "olmoe"])
def test_accumulation_equals_one_large_batch(family):
    model = build(family)
    V = model.config.vocab_size
    steps, big = [], []
    for s in range(3):
        mbs = [batch(V, seed=10 * s + k) for k in range(4)]
        # unequal counts of ignored labels per micro-batch: the mean must be over the whole step
        mbs[1]["labels"][:, :8] = -100
        steps.append(mbs)
        big.append({k: torch.cat([m[k] for m in mbs]) for k in ("input_ids", "labels")})
    # lr 1e-3: summation order differs from the large batch, and Adam amplifies that noise in
    # elements whose gradient is near zero (plain PyTorch's own accumulation differs by 4e-4 here).
    state, losses = engine_train(model, steps, lr=1e-3)
    ref, ref_losses = reference_train(model, big, lr=1e-3)
    assert_same(state, ref, losses, ref_losses)


@pytest.mark.parametrize("family", sorted({**FAMILIES, **BY_STRUCTURE}))
def test_weight_decay_skips_what_transformers_trainer_skips(family):
    """The units' undecayed ranges are exactly the parameters transformers' Trainer decays not (biases, norms,
    nn.LayerNorm's), whatever the family names them."""
    from transformers import Trainer

    from slideformer.model.adapter import ModelAdapter

    model = build(family)
    ad = ModelAdapter(model.config)
    spared = {p.key for u in ad.units for p in u.params if (p.offset, p.offset + p.numel) in u.no_decay}
    names = {p.key for u in ad.units for p in u.params}
    assert spared == names - set(Trainer.get_decay_parameter_names(None, model))
    assert any("norm" in k for k in spared) and all(u.no_decay == () for u in ad.units if u.kind == "embed")


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_clipping_weight_decay_and_schedule(backend):
    model = build("llama-tied")
    batches = [batch(97, seed=s) for s in range(4)]
    lrs = [lr_at(k, 1e-2, "cosine", warmup_steps=1, total_steps=4) for k in range(4)]
    assert len(set(lrs)) == 4
    kw = dict(weight_decay=0.1, max_grad_norm=0.05, betas=(0.8, 0.95))
    state, losses = engine_train(model, batches, lr=1e-2, lrs=lrs, optimizer_backend=backend, **kw)
    ref, ref_losses = reference_train(model, batches, lr=1e-2, lrs=lrs, **kw)
    assert_same(state, ref, losses, ref_losses)


def test_clipping_is_active_and_reported():
    model = build("llama")
    b = batch(97)
    eng = SlideEngine(model, EngineConfig(device="cpu", compute_dtype=torch.float32, lr=1e-2, max_grad_norm=1e-3))
    with eng:
        eng.train_step(b)
        norm = eng.last_grad_norm
    ref = copy.deepcopy(model)
    ref(**b).loss.backward()
    expect = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
    assert norm == pytest.approx(float(expect), rel=1e-5)
    assert norm > 1e-3  # the threshold was really crossed


def test_a_long_units_norm_does_not_drift_on_the_cpu():
    """A streamed unit's gradient is one flat vector; torch's CPU norm of a long fp32 vector drifts (about
    1e-3 relative at 30M elements, 1e-7 is fp32's rounding), so the engine's per-unit norm, which the
    clipping coefficient and the logged grad_norm take, must not be that norm."""
    from slideformer.engine.engine import grad_norm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(30_000_123, generator=g) * torch.rand(30_000_123, generator=g) ** 4
    exact = float(x.double().norm())
    assert float(grad_norm(x)) == pytest.approx(exact, rel=5e-5)
    assert float(grad_norm(x[:100])) == pytest.approx(float(x[:100].double().norm()), rel=1e-6)
    assert float(grad_norm(x.bfloat16())) == pytest.approx(float(x.bfloat16().double().norm()), rel=5e-5)


@pytest.mark.parametrize("loss_kernel", ["torch", "fused"])
def test_loss_chunks_without_labels_are_skipped_exactly(loss_kernel):
    """A whole loss chunk without a label (a row that is all prompt) is skipped by the micro-batch's host
    copy of which labels count: the training still equals PyTorch's. A micro-batch whose rows are all
    unpadded drops its attention mask (the same causal attention, built without reading the mask)."""
    model = build("llama")
    batches = []
    for s in range(3):
        b = batch(97, b=3, s=8, seed=s)
        # row 1 keeps one label, at position 4: after the shift it is target 11, so of the 4-token chunks
        # [8, 12) trains and [12, 16) is skipped (a mask taken before the shift would skip the wrong one)
        keep = b["labels"][1, 4].clone()
        b["labels"][1] = -100
        b["labels"][1, 4] = keep
        b["attention_mask"] = torch.ones_like(b["input_ids"])
        batches.append(b)
    state, losses = engine_train(model, batches, lr=1e-2, loss_kernel=loss_kernel, loss_chunk_tokens=4)
    ref, ref_losses = reference_train(model, batches, lr=1e-2)
    assert_same(state, ref, losses, ref_losses)


def test_padding_mask_and_ignored_labels():
    model = build("qwen3-tied")
    batches = []
    for s in range(3):
        b = batch(97, s=10, seed=s)
        am = torch.ones_like(b["input_ids"])
        am[0, 7:] = 0  # right padding in the first row
        b["labels"] = b["labels"].masked_fill(am == 0, -100)
        b["attention_mask"] = am
        batches.append(b)
    state, losses = engine_train(model, batches, lr=1e-2)
    ref, ref_losses = reference_train(model, batches, lr=1e-2)
    assert_same(state, ref, losses, ref_losses)


@pytest.mark.parametrize("staged", ["staged", 1])
def test_staged_host_weights_match_persistent(staged, monkeypatch):
    """bf16 compute: a copy cast at load time (all units, or the last layer only) is the same bits as the
    one the optimizer refreshes; the embedding's rows (engine/embedding.py) gathered and cast in pieces."""
    monkeypatch.setattr("slideformer.engine.runtime.ROWS_PIECE", 5)
    model = build("llama")
    batches = [batch(97, seed=s) for s in range(2)]
    a, la = engine_train(model, batches, lr=1e-2, compute_dtype=torch.bfloat16, host_weights="persistent")
    b, lb = engine_train(model, batches, lr=1e-2, compute_dtype=torch.bfloat16, host_weights=staged)
    assert la == lb
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("keep", [0, 1, 5])
def test_activation_offload_is_bit_identical(keep):
    model = build("qwen2-tied")
    steps = [[batch(97, seed=s), batch(97, b=3, s=9, seed=s + 7)] for s in range(2)]  # uneven micro-batches
    a, la = engine_train(model, steps, lr=1e-2)
    b, lb = engine_train(model, steps, lr=1e-2, offload_activations=True, gpu_activation_layers=keep)
    assert la == lb
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("buffers", [1, 2, None])
def test_host_gradient_ring_does_not_change_training(buffers):
    """One shared host buffer for all layer gradients (the main thread waits for the optimizer to free it)."""
    model = build("llama")
    batches = [batch(97, seed=s) for s in range(3)]
    state, losses = engine_train(model, batches, lr=1e-2, host_grad_buffers=buffers)
    ref, ref_losses = reference_train(model, batches, lr=1e-2)
    assert_same(state, ref, losses, ref_losses)


@pytest.mark.interpret
@pytest.mark.parametrize("family", ["llama", "qwen3-tied", "granite", "gemma2"])
def test_fused_loss_head_matches_pytorch(family):
    """The fused head (Triton, interpreted on the CPU) trains like the autograd head, which the tests
    above hold to plain PyTorch."""
    model = build(family)
    steps = [[batch(97, seed=s), batch(97, b=3, s=9, seed=s + 5)] for s in range(3)]
    state, losses = engine_train(model, steps, lr=1e-3, loss_kernel="fused", loss_chunk_tokens=7)
    ref, ref_losses = engine_train(model, steps, lr=1e-3, loss_kernel="torch")
    for k in state:
        assert float((state[k] - ref[k]).norm() / ref[k].norm()) < 1e-5, k
    assert losses == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.interpret
@pytest.mark.parametrize("family", ["llama", "qwen3-tied", "granite", "gemma2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliced_head_trains_like_the_whole_head(family, dtype, monkeypatch):
    """A plan that sums the lm_head gradient by vocabulary slices (engine/loss.py sliced_head_loss; the
    planner's choice under budgets too tight for its fp32 accumulator, test_plan.py) trains as the fused
    head does, to rounding, for a tied and an untied head, over several micro-batches; in bf16 too, where
    each slice's fp32 sum is cast into the bf16 slot as the whole accumulator is."""
    from dataclasses import replace

    from slideformer.engine import engine as engine_mod

    real_fit = engine_mod.fit
    monkeypatch.setattr(engine_mod, "fit", lambda *a, **k: replace(real_fit(*a, **k), micro_batch=2,
                                                                     head_slice=13))  # 97 rows: 8 slices
    model = build(family)
    steps = [batch(97, b=4, s=9, seed=s) for s in range(3)]
    state, losses = engine_train(model, steps, lr=1e-3, loss_kernel="fused", loss_chunk_tokens=7,
                                 gpu_memory_limit="1GiB", compute_dtype=dtype)
    split = [[{k: v[i: i + 2] for k, v in st.items()} for i in (0, 2)] for st in steps]
    ref, ref_losses = engine_train(model, split, lr=1e-3, loss_kernel="fused", loss_chunk_tokens=7,
                                   compute_dtype=dtype)
    for k in state:
        assert float((state[k] - ref[k]).norm() / ref[k].norm()) < 1e-5, k
    assert losses == pytest.approx(ref_losses, rel=1e-6)


def test_compact_state_trains_close_to_fp32_state():
    """The demo task, 120 steps, bf16 compute: compact state's tail loss lies within three times the
    spread of fp32 state's own over reorderings of each batch's rows (the trajectory's noise, which on
    some CPUs is large at this learning rate), or within 3% where that spread is smaller."""
    from slideformer.cli import main  # noqa: F401  (the demo data and tokenizer)
    from slideformer.data import pad_batch, render, to_messages, read_records, detect_format
    from slideformer.train.config import _assets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(_assets() / "tiny"))
    ex = [render(to_messages(r, detect_format(r, w), w), tok, w) for w, r in read_records(_assets() / "sample" / "alpaca.jsonl")]
    g = torch.Generator().manual_seed(0)
    picks = [torch.randint(0, len(ex), (8,), generator=g).tolist() for _ in range(120)]
    steps = [pad_batch([ex[i] for i in p], 0) for p in picks]
    runs = {"fp32": ("fp32", steps), "compact": ("compact", steps), "8bit": ("8bit", steps),  # and the same batches, rows reordered:
            "fp32 reversed": ("fp32", [pad_batch([ex[i] for i in reversed(p)], 0) for p in picks]),
            "fp32 rotated": ("fp32", [pad_batch([ex[i] for i in p[4:] + p[:4]], 0) for p in picks])}
    from slideformer.presets import preset_config

    tails = {}
    for name, (state, data) in runs.items():
        with SlideEngine.from_config(preset_config("tiny"), EngineConfig(device="cpu", compute_dtype=torch.bfloat16,
                                                                           lr=3e-3, optimizer_state=state)) as eng:
            curve = [eng.train_step(b) for b in data]
        assert sum(curve[-20:]) / 20 < 0.5 * curve[0], name  # it learned
        tails[name] = sum(curve[-20:]) / 20
    fp32 = [v for k, v in tails.items() if k.startswith("fp32")]
    noise = max(fp32) - min(fp32)
    for state in ("compact", "8bit"):
        gap = abs(tails[state] - tails["fp32"])
        assert gap <= max(3 * noise, 0.03 * tails["fp32"]), (state, gap, noise, tails)


def test_packed_rows_train_like_separate_rows():
    """Two samples packed in one row (positions restart, attention stays within each) give the same
    loss and update as the two samples in separate rows."""
    from slideformer.data import pack_batch

    model = build("qwen3-tied")
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 97, (10,), generator=g).tolist(), torch.randint(0, 97, (10,), generator=g).tolist()
    la, lb = [-100] * 3 + a[3:], [-100] * 2 + b[2:]
    packed = pack_batch([(a, la), (b, lb)], rows=1, length=20, pad_id=0)
    assert packed["examples_used"] == 2 and packed["position_ids"][0, 10] == 0
    packed.pop("examples_used")
    separate = {"input_ids": torch.tensor([a, b]), "labels": torch.tensor([la, lb])}
    # eps 1e-3: Adam's first step is g / (|g| + eps), a sign for tiny gradients; the two layouts sum in
    # other orders, so without a larger eps float noise in near-zero gradients would flip whole steps
    s1, l1 = engine_train(model, [packed], lr=1e-2, eps=1e-3)
    s2, l2 = engine_train(model, [separate], lr=1e-2, eps=1e-3)
    assert l1 == pytest.approx(l2, rel=1e-6)
    for k in s1:
        assert float((s1[k] - s2[k]).norm() / s2[k].norm()) < 1e-5, k
    # without the restarting positions the second sample would attend to the first: a different loss
    leaky = dict(packed, position_ids=torch.arange(20)[None])
    _, l3 = engine_train(model, [leaky], lr=1e-2, eps=1e-3)
    assert l3[0] != pytest.approx(l2[0], rel=1e-3)


@pytest.mark.parametrize("family,resident", [("qwen3-tied", 1), ("qwen3-tied", 3), ("llama", 2)])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_resident_layers_train_like_pytorch(family, resident, clip):
    """Some (the first 1 or 2; untied: the head shares the embedding's slot) or all (3: the whole model,
    embedding and head included) layers trained on the device."""
    model = build(family)
    batches = [[batch(97, seed=s), batch(97, seed=s + 11)] for s in range(3)]
    big = [{k: torch.cat([m[k] for m in mbs]) for k in ("input_ids", "labels")} for mbs in batches]
    state, losses = engine_train(model, batches, lr=1e-3, resident_layers=resident,
                                 max_grad_norm=clip, weight_decay=0.1)
    ref, ref_losses = reference_train(model, big, lr=1e-3, max_grad_norm=clip, weight_decay=0.1)
    assert_same(state, ref, losses, ref_losses,
                reference_noise(model, big, lr=1e-3, max_grad_norm=clip, weight_decay=0.1))


@pytest.mark.parametrize("family", ["qwen3-tied", "llama"])
@pytest.mark.parametrize("layers,clip", [(0, None), (1, 0.05)])
def test_resident_edges_train_like_pytorch(family, layers, clip):
    """Embedding and head (tied, or untied and sharing no slot) trained on the device, layers streamed."""
    model = build(family)
    batches = [[batch(97, seed=s), batch(97, seed=s + 11)] for s in range(3)]
    big = [{k: torch.cat([m[k] for m in mbs]) for k in ("input_ids", "labels")} for mbs in batches]
    state, losses = engine_train(model, batches, lr=1e-3, resident_layers=layers, resident_edges=True,
                                 max_grad_norm=clip, weight_decay=0.1)
    ref, ref_losses = reference_train(model, big, lr=1e-3, max_grad_norm=clip, weight_decay=0.1)
    assert_same(state, ref, losses, ref_losses,
                reference_noise(model, big, lr=1e-3, max_grad_norm=clip, weight_decay=0.1))


@pytest.mark.parametrize("family,resident", [("llama", 0), ("qwen3-tied", 1)])
@pytest.mark.parametrize("clip", [None, 0.05, 1e-9])
def test_first_layer_updated_on_the_gpu_trains_like_pytorch(family, resident, clip):
    """The first streamed layer's update on the device (engine/resident.py VisitingUpdate), with accumulation,
    weight decay and clipping (1e-9: every step clipped hard); its state goes back to the host store each step,
    and the CPU never updates it."""
    model = build(family)
    batches = [[batch(97, seed=s), batch(97, seed=s + 11)] for s in range(3)]
    big = [{k: torch.cat([m[k] for m in mbs]) for k in ("input_ids", "labels")} for mbs in batches]
    eng = SlideEngine(model, engine_config(device="cpu", compute_dtype=torch.float32, loss_kernel="torch", lr=1e-3,
                                           weight_decay=0.1, max_grad_norm=clip, resident_layers=resident,
                                           gpu_first_update=True))
    on_cpu, run = [], eng.runtime.updates._run_update
    eng.runtime.updates._run_update = lambda job: (on_cpu.append(job.unit), run(job))
    with eng:
        losses = [eng.train_step(b) for b in batches]
        state = {k: v.clone() for k, v in eng.state_dict().items()}
        first = eng.adapter.layer_unit(resident).index
        assert eng.runtime.visiting.unit == first and eng.runtime.visiting.updates == 3
    assert first not in on_cpu and first + 1 in on_cpu
    ref, ref_losses = reference_train(model, big, lr=1e-3, max_grad_norm=clip, weight_decay=0.1)
    assert_same(state, ref, losses, ref_losses,
                reference_noise(model, big, lr=1e-3, max_grad_norm=clip, weight_decay=0.1))


def test_the_copy_back_takes_the_visits_planned_for_the_steps_shape(monkeypatch):
    """Each step sets the state's copy back to plan.memory ``back_visits`` of the step as fit() sizes it:
    its rows times their longest sequence (micro-batches of 12 and 7 tokens: 4 x 12)."""
    import slideformer.engine.engine as engine_module

    asked = []
    monkeypatch.setattr(engine_module, "back_visits", lambda shape, p, tokens: asked.append(tokens) or 5)
    with SlideEngine(build("llama"), engine_config(device="cpu", compute_dtype=torch.float32, loss_kernel="torch",
                                                   gpu_first_update=True)) as eng:
        eng.train_step([batch(97, s=12), batch(97, s=7, seed=1)])
        assert eng.runtime.visiting.back_visits == 5 and asked == [48]


@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("pattern", [(1, 0, 1, 0, 1), (0, 1, 1, 0, 0)])
def test_first_layer_on_the_gpu_in_some_steps_only_trains_like_pytorch(clip, pattern):
    """Under a budget each step's plan says whether the first streamed layer's update runs on the device
    (engine._place): a step that updates it on the CPU takes the state a visiting step left on the device,
    and a visiting step the state a CPU update wrote."""
    model = build("llama")
    steps = [batch(97, seed=s) for s in range(len(pattern))]
    cfg = engine_config(device="cpu", compute_dtype=torch.float32, loss_kernel="torch", lr=1e-2, max_grad_norm=clip,
                        gpu_first_update=True)
    with SlideEngine(model, cfg) as e:
        losses = []
        for b, visits in zip(steps, pattern):
            e._visits_now = bool(visits)  # (what _place sets from the step's plan)
            losses.append(e.train_step(b))
        state = {k: v.clone() for k, v in e.state_dict().items()}
        assert e.runtime.visiting.updates == sum(pattern)
    ref, ref_losses = reference_train(model, steps, lr=1e-2, max_grad_norm=clip)
    assert_same(state, ref, losses, ref_losses, reference_noise(model, steps, lr=1e-2, max_grad_norm=clip))


def test_first_layer_on_the_gpu_survives_checkpoints_and_evaluation(tmp_path):
    """Resume is bit for bit, and an evaluation between steps reads the new weights from the device."""
    model = build("llama")
    steps = [batch(97, seed=s) for s in range(4)]
    cfg = dict(device="cpu", compute_dtype=torch.float32, loss_kernel="torch", lr=1e-2, gpu_first_update=True)
    straight, _ = engine_train(model, steps, lr=1e-2, gpu_first_update=True)
    with SlideEngine(model, engine_config(**cfg)) as e:
        for b in steps[:2]:
            e.train_step(b)
        e.evaluate(steps[0])
        e.save_checkpoint(tmp_path / "ck")
        e.train_step(steps[3])  # (the GPU's master is then another step's: the load below must not take it)
        e.load_checkpoint(tmp_path / "ck")
        for b in steps[2:]:
            e.train_step(b)
        resumed = {k: v.clone() for k, v in e.state_dict().items()}
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_resident_layers_and_the_nvme_tier_take_opposite_ends(tmp_path):
    """One layer resident (the first), one on the tier (the last), one in RAM (of 3); the training is
    the same as PyTorch's."""
    model = build("qwen3-tied")
    batches = [batch(97, seed=s) for s in range(3)]
    cfg = dict(resident_layers=1, offload_dir=str(tmp_path), nvme_fraction=1 / 3)
    with SlideEngine(model, engine_config(device="cpu", compute_dtype=torch.float32, **cfg)) as eng:
        layers = [eng.adapter.layer_unit(i).index for i in range(3)]
        assert [u in eng.resident for u in layers] == [True, False, False]
        assert [u in eng.store.tier.numels for u in layers] == [False, False, True]
    state, losses = engine_train(model, batches, lr=1e-3, weight_decay=0.1, **cfg)
    ref, ref_losses = reference_train(model, batches, lr=1e-3, weight_decay=0.1)
    assert_same(state, ref, losses, ref_losses)


@pytest.mark.parametrize("family,clip", [("llama", None), ("qwen3-tied", 0.05), ("olmo2", None), ("phi3", 0.05),
                                         ("qwen3-moe", 0.05)])
def test_token_chunked_mlps_train_like_pytorch(family, clip):
    """mlp_chunk_tokens (model/chunked_mlp.py): every layer's MLP runs in chunks of 7 tokens, each under its
    own checkpoint in backward; the training is PyTorch's."""
    model = build(family)
    batches = [[batch(97, seed=s), batch(97, seed=s + 11)] for s in range(3)]
    big = [{k: torch.cat([m[k] for m in mbs]) for k in ("input_ids", "labels")} for mbs in batches]
    rows = []
    cfg = EngineConfig(device="cpu", compute_dtype=torch.float32, lr=1e-3, weight_decay=0.1, max_grad_norm=clip, tuning=Tuning(loss_kernel="torch", mlp_chunk_tokens=7))
    with SlideEngine(model, cfg) as eng:
        mlp = eng.adapter.layers[1].mlp  # (the tokens each chunk's down projection, or experts, see)
        (getattr(mlp, "down_proj", None) or mlp.experts).register_forward_pre_hook(
            lambda m, i: rows.append(i[0].reshape(-1, i[0].shape[-1]).shape[0]))
        losses = [eng.train_step(b) for b in batches]
        state = {k: v.clone() for k, v in eng.state_dict().items()}
    # 24 tokens a micro-batch: chunks of 7, 7, 7 and 3, in the forward and twice in backward (recompute
    # of the layer, then of each chunk under its checkpoint)
    assert rows[:4] == [7, 7, 7, 3] and max(rows) == 7 and len(rows) == 3 * 2 * 3 * 4
    ref, ref_losses = reference_train(model, big, lr=1e-3, max_grad_norm=clip, weight_decay=0.1)
    assert_same(state, ref, losses, ref_losses,
                reference_noise(model, big, lr=1e-3, max_grad_norm=clip, weight_decay=0.1))


def test_resident_update_in_pieces_is_the_same_update(monkeypatch):
    from slideformer.engine import resident

    model = build("llama")
    steps = [batch(97, seed=s) for s in range(2)]
    whole, lw = engine_train(model, steps, lr=1e-2, resident_layers=1, resident_edges=True, max_grad_norm=0.05)
    monkeypatch.setattr(resident, "RESIDENT_PIECE", 1000)  # several pieces per unit, a short last one
    pieces, lp = engine_train(model, steps, lr=1e-2, resident_layers=1, resident_edges=True, max_grad_norm=0.05)
    assert lw == lp and all(torch.equal(whole[k], pieces[k]) for k in whole)


def test_resident_state_survives_checkpoints(tmp_path):
    model = build("llama")
    steps = [batch(97, seed=s) for s in range(4)]
    straight, _ = engine_train(model, steps, lr=1e-2, resident_layers=2)
    with SlideEngine(model, EngineConfig(device="cpu", compute_dtype=torch.float32, lr=1e-2, placement=Placement(resident_layers=2), tuning=Tuning(loss_kernel="torch"))) as e:
        for b in steps[:2]:
            e.train_step(b)
        e.save_checkpoint(tmp_path / "ck")
    with SlideEngine(model, EngineConfig(device="cpu", compute_dtype=torch.float32, lr=1e-2, placement=Placement(resident_layers=2), tuning=Tuning(loss_kernel="torch"))) as e:
        e.load_checkpoint(tmp_path / "ck")
        for b in steps[2:]:
            e.train_step(b)
        resumed = {k: v.clone() for k, v in e.state_dict().items()}
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


@pytest.mark.parametrize("family", ["llama", "qwen3-tied", "olmo2", "phi3", "granite", "cohere", "gemma3", "gemma2",
                                    "qwen3-moe", "mixtral", "olmoe"])
def test_padding_row_and_repeated_tokens_match_pytorch(family):
    """The embedding's backward sums each token's rows once (unique ids) and leaves the padding row's
    gradient at zero, as nn.Embedding(padding_idx) does; repeated tokens are the common case."""
    cfg = FAMILIES[family]()
    cfg.pad_token_id = 3
    cfg._attn_implementation = attention(cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    assert model.model.embed_tokens.padding_idx == 3
    g = torch.Generator().manual_seed(1)
    steps = [{"input_ids": torch.randint(0, 6, (2, 12), generator=g)} for _ in range(3)]  # token 3 and repeats
    for b in steps:
        b["labels"] = b["input_ids"].clone()
    state, losses = engine_train(model, steps, lr=1e-2)
    ref, ref_losses = reference_train(model, steps, lr=1e-2)
    assert_same(state, ref, losses, ref_losses, reference_noise(model, steps, lr=1e-2))


@pytest.mark.parametrize("family", ["llama", "qwen3-tied", "olmo2", "phi3", "granite", "cohere", "gemma3", "gemma2",
                                    "qwen3-moe", "mixtral", "olmoe"])
def test_gradient_norm_is_exact_every_step(family):
    """The head shares its slot with the embedding when untied: the alignment gaps of its layout must not
    carry the embedding's gradient of the step before into the norm (lr=0: the same norm every step)."""
    model = build(family)
    b = batch(97)
    b["input_ids"][:, :3] = torch.tensor([1, 2, 3])  # embedding rows that land in the head's layout gaps
    ref = copy.deepcopy(model)
    ref(**b).loss.backward()
    expect = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
    with SlideEngine(model, EngineConfig(device="cpu", compute_dtype=torch.float32, lr=0.0, tuning=Tuning(loss_kernel="torch"))) as eng:
        norms = []
        for _ in range(3):
            eng.train_step(b)
            norms.append(eng.last_grad_norm)
    assert norms == pytest.approx([expect] * 3, rel=1e-5)


def test_non_blocking_steps_train_the_same():
    model = build("qwen2")
    steps = [batch(97, seed=s) for s in range(3)]
    a, la = engine_train(model, steps, lr=1e-2)
    with SlideEngine(model, EngineConfig(device="cpu", compute_dtype=torch.float32, lr=1e-2, tuning=Tuning(loss_kernel="torch"))) as e:
        lb = [e.train_step(b, blocking=False) for b in steps]
        state = {k: v.clone() for k, v in e.state_dict().items()}
    assert all(torch.is_tensor(x) and x.dim() == 0 for x in lb)
    assert [float(x) for x in lb] == la
    assert all(torch.equal(a[k], state[k]) for k in a)


@pytest.mark.parametrize("state", ["fp32", "compact", "8bit"])
def test_chunked_gradient_stream_updates_the_same(state, tmp_path):
    """Gradients leave the GPU and are updated chunk by chunk: the result is bit-identical to one chunk
    per unit (compact state: its stochastic rounding hashes the position in the unit, not in the chunk)."""
    model = build("qwen3-tied")
    steps = [batch(97, seed=s) for s in range(3)]
    dt = torch.float32 if state == "fp32" else torch.bfloat16
    odd = 128 if state == "8bit" else 100  # (8-bit blocks are whole in a chunk)

    def run(**extra):
        cfg = engine_config(device="cpu", compute_dtype=dt, lr=1e-2, weight_decay=0.1, optimizer_state=state, **extra, loss_kernel="torch")
        with SlideEngine(model, cfg) as e:
            losses = [e.train_step(b) for b in steps]
            return losses, {k: v.clone() for k, v in e.state_dict().items()}

    la, a = run()
    lb, b = run(grad_chunk_elems=odd)  # small chunks: every unit is split many times
    lc, c = run(grad_chunk_elems=odd, offload_dir=str(tmp_path))  # and with the moments on the NVMe tier
    assert la == lb == lc
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("clip,state", [(None, "compact"), (0.05, "compact"), (0.05, "8bit")])
def test_compact_state_trains_resident_layers_like_streamed_ones(clip, state, tmp_path):
    """Compact state on the device (the first layer, embedding and head resident: bf16 lo half and
    moments beside the bf16 weights, updated by kernels/compact_adamw.py) is the CPU's compact AdamW: the
    same arithmetic and rounding bits, so the training follows the streamed one to fp32 rounding. Its
    checkpoint resumes it to the bit."""
    model = build("qwen3-tied")
    steps = [batch(97, seed=s) for s in range(4)]
    kw = dict(device="cpu", compute_dtype=torch.bfloat16, lr=1e-2, weight_decay=0.1, optimizer_state=state,
              optimizer_backend="torch", loss_kernel="torch", max_grad_norm=clip)

    def run(**extra):
        with SlideEngine(model, engine_config(**kw, **extra)) as e:
            assert (e.adapter.layer_unit(0).index in e.resident) == bool(extra)
            losses = [e.train_step(b) for b in steps]
            return losses, {k: v.clone() for k, v in e.state_dict().items()}

    la, a = run()
    lb, b = run(resident_layers=1, resident_edges=True)
    assert lb == pytest.approx(la, rel=1e-5)
    assert all(float((a[k] - b[k]).norm() / a[k].norm()) < 1e-4 for k in a)
    with SlideEngine(model, engine_config(**kw, resident_layers=1, resident_edges=True)) as e:
        for x in steps[:2]:
            e.train_step(x)
        e.save_checkpoint(tmp_path / "ck")
    with SlideEngine(model, engine_config(**kw, resident_layers=1, resident_edges=True)) as e:
        e.load_checkpoint(tmp_path / "ck")
        assert [e.train_step(x) for x in steps[2:]] == lb[2:]
        assert all(torch.equal(b[k], v) for k, v in e.state_dict().items())


def test_liger_ops_change_only_the_engines_own_modules():
    """fused_ops='liger' rebinds the forwards of the engine's skeleton (every RMSNorm, every SwiGLU MLP),
    never transformers' classes: another model of the family in the process keeps its own code."""
    from slideformer.model.adapter import ModelAdapter
    from slideformer.model.fused_ops import _unchanged, apply_liger

    model = build("qwen3-tied")
    ad = ModelAdapter(model.config)
    n = apply_liger(ad.layers + [ad.norm], model.config.hidden_act)
    per_layer = 4 + 1 + 1  # input, post-attention, q and k norms; the MLP; the attention's RoPE
    assert n == per_layer * ad.num_layers + 1
    assert all(lay.mlp.forward.__func__.__name__ == "_swiglu_forward" for lay in ad.layers)
    from slideformer.model.recompute import swiglu_mlp  # (its recompute then runs no SwiGLU forward either)
    assert all(swiglu_mlp(lay) is lay.mlp for lay in ad.layers)
    attn = ad.layers[0].self_attn  # (Qwen 3: its q and k norms run in the rotation's kernel)
    assert attn.forward.__func__.__globals__["apply_rotary_pos_emb"].__qualname__.startswith("_norm_rope_of")
    assert attn.q_norm.forward is attn.k_norm.forward is _unchanged
    llama = ModelAdapter(build("llama").config)
    apply_liger(llama.layers, model.config.hidden_act)
    assert llama.layers[0].self_attn.forward.__func__.__globals__["apply_rotary_pos_emb"].__name__ == "_liger_rope"
    for m in (model.model.layers[0].mlp, model.model.norm, model.model.layers[0].self_attn):
        assert "forward" not in vars(m)  # the user's model: untouched
    assert apply_liger(ad.layers, "gelu") == 5 * ad.num_layers  # a non-SiLU MLP keeps its forward


def test_attention_forward_with_another_rope_is_the_same_code():
    """The attention's rebound forward is its class's code with only the RoPE function swapped: with a
    counting wrapper around transformers' own RoPE, it gives the same output and calls the wrapper."""
    from slideformer.model.fused_ops import apply_liger

    model = build("llama")
    attn = model.model.layers[0].self_attn
    rope_fn = type(attn).forward.__globals__["apply_rotary_pos_emb"]
    calls = []

    def counting(*a, **k):
        calls.append(1)
        return rope_fn(*a, **k)

    x = torch.randn(2, 5, model.config.hidden_size)
    pos = model.model.rotary_emb(x, torch.arange(5)[None].expand(2, 5))
    ref = attn(x, position_embeddings=pos, attention_mask=None)[0]
    apply_liger([model.model.layers[0]], "gelu", rope=counting)
    out = attn(x, position_embeddings=pos, attention_mask=None)[0]
    assert calls and torch.equal(out, ref)


@pytest.mark.interpret
@pytest.mark.parametrize("family", ["llama", "qwen3-tied"])
def test_liger_rope_in_the_attention_matches_transformers(family):
    """Liger's RoPE kernel (Triton, interpreted on the CPU) inside the rebound attention, and for Qwen 3 our
    kernel of its q and k norms with the rotation: the same output and gradients as transformers'."""
    pytest.importorskip("liger_kernel")
    from slideformer.model.fused_ops import apply_liger

    model = build(family)
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 5, model.config.hidden_size, requires_grad=True)
    pos = model.model.rotary_emb(x, torch.arange(5)[None].expand(2, 5))
    params = list(attn.parameters())

    def run():
        y = attn(x, position_embeddings=pos, attention_mask=None)[0]
        return [y] + list(torch.autograd.grad((y * y).sum(), [x] + params))

    ref = run()
    apply_liger([model.model.layers[0]], "gelu")  # only the attention runs here: its norms are the fused ones too
    for a, b in zip(run(), ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_liger_ops_refused_where_they_cannot_run():
    from slideformer.model.fused_ops import liger_available, resolve

    with pytest.raises(ConfigError, match="[Ll]iger"):
        EngineConfig(device="cpu", tuning=Tuning(fused_ops="liger")).validate()
    assert resolve("auto", "cpu") == "none"  # the default: Liger where it can run, silently nothing elsewhere
    assert resolve("auto", "cuda") == ("liger" if liger_available() else "none")
    with SlideEngine.from_config(build("llama").config, EngineConfig(device=torch.device("cpu"))) as eng:
        assert eng.fused_ops == "none"  # (a torch.device works as well as a string)
        assert "Liger-Kernel is not installed" not in eng.describe()  # (the CPU runs unfused anyway)


def test_running_unfused_on_cuda_for_want_of_liger_is_said(monkeypatch):
    """A CUDA run that "auto" left unfused only because Liger-Kernel is missing is told why and what it
    costs (layers about a third slower); not where Liger would not serve anyway."""
    from slideformer.model import fused_ops

    monkeypatch.setattr(fused_ops, "liger_available", lambda: False)
    assert fused_ops.liger_missing("auto", "cuda:0", "qwen3")
    assert not fused_ops.liger_missing("auto", "cpu", "qwen3")
    assert not fused_ops.liger_missing("none", "cuda", "llama")
    assert not fused_ops.liger_missing("auto", "cuda", "gemma2")
    monkeypatch.setattr(fused_ops, "liger_available", lambda: True)
    assert not fused_ops.liger_missing("auto", "cuda", "llama")


def wait_for_speculation(eng):
    """Hold each verdict until every speculative update of the step has run (by default a late one runs
    in place after it): the tests then take the adopt or redo path every step, not by timing."""
    import time

    rt = eng.runtime.updates
    resolve = rt.resolve

    def resolve_when_done(coef):
        reserved = len(eng.store.spares) - len(rt._spares_free)
        t0 = time.monotonic()
        while len(rt._speculated) < reserved and time.monotonic() - t0 < 30:
            time.sleep(1e-3)
        resolve(coef)

    rt.resolve = resolve_when_done


@pytest.mark.parametrize("clip", [0.05, 100.0])  # every step clipped / none
@pytest.mark.parametrize("spares,backend", [(1, "native"), (3, "native"), (3, "torch")])
def test_speculative_updates_under_clipping_train_like_pytorch(clip, spares, backend):
    """speculative_layers: layers updated before the global norm is known, out of place into spare states.
    Where the norm is within the limit the spare is adopted, else the update runs again: bit for bit the
    training of updates that wait for the norm, and PyTorch's. Also with the verdict's natural timing."""
    model = build("llama")
    batches = [[batch(97, seed=s), batch(97, seed=s + 11)] for s in range(3)]
    big = [{k: torch.cat([m[k] for m in mbs]) for k in ("input_ids", "labels")} for mbs in batches]
    kw = dict(lr=1e-3, max_grad_norm=clip, weight_decay=0.1, optimizer_backend=backend)
    waiting, waiting_losses = engine_train(model, batches, **kw)
    for forced in (True, False):
        adopted = []
        with SlideEngine(model, engine_config(device="cpu", compute_dtype=torch.float32, **kw, speculative_layers=spares, loss_kernel="torch")) as eng:
            if forced:
                wait_for_speculation(eng)
            layers = [eng.adapter.layer_unit(i).index for i in range(3)]
            assert len(eng.store.spares) == spares
            losses = []
            for b in batches:
                before = [eng.store.master[u] for u in layers]
                losses.append(eng.train_step(b))
                eng.synchronize()
                adopted.append(sum(eng.store.master[u] is not t for u, t in zip(layers, before)))
            state = {k: v.clone() for k, v in eng.state_dict().items()}
            counts = dict(eng.runtime.updates.speculation)
        for key, v in waiting.items():
            assert torch.equal(state[key], v), (forced, key)
        assert losses == waiting_losses
        assert sum(counts.values()) == 3 * spares  # every spare used every step
        if forced:  # never clipped: each step's speculative updates are adopted; always clipped: redone
            assert adopted == ([spares] * 3 if clip == 100.0 else [0, 0, 0])
            assert counts == ({"kept": 3 * spares, "redone": 0, "late": 0, "dropped": 0} if clip == 100.0 else
                              {"kept": 0, "redone": 3 * spares, "late": 0, "dropped": 0})
    ref, ref_losses = reference_train(model, big, lr=1e-3, max_grad_norm=clip, weight_decay=0.1)
    assert_same(state, ref, losses, ref_losses,
                reference_noise(model, big, lr=1e-3, max_grad_norm=clip, weight_decay=0.1))


@pytest.mark.parametrize("state", ["compact", "8bit"])
def test_speculative_updates_of_compact_state_are_exact(state):
    """Compact state (bf16 hi/lo master, stochastically rounded moments) and 8-bit state speculated and
    adopted or redone: the same bits as updates that wait for the norm."""
    model = build("qwen3-tied")
    batches = [batch(97, seed=s) for s in range(3)]
    for clip in (0.05, 100.0):
        out = []
        for spares in (0, 3):
            cfg = EngineConfig(device="cpu", compute_dtype=torch.bfloat16, optimizer_state=state, lr=1e-2, max_grad_norm=clip, placement=Placement(speculative_layers=spares))
            with SlideEngine(model, cfg) as eng:
                wait_for_speculation(eng)
                losses = [eng.train_step(b) for b in batches]
                eng.synchronize()
                out.append(({k: v.clone() for k, v in eng.state_dict().items()}, losses))
                if spares:
                    assert eng.runtime.updates.speculation["kept" if clip == 100.0 else "redone"] == 9
        assert out[0][1] == out[1][1]
        for key, v in out[0][0].items():
            assert torch.equal(out[1][0][key], v), (clip, key)


def test_liger_ops_only_for_the_families_they_compute():
    """Liger's RMSNorm ("llama" casting) and whole-head RoPE are not OLMo 2's norm or Phi-3's partial rotary:
    "auto" leaves those families to transformers' modules, and "liger" asked for them is refused."""
    from slideformer.model.fused_ops import resolve

    assert resolve("auto", "cpu", "llama") == "none"  # (CUDA only)
    for family in ("olmo2", "phi3"):
        assert resolve("auto", "cuda", family) == "none"
        with pytest.raises(ConfigError, match=f"not '{family}'"):
            resolve("liger", "cuda", family)
    assert resolve("none", "cuda", "olmo2") == "none"


def test_attention_implementation_is_passed_through():
    """attn_implementation: eager trains like the SDPA reference; FlashAttention is refused on the CPU (and
    where it is not installed) with the fix; SDPA is refused for soft-capped attention, whose default is eager."""
    from slideformer.model.adapter import UnsupportedModelError

    model = build("llama")
    batches = [batch(97, seed=s) for s in range(2)]
    with SlideEngine(model, engine_config(device="cpu", attn_implementation="eager")) as eng:
        assert eng.adapter.layers[0].self_attn.config._attn_implementation == "eager"
    state, losses = engine_train(model, batches, lr=1e-2, attn_implementation="eager")
    ref, ref_losses = reference_train(model, batches, lr=1e-2)
    assert_same(state, ref, losses, ref_losses)
    with pytest.raises(ConfigError, match="runs on CUDA only"):
        EngineConfig(device="cpu", attn_implementation="flash_attention_2").validate()
    with pytest.raises(ConfigError, match="must be one of sdpa, eager"):
        EngineConfig(device="cpu", attn_implementation="flash").validate()
    with pytest.raises(UnsupportedModelError, match="soft-capped .*set attn_implementation to eager"):
        SlideEngine(build("gemma2"), engine_config(device="cpu", attn_implementation="sdpa"))
    with SlideEngine(build("gemma2"), engine_config(device="cpu")) as eng:
        assert eng.adapter.attn_implementation == "eager"


@pytest.mark.parametrize("family", ["llama", "qwen3-tied", "granite", "gemma2", "qwen3-moe"])
def test_evaluation_is_pytorchs_loss_and_leaves_training_as_it_was(family):
    """engine.evaluate (forward only, weights streamed, no gradient): transformers' loss on the same batch,
    after each step of training, in micro-batches too; and training with evaluations between its steps is
    the training without them."""
    model = build(family)
    steps = [batch(97, seed=s) for s in range(3)]
    held = [batch(97, b=3, s=10, seed=50), batch(97, b=2, s=12, seed=51)]
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0, fused=True)
    with SlideEngine(model, engine_config(device="cpu", compute_dtype=torch.float32, lr=1e-2,
                                          loss_kernel="torch")) as eng:
        for b in steps:
            eng.train_step(b)
            ref(**b).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for h in held:
                    loss, n, _ = eng.evaluate(h)
                    assert n == int((h["labels"][:, 1:] != -100).sum())
                    assert loss == pytest.approx(ref(**h).loss.item(), rel=1e-5)
            loss = eng.evaluate(held).loss  # two micro-batches: the mean over both batches' targets
            together = {k: torch.cat([torch.nn.functional.pad(h[k], (0, 12 - h[k].shape[1]), value=-100 if k ==
                                                              "labels" else 0) for h in held]) for k in held[0]}
            if family != "qwen3-moe":  # (padding would add routed tokens to the load-balancing loss)
                assert loss == pytest.approx(ref(**together).loss.item(), rel=1e-5)
        state = {k: v.clone() for k, v in eng.state_dict().items()}
    plain, _ = engine_train(model, steps, lr=1e-2)
    assert all(torch.equal(state[k], plain[k]) for k in plain)


@pytest.mark.parametrize("tied,clip", [(False, None), (False, 0.05), (True, None)])
@pytest.mark.parametrize("state", ["fp32", "compact", "8bit"])
def test_embedding_update_by_rows_is_the_whole_update(tied, clip, state, monkeypatch):
    """engine/embedding.py: the rows a step did not touch updated apart (untied: during its forward, with a
    zero gradient; tied: during backward, from the head's gradient), the touched ones from a packed gradient
    after backward, are the whole embedding's update to the bit, and plain PyTorch's training (fp32). Each
    step touches a few of the 97 rows, in two micro-batches, and rows touched before keep moving (momentum,
    weight decay), so an untouched part left out or run against the wrong step changes them; untied with
    clipping (active here) both parts wait for the verdict, and tied with clipping the update is whole."""
    import slideformer.engine.engine as engine_module
    from tiny import COMMON
    from transformers import LlamaConfig

    if state == "8bit":  # (rows of whole 8-bit blocks: 128 values)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**{**COMMON, "hidden_size": 128},
                                                             tie_word_embeddings=tied)).float()
    else:
        model = build("qwen3-tied" if tied else "llama")
    dtype = torch.float32 if state == "fp32" else torch.bfloat16
    g = torch.Generator().manual_seed(2)
    steps = [[{"input_ids": ids, "labels": ids.clone()}
              for ids in (torch.randint(8 * s, 8 * s + 12, (1, 12), generator=g) for _ in range(2))] for s in range(4)]
    kw = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=clip)
    with SlideEngine(model, engine_config(device="cpu", compute_dtype=dtype, optimizer_state=state)) as eng:
        assert eng._by_rows
    with SlideEngine(model, engine_config(device="cpu", compute_dtype=dtype, optimizer_state=state,
                                          max_grad_norm=0.05)) as eng:
        assert eng._by_rows != tied
    by_rows, losses = engine_train(model, steps, optimizer_state=state, compute_dtype=dtype, **kw)
    monkeypatch.setattr(engine_module, "embedding_by_rows", lambda *a, **k: False)
    whole, whole_losses = engine_train(model, steps, optimizer_state=state, compute_dtype=dtype, **kw)
    assert losses == whole_losses
    for k in whole:
        assert torch.equal(by_rows[k], whole[k]), k
    if state == "fp32":
        ref, ref_losses = reference_train(model, steps, **kw)
        assert_same(by_rows, ref, losses, ref_losses, reference_noise(model, [b[0] for b in steps], **kw))


def test_a_tied_embedding_by_rows_counts_every_row_in_the_norm(monkeypatch):
    """Tied, by rows, the untouched rows' part of the global norm is counted at the head and the touched
    rows' after backward: together the whole gradient's norm (which clipping and the logs read)."""
    import slideformer.engine.engine as engine_module

    model, b = build("qwen3-tied"), batch(97, b=2, s=12)
    norms = []
    for rows in (True, False):
        if not rows:
            monkeypatch.setattr(engine_module, "embedding_by_rows", lambda *a, **k: False)
        with SlideEngine(model, engine_config(device="cpu", compute_dtype=torch.float32, lr=1e-2)) as eng:
            assert eng._by_rows == rows
            eng.train_step(b)
            norms.append(eng.last_grad_norm)
    assert norms[0] == pytest.approx(norms[1], rel=1e-6)
    model(**b).loss.backward()  # plain PyTorch's, whose embedding holds a fair share of it
    whole = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert norms[0] == pytest.approx(float(whole), rel=1e-5)
    assert float(model.get_input_embeddings().weight.grad.norm()) > 0.3 * norms[0]


def test_the_loader_takes_updated_units_before_one_still_updating():
    """engine/runtime.py's loader: a load whose unit's update is still running does not hold up one asked
    after it whose unit is updated (at a step's start: the first layer behind the embedding); it goes
    when its update ends."""
    with SlideEngine(build("llama"), EngineConfig(device="cpu", compute_dtype=torch.float32)) as eng:
        rt = eng.runtime
        first, second = rt.slots["layer"][0], rt.slots["layer"][1]
        rt.updates.updated[1].clear()  # layer 0 "still updating"
        rt.load(1, first)
        rt.load(2, second)
        assert second.issued.wait(5) and not first.issued.is_set()
        rt.updates.updated[1].set()
        assert first.issued.wait(5)
        assert torch.equal(first.params[: eng.adapter.units[1].numel], eng.store.weights[1])


def test_the_embedding_by_rows_takes_a_padding_id_beyond_the_steps_rows(monkeypatch):
    """By rows the forward looks up the step's rows packed, where the padding id (50, of 97) is no row
    index: a padded untied model trains as PyTorch does, and as the whole update does, the padding row's
    gradient zero (nn.Embedding(padding_idx))."""
    import slideformer.engine.engine as engine_module

    cfg = FAMILIES["llama"]()
    cfg.pad_token_id = 50
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(3):
        ids = torch.randint(0, 6, (2, 12), generator=g)
        ids[:, -3:] = 50  # padding, inside the step's rows
        steps.append({"input_ids": ids, "labels": ids.clone()})
    kw = dict(lr=1e-2, weight_decay=0.1)
    state, losses = engine_train(model, steps, **kw)
    ref, ref_losses = reference_train(model, steps, **kw)
    assert_same(state, ref, losses, ref_losses, reference_noise(model, steps, **kw))
    monkeypatch.setattr(engine_module, "embedding_by_rows", lambda *a, **k: False)
    whole, _ = engine_train(model, steps, **kw)
    assert all(torch.equal(state[k], whole[k]) for k in whole)


def test_a_failed_step_stops_its_untouched_rows_before_anyone_reads(monkeypatch):
    """The rows a step does not touch are queued at its embedding visit; after a step that fails later, the
    engine refuses to read or save (StepFailed) rather than wait, and close returns only once that part, if
    it had begun, has ended: nothing changes the state after the engine is closed."""
    import time

    import slideformer.engine.updates as updates
    from slideformer import StepFailed

    real, started, done = updates.adamw_update_, [], []

    def slow(*a, rows=None, **k):
        if rows is not None and not rows.touched:
            started.append(1)
            time.sleep(0.3)
            done.append(1)
        return real(*a, rows=rows, **k)

    def fails(*a, **k):
        raise RuntimeError("a layer failed")

    monkeypatch.setattr(updates, "adamw_update_", slow)
    eng = SlideEngine(build("llama"), EngineConfig(device="cpu", compute_dtype=torch.float32))
    try:
        assert eng._by_rows
        monkeypatch.setattr(eng, "_fwd", fails)
        with pytest.raises(RuntimeError, match="a layer failed"):
            eng.train_step(batch(97))
        for read in (eng.synchronize, eng.state_dict):
            with pytest.raises(StepFailed):
                read()
    finally:
        eng.close()
    assert done == started
