"""The optimizer state formats (fp32, compact, 8-bit) and FP8 matmuls against fp32 state in bf16 on a
fine-tuning run, on the CPU or the GPU.

From the same weights, with each format, the same batches, at a fine-tuning learning rate, fine-tuned on
CPython's English documentation topics (pydoc_data, shipped with every Python; ``--corpus code``: its
standard library's source, for runs longer than the 0.47 MB of documentation allow). The weights: a real
pretrained model (``--pretrained DIR``, e.g. SmolLM2-135M from bench/pretrained.py), or else the bundled
tiny Llama (0.8M parameters) pretrained here on CPython's standard-library source. bf16 compute. Reported:
the held-out loss on the last windows of that text, in fp32, through transformers' own model; the fp32 arms' spread
over data orders (seeds) is the noise the other formats' differences are read against.

    python -m slideformer.bench.convergence            # one JSON line per arm and evaluation, then a summary
    python -m slideformer.bench.convergence --pretrained /tmp/smollm2 --steps 60 --lr 2e-5
    python -m slideformer.bench.convergence --pretrained DIR --steps 200 --states fp32,fp8 --seeds 0,1,2 \
        --corpus code --device cuda

The ``fp8`` arm is fp32 state with the layers' linears in FP8 (``EngineConfig.fp8``).
"""
from __future__ import annotations

import argparse
import json
import random
import sysconfig
import tempfile
from pathlib import Path

import torch

from .. import EngineConfig, SlideEngine
from ..presets import preset_config

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "tiny"


def corpora(limit_chars: int | None = None) -> tuple[str, str]:
    """(standard-library source, documentation topics) of the running Python."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    code = "\n".join(p.read_text(errors="replace") for p in sorted(lib.glob("*.py")))
    from pydoc_data.topics import topics

    docs = "\n\n".join(topics[k] for k in sorted(topics))
    return (code[:limit_chars], docs[:limit_chars]) if limit_chars else (code, docs)


def windows(text: str, seq: int, tokenizer: Path = ASSETS / "tokenizer.json") -> torch.Tensor:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tokenizer)).encode(text).ids
    n = len(ids) // seq
    return torch.tensor(ids[: n * seq]).view(n, seq)


def batches(data: torch.Tensor, batch: int, steps: int, seed: int):
    order, rng = [], random.Random(seed)
    while len(order) < steps * batch:
        perm = list(range(len(data)))
        rng.shuffle(perm)
        order += perm
    for s in range(steps):
        ids = data[order[s * batch: (s + 1) * batch]]
        yield {"input_ids": ids, "labels": ids}


def eval_loss(engine: SlideEngine, data: torch.Tensor, device: str = "cpu", batch: int = 8) -> float:
    """Mean next-token loss on ``data`` (windows of one length) in fp32, by transformers' model with the
    engine's master weights, on ``device``, ``batch`` windows at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(engine.adapter.config).float().eval()
    model.load_state_dict(engine.state_dict(), strict=False)
    model.tie_weights()
    model.to(device)
    with torch.no_grad():  # (every window has as many targets: the mean of the batches' means is the mean)
        total = sum(float(model(input_ids=x.to(device), labels=x.to(device)).loss) * len(x)
                    for x in data.split(batch))
    return total / len(data)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--pretrain-steps", type=int, default=1500)
    ap.add_argument("--pretrain-lr", type=float, default=3e-3)
    ap.add_argument("--steps", type=int, default=400, help="fine-tuning steps per arm")
    ap.add_argument("--lr", type=float, default=2e-4, help="fine-tuning learning rate")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seeds", default="0,1", help="data orders of the fine-tuning arms")
    ap.add_argument("--limit-chars", type=int, default=None, help="truncate both corpora (tests)")
    ap.add_argument("--pretrained", default=None, help="a Hugging Face folder to fine-tune (else the tiny model, "
                                                        "pretrained here)")
    ap.add_argument("--eval-windows", type=int, default=None, help="held-out windows (default: a tenth)")
    ap.add_argument("--states", default="fp32,compact,8bit", help="arms: optimizer state formats, and fp8")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--corpus", default="docs", choices=("docs", "code"),
                    help="fine-tune on the documentation topics (0.47 MB), or the standard library's source "
                         "(enough text for long runs on a real model without repeating it)")
    args = ap.parse_args(argv)
    states = args.states.split(",")
    code, docs = corpora(args.limit_chars)
    tokenizer = Path(args.pretrained) / "tokenizer.json" if args.pretrained else ASSETS / "tokenizer.json"
    ft = windows(docs if args.corpus == "docs" else code, args.seq, tokenizer)
    held = args.eval_windows or max(1, len(ft) // 10)
    ft_train, ft_eval = ft[:-held], ft[-held:]
    common = dict(device=args.device, compute_dtype=torch.bfloat16, max_grad_norm=1.0, weight_decay=0.01)
    with tempfile.TemporaryDirectory() as tmp:
        if args.pretrained:
            tmp = args.pretrained
            with SlideEngine.from_pretrained(tmp, EngineConfig(**common)) as eng:
                base = eval_loss(eng, ft_eval, args.device)
        else:
            with SlideEngine.from_config(preset_config("tiny"), EngineConfig(lr=args.pretrain_lr, **common)) as eng:
                for b in batches(windows(code, args.seq), args.batch, args.pretrain_steps, seed=1234):
                    eng.train_step(b)
                base = eval_loss(eng, ft_eval, args.device)
                eng.save_pretrained(tmp, dtype=torch.float32)
        print(json.dumps({"phase": "pretrained", "model": args.pretrained or "tiny",
                          "steps": 0 if args.pretrained else args.pretrain_steps, "docs_eval_loss": base}), flush=True)
        curves = {}
        for seed in (int(s) for s in args.seeds.split(",")):
            for state in states:
                arm = dict(fp8=True) if state == "fp8" else dict(optimizer_state=state)
                with SlideEngine.from_pretrained(tmp, EngineConfig(lr=args.lr, **arm, **common)) as e:
                    train = []
                    for k, b in enumerate(batches(ft_train, args.batch, args.steps, seed), start=1):
                        train.append(e.train_step(b))
                        if k % args.eval_every == 0 or k == args.steps:
                            rec = {"state": state, "seed": seed, "step": k,
                                   "eval_loss": eval_loss(e, ft_eval, args.device),
                                   "train_loss": sum(train[-args.eval_every:]) / len(train[-args.eval_every:])}
                            curves.setdefault((state, seed), []).append(rec["eval_loss"])
                            print(json.dumps(rec), flush=True)
    final = {k: v[-1] for k, v in curves.items()}
    seeds = sorted({s for _, s in final})
    summary = {"phase": "summary", "model": args.pretrained or "tiny", "pretrained_eval_loss": base,
               **{f"final_eval_{st}": [final[(st, s)] for s in seeds] for st in states},
               **{f"max_abs_diff_{st}": max(abs(final[("fp32", s)] - final[(st, s)]) for s in seeds)
                  for st in states if st != "fp32" and "fp32" in states},
               "seed_spread_fp32": max(final[("fp32", s)] for s in seeds) - min(final[("fp32", s)] for s in seeds)
               if "fp32" in states else None}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
