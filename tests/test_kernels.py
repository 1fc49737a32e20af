"""Triton kernels against the plain PyTorch reference, on tiny odd shapes.

On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set in conftest before triton
is imported); every kernel upcasts loads to fp32, so bf16 inputs give bf16-rounding-level results.
"""

import pytest
import torch

from slideformer.kernels import (cross_entropy_grad_, fused_linear_cross_entropy, reference_linear_cross_entropy,
                                 triton_usable)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_triton_runs_here():
    """make test installs triton: the kernel path, not only the PyTorch fallback, is what is tested."""
    assert triton_usable(torch.empty(1, device=DEV)), "triton missing or TRITON_INTERPRET unset on the CPU"


def inputs(T=37, V=211, H=48, dtype=torch.float32, seed=0, ignore=0.2):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(T, H, generator=g) / 2).to(dtype).to(DEV)
    w = (torch.randn(V, H, generator=g) / 4).to(dtype).to(DEV)
    lab = torch.randint(0, V, (T,), generator=g)
    lab[torch.rand(T, generator=g) < ignore] = -100
    return h, w, lab.to(DEV)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("chunk", [8, 4096])
def test_fused_linear_ce_matches_reference(dtype, softcap, chunk):
    h, w, lab = inputs(dtype=dtype)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h1, w1, lab, softcap=softcap, chunk_tokens=chunk)
    loss.backward()
    h2, w2 = h.float().clone().requires_grad_(), w.float().clone().requires_grad_()
    ref = reference_linear_cross_entropy(h2, w2, lab, softcap=softcap)
    ref.backward()
    tol = TOL[dtype]
    assert abs(float(loss.detach()) - float(ref.detach())) <= tol * abs(float(ref.detach()))
    assert rel(h1.grad, h2.grad) <= tol and rel(w1.grad, w2.grad) <= tol


def test_sum_reduction_and_grad_scaling():
    h, w, lab = inputs()
    h1 = h.clone().requires_grad_()
    (2.5 * fused_linear_cross_entropy(h1, w, lab, reduction="sum", chunk_tokens=16)).backward()
    h2 = h.clone().requires_grad_()
    (2.5 * reference_linear_cross_entropy(h2, w, lab, reduction="sum")).backward()
    assert rel(h1.grad, h2.grad) <= 1e-5


def test_all_ignored_chunks_give_zero_gradient_there():
    h, w, lab = inputs(T=20)
    lab[:10] = -100  # the whole first chunk
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    fused_linear_cross_entropy(h1, w1, lab, chunk_tokens=10).backward()
    assert torch.count_nonzero(h1.grad[:10]) == 0
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    reference_linear_cross_entropy(h2, w2, lab).backward()
    assert rel(h1.grad, h2.grad) <= 1e-5 and rel(w1.grad, w2.grad) <= 1e-5


def test_chunks_to_skip_come_from_the_host_copy_when_given():
    """The engine passes its host copy of which labels count, so that skipping all-ignored chunks never
    synchronises with the GPU; without it the labels are read once, not once per chunk."""
    from slideformer.kernels.fused_linear_ce import chunks_with_targets

    lab = torch.full((25,), 3)
    lab[:10] = -100
    lab[20:] = -100
    assert chunks_with_targets(lab, 10) == [False, True, False]
    wrong = torch.full((25,), 5)  # the host copy decides, not the labels
    assert chunks_with_targets(wrong, 10, targets=lab != -100) == [False, True, False]
    # and the kernel skips what it says: the first chunk costs nothing (and gets no gradient)
    h, w, _ = inputs(T=25)
    from slideformer.kernels.fused_linear_ce import linear_cross_entropy_grads

    a = linear_cross_entropy_grads(h, w, lab.to(DEV), 0.1, chunk_tokens=10)
    b = linear_cross_entropy_grads(h, w, lab.to(DEV), 0.1, chunk_tokens=10, targets=lab != -100)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and torch.count_nonzero(a[1][:10]) == 0
    # a chunk the host copy calls empty is skipped even though it has labels (so the copy is what is read)
    none = torch.zeros(25, dtype=torch.bool)
    loss, gh, gw = linear_cross_entropy_grads(h, w, lab.to(DEV), 0.1, chunk_tokens=10, targets=none)
    assert float(loss) == 0 and torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0
    with pytest.raises(ValueError, match="25 labels"):
        chunks_with_targets(lab, 10, targets=none[:24])


