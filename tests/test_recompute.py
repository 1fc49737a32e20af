"""model/recompute.py: backward's recompute records the down projection's graph without its product,
returns saved layers' kept products instead of multiplying again, and adds each weight's gradient into
its .grad within the GEMM."""
import contextlib

import pytest
import torch
from torch import nn

from slideformer import EngineConfig, SlideEngine
from slideformer.config import Tuning
from slideformer.model.recompute import LayerRecompute, _RecomputedLinear, kept_values_per_token, output_free_down

from tiny import FAMILIES, batch, build


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("mode", ["computed", "output_free", "kept"])
@pytest.mark.parametrize("into_grad", [False, True])
def test_the_recomputed_linear_has_linears_gradients(bias, mode, into_grad, monkeypatch):
    """Its output: the product, the kept one, or memory of the right shape; its gradients: autograd's for
    the linear, the weight's added into a .grad of the product's dtype where one is bound (and then not
    again by autograd), else returned."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 6, requires_grad=True)
    w = torch.randn(4, 6, requires_grad=True)
    b = torch.randn(4, requires_grad=True) if bias else None
    g = torch.randn(2, 5, 4)
    y = nn.functional.linear(x, w, b)
    ref = torch.autograd.grad(y, [x, w] + ([b] if bias else []), g)
    before = torch.randn(4, 6)
    fused, real = [], torch.Tensor.addmm_
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda *a, **k: fused.append(1) or real(*a, **k))
    if into_grad:
        w.grad = before.clone()
    out = _RecomputedLinear.apply(x, w, b, [y.detach()] if mode == "kept" else None, mode == "output_free")
    assert out.shape == (2, 5, 4)
    if mode != "output_free":
        assert torch.equal(out, y)
    torch.autograd.backward(out, g, inputs=[x, w] + ([b] if bias else []))
    assert torch.equal(x.grad, ref[0]) and x.grad.is_contiguous()
    if bias:
        assert torch.equal(b.grad, ref[2])
    assert len(fused) == into_grad
    if into_grad:  # added once, in the GEMM (fp32 rounding of one sum against two)
        torch.testing.assert_close(w.grad, before + ref[1], rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(w.grad, ref[1]) and w.grad.is_contiguous()


def test_the_engine_skips_the_projection_in_backward_only(monkeypatch):
    """The recompute in backward records each layer's down projection without its product (a SwiGLU MLP's
    in one node with the SwiGLU: ``unread_mlp``): 3 fewer linear products a step (3 layers, one
    micro-batch) than with the projection computed, the same loss (the training itself:
    tests/test_engine_parity.py)."""
    from slideformer.model import recompute

    products, graph_only = [], []
    real_linear, real_apply = torch.nn.functional.linear, _RecomputedLinear.apply
    real_swiglu = recompute._UnreadSwiGLUDown.apply
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: products.append(1) or real_linear(*a))

    def counted(*a):
        if a[4:5] == (True,):  # (output_free)
            graph_only.append(1)
        return real_apply(*a)

    monkeypatch.setattr(_RecomputedLinear, "apply", counted)
    monkeypatch.setattr(recompute._UnreadSwiGLUDown, "apply", lambda *a: graph_only.append(1) or real_swiglu(*a))

    def step():
        products.clear()
        graph_only.clear()
        with SlideEngine(build("llama"), EngineConfig(device="cpu", compute_dtype=torch.float32)) as eng:
            return eng.train_step(batch(97)), len(products), len(graph_only)

    loss, n, skipped = step()
    assert skipped == 3
    monkeypatch.setattr(LayerRecompute, "active", lambda self, on=True, kept=None, mid=None: contextlib.nullcontext())
    loss_full, n_full, skipped_full = step()
    assert (n_full - n, skipped_full, loss_full) == (3, 0, loss)


def test_the_forward_adds_each_layers_output_sum_in_the_down_projection(monkeypatch):
    """A forward without gradients adds each layer's output sum within its down projection's GEMM (3 layers,
    2 micro-batches a step), not in a separate add; OLMoE's experts end otherwise, so it sums apart. The
    training is the separate sum's, within fp32's rounding (one rounding of the product and sum, not two)."""
    sums, real_addmm = [], torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: sums.append(a[0].shape) or real_addmm(*a, **k))
    steps = [[batch(97, seed=s), batch(97, seed=10 + s)] for s in range(2)]

    def train(family):
        sums.clear()
        with SlideEngine(build(family), EngineConfig(device="cpu", compute_dtype=torch.float32)) as eng:
            return [eng.train_step(b) for b in steps], eng.state_dict()

    losses, got = train("llama")
    hidden = build("llama").config.hidden_size
    assert len(sums) == 2 * 3 * 2 and all(s[-1] == hidden for s in sums)
    train("olmoe")
    assert not sums
    monkeypatch.setattr(LayerRecompute, "sum_in_down", lambda self, layer, residual, mlp: residual + mlp())
    ref_losses, ref = train("llama")
    assert not sums
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-7)


def test_a_normalised_mlp_output_is_kept_like_the_others():
    """Where a norm reads the down projection's output (OLMo 2, Gemma), its product is neither skipped in
    the recompute nor left out of the kept products (tests/test_engine_parity.py trains OLMo 2)."""
    layer = nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.down_proj, layer.mlp.up_proj = nn.Linear(4, 6), nn.Linear(4, 4)
    assert output_free_down(layer) is layer.mlp.down_proj and kept_values_per_token(layer) == 4
    layer.post_feedforward_layernorm = nn.LayerNorm(4)
    assert output_free_down(layer) is None and kept_values_per_token(layer) == 10


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_saved_layers_train_bit_identically_without_recomputed_products(family, monkeypatch):
    """Saved layers' backward multiplies nothing again (each of the 2 saved layers' kept products, for each
    of 2 micro-batches, is gone from the step's recompute), and trains bit for bit as the
    recompute does: the kept products are the values the recompute would compute."""
    products = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: products.append(1) or real_linear(*a))
    model = build(family)
    steps = [[batch(97, seed=s), batch(97, seed=10 + s)] for s in range(3)]

    def train(saved):
        cfg = EngineConfig(device="cpu", compute_dtype=torch.float32).placed(saved_layers=saved)
        counts = []
        with SlideEngine(model, cfg) as eng:
            for b in steps:
                products.clear()
                losses.append(eng.train_step(b))
                counts.append(len(products))
            return losses, eng.state_dict(), counts

    losses = []
    ref_losses, ref, ref_counts = train(0)
    losses = []
    got_losses, got, counts = train(2)
    assert got_losses == ref_losses
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    layer = model.model.layers[0]
    kept = sum(type(m) is nn.Linear and m is not output_free_down(layer) for m in layer.modules())
    # (OLMo 2 and Gemmas 2-3 normalise the MLP output; MoE layers keep their attention's: the experts are no nn.Linear)
    assert kept == {"olmo2": 7, "gemma3": 7, "gemma2": 7, "phi3": 3, "qwen3-moe": 4, "mixtral": 4, "olmoe": 4}.get(family, 6)
    assert [r - c for r, c in zip(ref_counts, counts)] == [2 * 2 * kept] * 3  # 2 layers, 2 micro-batches


def test_saved_layers_with_offloaded_inputs_train_as_the_recompute():
    """Saved layers whose inputs went to host memory (the planner's ``host_input_bytes``: every layer
    saved, the first layer's input offloaded) train bit for bit as the recompute with every input kept:
    the recompute of a saved layer takes its input back from the activation store."""
    model = build("llama")
    steps = [[batch(97, seed=s), batch(97, seed=10 + s)] for s in range(3)]

    def train(**placement):
        cfg = EngineConfig(device="cpu", compute_dtype=torch.float32).placed(**placement)
        with SlideEngine(model, cfg) as eng:
            losses = [eng.train_step(b) for b in steps]
            offloaded = set(eng.activations.offload_layers)
            return losses, eng.state_dict(), offloaded

    ref_losses, ref, _ = train()
    n = model.config.num_hidden_layers
    got_losses, got, offloaded = train(saved_layers=n, offload_activations=True, gpu_activation_layers=n - 1)
    assert offloaded == {0}
    assert got_losses == ref_losses
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_an_output_changed_in_place_is_multiplied_again_then_kept_as_a_copy(monkeypatch):
    """A linear whose output forward changes in place (as Liger's RoPE does to q and k) is recomputed
    the first time, and kept as a copy from then on: the gradients are autograd's either way."""
    layer = nn.Module()
    layer.q = nn.Linear(6, 6)
    layer.mlp = nn.Module()
    layer.mlp.down_proj = nn.Linear(6, 6)
    rc = LayerRecompute([layer])

    def run(x):
        y = layer.q(x)
        y.mul_(2)  # in place on the product
        return layer.mlp.down_proj(torch.tanh(y)) + x

    products = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: products.append(1) or real_linear(*a))
    torch.manual_seed(0)
    x, g = torch.randn(3, 6), torch.randn(3, 6)
    params = list(layer.parameters())
    ref = torch.autograd.grad(run(x.requires_grad_(True)), [x] + params, g)
    for copies in (False, True):
        with torch.no_grad(), rc.recording() as kept:
            run(x)
        products.clear()
        with torch.enable_grad(), rc.active(kept=kept):
            got = torch.autograd.grad(run(x), [x] + params, g)
        assert len(products) == (0 if copies else 1)  # q's product again the first time (down's: graph only)
        assert (layer.q in rc._copied) and not kept[layer.q]
        for a, r in zip(got, ref):
            torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)


