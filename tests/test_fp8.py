"""The layers' linears in FP8 (model/fp8.py): products and input gradients within FP8's error of the
exact ones, weights cast once a visit, and an engine that trains with them as bf16 training does, within
FP8's error, never bit for bit."""
import pytest
import torch
import torch.nn.functional as F

from slideformer import EngineConfig, SlideEngine
from slideformer.config import ConfigError
from slideformer.model import fp8 as fp8_mod
from slideformer.model.fp8 import Fp8Weights, fp8_gradients, fp8_linear

from tiny import batch, build

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_fp8_products_are_within_fp8s_error_and_cast_each_weight_once(monkeypatch):
    """``x @ w.T``, ``g @ w`` and ``g.T @ x`` from e4m3 operands: off the exact product by about e4m3's
    rounding (3 mantissa bits: a few percent of its norm), not bf16's; the weight's two casts are made once
    while it is kept, and made again once the owner clears them (a new visit); an activation that
    consecutive linears take is cast once, and again once it changes or another tensor comes; a gradient's
    rows and columns come from one kernel where both products are asked, with the products each gives
    alone. Shapes ``_scaled_mm`` cannot take multiply in the compute dtype."""
    casts = []
    for name in ("cast_rows", "cast_columns", "cast_rows_and_columns"):
        real = getattr(fp8_mod, name)
        monkeypatch.setattr(fp8_mod, name, lambda t, real=real, name=name: casts.append((name, *t.shape)) or real(t))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 33, 64, generator=g).to(DEV)
    w = (torch.randn(96, 64, generator=g) / 8).to(DEV)
    b = torch.randn(96, generator=g).to(DEV)
    cache = Fp8Weights()
    y = fp8_linear(x, w, b, cache)
    exact = F.linear(x.double(), w.double(), b.double())
    assert y.shape == (4, 33, 96) and 1e-3 < rel(y - b, exact - b.double()) < 0.05
    gy = torch.randn(132, 96, generator=g).to(DEV)
    gx, none = fp8_gradients(gy, x.view(132, 64), w, cache, True, True)
    assert none is None  # (132 tokens: not a multiple of 16, the caller's product)
    assert gx.shape == (132, 64) and 1e-3 < rel(gx, gy.double() @ w.double()) < 0.05
    g16, x16 = gy[:128], x.view(132, 64)[:128]
    gx16, gw = fp8_gradients(g16, x16, w, cache, True, True)
    assert gw.shape == (96, 64) and 1e-3 < rel(gw, g16.double().t() @ x16.double()) < 0.05
    assert gw.dtype == gy.dtype and 1e-3 < rel(gx16, g16.double() @ w.double()) < 0.05
    fp8_linear(x, w, None, cache)
    assert torch.equal(fp8_gradients(g16, x16, w, cache, True, False)[0], gx16)
    none, gw_alone = fp8_gradients(g16, x16, w, cache, False, True)
    assert none is None and torch.equal(gw_alone, gw)
    w2 = (torch.randn(32, 64, generator=g) / 8).to(DEV)
    fp8_linear(x, w2, None, cache)  # (another linear of the same input: as q, k and v)
    # x's rows once; gy's rows; g16's rows and columns together, then each alone; x16's columns once; each
    # weight's rows and columns once
    assert sorted(casts) == sorted([("cast_rows", 132, 64), ("cast_rows", 132, 96), ("cast_rows_and_columns", 128, 96),
                                    ("cast_rows", 128, 96), ("cast_columns", 128, 96), ("cast_columns", 128, 64),
                                    ("cast_rows", 96, 64), ("cast_columns", 96, 64), ("cast_rows", 32, 64)])
    casts.clear()
    x.mul_(1)  # (its version moves: cast again)
    fp8_linear(x, w2, None, cache)
    fp8_linear(x.clone(), w2, None, cache)  # (the same values elsewhere: cast again)
    assert casts == [("cast_rows", 132, 64)] * 2
    w.mul_(2)
    casts.clear()
    cache.clear()
    assert rel(fp8_linear(x, w, None, cache), F.linear(x.double(), w.double())) < 0.05
    assert ("cast_rows", 96, 64) in casts and ("cast_rows", 132, 64) in casts
    odd = torch.randn(40, 24, generator=g).to(DEV)  # (24 in, 40 out: not multiples of 16)
    xo = torch.randn(7, 24, generator=g).to(DEV)
    assert torch.equal(fp8_linear(xo, odd, None, cache), F.linear(xo, odd))