def test_every_chunks_logits_go_into_one_workspace():
    """The fused head writes each chunk's logits (then their gradient) into one block, the caller's or one of
    its own, not a new one each chunk: the gradients are the same to the bit, the given block ends up
    holding the last chunk's, and a block too small or of another dtype is refused."""
    from slideformer.kernels.fused_linear_ce import linear_cross_entropy_grads, logits_buffer

    h, w, lab = inputs(T=25)
    a = linear_cross_entropy_grads(h, w, lab, 0.1, chunk_tokens=10)
    block = torch.full((10, w.shape[0]), float("nan"), device=DEV)
    b = linear_cross_entropy_grads(h, w, lab, 0.1, chunk_tokens=10, workspace=block)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # the last chunk (5 tokens) overwrote the block's first rows with its logits' gradient; the rest is the
    # second chunk's
    assert not torch.isnan(block).any() and torch.count_nonzero(block[:5]) > 0
    assert logits_buffer(25, w, 10).shape == (10, w.shape[0]) and logits_buffer(4, w, 10).shape == (4, w.shape[0])
    for bad in (torch.empty(9, w.shape[0], device=DEV), torch.empty(10, w.shape[0], dtype=torch.float64, device=DEV)):
        with pytest.raises(ValueError, match="logits workspace"):
            linear_cross_entropy_grads(h, w, lab, 0.1, chunk_tokens=10, workspace=bad)


def test_tied_weight_gradients_add_up():
    """The lm_head shares its matrix with the embedding: both uses' gradients must reach it."""
    h, w, lab = inputs(V=97)
    ids = torch.randint(0, 97, (37,)).to(DEV)
    w1 = w.clone().requires_grad_()
    x1 = torch.nn.functional.embedding(ids, w1) + h
    fused_linear_cross_entropy(x1, w1, lab.clamp(max=96), chunk_tokens=7).backward()
    w2 = w.clone().requires_grad_()
    x2 = torch.nn.functional.embedding(ids, w2) + h
    reference_linear_cross_entropy(x2, w2, lab.clamp(max=96)).backward()
    assert rel(w1.grad, w2.grad) <= 1e-5


@pytest.mark.parametrize("use_triton", [True, False])
def test_inplace_gradient_both_paths(use_triton, monkeypatch):
    from slideformer.kernels import cross_entropy

    if not use_triton:
        monkeypatch.setattr(cross_entropy, "triton_usable", lambda t: False)
    x = torch.randn(13, 101).to(DEV)
    lab = torch.randint(0, 101, (13,)).to(DEV)
    lab[3] = -100
    xr = x.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(xr, lab, reduction="sum") * 0.5
    ref.backward()
    loss = cross_entropy_grad_(x, lab, 0.5)
    assert abs(float(loss.sum()) - float(ref.detach())) < 1e-5 and float(loss[3]) == 0.0
    assert rel(x, xr.grad) < 1e-5


