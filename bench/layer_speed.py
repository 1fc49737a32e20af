"""One decoder layer's GPU work, as the engine runs it (a no-grad forward, then the recompute and backward),
under each way of running it: what a GPU-work lever (attention backend, regional compilation, Liger's
fused ops) could gain before it is built into the engine. Prints one JSON line per variant.

    python bench/layer_speed.py --model qwen3-4b --tokens 8192       # on the GPU machine
    python bench/layer_speed.py --model olmoe-1b-7b --experts          # a MoE layer's experts implementations
    python bench/layer_speed.py --model qwen3-4b --tokens 16384 --projections --variants none   # q/k/v, gate/up fused
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def build(model: str, liger: bool, experts: str | None = None):
    from transformers import AutoModelForCausalLM

    from slideformer.model.fused_ops import apply_liger
    from slideformer.presets import preset_config

    cfg = preset_config(model)
    cfg.num_hidden_layers = 1
    cfg._attn_implementation = "sdpa"
    if experts:
        cfg._experts_implementation = experts
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    layer = m.model.layers[0]
    if liger:
        apply_liger([layer], getattr(cfg, "hidden_act", ""))
    return cfg, layer, m.model.rotary_emb


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def floor(args) -> None:
    """The layer's GEMMs at its shapes (forward once, recompute without the down projection, backward's
    two products each) and its attention (SDPA forward twice, backward once), each timed alone."""
    import torch.nn.functional as F

    cfg, layer, _ = build(args.model, False)
    T = args.tokens
    gemms = []  # (name, rows, inner, cols) of each product a step runs
    for name, mod in layer.named_modules():
        if isinstance(mod, torch.nn.Linear):
            n, k = mod.out_features, mod.in_features
            passes = 1 if name.endswith("down_proj") else 2  # forward (and recompute)
            gemms += [(name, T, k, n)] * passes + [(name + ".dx", T, n, k), (name + ".dw", n, T, k)]
    bufs = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(k, n, device="cuda", dtype=torch.bfloat16))
            for _, m, k, n in gemms]
    mm = timed(lambda: [a @ b for a, b in bufs], args.reps)
    flops = sum(2 * m * k * n for _, m, k, n in gemms)
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    B, S = T // args.seq, args.seq
    q = torch.randn(B, heads, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k_ = torch.randn(B, kv, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k_, requires_grad=True)
    go = torch.randn(B, heads, S, d, device="cuda", dtype=torch.bfloat16)

    def attention():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k_, v, is_causal=True, enable_gqa=True)
        o = F.scaled_dot_product_attention(q, k_, v, is_causal=True, enable_gqa=True)
        torch.autograd.backward(o, go)

    att = timed(attention, args.reps)
    print(json.dumps({"variant": "floor", "model": args.model, "tokens": T, "matmuls_ms": mm * 1e3,
                      "matmul_tflops": flops / mm / 1e12, "attention_ms": att * 1e3,
                      "floor_ms": (mm + att) * 1e3, "torch": torch.__version__}))


def kernel_us(fn, calls: int) -> float:
    """GPU kernel time of one call of ``fn``, microseconds, summed from the profiler's kernel records: wall
    time would count the launches, which on a slow host take longer than these small kernels."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls


