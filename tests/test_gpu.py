"""The engine on a real GPU: streams and events must give the same training as the CPU path."""

import copy
import math

import pytest
import torch

from slideformer.config import Placement, Tuning
from slideformer import EngineConfig, SlideEngine

from test_engine_parity import reference_noise, reference_train
from tiny import batch, build, engine_config

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def gpu_noise(model, batches, ref, fused="none", **kw) -> dict[str, float]:
    """Each tensor's relative distance from the CPU reference ``ref`` (its state dict) that plain PyTorch's own
    arithmetic shows on this GPU: the largest of its training in the same order (the device's kernels), in
    another exact order of its sums (``reference_noise``) and, where the engine runs fused ops, with those
    kernels in PyTorch's norms', rotation's and SwiGLU's place (model/fused_ops.py ``apply_liger``: closed
    forms, exact in real numbers, rounded otherwise; tests/test_kernels.py holds each to PyTorch's)."""
    from slideformer.model.fused_ops import apply_liger

    on_gpu = [{k: v.cuda() for k, v in b.items()} for b in batches]
    runs = [reference_train(copy.deepcopy(model).cuda(), on_gpu, **kw)[0],
            *reference_noise(copy.deepcopy(model).cuda(), on_gpu, **kw)]
    if fused == "liger":
        fused_model = copy.deepcopy(model).cuda()
        assert apply_liger([fused_model.model], model.config.hidden_act)
        runs.append(reference_train(fused_model, on_gpu, **kw)[0])
    states = [{k: v.cpu() for k, v in run.state_dict().items()} for run in runs]
    return {k: max(float((st[k] - r).norm() / r.norm()) for st in states) for k, r in ref.items()}


def assert_near_reference(state, ref_model, losses, ref_losses, noise):
    """Each tensor within three times the reference's own distance on the GPU (``gpu_noise``) from the CPU
    reference, and never held under 1e-5 relative; the losses within 1e-4."""
    ref = ref_model.state_dict()
    for k, v in state.items():
        rel = float((v - ref[k]).norm() / ref[k].norm())
        bound = max(1e-5, 3 * noise[k])
        assert rel <= bound, f"{k}: relative error {rel:.2e} (bound {bound:.2e})"
    assert losses == pytest.approx(ref_losses, rel=1e-4)


def cuda_engine_train(model, steps, fused_as=None, **cfg):
    """The engine's state and losses after ``steps`` on CUDA; ``fused_as``: a list given the fused ops it ran."""
    eng = SlideEngine(model, engine_config(device="cuda", **cfg))
    if fused_as is not None:
        fused_as.append(eng.fused_ops)
    losses = []
    with eng:
        for b in steps:
            losses.append(eng.train_step(b))
        state = {k: v.clone() for k, v in eng.state_dict().items()}
    return state, losses


@pytest.mark.parametrize("family,slots,depth,clip,fused", [("llama", 2, 1, None, "none"),
                                                           ("qwen3-tied", 3, 2, 0.05, "none"),
                                                           ("qwen2", 4, 1, None, "none"),
                                                           ("llama", 2, 1, None, "liger"),
                                                           ("qwen3-tied", 3, 2, 0.05, "liger"),
                                                           ("qwen3-moe", 2, 1, 0.05, "none"),
                                                           ("mixtral", 3, 2, None, "none")])
def test_fp32_cuda_matches_pytorch(family, slots, depth, clip, fused):
    if fused == "liger":
        pytest.importorskip("liger_kernel")
    model = build(family)
    batches = [batch(model.config.vocab_size, seed=s) for s in range(3)]
    state, losses = cuda_engine_train(model, batches, compute_dtype=torch.float32, lr=1e-2, window_slots=slots,
                                      prefetch_depth=depth, max_grad_norm=clip, fused_ops=fused)
    ref, ref_losses = reference_train(model, batches, lr=1e-2, max_grad_norm=clip)
    noise = gpu_noise(model, batches, ref.state_dict(), fused, lr=1e-2, max_grad_norm=clip)
    assert_near_reference(state, ref, losses, ref_losses, noise)


def bf16_reference_train(model, batches, *, lr):
    """Plain PyTorch mixed precision as the engine does it: an fp32 master updated by AdamW, and a bf16
    copy of it that runs forward and backward, on CUDA."""
    master = copy.deepcopy(model).cuda()
    work = copy.deepcopy(model).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=lr, fused=True)
    pairs = list(zip(master.parameters(), work.parameters()))
    for b in batches:
        with torch.no_grad():
            for m, w in pairs:
                w.copy_(m)
        work(**{k: v.cuda() for k, v in b.items()}).loss.backward()
        for m, w in pairs:
            m.grad, w.grad = w.grad.float(), None
        opt.step()
        opt.zero_grad(set_to_none=True)
    return master.cpu()


