"""The fp32 GPU parity cases of tests/test_gpu.py, measured apart (on the GPU machine, from the repo root): every
tensor's relative distance from the CPU reference for the engine, and for plain PyTorch trained on the GPU in
the same order, rows apart (``reference_noise``), with the engine's fused kernels, and on the CPU rows apart.
One JSON line a tensor, to $OUT/noise.jsonl: what the parity tests' bound (three times the largest of the GPU
runs) is made of."""
import copy
import json
import os
import sys

import torch

sys.path.insert(0, "tests")
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
from test_engine_parity import reference_noise, reference_train  # noqa: E402
from test_gpu import cuda_engine_train  # noqa: E402
from tiny import batch, build  # noqa: E402

from slideformer.model.fused_ops import apply_liger  # noqa: E402

CASES = [(f, dict(window_slots=s, prefetch_depth=d, max_grad_norm=c, fused_ops=fu)) for f, s, d, c, fu in
         [("llama", 2, 1, None, "none"), ("qwen3-tied", 3, 2, 0.05, "none"), ("qwen2", 4, 1, None, "none"),
          ("llama", 2, 1, None, "liger"), ("qwen3-tied", 3, 2, 0.05, "liger"), ("qwen3-moe", 2, 1, 0.05, "none"),
          ("mixtral", 3, 2, None, "none")]]
CASES += [(f, dict(resident_edges=True, resident_layers=1, max_grad_norm=0.05)) for f in ("llama", "qwen3-tied")]


def main():
    out = open(os.path.join(os.environ.get("OUT", "."), "noise.jsonl"), "w")
    for fam, kw in CASES:
        model = build(fam)
        bs = [batch(model.config.vocab_size, seed=s) for s in range(3)]
        fused = []
        state, _ = cuda_engine_train(model, bs, fused, compute_dtype=torch.float32, lr=1e-2, **kw)
        train = dict(lr=1e-2, max_grad_norm=kw["max_grad_norm"])
        ref = reference_train(model, bs, **train)[0].state_dict()
        on_gpu = [{k: v.cuda() for k, v in b.items()} for b in bs]
        runs = {"plain_gpu": reference_train(copy.deepcopy(model).cuda(), on_gpu, **train)[0],
                "rows_gpu": reference_noise(copy.deepcopy(model).cuda(), on_gpu, **train),
                "rows_cpu": reference_noise(model, bs, **train)}
        if fused[0] == "liger":
            m = copy.deepcopy(model).cuda()
            apply_liger([m.model], model.config.hidden_act)
            runs["fused_gpu"] = reference_train(m, on_gpu, **train)[0]
        states = {name: {k: v.cpu() for k, v in run.state_dict().items()} for name, run in runs.items()}
        rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
        for k, r in ref.items():
            out.write(json.dumps({"case": f"{fam} {kw}", "fused": fused[0], "key": k, "engine": rel(state[k], r),
                                  **{name: rel(st[k], r) for name, st in states.items()}}) + "\n")
        out.flush()
        print(fam, kw, "done", flush=True)


if __name__ == "__main__":
    main()