def norms(args) -> None:
    """Each of the layer's RMSNorm shapes (the hidden norms, Qwen3's per-head q and k norms), forward then
    backward, under Liger's kernels and ours: kernel time, and the rate backward moves its bytes at."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    from slideformer.kernels.rms_norm import RMSNormFunction

    cfg = __import__("slideformer.presets", fromlist=["preset_config"]).preset_config(args.model)
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    T = args.tokens
    for name, shape in (("hidden", (T, cfg.hidden_size)), ("q_norm", (T, heads, d)), ("k_norm", (T, kv, d))):
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.ones(shape[-1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        for impl, fn in (("liger", lambda: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False)),
                         ("slideformer", lambda: RMSNormFunction.apply(x, w, 1e-6))):
            with torch.no_grad():
                f = kernel_us(fn, args.reps * 5)
            y = fn()
            b = kernel_us(lambda: torch.autograd.grad(y, [x, w], dy, retain_graph=True), args.reps * 5)
            print(json.dumps({"variant": f"norm {name} {impl}", "model": args.model, "shape": list(shape),
                              "forward_kernel_us": f, "backward_kernel_us": b,
                              "backward_gbps": 3 * x.numel() * 2 / b / 1e3, "torch": torch.__version__}))


def fp8(args) -> None:
    """The layer's GEMMs (as ``floor`` counts them) in FP8 through torch._scaled_mm with one dynamic scale a
    tensor (torchao's float8 training recipe: e4m3 inputs and weights, e5m2 gradients): the products alone,
    then with the eager work around each (amax, scale, cast, and the transposed copies backward's layouts
    need), against bf16. What the FP8 stretch could gain before it is built."""
    cfg, layer, _ = build(args.model, False)
    T, e4, e5 = args.tokens, torch.float8_e4m3fn, torch.float8_e5m2
    linears = [(n, m.in_features, m.out_features) for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
    bufs = [(name, torch.randn(T, i, device="cuda", dtype=torch.bfloat16),
             torch.randn(o, i, device="cuda", dtype=torch.bfloat16) / i ** 0.5,
             torch.randn(T, o, device="cuda", dtype=torch.bfloat16)) for name, i, o in linears]

    def cast(t, dtype):
        scale = torch.finfo(dtype).max / t.abs().amax().float().clamp(min=1e-12)
        return (t.float() * scale).to(dtype), scale.reciprocal()

    def bf16_step():
        for name, x, w, dy in bufs:
            for _ in range(1 if name.endswith("down_proj") else 2):
                x @ w.t()
            dy @ w
            dy.t() @ x

    pre = [(name, cast(x, e4), cast(w, e4), cast(dy, e5)) for name, x, w, dy in bufs]
    pre = [(name, x8, w8, dy8, (w8[0].t().contiguous(), w8[1]), (dy8[0].t().contiguous(), dy8[1]),
            (x8[0].t().contiguous(), x8[1])) for name, x8, w8, dy8 in pre]

    def mm(a, b):
        return torch._scaled_mm(a[0], b[0], a[1], b[1], out_dtype=torch.bfloat16)

    def fp8_gemms():
        for name, x8, w8, dy8, wt8, dyt8, xt8 in pre:
            for _ in range(1 if name.endswith("down_proj") else 2):
                mm(x8, (w8[0].t(), w8[1]))
            mm(dy8, (wt8[0].t(), wt8[1]))
            mm(dyt8, (xt8[0].t(), xt8[1]))

    def fp8_eager():
        for name, x, w, dy in bufs:
            x8, w8 = cast(x, e4), cast(w, e4)
            for _ in range(1 if name.endswith("down_proj") else 2):
                mm(x8, (w8[0].t(), w8[1]))
            dy8 = cast(dy, e5)
            mm(dy8, (w8[0].t().contiguous().t(), w8[1]))
            mm((dy8[0].t().contiguous(), dy8[1]), (x8[0].t().contiguous().t(), x8[1]))

    out = {"variant": "fp8", "model": args.model, "tokens": T, "torch": torch.__version__}
    for key, fn in (("bf16_ms", bf16_step), ("fp8_gemms_ms", fp8_gemms), ("fp8_eager_ms", fp8_eager)):
        out[key] = timed(fn, args.reps) * 1e3
    print(json.dumps(out))


def projections(args) -> None:
    """The linears that read one input (q, k and v; gate and up) as the engine runs them, one GEMM each, against
    one GEMM over their weights side by side (as a slot holds them): forward, the input gradient (the engine's
    beta-1 sum against one product over the gradients side by side) and the weight gradients; and what making
    one column view contiguous costs (a consumer that copies it). Seconds a call, for --tokens tokens."""
    from slideformer.presets import preset_config

    cfg = preset_config(args.model)
    h, d = cfg.hidden_size, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    groups = {"qkv": [cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.num_key_value_heads * d],
              "gate_up": [cfg.intermediate_size, cfg.intermediate_size]}
    t, bf = args.tokens, torch.bfloat16
    x = torch.randn(t, h, device="cuda", dtype=bf)
    for name, outs in groups.items():
        w = torch.randn(sum(outs), h, device="cuda", dtype=bf) / h ** 0.5
        ws = list(w.split(outs))
        g = torch.randn(t, sum(outs), device="cuda", dtype=bf)
        gs = [gi.contiguous() for gi in g.split(outs, dim=1)]
        dw = torch.empty_like(w)
        dws = list(dw.split(outs))
        flops = 2 * t * h * sum(outs)

        def input_grad_apart():
            gx = gs[-1].mm(ws[-1])
            for gi, wi in zip(gs[-2::-1], ws[-2::-1]):
                gx.addmm_(gi, wi)

        def weight_grad_apart():
            for gi, dwi in zip(gs, dws):
                dwi.addmm_(gi.t(), x)
        rows = {"forward_apart": lambda: [x.mm(wi.t()) for wi in ws], "forward_one": lambda: x.mm(w.t()),
                "input_grad_apart": input_grad_apart, "input_grad_one": lambda: g.mm(w),
                "weight_grad_apart": weight_grad_apart, "weight_grad_one": lambda: dw.addmm_(g.t(), x),
                "first_view_contiguous": lambda: g[:, : outs[0]].contiguous()}
        for what, fn in rows.items():
            s = timed(fn, args.reps)
            print(json.dumps({"model": args.model, "tokens": t, "group": name, "outs": outs, "what": what,
                              "s": s, "tflops": None if what.endswith("contiguous") else flops / s / 1e12}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--floor", action="store_true", help="also time the layer's matrix products alone and its "
                    "attention alone (SDPA), forward + recompute + backward: what no fusion can take off")
    ap.add_argument("--norms", action="store_true", help="also time the layer's RMSNorms alone (forward and "
                    "backward), Liger's kernels against slideformer's (kernels/rms_norm.py)")
    ap.add_argument("--fp8", action="store_true", help="also time the layer's GEMMs in FP8 (torch._scaled_mm, "
                    "a dynamic scale a tensor), alone and with their casts, against bf16")
    ap.add_argument("--experts", action="store_true", help="a MoE model: its experts run by transformers' loop "
                    "(eager), batched_mm and grouped_mm")
    ap.add_argument("--projections", action="store_true", help="also time the linears that read one input (q, k "
                    "and v; gate and up) one GEMM each against one GEMM over their weights side by side")
    ap.add_argument("--variants", default="all", help="the layer's ways to time, comma-separated, or none")
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # ("liger": the engine's fused ops, Liger's SwiGLU and RoPE with our RMSNorm; --norms times the norms apart)
    variants = [("eager", False, False, None), ("liger", True, False, None),
                ("liger+cudnn_attention", True, False, SDPBackend.CUDNN_ATTENTION),
                ("liger+flash_attention", True, False, SDPBackend.FLASH_ATTENTION),
                ("compiled", False, True, None), ("liger+compiled", True, True, None)]
    if args.experts:
        variants = [(f"experts={impl}", False, False, None) for impl in ("eager", "batched_mm", "grouped_mm")]
    if args.variants != "all":
        variants = [v for v in variants if v[0] in args.variants.split(",")]
    if args.floor:
        floor(args)
    if args.norms:
        norms(args)
    if args.fp8:
        fp8(args)
    if args.projections:
        projections(args)
    for name, liger, compiled, backend in variants:
        cfg, layer, rotary = build(args.model, liger, name.split("=")[1] if args.experts else None)
        B, S = args.tokens // args.seq, args.seq
        x = torch.randn(B, S, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        pos = torch.arange(S, device="cuda")[None]
        rope = rotary(x, pos)
        run = torch.compile(layer) if compiled else layer
        params = list(layer.parameters())
        gy = torch.randn_like(x)

        def call(h):
            out = run(h, attention_mask=None, position_ids=pos, position_embeddings=rope)
            return out[0] if isinstance(out, tuple) else out

        def forward():
            with torch.no_grad():
                call(x)

        def backward():
            h = x.detach().requires_grad_(True)
            torch.autograd.backward(call(h), gy, inputs=[h] + params)

        ctx = sdpa_kernel(backend) if backend is not None else torch.enable_grad()
        try:
            with ctx:
                f, b = timed(forward, args.reps), timed(backward, args.reps)
        except Exception as e:  # a backend this shape or build lacks is a result too
            print(json.dumps({"variant": name, "error": str(e)[:200]}))
            continue
        from slideformer.model.moe import expert_params, experts_of

        experts, top_k = experts_of(cfg)  # (a MoE layer: the parameters a token passes through)
        n = sum(p.numel() for p in params) - (experts - top_k) * (expert_params(layer, experts) // max(experts, 1))
        flops = 8 * n * args.tokens  # forward, recompute, backward: 2 + 2 + 4 a parameter and token
        print(json.dumps({"variant": name, "model": args.model, "tokens": args.tokens, "forward_ms": f * 1e3,
                          "recompute_backward_ms": b * 1e3, "layer_ms": (f + b) * 1e3,
                          "tflops": flops / (f + b) / 1e12, "torch": torch.__version__}))
        layer = run = None  # (freed before the next variant)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