@pytest.mark.parametrize("family", ["llama", "qwen3-moe"])
def test_bf16_matches_fp32_within_bf16_tolerance(family):
    """bf16 on CUDA (a MoE model's experts through transformers' grouped GEMM) against fp32 PyTorch. Each
    tensor lands within a tenth of its own movement from fp32's, or within three times the distance that
    plain PyTorch's own bf16 training (fp32 master, bf16 compute copy) lands from it: bf16's noise,
    measured. A router's softmax and top-k turn that noise into other routing choices, so a MoE model's
    experts move apart further than their movement's tenth in both runs; over four Adam steps a dense
    tensor's distance varies several-fold between equally exact bf16 runs, so noise alone is no bound."""
    model = build(family)
    batches = [batch(97, b=4, s=32, seed=s) for s in range(4)]
    state, losses = cuda_engine_train(model, batches, compute_dtype=torch.bfloat16, lr=1e-3)
    ref, ref_losses = reference_train(model, batches, lr=1e-3)
    assert losses == pytest.approx(ref_losses, rel=2e-2)
    ref_sd, plain = ref.state_dict(), bf16_reference_train(model, batches, lr=1e-3).state_dict()
    init = model.state_dict()
    for k, v in state.items():
        moved, noise = (ref_sd[k] - init[k]).norm(), (plain[k] - ref_sd[k]).norm()
        bound = max(0.1 * float(moved), 3 * float(noise)) + 1e-3 * float(ref_sd[k].norm())
        assert float((v - ref_sd[k]).norm()) <= bound, k


@pytest.mark.parametrize("chunk", [1 << 24, 1000])  # one gradient chunk per unit, and many
def test_copy_delays_do_not_change_results(monkeypatch, chunk):
    """Slow copies (injected sleeps on both copy streams) must not let compute read stale data, nor the
    CPU update read a gradient chunk before it has landed."""
    from slideformer.engine import runtime as rt_mod

    model = build("llama")
    batches = [batch(97, seed=s) for s in range(3)]
    fast, _ = cuda_engine_train(model, batches, compute_dtype=torch.float32, lr=1e-2, window_slots=2)

    load, send = rt_mod.Runtime.load, rt_mod.Runtime.send_grads

    def slow_load(self, unit, slot, rows=None):
        with torch.cuda.stream(self.copier.h2d):
            torch.cuda._sleep(2_000_000)
        return load(self, unit, slot, rows)

    def slow_send(self, unit, slot, rows=None):
        with torch.cuda.stream(self.copier.d2h):
            torch.cuda._sleep(2_000_000)
        return send(self, unit, slot, rows)

    monkeypatch.setattr(rt_mod.Runtime, "load", slow_load)
    monkeypatch.setattr(rt_mod.Runtime, "send_grads", slow_send)
    slow, _ = cuda_engine_train(model, batches, compute_dtype=torch.float32, lr=1e-2, window_slots=2,
                                grad_chunk_elems=chunk)
    assert all(torch.equal(fast[k], slow[k]) for k in fast)


def test_gpu_memory_does_not_grow_after_first_step():
    model = build("qwen2")
    eng = SlideEngine(model, EngineConfig(device="cuda", compute_dtype=torch.bfloat16, lr=1e-3))
    with eng:
        eng.train_step(batch(97, b=4, s=32))
        torch.cuda.synchronize()
        after_first = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        eng.train_step(batch(97, b=4, s=32, seed=1))
        peak_second = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for s in range(2, 5):
            eng.train_step(batch(97, b=4, s=32, seed=s))
        # (not grown: an earlier test's block freed behind its stream's event may leave the count lower)
        assert torch.cuda.memory_allocated() <= after_first
        assert torch.cuda.max_memory_allocated() <= peak_second


def test_profile_counts_resident_adamw_as_gpu_work_not_idle():
    """The resident units' AdamW runs on the compute stream between visits and, with clipping, after the
    last one: the breakdown reports it (gpu_adamw_busy_s), the span reaches it, and idle is never negative.
    fp32 state (torch's fused AdamW) and compact state (kernels/compact_adamw.py) alike."""
    model = build("llama")
    for state in ("fp32", "compact", "8bit"):
        cfg = EngineConfig(device="cuda", compute_dtype=torch.bfloat16, lr=1e-3, max_grad_norm=0.05, optimizer_state=state, placement=Placement(resident_layers=3), tuning=Tuning(profile=True))
        with SlideEngine(model, cfg) as eng:
            eng.train_step(batch(97, b=4, s=32))
            eng.synchronize()
            eng.profile()
            eng.train_step(batch(97, b=4, s=32, seed=1))
            eng.synchronize()
            b = eng.profile()
        assert b["gpu_adamw_busy_s"] > 0 and b["gpu_idle_s"] >= 0, state


def test_timeline_says_at_which_visit_the_gpu_memory_peaks():
    """Each GPU visit of the timeline carries the allocator's peak so far: never falling within a window,
    its last value the step's peak, and the visit where it last rises the one that holds the peak (with
    every layer streamed and its input offloaded, a layer's backward or the loss head, not the forward)."""
    model = build("llama")
    cfg = EngineConfig(device="cuda", compute_dtype=torch.bfloat16, lr=1e-3,
                       placement=Placement(offload_activations=True, gpu_activation_layers=0),
                       tuning=Tuning(profile=True))
    with SlideEngine(model, cfg) as eng:
        eng.train_step(batch(97, b=4, s=32))
        eng.profile()
        torch.cuda.reset_peak_memory_stats()
        eng.train_step(batch(97, b=4, s=32, seed=1))
        gpu = eng.profile(timeline=True)["timeline"]["gpu"]
        peak = torch.cuda.max_memory_allocated()
    peaks = [row[4] for row in gpu]  # (bytes: the tiny model's steps move the peak by kilobytes)
    assert all(len(row) == 5 for row in gpu) and peaks == sorted(peaks) and peaks[0] < peaks[-1]
    assert peaks[-1] <= peak and peak - peaks[-1] < 2**20
    layers = model.config.num_hidden_layers
    at = next(i for i, p in enumerate(peaks) if p == peaks[-1])
    assert at >= layers + 1, (at, gpu)  # after the forward's visits (embedding, then each layer)