def test_kept_values_are_the_linears_outputs_but_the_down_projections():
    layer = build("llama").model.layers[0]
    a, m = layer.self_attn, layer.mlp
    assert kept_values_per_token(layer) == (a.q_proj.out_features + a.k_proj.out_features + a.v_proj.out_features
                                            + a.o_proj.out_features + m.gate_proj.out_features + m.up_proj.out_features)


class _RotateThroughPointers(torch.autograd.Function):
    """Liger's RoPE as torch sees it: q and k changed in their own memory where no version counter sees it,
    views of them returned."""

    @staticmethod
    def forward(ctx, q, k, *_):
        q.data.mul_(2)
        k.data.mul_(3)
        return q.view_as(q), k.view_as(k)

    @staticmethod
    def backward(ctx, gq, gk):
        return 2 * gq, 3 * gk, None, None


def test_kept_products_survive_a_rope_that_rotates_in_place(monkeypatch):
    """fused_ops' Liger RoPE moves the version counters of q and k in a forward without gradients: the
    kept q and k projections are multiplied again the first time and copied from then on, and gradients
    are autograd's; with gradients on it leaves autograd alone (no view error)."""
    rope = pytest.importorskip("liger_kernel.transformers.rope")
    from slideformer.model.fused_ops import _liger_rope

    monkeypatch.setattr(rope, "liger_rotary_pos_emb", _RotateThroughPointers.apply)
    layer = nn.Module()
    layer.q, layer.k = nn.Linear(6, 6), nn.Linear(6, 6)
    layer.mlp = nn.Module()
    layer.mlp.down_proj = nn.Linear(6, 6)
    rc = LayerRecompute([layer])

    def run(x):
        q, k = _liger_rope(layer.q(x), layer.k(x), None, None)
        return layer.mlp.down_proj(q * k) + x

    torch.manual_seed(0)
    x, g = torch.randn(3, 6), torch.randn(3, 6)
    params = list(layer.parameters())
    ref = torch.autograd.grad(run(x), params, g)
    for step in range(2):
        with torch.no_grad(), rc.recording() as kept:
            run(x)
        with torch.enable_grad(), rc.active(kept=kept):
            got = torch.autograd.grad(run(x), params, g)
        assert {layer.q, layer.k} <= rc._copied
        for a, r in zip(got, ref):
            torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("into_grad", [False, True])
