"""One decoder layer's GPU work, as the engine runs it (a no-grad forward, then the recompute and backward),
under each way of running it: what a GPU-work lever (attention backend, regional compilation, Liger's
fused ops) could gain before it is built into the engine. Prints one JSON line per variant.

    python bench/layer_speed.py --model qwen3-4b --tokens 8192       # on the GPU machine
    python bench/layer_speed.py --model olmoe-1b-7b --experts          # a MoE layer's experts implementations
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--experts", action="store_true", help="a MoE model: its experts run by transformers' loop "
                    "(eager), batched_mm and grouped_mm")
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    variants = [("eager", False, False, None), ("liger", True, False, None),
                ("liger+cudnn_attention", True, False, SDPBackend.CUDNN_ATTENTION),
                ("liger+flash_attention", True, False, SDPBackend.FLASH_ATTENTION),
                ("compiled", False, True, None), ("liger+compiled", True, True, None)]
    if args.experts:
        variants = [(f"experts={impl}", False, False, None) for impl in ("eager", "batched_mm", "grouped_mm")]
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