@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_slice_gradient_is_the_rows_gradient_there(use_triton, softcap, monkeypatch):
    """A vocabulary slice's gradient, redone from the row's saved log-sum-exp, is those columns of the
    whole row's gradient; the label's -1 lands only in the slice that holds it."""
    from slideformer.kernels import cross_entropy
    from slideformer.kernels.cross_entropy import cross_entropy_grad_slice_

    if not use_triton:
        monkeypatch.setattr(cross_entropy, "triton_usable", lambda t: False)
    x = torch.randn(13, 101).to(DEV)
    lab = torch.randint(0, 101, (13,)).to(DEV)
    lab[3] = -100
    lab[5], lab[6] = 0, 100  # the first and last columns
    whole, lse = x.clone(), torch.empty(13).to(DEV)
    loss = cross_entropy_grad_(whole, lab, 0.5, softcap=softcap, lse_out=lse)
    assert torch.allclose(loss, cross_entropy_grad_(x.clone(), lab, 0.5, softcap=softcap))
    ref = torch.logsumexp(x if softcap is None else softcap * torch.tanh(x / softcap), 1)
    assert torch.allclose(lse, ref, atol=1e-5)
    for c0 in range(0, 101, 17):
        part = x[:, c0: c0 + 17].contiguous()
        cross_entropy_grad_slice_(part, lab, lse, c0, 0.5, softcap=softcap)
        assert torch.allclose(part, whole[:, c0: c0 + 17], atol=1e-6), c0


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_by_slices_is_the_fused_one(out_dtype):
    """Summed slice by slice over several micro-batches (odd slice and chunk sizes, a chunk without labels),
    the lm_head gradient is the one the whole fp32 accumulator gets; the output is overwritten."""
    from slideformer.kernels.fused_linear_ce import (chunks_with_targets, linear_cross_entropy_grads,
                                                     weight_grad_by_slices)

    h1, w, lab1 = inputs(T=37)
    h2, _, lab2 = inputs(T=20, seed=1)
    lab2[:7] = -100
    acc = torch.zeros(w.shape).to(DEV)
    parts = []
    for h, lab in ((h1, lab1), (h2, lab2)):
        lse = torch.empty(h.shape[0]).to(DEV)
        a = linear_cross_entropy_grads(h, w, lab, 0.1, chunk_tokens=7, grad_weight=acc)
        b = linear_cross_entropy_grads(h, w, lab, 0.1, chunk_tokens=7, lse_out=lse)
        assert b[2] is None and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        parts.append((h, lab, lse, chunks_with_targets(lab, 7)))
    out = torch.full(w.shape, 7.0, dtype=out_dtype).to(DEV)
    weight_grad_by_slices(parts, w, 0.1, out, slice_rows=50, chunk_tokens=7)
    assert rel(out, acc) <= (1e-6 if out_dtype == torch.float32 else 4e-3)
    ref = torch.zeros_like(acc)
    for h, lab, *_ in parts:
        hw = w.clone().requires_grad_()
        (0.1 * reference_linear_cross_entropy(h, hw, lab, reduction="sum")).backward()
        ref += hw.grad
    assert rel(acc, ref) <= 1e-5


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_compact_adamw_kernel_is_the_reference_update(grad_dtype):
    """The Triton compact AdamW (resident units' update on the GPU) against optim.adamw's PyTorch reference
    on an odd size, from an unaligned offset in the unit, over steps with decay and a gradient scale. bf16
    values are handled as bit patterns; the interpreter keeps scalar arguments in fp64 (and the GPU fuses
    multiply-adds), so results agree to fp32 rounding, not always to the bit."""
    from slideformer.kernels import compact_adamw_
    from slideformer.optim.adamw import adamw_compact_

    out = {}
    for which in ("kernel", "reference"):
        g = torch.Generator().manual_seed(0)
        p = torch.randn(1001, generator=g)
        hi = p.bfloat16()
        lo = (p - hi.float()).bfloat16()
        m, v = torch.zeros_like(hi), torch.zeros_like(hi)
        for step in range(1, 4):
            grad = torch.randn(1001, generator=g).to(grad_dtype)
            kw = dict(step=step, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, grad_coef=0.7, seed=5,
                      offset=17)
            dev = [t.to(DEV) for t in (hi, lo, grad, m, v)]
            if which == "kernel":
                compact_adamw_(*dev, **kw)
            else:
                adamw_compact_(*dev, backend="torch", **kw)
            hi, lo, _, m, v = (t.cpu() for t in dev)
        out[which] = (hi, lo, m, v)
    (hi, lo, m, v), (rhi, rlo, rm, rv) = out["kernel"], out["reference"]
    master, ref_master = hi.double() + lo.double(), rhi.double() + rlo.double()
    assert rel(master, ref_master) < 1e-6  # the master to fp32 precision
    assert (hi != rhi).float().mean() < 0.01  # the weights themselves to the bit, nearly everywhere
    assert rel(m, rm) < 1e-3 and rel(v, rv) < 1e-3  # moments: the same hashed rounding bits
    assert float(m.float().abs().sum()) > 0  # they moved


def norm_of(cls, w: torch.Tensor):
    """transformers' norm class ``cls`` whose weight is the tensor ``w`` itself (so that its gradient is asked
    of the module's graph)."""
    m = cls(w.shape[0], eps=1e-6)
    del m.weight
    m.weight = w
    return m


def assert_no_farther_from_exact(names, ours, theirs, exact, dtype):
    """Each of ours no farther from fp64 than transformers' own in that dtype: twice, plus fp32's ulp (bf16's
    output rounding differs element by element); three times under Triton's CPU interpreter, which casts to
    bf16 by truncation (measured 2.4-2.8x), against rounding to nearest on the GPU."""
    factor = 3 if dtype == torch.bfloat16 and DEV == "cpu" else 2
    for name, a, b, e in zip(names, ours, theirs, exact):
        assert rel(a, e) <= factor * rel(b, e) + 1e-7, (name, rel(a, e), rel(b, e))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 40), (5, 7, 3, 16), (0, 24)])