def test_linears_of_one_input_have_linears_gradients_with_one_input_gradient(bias, into_grad, monkeypatch):
    """Three linears of one input as one node: the products (one of them kept), autograd's gradients for
    each, the input's summed within the later linears' GEMMs (2 addmm_ into the first's, not autograd's
    adds), an unused output's linear given no gradient (None, not a product of zeros)."""
    from slideformer.model.recompute import _SharedInputLinears

    torch.manual_seed(0)
    x = torch.randn(2, 5, 6, requires_grad=True)
    ws = [torch.randn(n, 6, requires_grad=True) for n in (4, 3, 5)]
    bs = [torch.randn(n, requires_grad=True) if bias else None for n in (4, 3, 5)]
    gs = [torch.randn(2, 5, n) for n in (4, 3)]  # (the third output is not used)
    ys = [nn.functional.linear(x, w, b) for w, b in zip(ws, bs)]
    leaves = [x] + ws[:2] + [b for b in bs[:2] if b is not None]
    ref = torch.autograd.grad(ys[:2], leaves, gs)
    befores = [torch.randn(n, 6) for n in (4, 3, 5)]
    if into_grad:
        for w, before in zip(ws, befores):
            w.grad = before.clone()
    calls, real = [], torch.Tensor.addmm_
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda t, *a, **k: calls.append(t) or real(t, *a, **k))
    outs = _SharedInputLinears.apply(x, [None, ys[1].detach(), None], *[t for p in zip(ws, bs) for t in p])
    assert all(torch.equal(o, y) for o, y in zip(outs, ys))
    got = torch.autograd.grad(outs[:2], leaves, gs, allow_unused=True) if not into_grad else None
    if into_grad:
        torch.autograd.backward(outs[:2], gs, inputs=leaves)
        got = [x.grad] + [None, None] + [b.grad for b in bs[:2] if b is not None]
        for w, before, r in zip(ws[:2], befores, ref[1:3]):  # added once, in the GEMM
            torch.testing.assert_close(w.grad, before + r, rtol=1e-6, atol=1e-6)
        assert torch.equal(ws[2].grad, befores[2])  # (no gradient: not even zeros added)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    for a, r in zip(got[3:], ref[3:]):
        assert torch.equal(a, r)
    if not into_grad:
        for a, r in zip(got[1:3], ref[1:3]):
            assert torch.equal(a, r)
    input_sums = [t for t in calls if t.shape == (10, 6)]
    assert len(input_sums) == 1 and len(calls) == 1 + 2 * into_grad


