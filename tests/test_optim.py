import pytest
import torch

from slideformer.optim import adamw_update_, lr_at
from slideformer.optim import native

BACKENDS = ["native", "torch"]


@pytest.fixture(scope="module", autouse=True)
def built():
    native.load(strict=True)  # CI has gcc: the compiled path must build, not silently fall back


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("n", [1, 37, 1000, 70001])
def test_adamw_matches_torch(backend, wd, n):
    torch.manual_seed(n)
    p = torch.randn(n)
    ref = p.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=wd)
    m, v = torch.zeros(n), torch.zeros(n)
    for step in range(1, 6):
        g = torch.randn(n)
        ref.grad = g.clone()
        opt.step()
        adamw_update_(p, g.clone(), m, v, step=step, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=wd,
                      backend=backend, threads=3)
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_undecayed_ranges_take_the_decay_back(backend):
    """Undecayed: over its ranges (adjacent ones joined), an update with weight decay ends as torch's AdamW
    without it, to a rounding; elsewhere as with it; the bf16 copy follows the master."""
    from slideformer.optim.adamw import Undecayed

    spared = Undecayed(((40, 50), (0, 8), (8, 16)))
    assert spared.ranges == [(0, 16), (40, 50)]
    torch.manual_seed(0)
    n, kw = 70, dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    p = torch.randn(n)
    ref = p.clone().requires_grad_(True)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[0:16] = mask[40:50] = True
    opt = torch.optim.AdamW([ref], weight_decay=0.0, **kw)
    m, v, out = torch.zeros(n), torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)
    for step in range(1, 6):
        g = torch.randn(n)
        with torch.no_grad():
            ref.mul_(torch.where(mask, 1.0, 1 - kw["lr"] * 0.5))  # (decoupled decay on the others alone)
        ref.grad = g.clone()
        opt.step()
        saved = spared.before(0.5, p)
        adamw_update_(p, g.clone(), m, v, step=step, weight_decay=0.5, out=out, backend=backend, threads=2, **kw)
        spared.after(saved, kw["lr"], 0.5, p, out=out)
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(out, p.bfloat16())
    assert spared.before(0.0, p) is None and Undecayed(()).before(0.5, p) is None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta1", [0.9, 0.3])  # both branches of torch's lerp
def test_bf16_grad_coef_and_copy_out(backend, beta1):
    torch.manual_seed(0)
    n = 4099
    p, g = torch.randn(n), torch.randn(n).bfloat16()
    a, b = p.clone(), p.clone()
    ma, va, mb, vb = (torch.zeros(n) for _ in range(4))
    out = torch.empty(n, dtype=torch.bfloat16)
    kw = dict(lr=1e-2, betas=(beta1, 0.999), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW([b.requires_grad_()], fused=True, **kw)
    for step in (1, 2):
        adamw_update_(a, g, ma, va, step=step, grad_coef=0.5, out=out, scratch=torch.empty(n), backend=backend, **kw)
        b.grad = g.float() * 0.5
        ref.step()
    torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(out, a.bfloat16())  # the copy is the master rounded to nearest even, as torch rounds


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])  # bf16: the hand-vectorised path
@pytest.mark.parametrize("offset", [0, 3])  # a copy that starts off its 32-byte alignment
def test_bf16_rounding_is_torchs(grad_dtype, offset):
    special = torch.tensor([0.0, -0.0, 1.0, 1.00390625, 1.01171875, 3.4e38, float("inf"), -float("inf"), 1e-40,
                            float("nan")])
    x = torch.cat([special.repeat(20), torch.randn(100_000) * 10])
    p, m, v = x.clone(), torch.zeros_like(x), torch.zeros_like(x)
    out = torch.empty(x.numel() + offset, dtype=torch.bfloat16)[offset:]
    # lr=0 and no decay leave the master as it is: out is then exactly the cast of x
    adamw_update_(p, torch.zeros_like(x, dtype=grad_dtype), m, v, step=1, lr=0.0, betas=(0.9, 0.999), eps=1e-8,
                  weight_decay=0.0, out=out, backend="native", threads=3)
    nan = x.isnan()  # any NaN will do: torch's own casts disagree on its bits
    assert out[nan].isnan().all()
    assert torch.equal(out[~nan].view(torch.int16), x[~nan].bfloat16().view(torch.int16))