@pytest.mark.parametrize("rows", [None, 4])
def test_rms_norm_is_transformers_norm(dtype, shape, rows, monkeypatch):
    """kernels/rms_norm.py against transformers' Llama RMSNorm under autograd, both measured against the same
    norm in fp64: ours is no farther from it than transformers' own in that dtype (twice, plus fp32's
    ulp: bf16's output rounding differs element by element; three times under Triton's CPU interpreter,
    which casts to bf16 by truncation, measured 2.4-2.8x, against rounding to nearest on the GPU). Rows spread over several programs, each
    with several row blocks (the weight gradient is summed over programs), a row length that is not a
    power of two, per-head rows (Qwen3's q and k norms), and no rows at all; ``rows``: blocks of several
    rows, as the GPU takes short rows (the interpreter's default is one)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from slideformer.kernels import rms_norm
    from slideformer.kernels.rms_norm import RMSNormFunction

    if rows:
        blocks = rms_norm._blocks
        monkeypatch.setattr(rms_norm, "_blocks", lambda n, interpret: (blocks(n, interpret)[0], rows, 1))

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).to(DEV)
    w = (1 + torch.randn(shape[-1], generator=g) / 4).to(dtype).to(DEV)
    dy = torch.randn(*shape, generator=g).to(dtype).to(DEV)

    def run(fn, x, w):
        x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y = fn(x, w)
        return (y, *torch.autograd.grad(y, [x, w], dy.to(x.dtype)))

    def hf(x, w):
        return norm_of(LlamaRMSNorm, w)(x)

    ours = run(lambda x, w: RMSNormFunction.apply(x, w, 1e-6), x, w)
    theirs = run(hf, x, w)
    exact = run(hf, x.double(), w.double())
    if not x.numel():
        assert all(t.shape == e.shape for t, e in zip(ours, exact)) and float(ours[2].abs().sum()) == 0
        return
    assert_no_farther_from_exact(("y", "dx", "dw"), ours, theirs, exact, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 40), (5, 7, 48), (0, 24)])
@pytest.mark.parametrize("sum_used", [True, False])
def test_the_norm_of_a_residual_sum_is_the_sum_then_transformers_norm(dtype, shape, sum_used):
    """AddRMSNormFunction against ``s = x + r`` then transformers' Llama RMSNorm under autograd, both against
    the same in fp64: the sum is the dtype's own add bit for bit (on the GPU), and the norm, the gradients of x and r
    (the sum's own gradient added in the norm's backward pass) and the weight's are no farther from fp64
    than transformers' (twice, as the norm's own test; three times under the CPU interpreter's bf16
    truncation). ``sum_used`` False: the sum's output has no gradient."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from slideformer.kernels.rms_norm import AddRMSNormFunction

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).to(DEV)
    r = torch.randn(*shape, generator=g).to(dtype).to(DEV)
    w = (1 + torch.randn(shape[-1], generator=g) / 4).to(dtype).to(DEV)
    dy, ds = (torch.randn(*shape, generator=g).to(dtype).to(DEV) for _ in range(2))

    def run(fn, *inputs):
        inputs = [t.detach().clone().requires_grad_() for t in inputs]
        y, s = fn(*inputs)
        outs, grads = ([y, s], [dy.to(y.dtype), ds.to(y.dtype)]) if sum_used else ([y], [dy.to(y.dtype)])
        return (y, s, *torch.autograd.grad(outs, inputs, grads))

    def hf(x, r, w):
        s = x + r
        return norm_of(LlamaRMSNorm, w)(s), s

    ours = run(lambda x, r, w: AddRMSNormFunction.apply(x, r, w, 1e-6), x, r, w)
    theirs = run(hf, x, r, w)
    exact = run(hf, x.double(), r.double(), w.double())
    if DEV == "cuda" or dtype == torch.float32:
        assert torch.equal(ours[1], theirs[1])
    else:  # (the interpreter's cast to bf16 truncates: within one ulp)
        torch.testing.assert_close(ours[1], theirs[1], rtol=2 ** -7, atol=0)
    if not x.numel():
        assert all(t.shape == e.shape for t, e in zip(ours, exact))
        return
    assert torch.equal(ours[2], ours[3])  # (x and r: one sum, one gradient)
    assert_no_farther_from_exact(("y", "s", "dx", "dr", "dw"), ours, theirs, exact, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 40), (5, 7, 48), (0, 24)])