def test_the_engine_recomputes_linears_of_one_input_as_one_node(monkeypatch):
    """The groups are learnt from forward (q, k, v; gate, up), each runs as one node in every layer's
    recompute, and training is plain linears' within fp32 noise (against plain PyTorch:
    tests/test_engine_parity.py)."""
    from slideformer.model import recompute

    nodes, real = [], recompute._SharedInputLinears.apply
    monkeypatch.setattr(recompute._SharedInputLinears, "apply", lambda *a: nodes.append(len(a) - 2) or real(*a))
    model = build("llama")
    steps = [[batch(97, seed=s), batch(97, seed=10 + s)] for s in range(2)]

    def train():
        with SlideEngine(model, EngineConfig(device="cpu", compute_dtype=torch.float32)) as eng:
            losses = [eng.train_step(b) for b in steps]
            groups, layers = set(eng.recompute._groups.values()), eng.adapter.layers
            return losses, eng.state_dict(), (groups, layers)

    losses, got, (groups, layers) = train()
    assert groups == {g for layer in layers for g in ((layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                        layer.self_attn.v_proj), (layer.mlp.gate_proj, layer.mlp.up_proj))}
    n = model.config.num_hidden_layers
    assert sorted(set(nodes)) == [4, 6] and len(nodes) == 2 * n * 2 * 2  # 2 steps x 2 micro-batches
    monkeypatch.setattr(LayerRecompute, "_group_forward", lambda *a: None)
    ref_losses, ref, _ = train()
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)


