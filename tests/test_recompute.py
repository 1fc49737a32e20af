"""model/recompute.py: backward's recompute records the down projection's graph without its product."""
import contextlib

import pytest
import torch
from torch import nn

from slideformer import EngineConfig, SlideEngine
from slideformer.model.recompute import OutputFreeRecompute, _GraphOnlyLinear

from tiny import batch, build


@pytest.mark.parametrize("bias", [False, True])
def test_graph_only_linear_has_linears_gradients(bias):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 6, requires_grad=True)
    w = torch.randn(4, 6, requires_grad=True)
    b = torch.randn(4, requires_grad=True) if bias else None
    g = torch.randn(2, 5, 4)
    ref = torch.autograd.grad(nn.functional.linear(x, w, b), [x, w] + ([b] if bias else []), g)
    out = _GraphOnlyLinear.apply(x, w, b)
    assert out.shape == (2, 5, 4)
    got = torch.autograd.grad(out, [x, w] + ([b] if bias else []), g)
    for a, r in zip(got, ref):
        assert a.is_contiguous() and torch.equal(a, r)


def test_the_engine_skips_the_projection_in_backward_only(monkeypatch):
    """The recompute in backward records each layer's down projection without its product: 3 fewer
    linear products a step (3 layers, one micro-batch) than with the projection computed, the same loss
    (the training itself: tests/test_engine_parity.py)."""
    products, graph_only = [], []
    real_linear, real_apply = torch.nn.functional.linear, _GraphOnlyLinear.apply
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: products.append(1) or real_linear(*a))
    monkeypatch.setattr(_GraphOnlyLinear, "apply", lambda *a: graph_only.append(1) or real_apply(*a))

    def step():
        products.clear()
        graph_only.clear()
        with SlideEngine(build("llama"), EngineConfig(device="cpu", compute_dtype=torch.float32)) as eng:
            return eng.train_step(batch(97)), len(products), len(graph_only)

    loss, n, skipped = step()
    assert skipped == 3
    monkeypatch.setattr(OutputFreeRecompute, "active", lambda self, on=True: contextlib.nullcontext())
    loss_full, n_full, skipped_full = step()
    assert (n_full - n, skipped_full, loss_full) == (3, 0, loss)


def test_a_normalised_mlp_output_is_refused():
    layer = nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.down_proj = nn.Linear(4, 4)
    OutputFreeRecompute([layer])
    layer.post_feedforward_layernorm = nn.LayerNorm(4)
    with pytest.raises(TypeError, match="residual sum"):
        OutputFreeRecompute([layer])