@pytest.mark.parametrize("used", ["both", "norm", "stream"])
def test_the_norm_of_a_stream_passed_on_is_transformers_norm(dtype, shape, used):
    """RMSNormPassFunction against transformers' Llama RMSNorm of x with x used again (a residual stream)
    under autograd, both against the same in fp64: the stream passed on is x itself, and the norm, x's
    gradient (the stream's added in the norm's backward pass) and the weight's are no farther from fp64 than
    transformers'. ``used``: which outputs have a gradient."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from slideformer.kernels.rms_norm import RMSNormPassFunction

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).to(DEV)
    w = (1 + torch.randn(shape[-1], generator=g) / 4).to(dtype).to(DEV)
    dy, ds = (torch.randn(*shape, generator=g).to(dtype).to(DEV) for _ in range(2))

    def run(fn, *inputs):
        inputs = [t.detach().clone().requires_grad_() for t in inputs]
        y, s = fn(*inputs)
        outs, grads = {"both": ([y, s], [dy, ds]), "norm": ([y], [dy]), "stream": ([s], [ds])}[used]
        got = torch.autograd.grad(outs, inputs, [t.to(y.dtype) for t in grads], allow_unused=True)
        return (y, s, *(torch.zeros_like(i) if d is None else d for i, d in zip(inputs, got)))

    ours = run(lambda x, w: RMSNormPassFunction.apply(x, w, 1e-6), x, w)
    theirs = run(lambda x, w: (norm_of(LlamaRMSNorm, w)(x), x), x, w)
    exact = run(lambda x, w: (norm_of(LlamaRMSNorm, w)(x), x), x.double(), w.double())
    assert torch.equal(ours[1], x)
    if not x.numel():
        assert all(t.shape == e.shape for t, e in zip(ours, exact))
        return
    assert_no_farther_from_exact(("y", "s", "dx", "dw"), ours, theirs, exact, dtype)


def e4m3_half_step(v: torch.Tensor) -> torch.Tensor:
    """Half the spacing of e4m3 values around ``v``: 3 mantissa bits from 2^-6 up, 2^-9 below."""
    a = v.abs().clamp(min=2.0 ** -6)
    return torch.exp2(torch.floor(torch.log2(a)) - 3) / 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_row_cast_rounds_each_row_to_nearest_on_its_own_scale(dtype):
    """Each row's largest magnitude maps to 448 (its inverse scale is amax / 448); every value, from that
    scale's subnormals (2^-9 steps) to 448, lands on the nearest e4m3 value, as PyTorch's own cast puts it
    (ties may differ by the scale's last bit); a zero row stays zero; strided rows (a weight's columns) and
    no rows work. Rows longer than a block (2048 values) take the largest over every block."""
    from slideformer.kernels.fp8 import E4M3, cast_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(19, 2500, generator=g) * torch.logspace(-7, 2, 2500)[torch.randperm(2500, generator=g)]
    x[3] = 0
    x[5, 2300] = 1e3  # (the row's largest in its second block)
    x = x.to(dtype).to(DEV)
    q, inv = cast_rows(x)
    assert q.dtype == E4M3 and q.shape == x.shape and inv.shape == (19, 1) and inv.dtype == torch.float32
    amax = x.float().abs().amax(1, keepdim=True).clamp(min=1e-12)
    torch.testing.assert_close(inv, amax / 448, rtol=1e-6, atol=0)
    assert q[5, 2300].float() == 448 and torch.all(q[3].float() == 0)
    v = x.float() / inv
    assert torch.all((q.float() - v).abs() <= e4m3_half_step(v) * (1 + 1e-5))
    assert (q.float() != v.to(E4M3).float()).float().mean() < 1e-3
    w = torch.randn(48, 32, generator=g).to(dtype).to(DEV)
    qt, it = cast_rows(w.t())
    q2, i2 = cast_rows(w.t().contiguous())
    assert torch.equal(qt.float(), q2.float()) and torch.equal(it, i2)
    empty, inv0 = cast_rows(torch.zeros(0, 32, dtype=dtype, device=DEV))
    assert empty.shape == (0, 32) and inv0.shape == (0, 1)
    bad = torch.ones(2, 3000, dtype=dtype, device=DEV)
    bad[0, 2999], bad[1, 7] = float("nan"), float("inf")  # (non-finite values reach the loss, not clamped)
    qb, _ = cast_rows(bad)
    if DEV == "cuda":  # (Triton's CPU interpreter converts NaN to e4m3 as 384)
        assert qb[0, 2999].float().isnan() and qb[1, 7].float().isnan()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_column_cast_is_the_row_cast_of_the_transpose(dtype):
    """The weight gradient's operands: each column of x on its own scale, written as the rows of x.T, the
    same values and scales as ``cast_rows(x.t())`` gives (which copies the transpose first), over several
    tiles each way and ragged edges; a zero column stays zero; strided rows and no rows work; a NaN makes
    its column non-finite."""
    from slideformer.kernels.fp8 import E4M3, cast_columns, cast_rows

    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 40, generator=g) * torch.logspace(-6, 2, 40)[torch.randperm(40, generator=g)]
    x[:, 6] = 0
    x[30, 9] = 5e2  # (the column's largest in its last tile)
    x = x.to(dtype).to(DEV)
    q, inv = cast_columns(x)
    assert q.dtype == E4M3 and q.shape == (40, 37) and q.is_contiguous() and inv.shape == (40, 1)
    qr, ir = cast_rows(x.t())
    assert torch.equal(q.float(), qr.float()) and torch.equal(inv, ir)
    assert q[9, 30].float() == 448 and torch.all(q[6].float() == 0)
    wide = torch.randn(21, 64, generator=g).to(dtype).to(DEV)[:, 8:56]  # (rows strided)
    qs, is_ = cast_columns(wide)
    q2, i2 = cast_rows(wide.t().contiguous())
    assert torch.equal(qs.float(), q2.float()) and torch.equal(is_, i2)
    empty, inv0 = cast_columns(torch.zeros(0, 32, dtype=dtype, device=DEV))
    assert empty.shape == (32, 0) and inv0.shape == (32, 1)
    bad = torch.ones(20, 3, dtype=dtype, device=DEV)
    bad[4, 1] = float("nan")
    qb, ib = cast_columns(bad)
    assert torch.equal(qb[0].float(), torch.full((20,), 448.0, device=DEV))
    # (the column's scale is NaN where the maximum keeps NaN, the interpreter's; the GPU's drops it and keeps
    # the NaN value instead)
    assert not (qb[1].float() * ib[1]).isfinite().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_rows_and_columns_in_one_kernel_are_the_two_casts(dtype):
    """A gradient's two casts from one pass of tile maxima and one of casts: bit for bit ``cast_rows`` and
    ``cast_columns`` of it, over several tiles each way with ragged edges, a row's and a column's largest in
    different tiles, zero rows and columns, strided rows, no rows; a NaN's values stay NaN."""
    from slideformer.kernels.fp8 import cast_columns, cast_rows, cast_rows_and_columns

    g = torch.Generator().manual_seed(2)
    x = torch.randn(70, 41, generator=g) * torch.logspace(-6, 2, 41)[torch.randperm(41, generator=g)]
    x[:, 5], x[9] = 0, 0
    x[66, 3], x[2, 39] = 3e2, -7e2  # (largests in the last row tile and the last column tile)
    wide = torch.randn(33, 96, generator=g)[:, 8:80]  # (rows strided)
    for t in (x, wide, torch.zeros(0, 32)):
        t = t.to(dtype).to(DEV)
        (qr, ir), (qc, ic) = cast_rows_and_columns(t)
        (er, eir), (ec, eic) = cast_rows(t), cast_columns(t)
        assert qr.shape == er.shape and qc.shape == ec.shape and qr.is_contiguous() and qc.is_contiguous()
        assert torch.equal(qr.float(), er.float()) and torch.equal(ir, eir)
        assert torch.equal(qc.float(), ec.float()) and torch.equal(ic, eic)
    bad = torch.ones(20, 3, dtype=dtype, device=DEV)
    bad[4, 1] = float("nan")
    (qr, _), (qc, _) = cast_rows_and_columns(bad)
    assert torch.equal(qr[0].float(), torch.full((3,), 448.0, device=DEV))
    if DEV == "cuda":  # (the interpreter converts NaN to e4m3 as 384)
        assert qr[4, 1].float().isnan() and qc[1, 4].float().isnan()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 3, 16), (1, 7, 4, 12), (3, 0, 2, 8)])