def test_summing_linears_input_gradients_first_is_the_only_change():
    """OLMo 2's q, k and v read the layer's input, which the residual reads too: the engine sums the three
    input gradients, then adds the residual's, where autograd adds them one by one. Against plain PyTorch
    that reassociation moves a few Adam elements with near-zero gradients (6e-5 of a tensor after 3 steps
    at lr 1e-2); against plain PyTorch with the same association (its linears reading one alias of their
    input), the engine is within fp32 noise."""
    import copy

    from test_engine_parity import engine_train, linears_read_one_alias, reference_train

    model = build("olmo2")
    batches = [batch(model.config.vocab_size, seed=s) for s in range(3)]
    state, _ = engine_train(model, batches, lr=1e-2)
    ref = reference_train(linears_read_one_alias(copy.deepcopy(model)), batches, lr=1e-2)[0].state_dict()
    assert max(float((state[k] - ref[k]).norm() / ref[k].norm()) for k in state) < 1e-6


@pytest.mark.parametrize("saved", [False, True])
def test_a_group_called_otherwise_in_the_recompute_falls_back_to_single_linears(saved):
    """A group learnt from forward (a, b on x) whose recompute calls a again with another input, and b
    with another input than a's: each such call is its own linear, with autograd's gradients, and
    kept products are taken in call order."""
    layer = nn.Module()
    layer.a, layer.b = nn.Linear(6, 6), nn.Linear(6, 6)
    layer.mlp = nn.Module()
    layer.mlp.down_proj = nn.Linear(6, 6)
    rc = LayerRecompute([layer])

    def run(x, other):
        y = layer.a(x) * layer.b(other if other is not None else x)
        return layer.mlp.down_proj(y + layer.a(torch.tanh(y))) + x

    torch.manual_seed(0)
    x, g = torch.randn(3, 6), torch.randn(3, 6)
    params = list(layer.parameters())
    with torch.no_grad():
        run(x, None)
    assert rc._groups[layer.a] == (layer.a, layer.b)
    for other in (None, x + 1):
        ref = torch.autograd.grad(run(x.requires_grad_(True), other), [x] + params, g)
        with torch.no_grad(), (rc.recording() if saved else contextlib.nullcontext({})) as kept:
            run(x, other)
        with torch.enable_grad(), rc.active(kept=kept if saved else None):
            got = torch.autograd.grad(run(x, other), [x] + params, g)
        for a, r in zip(got, ref):
            torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)


def test_the_recompute_runs_no_swiglu_forward(monkeypatch):
    """A SwiGLU MLP's recompute multiplies gate and up and stops there (3 layers x 2 micro-batches a step):
    no SwiGLU product in the forward, its product made in backward beside gate's and up's gradients
    (kernels/swiglu.py), and the training is bit for bit the MLP's own (autograd's ops on the CPU). MLPs
    of other shapes (a GeLU's, a MoE block, a normalised output, a fused gate_up) run their own forward."""
    from slideformer.model import recompute

    nodes, real = [], recompute.swiglu_backward_product
    forwards, real_silu = [], torch.nn.functional.silu

    def in_backward(*a):
        nodes.append(1)
        forwards.append("backward")
        real(*a)

    monkeypatch.setattr(recompute, "swiglu_backward_product", in_backward)
    monkeypatch.setattr(torch.nn.functional, "silu", lambda x, *a, **k: forwards.append(torch.is_grad_enabled())
                        or real_silu(x, *a, **k))
    steps = [[batch(97, seed=s), batch(97, seed=10 + s)] for s in range(2)]
    model = build("llama")

    def train():
        nodes.clear()
        forwards.clear()
        with SlideEngine(model, EngineConfig(device="cpu", compute_dtype=torch.float32)) as eng:
            return [eng.train_step(b) for b in steps], eng.state_dict()

    losses, got = train()
    # (per step: the forwards without gradients, then in backward the products alone, each with its own silu)
    assert len(nodes) == 2 * 3 * 2 and forwards == ([False] * 6 + ["backward", True] * 6) * 2
    monkeypatch.setattr(LayerRecompute, "unread_mlp", lambda self, layer, x: layer.mlp(x))
    ref_losses, ref = train()
    assert not nodes and forwards == ([False] * 6 + [True] * 6) * 2
    assert losses == ref_losses and all(torch.equal(got[k], ref[k]) for k in ref)
    for family in ("qwen2", "qwen3-tied", "mistral-sliding"):
        assert all(recompute.swiglu_mlp(lay) is lay.mlp for lay in build(family).model.layers)
    for family in ("olmo2", "phi3", "gemma3", "olmoe"):
        assert all(recompute.swiglu_mlp(lay) is None for lay in build(family).model.layers), family