def test_torch_backend_needs_scratch_for_bf16():
    with pytest.raises(ValueError, match="scratch"):
        adamw_update_(torch.zeros(4), torch.zeros(4).bfloat16(), torch.zeros(4), torch.zeros(4), step=1, lr=1e-2,
                      betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, backend="torch")


def test_schedules_match_transformers():
    from transformers import get_scheduler

    from slideformer.optim.schedule import SCHEDULES

    for kind in SCHEDULES:  # (constant has no warmup, as transformers' has none: constant_with_warmup has)
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=2.0)
        sched = get_scheduler(kind, opt, num_warmup_steps=3, num_training_steps=10)
        for step in range(10):
            assert lr_at(step, 2.0, kind, warmup_steps=3, total_steps=10) == pytest.approx(sched.get_last_lr()[0])
            opt.step()
            sched.step()
    with pytest.raises(ValueError, match="unknown lr schedule"):
        lr_at(0, 1.0, "step")


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_compact_kernel_matches_its_reference(grad_dtype):
    from slideformer.optim.adamw import adamw_compact_

    n = 20_011
    out = {}
    for backend in ("native", "torch"):
        torch.manual_seed(0)
        p = torch.randn(n)
        hi = p.bfloat16()
        lo = (p - hi.float()).bfloat16()
        m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        for step in range(1, 4):
            adamw_compact_(hi, lo, torch.randn(n).to(grad_dtype), m, v, step=step, lr=1e-2, betas=(0.9, 0.999),
                           eps=1e-8, weight_decay=0.1, grad_coef=0.7, seed=5, backend=backend, threads=2)
        out[backend] = (hi.float() + lo.float(), m.float(), v.float())
    for a, b in zip(out["native"], out["torch"]):
        assert float((a - b).norm() / b.norm()) < 1e-4  # fused multiply-adds in the kernel, not in torch