@pytest.mark.parametrize("angle_batch", [1, None])
def test_norm_rope_is_transformers_norm_then_rotation(dtype, shape, angle_batch):
    """kernels/norm_rope.py against Qwen 3's q norm then transformers' apply_rotary_pos_emb under autograd,
    both against the same in fp64: output, input and weight gradients no farther from fp64 than
    transformers' own (twice; three times under the interpreter's bf16 truncation). Heads of a length
    whose half is not a power of two, angles shared by the batch (1) or per row (None: the batch's),
    and no tokens at all."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    from slideformer.kernels.norm_rope import norm_rope

    b, s, h, d = shape
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(*shape, generator=g) * 2).to(dtype).to(DEV)
    w = (1 + torch.randn(d, generator=g) / 4).to(dtype).to(DEV)
    ang = torch.randn(angle_batch or b, s, d // 2, generator=g).repeat(1, 1, 2)
    cos, sin = ang.cos().to(dtype).to(DEV), ang.sin().to(dtype).to(DEV)
    dy = torch.randn(*shape, generator=g).to(dtype).to(DEV)

    def run(fn, x, w, cos, sin):
        x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y = fn(x, w, cos, sin)
        return (y, *torch.autograd.grad(y, [x, w], dy.to(y.dtype)))

    def hf(x, w, cos, sin):
        q = norm_of(Qwen3RMSNorm, w)(x).transpose(1, 2)  # (as Qwen3Attention: [batch, heads, seq, head_dim])
        return apply_rotary_pos_emb(q, q, cos, sin)[0].transpose(1, 2)

    ours = run(lambda x, w, c, s_: norm_rope(x, w, c, s_, 1e-6), x, w, cos, sin)
    assert ours[0].grad_fn.name() == "NormRopeFunctionBackward"
    theirs = run(hf, x, w, cos, sin)
    exact = run(hf, x.double(), w.double(), cos.double(), sin.double())
    if not x.numel():
        assert all(t.shape == e.shape for t, e in zip(ours, exact)) and float(ours[2].abs().sum()) == 0
        return
    assert_no_farther_from_exact(("y", "dx", "dw"), ours, theirs, exact, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 40), (5, 7, 48), (3, 5000), (0, 24)])
@pytest.mark.parametrize("use_triton", [True, False])
def test_swiglu_backward_writes_the_product_and_transformers_gradients(dtype, shape, use_triton):
    """kernels/swiglu.py against transformers' SwiGLU (``silu(gate) * up``) under autograd, both against the
    same in fp64: the product it writes over the gradient is the forward's (within a few fp32 ulps of the
    sigmoid, whose GPU exp and division are approximate, one bf16 ulp, two under the interpreter, which truncates; bit for bit where Triton does not run), and gate's and up's gradients are no
    farther from fp64 than transformers' own. Blocks of the flat tensors that end inside a row, a tail
    block, and no rows at all."""
    from slideformer.kernels.swiglu import swiglu_backward_product

    g = torch.Generator().manual_seed(5)
    gate, up, dy = ((torch.randn(*shape, generator=g) * 3).to(dtype).to(DEV) for _ in range(3))

    def theirs(gate, up, dy):
        gate, up = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
        y = torch.nn.functional.silu(gate) * up
        return (y, *torch.autograd.grad(y, (gate, up), dy.to(y.dtype)))

    ours = [dy.clone(), gate.clone(), up.clone()]
    swiglu_backward_product(*ours, use_triton=use_triton)
    ref = theirs(gate, up, dy)
    exact = theirs(gate.double(), up.double(), dy.double())
    # (its sigmoid is Triton's, on the GPU with approximate exp and division: up to about 8 fp32 ulps from
    # torch's, which may move a bf16 rounding by one ulp; the interpreter truncates each of the two casts to
    # bf16: two)
    ulps = 1 if DEV == "cuda" or not use_triton else 2
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-6 if dtype == torch.float32 else ulps * 2 ** -7, atol=0)
    if not use_triton:  # (autograd's own ops)
        assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    if gate.numel() and dtype == torch.float32:  # (those ulps against torch's own, which rounds once or twice)
        assert all(rel(a, e) <= 2 * rel(b, e) + 1e-6 for a, b, e in zip(ours, ref, exact))
    elif gate.numel():
        assert_no_farther_from_exact(("y", "dgate", "dup"), ours, ref, exact, dtype)