@pytest.mark.parametrize("family", ["llama", "qwen3-tied", "olmo2"])
def test_mid_layers_train_bit_identically_without_the_attentions_output_product(family, monkeypatch):
    """Layers that offload their residual sum after attention (the planner's ``mid_layers``: the first 2 of
    3 offloaded layers) recompute their attention's output projection without its product (2 layers x 2
    micro-batches a step, fewer products by as many), and train bit for bit as the recompute does: the sum
    forward kept is the one the recompute would compute. OLMo 2 (its own forward, a norm after the
    attention) keeps none."""
    from slideformer.model import recompute

    products = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: products.append(1) or real_linear(*a))
    model = build(family)
    n = model.config.num_hidden_layers
    steps = [[batch(97, seed=s), batch(97, seed=10 + s)] for s in range(3)]

    def train(mids):
        cfg = EngineConfig(device="cpu", compute_dtype=torch.float32).placed(
            offload_activations=True, gpu_activation_layers=0, mid_layers=mids)
        losses, counts = [], []
        with SlideEngine(model, cfg) as eng:
            for b in steps:
                products.clear()
                losses.append(eng.train_step(b))
                counts.append(len(products))
            return losses, eng.state_dict(), counts, eng._mids, eng.activations.host_bytes

    ref_losses, ref, ref_counts, none, ref_host = train(0)
    got_losses, got, counts, mids, host = train(2)
    assert not none and got_losses == ref_losses
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    if family == "olmo2":
        assert not mids and counts == ref_counts and recompute.mid_projection(model.model.layers[0]) is None
        return
    assert mids == {0, 1} and n == 3
    assert [r - c for r, c in zip(ref_counts, counts)] == [2 * 2] * 3
    assert host == ref_host * 5 // 3  # (3 layers' inputs and 2 layers' sums)
    # token-chunked MLPs recompute under their own checkpoints, which would not take the sums: none kept
    cfg = EngineConfig(device="cpu", compute_dtype=torch.float32, tuning=Tuning(mlp_chunk_tokens=4)).placed(
        offload_activations=True, gpu_activation_layers=0, mid_layers=2)
    with SlideEngine(model, cfg) as eng:
        eng.train_step(steps[0])
        assert not eng._mids and eng.activations.host_bytes == ref_host


def test_the_down_projection_is_output_free_only_where_nothing_with_weights_reads_it():
    """Backward's recompute never makes an output-free down projection's output (only its graph): right only
    where that output joins the residual sum alone. A norm after the MLP under any name (GLM-4's
    post_mlp_layernorm, Gemma 2's post_feedforward_layernorm) or a scale the MLP or layer holds itself reads
    it: then the projection is recomputed like the others."""
    from slideformer.model import ModelAdapter

    layer = ModelAdapter(build("llama").config).layers[0]
    assert output_free_down(layer) is layer.mlp.down_proj
    for family in ("glm4", "gemma2", "olmo2"):
        assert output_free_down(ModelAdapter(build(family).config).layers[0]) is None, family
    layer.post_mlp_norm = nn.LayerNorm(4)
    assert output_free_down(layer) is None
    del layer.post_mlp_norm
    layer.mlp.global_scale = nn.Parameter(torch.ones(1))
    assert output_free_down(layer) is None