def test_timeline_puts_host_and_gpu_records_on_one_clock():
    """A layer's CPU update waits for the gradient its backward visit made, and the layer's next forward
    waits for that update: on the timeline's one clock each update ends after that backward visit and
    before the next forward's weights are ready (within a millisecond of the anchor's error)."""
    model = build("llama")
    cfg = EngineConfig(device="cuda", compute_dtype=torch.bfloat16, lr=1e-3, tuning=Tuning(profile=True))
    with SlideEngine(model, cfg) as eng:
        eng.train_step(batch(97, b=4, s=32))
        eng.profile()
        for s in range(1, 4):
            eng.train_step(batch(97, b=4, s=32, seed=s))
        tl = eng.profile(timeline=True)["timeline"]
        layers = {eng.adapter.layer_unit(i).index for i in range(model.config.num_hidden_layers)}
    checked = 0
    for unit in layers:
        visits = [row for row in tl["gpu"] if row[0] == unit]  # forward, backward, per step
        updates = [row for row in tl["host"] if row[0] == "optimizer" and row[1] == unit]
        assert len(visits) == 6 and len(updates) == 3, (visits, updates)
        for k, (_, _, _, end) in enumerate(updates):
            assert end >= visits[2 * k + 1][3] - 1.0, (unit, k, end, visits)
            if k < 2:
                assert end <= visits[2 * k + 2][2] + 1.0, (unit, k, end, visits)
            checked += 1
    assert checked == 3 * len(layers)


@pytest.mark.parametrize("state", ["compact", "8bit"])
def test_compact_state_on_the_device_matches_the_cpu_update(state):
    """Compact state for resident units is updated on the GPU by kernels/compact_adamw.py (8-bit state by
    the PyTorch reference, in pieces), streamed units by the C++ kernel: the same arithmetic, a last bit
    apart now and then (fused multiply-adds on one side), so the training follows the all-streamed run
    to 1e-2 over four steps."""
    model = build("qwen3-tied")
    steps = [batch(97, b=4, s=32, seed=s) for s in range(4)]
    kw = dict(compute_dtype=torch.bfloat16, lr=1e-2, weight_decay=0.1, optimizer_state=state,
              optimizer_backend="native")
    a, la = cuda_engine_train(model, steps, **kw)
    b, lb = cuda_engine_train(model, steps, resident_layers=1, resident_edges=True, **kw)
    assert lb == pytest.approx(la, rel=1e-3)
    for k in a:
        assert float((a[k] - b[k]).norm() / a[k].norm()) < 1e-2, k


def test_nothing_is_pinned_after_the_first_step(monkeypatch):
    """Pinning costs ~0.55 s/GB: the store pins at start, the activation arena at the first step (and
    only again when a step needs more); same-shaped and smaller steps pin nothing."""
    from slideformer.host import pinned

    model = build("llama")
    cfg = EngineConfig(device="cuda", compute_dtype=torch.bfloat16, lr=1e-3, placement=Placement(offload_activations=True, gpu_activation_layers=0))
    with SlideEngine(model, cfg) as eng:
        eng.train_step(batch(97, b=4, s=32))
        calls = []
        real = pinned.pin
        monkeypatch.setattr(pinned, "pin", lambda t, *a: (calls.append(t.numel()), real(t, *a)))
        for s in range(1, 4):
            eng.train_step(batch(97, b=4 if s % 2 else 2, s=32, seed=s))
        eng.synchronize()
        assert calls == []


