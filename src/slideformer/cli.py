"""slideformer: fine-tune language models larger than GPU memory on one GPU.

``slideformer train`` with no arguments fine-tunes the bundled tiny model on the bundled sample data:
that is what ``make demo`` runs. ``slideformer bench`` measures a training step (see bench/).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from importlib import resources
from pathlib import Path

import torch


def _assets() -> Path:
    return Path(str(resources.files("slideformer") / "assets"))


def cmd_train(args) -> int:
    from tokenizers import Tokenizer
    from transformers import AutoConfig, PreTrainedTokenizerFast

    from . import EngineConfig, SlideEngine, lr_at
    from .data import pad_batch, read_jsonl, render_alpaca

    assets = _assets()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tok = Tokenizer.from_file(str(assets / "tiny" / "tokenizer.json"))
    config = AutoConfig.from_pretrained(assets / "tiny")
    records = read_jsonl(args.data or assets / "sample" / "alpaca.jsonl")
    examples = [render_alpaca(r, tok, config.eos_token_id) for r in records]
    rng = random.Random(args.seed)
    cfg = EngineConfig(lr=args.lr, weight_decay=0.01, max_grad_norm=1.0, device=device, compute_dtype=dtype, seed=args.seed)
    print(f"slideformer: tiny Llama ({config.num_hidden_layers} layers) on {len(examples)} samples, "
          f"device={device}, {args.steps} steps of {args.batch_size}")
    engine = SlideEngine.from_config(config, cfg)
    t0, first = time.perf_counter(), None
    with engine:
        for step in range(args.steps):
            batch = pad_batch(rng.sample(examples, args.batch_size), pad_id=config.pad_token_id)
            engine.set_lr(lr_at(step, args.lr, "cosine", warmup_steps=args.steps // 10, total_steps=args.steps))
            loss = engine.train_step(batch)
            first = loss if first is None else first
            if step % 10 == 0 or step == args.steps - 1:
                print(f"step {step + 1:4d}/{args.steps}  loss {loss:.4f}  grad-norm {engine.last_grad_norm:.3f}  "
                      f"{time.perf_counter() - t0:.1f}s", flush=True)
        out = Path(args.output_dir)
        engine.save_pretrained(out)
        PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>",
                                eos_token="<|eos|>").save_pretrained(out)
    print(f"loss {first:.3f} -> {loss:.3f}; saved a transformers checkpoint to {out}/")
    return 0 if loss < first else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own parser: one case, or `bench report FILE...`
        if argv[1:2] == ["report"]:
            from .bench.report import main as report
            return report(argv[2:])
        from .bench.harness import main as bench
        bench(argv[1:])
        return 0
    p = argparse.ArgumentParser(prog="slideformer", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="fine-tune (no arguments: the bundled tiny model on the sample data)")
    t.add_argument("--data", help="alpaca-format JSONL (default: the bundled sample)")
    t.add_argument("--steps", type=int, default=150)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--device", choices=["cpu", "cuda"])
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--output-dir", default="out/demo")
    t.set_defaults(func=cmd_train)
    sub.add_parser("bench", help="benchmark one case (see `slideformer bench --help`), or `bench report FILE...`",
                   add_help=False)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
