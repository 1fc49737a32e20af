#!/usr/bin/env bash
# Everything measured on the GPU machine, in one call: the GPU tests, then the benchmark cases.
#   run from the repo root on the device machine; results go to $OUT (or ./bench/out).
# Usage: bench/run_device.sh [tests|optim|optim4b|loss|profile|capacity|demo|bench|all] [a name in bench/cases.yaml | case ...]
#        bench/run_device.sh ab COMMIT [a name | case ...]: each case A-B-A-B, COMMIT's src (bench/out/src_COMMIT,
#        from `git archive COMMIT src`, carried) against this tree, on one machine
#   (a case: "system model batch [extra args]")
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
# SLIDEFORMER_SRC: another commit's src/ (git archive, carried) to run beside this one on the same machine
export PYTHONPATH=${SLIDEFORMER_SRC:-$PWD/src} PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
what=${1:-all}; shift || true
if [[ $what == ab ]]; then
  old=$1; shift
  [[ -d bench/out/src_$old/src ]] || { echo "no bench/out/src_$old/src: mkdir -p bench/out/src_$old && git archive $old src | tar -x -C bench/out/src_$old"; exit 2; }
  new=${SLIDEFORMER_COMMIT:?set SLIDEFORMER_COMMIT to the commit of this tree}
  for c in "$@"; do
    for round in 1 2; do
      SLIDEFORMER_SRC=$PWD/bench/out/src_$old/src SLIDEFORMER_COMMIT=$old "$0" bench "$c"
      SLIDEFORMER_COMMIT=$new "$0" bench "$c"
    done
  done
  exit 0
fi
# Packages the machine lacks (DeepSpeed and its dependencies, Liger-Kernel) travel as wheels in .whl, an
# ignored folder: a call carries it (see bench/README.md). Without Liger, slideformer's fused_ops "auto" runs
# unfused: layers about a third slower, which no comparison with another call's figures survives.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
else
  echo "bench/run_device.sh: no .whl/ here (carry it): no Liger-Kernel, slideformer runs unfused" >&2
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2;
  lscpu | grep -E "Model name|Thread\(s\) per core|Socket"; gcc --version | head -1;
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)";
  # (the device's checkout keeps a stale HEAD under the copied tree: the caller names the commit)
  echo "commit ${SLIDEFORMER_COMMIT:-$(git rev-parse --short HEAD) (HEAD; set SLIDEFORMER_COMMIT)}"; } > "$OUT/machine.txt" 2>&1
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
fi
if [[ $what == optim || $what == all ]]; then
  python3 -m slideformer.bench.optimizer --params 2e9 --threads 8,12,15,16 \
    --variants="${OPTIM_VARIANTS-portable,no_prefetch,compact_scalar}" 2>&1 | tee -a "$OUT/optimizer.jsonl" | tail -2
fi
if [[ $what == optim4b ]]; then  # issue 4's 4B parameters: the host holds native's and torch fused's buffers, not all
  python3 -m slideformer.bench.optimizer --params 4e9 --threads 15,16 --only native,torch_fused,dma 2>&1 \
    | tee -a "$OUT/optimizer.jsonl" | tail -2
fi
if [[ $what == loss || $what == all ]]; then
  timeout "${LOSS_TIMEOUT:-600}" python3 -m slideformer.bench.loss --chunks 4096,16384 2>&1 | tee -a "$OUT/loss.jsonl" | tail -8
fi
if [[ $what == profile ]]; then  # issue 6: the costliest GPU ops of one Llama-8B step, streamed and resident
  for extra in "--resident-layers 0" "--resident-layers 31"; do
    python3 -m slideformer.bench --system slideformer --model llama3-8b --batch 8 $extra --profile-ops 30 \
      --out "$OUT/profile.jsonl" 2>&1 | tail -1 | cut -c1-300
  done
fi
if [[ $what == capacity ]]; then  # issue 21: the largest model on this box (8-bit state, moments on the NVMe tier)
  df -h /tmp | tail -1 | tee "$OUT/disk.txt"; free -g | head -2 | tee -a "$OUT/disk.txt"
  timeout "${CAPACITY_TIMEOUT:-560}" python3 -m slideformer.bench --system slideformer --model "${CAPACITY_MODEL:-gemma2-27b-shape}" \
    --batch 8 --optimizer-state 8bit --gpu-memory-limit-gib 24 --offload-dir /tmp/nvme --warmup 1 --steps "${CAPACITY_STEPS:-2}" \
    --out "$OUT/capacity.jsonl" 2>&1 | tail -3 | cut -c1-600
fi
if [[ $what == demo || $what == all ]]; then
  python3 -m slideformer.cli train max_steps=60 output_dir=/tmp/demo progress=false 2>&1 | tee "$OUT/demo.log" | tail -3
fi
if [[ $what == bench || $what == all ]]; then
  # a name in bench/cases.yaml stands for its cases; anything else is a case itself ("system model batch [flags]")
  if [[ $# -le 1 ]]; then
    mapfile -t named < <(python3 - "${1:-default}" <<'PY'
import sys, yaml
cases = yaml.safe_load(open("bench/cases.yaml"))
name = sys.argv[1]
print("\n".join(cases[name]["cases"]) if name in cases else name)
PY
)
    set -- "${named[@]}"
  fi
  for c in "$@"; do
    read -r sys model b extra <<<"$c"
    echo "== $c" | tee -a "$OUT/bench.log"
    timeout 300 python3 -m slideformer.bench --system "$sys" --model "$model" --batch "$b" $extra \
      --out "$OUT/results.jsonl" >> "$OUT/bench.log" 2>&1
    rc=$?
    if [[ $rc -ne 0 ]]; then
      echo "FAILED: $c (rc=$rc)" | tee -a "$OUT/bench.log"
      # killed (SIGKILL: with no swap, the host out of RAM) or timed out: no line of its own, so one is written
      why=$( ((rc == 137)) && echo "killed by the host (SIGKILL)" || { ((rc == 124)) && echo "timed out (300 s)"; } )
      [[ -n $why ]] && python3 -m slideformer.bench --system "$sys" --model "$model" --batch "$b" $extra \
        --failed "$why" --out "$OUT/results.jsonl" >> "$OUT/bench.log" 2>&1
    fi
    tail -1 "$OUT/bench.log" | cut -c1-400
  done
fi