def train(family, steps, **kw):
    model = build(family)
    cfg = EngineConfig(device="cpu", compute_dtype=torch.float32, **kw)
    with SlideEngine(model, cfg) as eng:
        return [eng.train_step(b) for b in steps], eng.state_dict()


@pytest.mark.parametrize("family", ["llama", "qwen3-tied"])
def test_the_engine_trains_in_fp8_as_in_full_precision_within_fp8s_error(family, monkeypatch):
    """With fp8 every decoder linear's forward, recompute (but the down projection's, whose output it
    does not need), input gradient and weight gradient go through ``_scaled_mm``, for each layer and
    micro-batch, the weight gradient only where the micro-batch's tokens are a multiple of 16 (on the CPU
    ``scaled_mm``'s fp32 product of the dequantized values); the loss
    falls as full precision's does, within FP8's error of it, never equal to it."""
    calls = []
    real = fp8_mod.scaled_mm
    monkeypatch.setattr(fp8_mod, "scaled_mm", lambda *a: calls.append(1) or real(*a))
    steps = [[batch(97, s=16, seed=0), batch(97, seed=10)]] * 8  # (32 and 24 tokens; one batch learnt: the
    # loss falls)
    ref_losses, ref = train(family, steps, lr=3e-3)
    assert not calls
    losses, got = train(family, steps, lr=3e-3, fp8=True)
    model = build(family)
    layer = model.model.layers[0]
    linears = [m for m in layer.modules() if type(m) is torch.nn.Linear]
    # a step: layers x (forward + recompute without the down projection + input gradient, for both
    # micro-batches; the weight gradient for the first)
    per_step = model.config.num_hidden_layers * (2 * (3 * len(linears) - 1) + len(linears))
    assert len(calls) == len(steps) * per_step
    assert losses[-1] < losses[0] - 0.9 and ref_losses[-1] < ref_losses[0] - 0.9
    # (full precision with its micro-batches reordered moves the losses by under 1e-6; FP8 by about 1e-3)
    assert 1e-5 < max(abs(a - b) for a, b in zip(losses, ref_losses)) < 0.005 * ref_losses[0]
    # each layer weight's change over the run: within about a fifth of full precision's (Adam's normalised
    # steps carry small gradient differences into whole steps for the weights whose gradients are small)
    drift = max(rel(got[k] - model.state_dict()[k], ref[k] - model.state_dict()[k]) for k in ref
                if "layers" in k and not torch.equal(ref[k], model.state_dict()[k]))
    assert 0 < drift < 0.4


@pytest.mark.parametrize("placement,state", [
    (dict(window_slots=2, prefetch_depth=1), "fp32"),  # a slot takes another layer's weights within a step
    (dict(resident_layers=1, window_slots=2, prefetch_depth=1), "compact"),  # a Triton update, in place
])
def test_the_casts_a_visit_reuses_are_those_of_its_weights(placement, state, monkeypatch):
    """A weight's casts serve every micro-batch of a visit and never another visit, and an activation's
    serve the linears that take it: training with them kept is training with each weight and activation
    cast afresh at each use, bit for bit, where slots take other layers' weights and where a resident
    layer's update writes its weights without moving their version counter (compact state's kernel)."""
    steps = [[batch(97, s=16, seed=s), batch(97, seed=10 + s)] for s in range(3)]  # (FP8 and bf16 weight gradients)

    def run():
        model = build("llama")
        cfg = EngineConfig(device="cpu", compute_dtype=torch.bfloat16, fp8=True, lr=1e-2,
                           optimizer_state=state).placed(**placement)
        with SlideEngine(model, cfg) as eng:
            return [eng.train_step(b) for b in steps], eng.state_dict()

    kept_losses, kept = run()
    monkeypatch.setattr(Fp8Weights, "get", lambda self, w, columns=False:
                        fp8_mod.cast_rows(w.detach().t() if columns else w.detach()))
    monkeypatch.setattr(Fp8Weights, "activation", lambda self, x, columns=False:
                        fp8_mod.cast_columns(x) if columns else fp8_mod.cast_rows(x))
    fresh_losses, fresh = run()
    assert kept_losses == fresh_losses
    assert all(torch.equal(kept[k], fresh[k]) for k in fresh)


def test_fp8_asks_for_bf16_on_the_gpu():
    with pytest.raises(ConfigError, match="compute_dtype"):
        EngineConfig(device="cuda", compute_dtype=torch.float32, fp8=True).validate()
