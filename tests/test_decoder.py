"""model/decoder.py: the engine's forward of Llama-style layers is transformers' own arithmetic, with the
residual sum in the norm's kernel (fused) and the recompute's output sum left uncomputed."""
import copy

import pytest
import torch

from slideformer import EngineConfig, SlideEngine
from slideformer.model import decoder

from tiny import FAMILIES, batch, build


def test_llama_style_layers_are_the_families_with_llamas_forward():
    styled = {f for f in FAMILIES if decoder.llama_style(build(f).model.layers[0])}
    assert styled == {"llama", "llama-tied", "qwen2", "qwen2-tied", "qwen3-tied", "mistral-sliding", "qwen3-moe",
                      "gemma", "olmoe"}


class _Recompute:
    recomputing = False

    @staticmethod
    def sum_in_down(layer, residual, mlp):
        return residual + mlp()

    @staticmethod
    def take_mid():
        return None

    @staticmethod
    def keep_mid(residual):
        pass


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.interpret)])
def test_the_forward_is_transformers(fused, monkeypatch):
    """Output and gradients as transformers' own forward of the layer (fp32; fused: the residual sum and
    the norm in the Triton kernel: on the GPU where there is one, else under the CPU interpreter)."""
    from slideformer.kernels.rms_norm import AddRMSNormFunction, RMSNormPassFunction

    kernels, real, real_pass = [], AddRMSNormFunction.apply, RMSNormPassFunction.apply
    monkeypatch.setattr(AddRMSNormFunction, "apply", lambda *a: kernels.append(1) or real(*a))
    monkeypatch.setattr(RMSNormPassFunction, "apply", lambda *a: kernels.append(2) or real_pass(*a))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = build("qwen3-tied").to(dev)
    ref_layer = model.model.layers[1]
    layer = copy.deepcopy(ref_layer)
    assert decoder.install([layer], _Recompute(), fused) == 1
    torch.manual_seed(0)
    x, g = torch.randn(2, 7, 32, device=dev), torch.randn(2, 7, 32, device=dev)
    pos = torch.arange(7, device=dev)[None].expand(2, 7)
    rope = model.model.rotary_emb(x, pos)

    def run(m):
        xi = x.clone().requires_grad_(True)
        y = m(xi, attention_mask=None, position_ids=pos, position_embeddings=rope)
        y = y[0] if isinstance(y, tuple) else y
        return (y, *torch.autograd.grad(y, [xi] + list(m.parameters()), g))

    for a, b in zip(run(layer), run(ref_layer)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert kernels == ([2, 1] if fused else [])  # (the input's norm passing the stream on, then the sum's)


def test_the_recompute_leaves_each_layers_output_sum_uncomputed(monkeypatch):
    """Each layer's recomputed output is an unread sum (3 layers x 2 micro-batches a step), and training
    is bit for bit transformers' forward's."""
    sums, real = [], decoder._UnreadSum.apply
    monkeypatch.setattr(decoder._UnreadSum, "apply", lambda *a: sums.append(1) or real(*a))
    model = build("llama")
    steps = [[batch(97, seed=s), batch(97, seed=10 + s)] for s in range(2)]

    def train():
        with SlideEngine(model, EngineConfig(device="cpu", compute_dtype=torch.float32)) as eng:
            return [eng.train_step(b) for b in steps], eng.state_dict()

    losses, got = train()
    assert len(sums) == 2 * 3 * 2
    monkeypatch.setattr(decoder, "install", lambda *a, **k: 0)
    monkeypatch.setattr("slideformer.engine.engine.install_decoder", lambda *a, **k: 0)
    sums.clear()
    ref_losses, ref = train()
    assert not sums and losses == ref_losses
    assert all(torch.equal(got[k], ref[k]) for k in ref)