def test_compact_avx512_matches_the_scalar_build_bit_for_bit():
    """The default build's hand-vectorised compact update against the compiler's vector code of the scalar
    loop (the benchmark's compact_scalar build): every lane, both lerp branches, NaN and inf gradients,
    ragged tails."""
    import re

    from slideformer.bench.optimizer import VARIANTS
    from slideformer.optim import native

    if not re.search(r"\bavx512bw\b", open("/proc/cpuinfo").read()):
        pytest.skip("no AVX-512 here: both builds are the scalar loop")
    scalar, ours = native.build("_compact_scalar", VARIANTS["compact_scalar"]), native.build()

    def state(n):
        g = torch.Generator().manual_seed(n)
        p = torch.randn(n, generator=g)
        grad = torch.randn(n, generator=g).bfloat16()
        grad[n // 3] = float("nan")
        grad[n // 2] = float("inf")
        return [p.bfloat16(), (p - p.bfloat16().float()).bfloat16(), grad,
                (torch.randn(n, generator=g) * 0.1).bfloat16(), (torch.rand(n, generator=g) * 0.01).bfloat16()]

    for n in (15, 16, 17, 65536 * 2 + 7):
        for beta1 in (0.9, 0.3):
            a, b = state(n), state(n)
            for step in (1, 2):
                kw = (step, 1e-2, beta1, 0.999, 1e-8, 0.1, 0.7, 5, 123, 2)
                ours.adamw_step_compact(*a, *kw)
                scalar.adamw_step_compact(*b, *kw)
            for x, y in zip(a, b):
                assert torch.equal(x.view(torch.int16), y.view(torch.int16)), (n, beta1)


def test_compact_state_tracks_fp32_adamw():
    """Compact mode's documented tolerance: over 300 noisy steps on a quadratic its weights stay within
    1% of exact AdamW's path, and its second moment (bf16, rounded stochastically) within 5%."""
    from slideformer.optim.adamw import adamw_compact_

    torch.manual_seed(0)
    n = 4096
    target = torch.randn(n)
    p = torch.randn(n)
    ref = p.clone()
    hi, lo = p.bfloat16(), (p - p.bfloat16().float()).bfloat16()
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    rm, rv = torch.zeros(n), torch.zeros(n)
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for step in range(1, 301):
        noise = 0.1 * torch.randn(n)
        adamw_compact_(hi, lo, (hi.float() + lo.float() - target + noise), m, v, step=step, seed=1, **kw)
        adamw_update_(ref, ref - target + noise, rm, rv, step=step, backend="torch", **kw)
    got = hi.float() + lo.float()
    assert float((got - ref).norm() / (ref - p).norm()) < 0.01
    assert float((v.float() - rv).norm() / rv.norm()) < 0.05


def _state_and_update(fmt: str, n: int, g: torch.Tensor, **over):
    """A unit's optimizer state of ``n`` parameters in format ``fmt`` (moments not all zero) and an update
    of it by ``g``: ``update(state, landing=None, src=None)``."""
    from slideformer.optim.adamw import adamw_8bit_, adamw_compact_
    from slideformer.optim.formats import moment_numel

    kw = dict(step=3, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, backend="native", threads=2) | over
    if fmt == "fp32":
        state = [torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01, torch.empty(n, dtype=torch.bfloat16)]

        def update(s, landing=None, src=None, grad=None, rows=None):
            return adamw_update_(s[0], g if grad is None else grad, s[1], s[2], out=s[3], scratch=torch.empty(n),
                                 landing=landing, src=None if src is None else src[:3], rows=rows, **kw)
        return state, update
    hi, lo = torch.randn(n).bfloat16(), (torch.randn(n) * 1e-3).bfloat16()
    if fmt == "compact":
        state = [hi, lo, (torch.randn(n) * 0.1).bfloat16(), (torch.rand(n) * 0.01).bfloat16()]

        def update(s, landing=None, src=None, grad=None, rows=None):
            return adamw_compact_(*s[:2], g if grad is None else grad, *s[2:], seed=5, landing=landing, src=src,
                                  rows=rows, **kw)
        return state, update
    state = [hi, lo] + [torch.randint(0, 256, (moment_numel("8bit", n),), dtype=torch.uint8) for _ in range(2)]
    for m in state[2:]:
        m[n:].view(torch.float32).copy_(torch.rand(n // 128) * 0.1)  # (scales: finite and positive)

    def update(s, landing=None, src=None, grad=None, rows=None):
        return adamw_8bit_(*s[:2], g if grad is None else grad, *s[2:], landing=landing, src=src, rows=rows, **kw)
    return state, update


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt,length", [("fp32", 256), ("fp32", 37), ("compact", 256), ("compact", 37),
                                        ("8bit", 256)])  # (8-bit state: rows of whole 128-value blocks)
def test_a_row_wise_update_in_two_parts_is_the_dense_update(fmt, grad_dtype, length):
    """An embedding's update in two parts (engine/embedding.py): the rows a step touched, from their packed
    gradient and chunk by chunk as it lands, and the rest with a zero gradient, in either order, give the
    bits of one dense update whose gradient is zero outside those rows. A unit with a padded tail; touched
    rows in runs (merged into segments) and alone, the first and the last among them; an untouched gap
    longer than the kernel's 64k-element blocks (rows of 256); rows off the vector width (37)."""
    from slideformer.optim.adamw import Landing, Rows

    nrows, tail = 600, 128
    n = length * nrows + tail
    ids = torch.tensor([0, 1, 2, 7, 8, 100, 101, 102, 103, 104, 450, nrows - 1])
    torch.manual_seed(0)
    packed = torch.randn(len(ids), length).to(grad_dtype)
    dense = torch.zeros(n, dtype=grad_dtype)
    dense[: nrows * length].view(nrows, length)[ids] = packed
    state, update = _state_and_update(fmt, n, dense)
    ref = [t.clone() for t in state]
    update(ref)
    touched, rest = Rows(ids, length, True), Rows(ids, length, False)
    chunk = 384  # (chunks that split rows: the segments follow the landing)
    flags, abort = torch.full((-(-packed.numel() // chunk),), 3, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    for order in ([touched, rest], [rest, touched]):
        got = [t.clone() for t in state]
        for part in order:
            update(got, landing=Landing(flags, 3, chunk, abort) if part.touched else None,
                   grad=packed.flatten() if part.touched else packed[:0].flatten(), rows=part)
        for a, b in zip(got, ref):
            assert torch.equal(a, b)
    one = [t.clone() for t in state]
    update(one, grad=packed.flatten(), rows=touched)
    assert torch.equal(one[0][length * 3: length * 7], state[0][length * 3: length * 7])  # untouched rows left
    assert not torch.equal(one[0][:length], state[0][:length])
    with pytest.raises(RuntimeError, match="sorted, unique"):
        update([t.clone() for t in state], grad=packed.flatten(), rows=Rows(ids.flip(0), length, True))
    torch_update = _state_and_update(fmt, n, dense, backend="torch")[1]
    with pytest.raises(ValueError, match="native"):
        torch_update([t.clone() for t in state], grad=packed.flatten(), rows=touched)
    with pytest.raises(RuntimeError, match="none for a zero gradient"):
        update([t.clone() for t in state], grad=packed.flatten(), rows=rest)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt,length", [("fp32", 256), ("fp32", 37), ("compact", 256), ("8bit", 256)])
def test_the_untouched_rows_read_a_whole_gradient_as_it_lands(fmt, grad_dtype, length):
    """A tied embedding's update by rows (engine/embedding.py): the untouched rows read the head's whole
    gradient at their own places, chunk by chunk as it lands (chunks that split rows and gaps), the touched
    rows their packed gradient (head and embedding summed). Together, in either order, the bits of one dense update; the rows of the other part and a
    chunk not yet landed are left alone."""
    from slideformer.optim.adamw import Landing, Rows

    nrows, tail = 600, 128
    n = length * nrows + tail
    ids = torch.tensor([0, 1, 2, 7, 8, 100, 101, 102, 103, 104, 450, nrows - 1])
    torch.manual_seed(1)
    head = torch.randn(n).to(grad_dtype)
    head[nrows * length:] = 0  # (the padding's gradient, as the slot's)
    packed = torch.randn(len(ids), length).to(grad_dtype)
    dense = head.clone()
    dense[: nrows * length].view(nrows, length)[ids] = packed
    state, update = _state_and_update(fmt, n, dense)
    ref = [t.clone() for t in state]
    update(ref)
    touched, rest = Rows(ids, length, True), Rows(ids, length, False)
    chunk, abort = 128 * (n // 384 + 1), torch.zeros(1, dtype=torch.int64)  # (3 chunks, whole 8-bit blocks)
    landed = lambda k: Landing(torch.full((-(-n // chunk),), k, dtype=torch.int64), 3, chunk, abort)  # noqa: E731
    for order in ([touched, rest], [rest, touched]):
        got = [t.clone() for t in state]
        for part in order:
            update(got, landing=landed(3), grad=(packed if part.touched else head).flatten(), rows=part)
        for a, b in zip(got, ref):
            assert torch.equal(a, b)
    one = [t.clone() for t in state]
    update(one, landing=landed(3), grad=head, rows=rest)
    assert torch.equal(one[0][length * 100: length * 105], state[0][length * 100: length * 105])  # touched: left
    assert torch.equal(one[0][length * 3: length * 7], ref[0][length * 3: length * 7])
    abort.fill_(1)  # a chunk that never lands: the update stops there, its rows and those after left alone
    flags = torch.full((-(-n // chunk),), 3, dtype=torch.int64)
    flags[1] = 0
    part = [t.clone() for t in state]
    with pytest.raises(RuntimeError, match="aborted"):
        update(part, landing=Landing(flags, 3, chunk, abort), grad=head, rows=rest)
    assert torch.equal(part[0][chunk:], state[0][chunk:])
    assert torch.equal(part[0][length * 3: length * 7], ref[0][length * 3: length * 7])


@pytest.mark.parametrize("fmt", ["fp32", "compact", "8bit"])
def test_native_update_follows_the_landing_flags(fmt):
    """One call per unit updates each chunk once its flag shows the ticket, and only then, and returns how
    long it waited for them (the profile's honest update time); an abort ends the wait for a chunk that
    never lands."""
    import threading
    import time

    from slideformer.optim.adamw import Landing

    n, chunk, ticket = 1024, 384, 7  # (8-bit blocks of 128: chunks of whole blocks)
    torch.manual_seed(0)
    g = torch.randn(n).bfloat16()
    state, update = _state_and_update(fmt, n, g, weight_decay=0.0)
    ref = [t.clone() for t in state]
    assert update(ref) == 0.0
    before = state[0].clone()
    flags, abort = torch.zeros(3, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    flags[0] = ticket - 1  # a previous send's ticket: not this one
    waited = []
    th = threading.Thread(target=lambda: waited.append(update(state, Landing(flags, ticket, chunk, abort))))
    th.start()
    time.sleep(0.05)
    assert torch.equal(state[0], before)  # nothing has landed
    flags[0] = ticket
    time.sleep(0.05)
    assert not torch.equal(state[0][:chunk], before[:chunk]) and torch.equal(state[0][chunk:], before[chunk:])
    flags[1:] = ticket
    th.join(5)
    assert not th.is_alive()
    for a, b in zip(state, ref):
        assert torch.equal(a, b)  # chunk by chunk is the same update as one piece
    assert 0.09 < waited[0] < 5  # two sleeps of 0.05 s before chunks landed
    assert update([t.clone() for t in ref], Landing(flags, ticket, chunk, abort)) == 0.0  # all there already

    flags.zero_()
    failure = []

    def waits_forever():
        try:
            update(state, Landing(flags, ticket, chunk, abort))
        except RuntimeError as e:
            failure.append(str(e))

    th = threading.Thread(target=waits_forever)
    th.start()
    time.sleep(0.05)
    abort.fill_(1)
    th.join(5)
    assert not th.is_alive() and "aborted" in failure[0]


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("fmt", ["fp32", "compact", "8bit"])
def test_update_out_of_place_leaves_the_source(backend, fmt):
    """``src``: the update reads the state there and writes it elsewhere (a speculative update into a spare
    state, engine/updates.py): the same bits as in place, the source untouched. bf16 gradient and copy
    out, odd length: the vector path (non-temporal stores where the destination is aligned) and its tail."""
    n = 4096 if fmt == "8bit" else 4099
    torch.manual_seed(0)
    g = torch.randn(n).bfloat16()
    state, update = _state_and_update(fmt, n, g, backend=backend)
    keep = [t.clone() for t in state]
    in_place = [t.clone() for t in state]
    update(in_place)
    out = [torch.empty_like(t) for t in state]
    update(out, src=tuple(state))
    for a, b in zip(out, in_place):
        assert torch.equal(a, b)
    for a, b in zip(state[:3] if fmt == "fp32" else state, keep):
        assert torch.equal(a, b)


def test_without_a_compiler_auto_falls_back_to_torch_with_one_warning(monkeypatch):
    """No compiler (or headers, or ninja): `auto` takes torch's fused kernel, says so once, and the
    engine's other entry points still ask for the compiled path strictly."""
    import warnings

    from slideformer.optim.adamw import resolve_backend

    def no_compiler(*a, **k):
        raise RuntimeError("Error building extension 'slideformer_adamw': c++: not found")

    monkeypatch.setattr(native, "build", no_compiler)
    monkeypatch.setattr(native, "_loaded", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_backend("auto") == "torch" and resolve_backend("auto") == "torch"
    assert len(caught) == 1 and "using torch's fused AdamW" in str(caught[0].message)
    assert "c++: not found" in str(caught[0].message)
    monkeypatch.setattr(native, "_loaded", {})
    with pytest.raises(RuntimeError, match="c\\+\\+: not found"):
        resolve_backend("native")


# -- 8-bit state (optim/formats.py) ---------------------------------------------------------------------

def torchao():
    """torchao, the 8-bit AdamW reference, from the folder `make test` installs it into (apart from the
    venv, whose transformers would import it in every run)."""
    import sys
    from pathlib import Path

    ref = Path(sys.prefix) / "reference"
    if ref.is_dir() and str(ref) not in sys.path:
        sys.path.append(str(ref))
    try:
        import torchao.optim  # noqa: F401
    except ImportError:
        pytest.fail("torchao, the 8-bit AdamW reference, is missing: `make test` installs it into .venv/reference")

def test_8bit_maps_are_torchaos():
    """The dynamic maps are bitsandbytes' and torchao's, value for value."""
    torchao()
    from torchao.optim.quant_utils import create_dynamic_map

    from slideformer.optim.formats import qmap

    for signed in (True, False):
        assert torch.equal(qmap(signed), torch.tensor(create_dynamic_map(signed), dtype=torch.float32))


@pytest.mark.parametrize("signed", [True, False])
def test_8bit_code_tables_are_the_binary_search(signed):
    """The C++ kernel's two lookups give the binary search's code for random values, every map value, and
    every midpoint and its fp32 neighbours (where a code changes)."""
    from slideformer.optim.formats import code_tables, nearest_codes, qmap

    q = qmap(signed)
    mids = (q[1:] + q[:-1]) / 2
    torch.manual_seed(0)
    r = torch.rand(200_000)
    y = torch.cat([r * 2 - 1 if signed else r, r ** 8, q, mids, torch.nextafter(mids, torch.tensor(-2.0)),
                   torch.nextafter(mids, torch.tensor(2.0)), torch.tensor([0.0, -0.0, 1e-30, 1.0])])
    y = y if signed else y.abs()
    base, threshold = code_tables(signed)
    k = (y.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) >> 16
    assert torch.equal(base[k].long() + (y >= threshold[k]).long(), nearest_codes(y, q))
    assert int((threshold < float("inf")).sum()) > 200  # (most jumps fall inside a bucket)


def test_8bit_update_is_torchaos_adamw8bit():
    """Against torchao's AdamW8bit (blocks of 128) over 20 steps: the same codes, scales to fp32 rounding,
    and the master within its bf16 hi + lo precision (torchao keeps an fp32 parameter)."""
    torchao()
    from torchao.optim.adam import single_param_adam
    from torchao.optim.subclass_8bit import OptimState8bit

    from slideformer.optim.adamw import adamw_8bit_
    from slideformer.optim.formats import moment_numel, split_moment

    torch.manual_seed(0)
    n = 8192
    p0 = torch.randn(n) * 0.02
    hi = p0.bfloat16()
    lo = (p0 - hi.float()).bfloat16()
    p = hi.float() + lo.float()
    p0 = p.clone()
    m, v = (torch.zeros(moment_numel("8bit", n), dtype=torch.uint8) for _ in range(2))
    tm, tv = OptimState8bit.zeros((n,), True, 128), OptimState8bit.zeros((n,), False, 128)
    for step in range(1, 21):
        g = torch.randn(n) * (1 + step % 3)
        adamw_8bit_(hi, lo, g, m, v, step=step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                    backend="torch")
        single_param_adam(p, g, torch.tensor(float(step)), tm, tv, None, torch.tensor(1e-3), 0.9, 0.999, 0.1, 1e-8,
                          True, False)
    for ours, theirs in ((m, tm), (v, tv)):
        codes, scales = split_moment(ours, n)
        assert torch.equal(codes, theirs.codes)
        torch.testing.assert_close(scales, theirs.scale, rtol=1e-6, atol=0)
    moved = (p - p0).abs().max()
    assert float((hi.float() + lo.float() - p).abs().max()) < 1e-3 * float(moved)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_8bit_kernel_matches_its_reference(grad_dtype):
    """The C++ kernel is the PyTorch reference's arithmetic (no contracted multiply-adds): over 5 steps the
    same codes, and the same master but for the last bit of a few of its lo halves, or the fp32 rounding of
    the update where lo is tiny (0.02% of them on some hosts, 0.15% on an AMD EPYC one, whose vector kernels
    round a few products otherwise), which moves the hi half only where it carries."""
    from slideformer.optim.adamw import adamw_8bit_
    from slideformer.optim.formats import moment_numel

    torch.manual_seed(0)
    n = 128 * 1000
    p = torch.randn(n) * 0.02
    a = [p.bfloat16(), (p - p.bfloat16().float()).bfloat16()] + \
        [torch.zeros(moment_numel("8bit", n), dtype=torch.uint8) for _ in range(2)]
    for step in range(1, 6):
        g = (torch.randn(n) * (1 + step % 3)).to(grad_dtype)
        b = [t.clone() for t in a]
        kw = dict(step=step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, grad_coef=0.5)
        adamw_8bit_(*a[:2], g, *a[2:], backend="torch", **kw)
        adamw_8bit_(*b[:2], g, *b[2:], backend="native", threads=2, **kw)
        assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])
        lo_differs = a[1] != b[1]
        assert int(lo_differs.sum()) <= n // 500 and not ((a[0] != b[0]) & ~lo_differs).any()
        gap = (a[0].float() + a[1].float()) - (b[0].float() + b[1].float())  # (the master: hi + lo)
        # a unit of the lo half, or where lo is tiny the fp32 rounding of the update and of the master it lands on
        # (Adam's normalised step is about 1: a few lr)
        lo_unit = torch.finfo(torch.bfloat16).eps * torch.maximum(a[1].float().abs(), b[1].float().abs())
        fp32_unit = torch.finfo(torch.float32).eps * (a[0].float().abs() + 8 * kw["lr"])
        assert torch.all(gap.abs() <= torch.maximum(lo_unit, fp32_unit))
        a = b


def test_8bit_nan_reaches_the_scale_in_both_backends():
    """A NaN gradient makes its block's scales NaN in the reference (its maximum keeps the NaN); the kernel's
    vector maximum would drop it and store a finite, wrong moment: both give the same state."""
    from slideformer.optim.adamw import adamw_8bit_
    from slideformer.optim.formats import moment_numel, split_moment

    n = 512
    torch.manual_seed(0)
    g = torch.randn(n)
    g[130] = float("nan")
    start = [torch.randn(n).bfloat16(), torch.zeros(n, dtype=torch.bfloat16)] + \
        [torch.zeros(moment_numel("8bit", n), dtype=torch.uint8) for _ in range(2)]
    states = []
    for backend in ("torch", "native"):
        s = [t.clone() for t in start]
        adamw_8bit_(*s[:2], g, *s[2:], step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                    backend=backend, threads=2)
        states.append(s)
    (hi, lo, m, v), (hi2, lo2, m2, v2) = states
    torch.testing.assert_close(hi2, hi, rtol=0, atol=0, equal_nan=True)  # (a NaN's sign bit may differ)
    torch.testing.assert_close(lo2, lo, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(m, m2) and torch.equal(v, v2)
    scales = split_moment(states[1][2], n)[1]
    assert scales[1].isnan() and not scales[[0, 2, 3]].isnan().any()  # (block 1 holds element 130)


def test_8bit_state_tracks_fp32_adamw_as_torchaos_does():
    """On compact state's quadratic, 300 noisy steps: 8-bit moments move the weights off exact AdamW's path
    (3.4% here), as torchao's AdamW8bit does; ours stays on torchao's path within 0.1% of the distance
    travelled (what the bf16 hi + lo master adds), so its deviation is torchao's."""
    torchao()
    from torchao.optim.adam import single_param_adam
    from torchao.optim.subclass_8bit import OptimState8bit

    from slideformer.optim.adamw import adamw_8bit_
    from slideformer.optim.formats import moment_numel

    torch.manual_seed(0)
    n = 4096
    target, p = torch.randn(n), torch.randn(n)
    ref, theirs = p.clone(), p.clone()
    hi, lo = p.bfloat16(), (p - p.bfloat16().float()).bfloat16()
    m, v = (torch.zeros(moment_numel("8bit", n), dtype=torch.uint8) for _ in range(2))
    tm, tv = OptimState8bit.zeros((n,), True, 128), OptimState8bit.zeros((n,), False, 128)
    rm, rv = torch.zeros(n), torch.zeros(n)
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for step in range(1, 301):
        noise = 0.1 * torch.randn(n)
        adamw_8bit_(hi, lo, (hi.float() + lo.float() - target + noise), m, v, step=step, **kw)
        single_param_adam(theirs, theirs - target + noise, torch.tensor(float(step)), tm, tv, None,
                          torch.tensor(1e-2), 0.9, 0.999, 0.0, 1e-8, True, False)
        adamw_update_(ref, ref - target + noise, rm, rv, step=step, backend="torch", **kw)
    got, travelled = hi.float() + lo.float(), (ref - p).norm()
    assert float((got - theirs).norm() / travelled) < 1e-3
    assert 0.01 < float((theirs - ref).norm() / travelled) < 0.1  # (8-bit moments do move the path)