@pytest.mark.parametrize("staged", [2, "staged"])
def test_staged_host_weights_on_gpu_match_persistent(staged, monkeypatch):
    """The fp32 master sent and cast on the GPU at copy time (CudaCopier._copy_staged, engine/copier.py), in
    pieces through one staging buffer, for some layers or every unit, gives the same bits as the bf16 copy
    the optimizer refreshes."""
    from slideformer.engine import runtime

    monkeypatch.setattr(runtime, "STAGING_ELEMS", 1000)  # a layer in several pieces, the last one short
    model = build("llama")
    steps = [batch(97, b=4, s=32, seed=s) for s in range(3)]
    a, la = cuda_engine_train(model, steps, compute_dtype=torch.bfloat16, lr=1e-3, host_weights="persistent")
    b, lb = cuda_engine_train(model, steps, compute_dtype=torch.bfloat16, lr=1e-3, host_weights=staged)
    assert la == lb
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_compact_adamw_compiles_once_for_every_unit_and_step():
    """Its seeds change with every unit and step; a Triton variant per seed value (int32 or int64, divisible
    by 16 or not) compiled inside timed steps (0.22 s of a 0.85 s step at 4B b8, table11)."""
    from slideformer.kernels import compact_adamw_
    from slideformer.kernels.compact_adamw import _compact_adamw_kernel

    if not hasattr(_compact_adamw_kernel, "device_caches"):
        pytest.skip("this Triton keeps its compiled variants elsewhere")
    hi, lo, m, v = (torch.zeros(4096, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    g = torch.randn(4096, device="cuda").bfloat16()

    def update(step, seed):
        compact_adamw_(hi, lo, g, m, v, step=step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, seed=seed)

    def variants():
        return sum(len(c[0]) for c in _compact_adamw_kernel.device_caches.values())

    update(1, 0)  # this shape's variant (earlier tests may have compiled others)
    before = variants()
    for step in range(1, 9):
        for seed in range(6):
            update(step, seed * 1_000_003 + step)
    assert variants() == before


def test_token_chunked_mlps_bound_a_long_sequence_on_gpu():
    """One 4096-token sequence through a model with a wide MLP: in 512-token chunks the peak drops by more
    than two of the MLP's [tokens, ffn] fp32 intermediates (the whole sequence's recomputed backward holds
    about two and a half of them at its peak, a chunk's are an eighth as large), and the training stays
    the same."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AutoModelForCausalLM, LlamaConfig

    # (no grouped-query attention: the efficient fp32 kernel wants as many key/value heads as query heads)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=4096, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    steps = [batch(97, b=1, s=4096, seed=s) for s in range(2)]

    def run(chunk):
        torch.cuda.reset_peak_memory_stats()
        # fp32 SDPA would take the math backend, whose 4096^2 scores peak above any MLP (both runs at 1.17 GB)
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            state, losses = cuda_engine_train(model, steps, compute_dtype=torch.float32, lr=1e-3,
                                              mlp_chunk_tokens=chunk)
        return state, losses, torch.cuda.max_memory_allocated()

    a, la, whole = run(None)
    b, lb, chunked = run(512)
    assert whole - chunked > 2 * 4096 * (4096 - 512) * 4  # (measured on an H100: 2.3 of them)
    assert lb == pytest.approx(la, rel=1e-5)
    # chunks sum each weight gradient over tokens in another order; Adam's first steps move weights by
    # ~lr x sign(g), so an element whose gradient is rounding noise may move either way: compare norms
    for k in a:
        assert float((a[k] - b[k]).norm() / a[k].norm()) < 1e-3, k


@pytest.mark.parametrize("to_nvme", [False, True])
def test_activation_offload_on_gpu_is_bit_identical(tmp_path, to_nvme):
    model = build("llama")
    batches = [[batch(97, b=4, s=32, seed=s), batch(97, b=2, s=16, seed=s + 9)] for s in range(3)]
    kw = dict(compute_dtype=torch.float32, lr=1e-3, window_slots=2)  # fp32: flash-attention backward (bf16) is not deterministic
    a, la = cuda_engine_train(model, batches, **kw)
    nvme = dict(activations_to_nvme=True, offload_dir=str(tmp_path)) if to_nvme else {}
    b, lb = cuda_engine_train(model, batches, offload_activations=True, gpu_activation_layers=0, **nvme, **kw)
    assert la == lb
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_restored_activations_come_from_the_compute_pool_and_wait_for_its_readers():
    """``to_device``'s tensors are the compute stream's: a free block of another stream's pool cannot serve
    the compute stream, so under a GPU cap the allocator would empty its cache to move memory between the
    two. Such a block may still be read by enqueued compute work: the copy into it waits for that work
    (a sleep in front of the reader makes an early copy overwrite what it reads)."""
    from slideformer.engine.copier import CudaCopier
    from slideformer.engine.profile import NullProfiler

    cp = CudaCopier(torch.device("cuda"), NullProfiler())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # (no other free block of the size below: the next one is ``a``'s)
    n = (1 << 20) + 4096
    host = torch.full((n,), 7.0).pin_memory()  # (before the sleep: pinning may wait for the device)
    with torch.cuda.stream(cp.compute):
        a = torch.full((n,), 1.0, device="cuda")
        torch.cuda._sleep(100_000_000)
        b = a * 2  # reads ``a`` after the sleep
        ptr = a.data_ptr()
        del a  # free in the compute stream's order, its reader still enqueued
    out, ready = cp.to_device([host], None)
    assert out[0].data_ptr() == ptr  # ``a``'s block: the compute stream's pool
    cp.consume(out, ready)
    torch.cuda.synchronize()
    assert bool((b == 2.0).all())
    assert bool((out[0] == 7.0).all())


def test_offloaded_tensors_go_back_to_the_compute_pool_after_their_copy():
    """``to_host``'s GPU tensors are held until the visit after next, then let go in the compute stream's
    order behind a wait for their copy: the next compute tensor takes the block at once (the allocator has
    no event of another stream's to find done first, which under a GPU cap means emptying its cache), and a
    copy that starts late still reads what was offloaded (a write into the reused block before it would
    show in the host's bytes)."""
    from slideformer.engine.copier import CudaCopier
    from slideformer.engine.profile import NullProfiler

    cp = CudaCopier(torch.device("cuda"), NullProfiler())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    n = (1 << 20) + 4096
    host = torch.zeros(n).pin_memory()
    with torch.cuda.stream(cp.compute):
        a = torch.full((n,), 3.0, device="cuda")
    ptr = a.data_ptr()
    with torch.cuda.stream(cp.d2h):
        torch.cuda._sleep(100_000_000)  # the copy starts late
    cp.to_host([host], [a])
    del a
    cp.begin_visit(None)
    cp.end_visit(0)  # the visit that offloaded it: still held
    with torch.cuda.stream(cp.compute):
        other = torch.empty(n, device="cuda")
    assert other.data_ptr() != ptr
    cp.begin_visit(None)
    cp.end_visit(1)  # the next: let go, behind the copy
    with torch.cuda.stream(cp.compute):
        b = torch.full((n,), 5.0, device="cuda")
    assert b.data_ptr() == ptr
    torch.cuda.synchronize()
    assert bool((host == 3.0).all()) and bool((b == 5.0).all())
    # in the order of the copies: one held for three more visits holds back one copied after it for one
    long, short = torch.ones(n, device="cuda"), torch.ones(n, device="cuda")
    cp.to_host([host], [long], visits=3)
    cp.to_host([host], [short])
    import weakref

    held = [weakref.ref(long), weakref.ref(short)]  # (not the allocator's count: other tests' blocks move it)
    del long, short
    for unit in range(3):
        cp.begin_visit(None)
        cp.end_visit(unit)
        assert all(t() is not None for t in held)
    cp.begin_visit(None)
    cp.end_visit(3)
    assert all(t() is None for t in held)


def test_fused_loss_fp32_accumulation_on_gpu():
    """The lm_head gradient accumulates into fp32 through cuBLAS's fp32 output (no temporaries)."""
    from slideformer.kernels.fused_linear_ce import addmm_fp32_, linear_cross_entropy_grads

    torch.manual_seed(0)
    a = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(64, 40, device="cuda", dtype=torch.bfloat16)
    acc = torch.randn(300, 40, device="cuda")
    expect = acc + a.float() @ b.float()
    addmm_fp32_(acc, a, b)
    torch.testing.assert_close(acc, expect, rtol=1e-5, atol=1e-4)

    h = torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(211, 64, device="cuda", dtype=torch.bfloat16) * 0.1
    lab = torch.randint(0, 211, (1000,), device="cuda")
    gw = torch.zeros(211, 64, device="cuda")
    loss, gh, gw = linear_cross_entropy_grads(h, w, lab, 1 / 1000, chunk_tokens=128, grad_weight=gw)
    hr, wr = h.float().requires_grad_(), w.float().requires_grad_()
    ref = torch.nn.functional.cross_entropy(hr @ wr.T, lab)
    ref.backward()
    assert float(loss) == pytest.approx(float(ref), rel=1e-3)
    torch.testing.assert_close(gw, wr.grad, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gh.float(), hr.grad, rtol=2e-2, atol=1e-3)


def test_trainer_on_cuda_with_auto_resident_layers_and_a_budget(tmp_path):
    """`slideformer train` on the GPU as a user runs it: resident layers chosen by the planner for the
    budget, which the engine then also plans micro-batches with; the checkpoint loads in transformers."""
    from transformers import AutoModelForCausalLM

    from slideformer.cli import main

    for limit in ("null", "2GiB"):  # the whole card (90% of it), and a budget that forces streaming
        out = tmp_path / limit
        assert main(["train", "max_steps=30", "device=cuda", "progress=false", f"output_dir={out}",
                     f"offload.gpu_memory_limit={limit}"]) == 0
        ck = sorted(out.glob("checkpoint-*"))[-1]
        AutoModelForCausalLM.from_pretrained(ck)


def test_non_blocking_step_returns_the_same_loss_on_cuda():
    model = build("llama")
    steps = [batch(97, seed=s) for s in range(2)]
    _, losses = cuda_engine_train(model, steps, compute_dtype=torch.float32)
    with SlideEngine(model, EngineConfig(device="cuda", compute_dtype=torch.float32)) as eng:
        got = [eng.train_step(b, blocking=False) for b in steps]
    assert all(t.is_cuda for t in got)
    assert [float(t) for t in got] == pytest.approx(losses, rel=1e-6)


@pytest.mark.parametrize("state,slow", [("fp32", False), ("8bit", False), ("8bit", True), ("fp32-staged", False),
                                        ("fp32-staged", True)])
def test_master_on_the_nvme_tier_on_cuda(tmp_path, monkeypatch, state, slow):
    """fp32: bf16 compute copy pinned in RAM, fp32 master and moments in the tier's files. 8bit: the compact
    master (the weights the window reads) and moments in the files, the weights read into two pinned buffers
    and copied on the h2d stream, each buffer reused only once its copy has finished. The same training.
    ``slow``: 8 layers, one buffer read ahead for the update (so that the window's loads read the files),
    and each copy behind a 10 ms spin on the h2d stream: the loader's reads run ahead of the copies, and a
    buffer reused early would be overwritten before its copy. fp32-staged: fp32 state with staged layers,
    whose master the window reads from the files the same way, cast on the GPU."""
    kw = dict(compute_dtype=torch.bfloat16, lr=1e-3, optimizer_state=state.split("-")[0], window_slots=2,
              **({"host_weights": "staged"} if state.endswith("staged") else {}))
    model = build("llama")
    if slow:
        from transformers import AutoModelForCausalLM, LlamaConfig

        from tiny import COMMON

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**{**COMMON, "num_hidden_layers": 8},
                                                             tie_word_embeddings=False)).float()
        kw["nvme_buffers"] = 1
        from slideformer.engine.copier import CudaCopier

        load = CudaCopier.load

        def late(self, dst, src, staged, used, **kw):
            with torch.cuda.stream(self.h2d):
                torch.cuda._sleep(20_000_000)
            return load(self, dst, src, staged, used, **kw)
        monkeypatch.setattr(CudaCopier, "load", late)
    from slideformer.engine.runtime import Runtime

    from_tier, reuses = Runtime._load_from_tier, []

    def counted(self, unit, dst, used):  # (a buffer whose last copy may still be pending: the guard's case)
        reuses.append(self._tier_copied[1 - self._tier_turn] is not None)
        return from_tier(self, unit, dst, used)
    monkeypatch.setattr(Runtime, "_load_from_tier", counted)
    batches = [batch(97, seed=s) for s in range(4)]
    ram, la = cuda_engine_train(model, batches, **kw)
    tier, lb = cuda_engine_train(model, batches, **kw, offload_dir=str(tmp_path), nvme_master=True)
    assert la == lb and all(torch.equal(ram[k], tier[k]) for k in ram)
    assert not slow or sum(reuses) >= 8, reuses


def test_sending_gradients_never_synchronizes(monkeypatch):
    """The chunk copies and their landing flags (a 0-d device tensor copied into pinned memory) must all
    be asynchronous: a hidden synchronisation there would stall the GPU-driving thread every unit."""
    from slideformer.engine import runtime as rt_mod

    send = rt_mod.Runtime.send_grads

    def strict(self, unit, slot, rows=None):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return send(self, unit, slot, rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(rt_mod.Runtime, "send_grads", strict)
    model = build("llama")
    state, _ = cuda_engine_train(model, [batch(97, seed=s) for s in range(2)], compute_dtype=torch.bfloat16,
                                 lr=1e-3, grad_chunk_elems=1000)
    assert all(torch.isfinite(v).all() for v in state.values())


@pytest.mark.parametrize("visit,kernel", [("_head", "fused"), ("_head", "torch"), ("_embed_fwd", "fused")])
def test_the_head_and_the_embedding_never_synchronize(monkeypatch, visit, kernel):
    """The head skips chunks without labels by the micro-batch's host copy of them, and the embedding's
    visit builds the attention masks without handing transformers device tensors to inspect (position ids
    of unpacked rows, an all-ones mask): a device read in either would stall the GPU-driving thread until
    all the queued work had run."""
    from slideformer.engine.engine import SlideEngine as Engine

    run = getattr(Engine, visit)

    def strict(self, st, unit, slot):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return run(self, st, unit, slot)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(Engine, visit, strict)
    model = build("llama")
    labels = batch(97, b=4, s=32)
    labels["labels"] = labels["input_ids"].clone()
    labels["labels"][:2] = -100  # whole chunks without a label
    labels["attention_mask"] = torch.ones_like(labels["input_ids"])  # no padding: dropped on the host
    state, _ = cuda_engine_train(model, [labels], compute_dtype=torch.bfloat16, lr=1e-3, loss_kernel=kernel,
                                 loss_chunk_tokens=32)
    assert all(torch.isfinite(v).all() for v in state.values())


@pytest.mark.parametrize("family", ["qwen3-tied", "llama"])
def test_resident_edges_on_cuda_match_pytorch(family):
    """Embedding and head trained on the GPU (fused AdamW on the compute stream) while layers stream."""
    model = build(family)
    batches = [batch(model.config.vocab_size, seed=s) for s in range(3)]
    fused = []
    state, losses = cuda_engine_train(model, batches, fused, compute_dtype=torch.float32, lr=1e-2, resident_edges=True,
                                      resident_layers=1, max_grad_norm=0.05)
    ref, ref_losses = reference_train(model, batches, lr=1e-2, max_grad_norm=0.05)
    noise = gpu_noise(model, batches, ref.state_dict(), fused[0], lr=1e-2, max_grad_norm=0.05)
    assert_near_reference(state, ref, losses, ref_losses, noise)


@pytest.mark.parametrize("clip", [None, 0.05])
def test_first_layer_updated_on_cuda_matches_pytorch_and_waits_for_its_copies(clip, monkeypatch):
    """The first streamed layer's update on the GPU (engine/resident.py VisitingUpdate): its state crosses on
    the copy streams, so slow copies (sleeps queued ahead of the fetch and of the copy back) must change
    nothing; and the training is plain PyTorch's within its own GPU noise."""
    from slideformer.engine.resident import VisitingUpdate

    model = build("llama")
    batches = [batch(97, seed=s) for s in range(3)]
    cfg = dict(compute_dtype=torch.float32, lr=1e-2, window_slots=2, max_grad_norm=clip, gpu_first_update=True)
    fast, losses = cuda_engine_train(model, batches, **cfg)
    ref, ref_losses = reference_train(model, batches, lr=1e-2, max_grad_norm=clip)
    assert_near_reference(fast, ref, losses, ref_losses, gpu_noise(model, batches, ref.state_dict(), lr=1e-2,
                                                                   max_grad_norm=clip))
    fetch, send_back = VisitingUpdate.fetch, VisitingUpdate.send_back

    def slow(stream, f):
        def run(self, *args):
            with torch.cuda.stream(getattr(self.copier, stream)):
                torch.cuda._sleep(5_000_000)
            return f(self, *args)
        return run

    monkeypatch.setattr(VisitingUpdate, "fetch", slow("h2d", fetch))
    monkeypatch.setattr(VisitingUpdate, "send_back", slow("d2h", send_back))
    slowed, _ = cuda_engine_train(model, batches, **cfg)
    assert all(torch.equal(fast[k], slowed[k]) for k in fast)


def test_first_layer_state_held_on_cuda_is_back_before_the_host_store_is_read(tmp_path, monkeypatch):
    """Its state stays on the GPU from the update into the next forward: a step that updates the layer on
    the CPU, an evaluation and a checkpoint between steps must each read the host store after the state is
    back, however late the copy back runs (a sleep queued ahead of it)."""
    from slideformer.engine.resident import VisitingUpdate

    model = build("llama")
    steps = [batch(97, seed=s) for s in range(4)]
    cfg = engine_config(device="cuda", compute_dtype=torch.float32, lr=1e-2, window_slots=2, gpu_first_update=True)

    def run(checkpoint=None):
        with SlideEngine(model, cfg) as e:
            losses, mid = [], None
            for i, (b, visits) in enumerate(zip(steps, (1, 0, 1, 1))):
                e._visits_now = bool(visits)  # (what _place sets from the step's plan)
                losses.append(e.train_step(b))
                if i == 2:
                    losses.append(e.evaluate(steps[0]).loss)
                    if checkpoint is not None:
                        e.save_checkpoint(checkpoint)
                    else:
                        mid = {k: v.clone() for k, v in e.state_dict().items()}
            assert e.runtime.visiting.updates == 3
            return {k: v.clone() for k, v in e.state_dict().items()}, losses, mid

    state, losses, mid = run()
    send_back = VisitingUpdate.send_back

    def late(self, *args):
        with torch.cuda.stream(self.copier.d2h):
            torch.cuda._sleep(50_000_000)
        return send_back(self, *args)

    monkeypatch.setattr(VisitingUpdate, "send_back", late)
    slow, slow_losses, _ = run(tmp_path / "ck")
    assert slow_losses == losses
    assert all(torch.equal(state[k], slow[k]) for k in state)
    monkeypatch.undo()
    with SlideEngine(model, cfg) as e:
        e.load_checkpoint(tmp_path / "ck")
        saved = e.state_dict()
        assert all(torch.equal(mid[k], saved[k]) for k in mid)


@pytest.mark.parametrize("state", ["fp32", "compact"])
def test_resume_on_cuda_with_resident_units(tmp_path, state):
    """Resident units' state lives on the GPU only: a checkpoint copies it out, a fresh engine copies it
    back in (ResidentState.copy_out/copy_in on the compute stream), and training continues as if uninterrupted."""
    from test_state import run

    model = build("qwen3-tied")
    cfg = dict(device="cuda", compute_dtype=torch.bfloat16, resident_layers=1, resident_edges=True,
               optimizer_state=state, max_grad_norm=0.05)
    straight = run(model, 6, **cfg)
    run(model, 3, save=tmp_path / "ck", save_at=3, **cfg)
    resumed = run(model, 6, start=3, resume=tmp_path / "ck", **cfg)
    for k in straight:  # (not bit-identical on a GPU: atomic sums; a lost moment or master is far off this)
        assert float((straight[k] - resumed[k]).norm() / straight[k].norm()) < 1e-4, k
    with SlideEngine(model, engine_config(**{**cfg, "lr": 1e-2})) as eng:
        rep = eng.memory_report()
        streamed = sum(u.numel for u in eng.adapter.units if u.index not in eng.resident)  # (padded sizes)
        assert eng.resident and rep["host_master"] == 4 * streamed  # (compact: bf16 hi + lo)


@pytest.mark.parametrize("fused", ["none", "liger"])
def test_saved_layers_on_cuda_train_like_the_recompute(fused, monkeypatch):
    """Kept products on the GPU train bit for bit as the recompute (the same kernels on the same inputs);
    with Liger, whose RoPE rotates Llama's q and k in their projections' memory, the first step multiplies
    those again and later ones keep copies (model/recompute.py)."""
    ref, ref_losses, got, losses, fewer = _with_and_without(monkeypatch, fused, {}, saved_layers=3)
    assert losses == ref_losses
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    # 3 steps x 3 layers x 2 micro-batches x 6 products not recomputed; with Liger the first step's q and k are
    assert fewer == 108 - (12 if fused == "liger" else 0)


def _with_and_without(monkeypatch, fused: str, placed: dict, **extra):
    """Llama's training on CUDA in fp32, 3 steps of 2 micro-batches, placed as ``placed`` and with ``extra``
    too: the state and losses of each, and how many fewer linear products the second ran."""
    if fused == "liger":
        pytest.importorskip("liger_kernel")
    model = build("llama")
    steps = [[batch(97, seed=s), batch(97, seed=10 + s)] for s in range(3)]
    products = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: products.append(1) or real_linear(*a))
    ref, ref_losses = cuda_engine_train(model, steps, compute_dtype=torch.float32, fused_ops=fused, **placed)
    ref_products, products[:] = len(products), []
    got, losses = cuda_engine_train(model, steps, compute_dtype=torch.float32, fused_ops=fused, **placed, **extra)
    return ref, ref_losses, got, losses, ref_products - len(products)


_ON_SECOND_GPU = """
import sys
import torch
sys.path[:0] = {paths!r}
from tiny import batch, build, engine_config
from slideformer import SlideEngine

torch.cuda.set_device(1)  # (as train/loop.py does with torchrun's LOCAL_RANK)
cfg = engine_config(device="cuda", offload_dir={tier!r}, nvme_fraction=1.0, window_slots=2)
with SlideEngine(build("llama"), cfg) as eng:
    for s in range(2):
        eng.train_step(batch(97, seed=s))
print("context on GPU 0:", torch._C._cuda_hasPrimaryContext(0), "on GPU 1:", torch._C._cuda_hasPrimaryContext(1))
"""


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_an_engine_on_the_second_gpu_opens_no_context_on_the_first(tmp_path):
    """A data-parallel rank on GPU 1: its loader, optimizer and disk threads run on its device (a new thread
    starts on GPU 0, and a stream's context manager or an event wait there would open a context on GPU 0:
    about 0.5 GiB that rank 0's plan does not count). A fresh process, so nothing else has touched GPU 0."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    code = _ON_SECOND_GPU.format(paths=[tests, os.path.join(os.path.dirname(tests), "src")], tier=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "context on GPU 0: False on GPU 1: True" in out.stdout, out.stdout


@pytest.mark.parametrize("placement,state", [
    (dict(window_slots=2, prefetch_depth=1), "fp32"),  # slots take other layers' weights within a step
    (dict(resident_layers=1, window_slots=2, prefetch_depth=1), "compact"),  # a resident layer's Triton update
])
def test_fp8_on_cuda_trains_near_bf16_and_casts_each_visits_weights(placement, state, monkeypatch):
    """On Hopper: the layers' linears in FP8 (the Triton casts, ``_scaled_mm``) train within 1% of bf16's
    losses, never equal to them; the casts a visit keeps are the weights' of that visit, bit for bit as
    casting afresh at every use (broadcasts and Triton updates move no version counter)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 rows with a scale each need compute capability 9.0")
    from slideformer.model import fp8 as fp8_mod

    model = build("llama")
    # (32 tokens: the weight gradient in FP8 too; 24: in bf16)
    batches = [[batch(97, s=16, seed=s), batch(97, seed=10 + s)] for s in range(3)]
    kw = dict(compute_dtype=torch.bfloat16, lr=1e-2, optimizer_state=state, **placement)
    _, bf16 = cuda_engine_train(model, batches, **kw)
    kept, fp8 = cuda_engine_train(model, batches, fp8=True, **kw)
    assert fp8 != bf16 and max(abs(a - b) / b for a, b in zip(fp8, bf16)) < 0.01
    monkeypatch.setattr(fp8_mod.Fp8Weights, "get", lambda self, w, columns=False:
                        fp8_mod.cast_rows(w.detach().t() if columns else w.detach()))
    fresh, fresh_losses = cuda_engine_train(model, batches, fp8=True, **kw)
    assert fresh_losses == fp8 and all(torch.equal(kept[k], fresh[k]) for k in fresh)


@pytest.mark.parametrize("family,state,clip", [("llama", "fp32", None), ("llama", "compact", None),
                                               ("llama", "compact", 0.05), ("qwen3-tied", "fp32", None),
                                               ("qwen3-tied", "compact", None)])
def test_embedding_update_by_rows_on_cuda_is_the_whole_update(family, state, clip, monkeypatch):
    """engine/embedding.py on the GPU: the untouched rows updated while the step's forward streams (tied:
    from the head's gradient, sent at the head, while backward runs), the packed gradient of the touched
    ones sent in chunks; the same bits as the whole embedding's update. (With clipping the global norm sums
    the packed gradient's squares, not the whole one's zeros too: in another order on the GPU, so there the
    same to rounding of the coefficient, which bf16 weights can round a bit apart: within a small multiple of
    the whole update's own noise, its micro-batches rotated.)"""
    import slideformer.engine.engine as engine_module

    model = build(family)
    g = torch.Generator().manual_seed(2)
    steps = [[{"input_ids": ids, "labels": ids.clone()}
              for ids in (torch.randint(8 * s, 8 * s + 12, (1, 12), generator=g) for _ in range(3))] for s in range(4)]
    dtype = torch.float32 if state == "fp32" else torch.bfloat16
    kw = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=clip, optimizer_state=state, compute_dtype=dtype,
              grad_chunk_elems=256)
    with SlideEngine(model, engine_config(device="cuda", **kw)) as eng:
        assert eng._by_rows
    by_rows, losses = cuda_engine_train(model, steps, **kw)
    monkeypatch.setattr(engine_module, "embedding_by_rows", lambda *a, **k: False)
    whole, whole_losses = cuda_engine_train(model, steps, **kw)
    if clip is None:
        assert losses == whole_losses
        for k in whole:
            assert torch.equal(by_rows[k], whole[k]), k
    else:
        rotated, rotated_losses = cuda_engine_train(model, [b[1:] + b[:1] for b in steps], **kw)

        def loss_gap(got):
            return max(abs(a - b) / abs(b) for a, b in zip(got, whole_losses))

        def state_gap(got):
            return math.sqrt(sum(float((got[k] - whole[k]).norm()) ** 2 for k in whole)
                             / sum(float(whole[k].norm()) ** 2 for k in whole))

        assert loss_gap(rotated_losses) > 0 and state_gap(rotated) > 0  # (the noise is there to measure)
        assert loss_gap(losses) <= 4 * loss_gap(rotated_losses)
        assert state_gap(by_rows) <= 4 * state_gap(rotated)


@pytest.mark.parametrize("fused", ["none", "liger"])
def test_mid_layers_on_cuda_train_like_the_recompute(fused, monkeypatch):
    """Layers that offload their residual sum after attention (``mid_layers``) train as the recompute on
    CUDA: with the fused ops the sum's gradient is added in the post-attention norm's pass
    (kernels/rms_norm.py rms_norm_pass) where the recompute's add_rms_norm adds it, within fp32's rounding
    of that sum; one output projection fewer a mid layer and micro-batch."""
    ref, ref_losses, got, losses, fewer = _with_and_without(
        monkeypatch, fused, dict(offload_activations=True, gpu_activation_layers=0), mid_layers=3)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-7)
    assert fewer == 3 * 3 * 2  # 3 steps x 3 layers x 2 micro-batches
