#!/usr/bin/env bash
# Everything measured on the GPU machine, in one call: the GPU tests, then the benchmark cases.
#   run from the repo root on the device machine; results go to $OUT (or ./bench/out).
# Usage: bench/run_device.sh [tests|optim|optim4b|loss|profile|capacity|demo|bench|all] [table1..table32|b64|timeline | case ...]
#   (a case: "system model batch [extra args]")
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
# SLIDEFORMER_SRC: another commit's src/ (git archive, carried) to run beside this one on the same machine
export PYTHONPATH=${SLIDEFORMER_SRC:-$PWD/src} PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
what=${1:-all}; shift || true
# Packages the machine lacks (DeepSpeed and its dependencies, Liger-Kernel) travel as wheels in .whl
# (see bench/README.md). Liger is used only where asked for (--fused-ops liger, the loss benchmark).
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
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
if [[ $what == capacity ]]; then  # issue 5: a model whose fp32 training state exceeds the RAM (see NOTES)
  df -h /tmp | tail -1 | tee "$OUT/disk.txt"
  timeout "${CAPACITY_TIMEOUT:-560}" python3 -m slideformer.bench --system slideformer --model qwen2.5-14b --batch 8 --optimizer-state compact \
    --gpu-memory-limit-gib 24 --offload-dir /tmp/nvme --nvme-fraction 0.5 --warmup 1 --steps 2 \
    --out "$OUT/capacity.jsonl" 2>&1 | tail -3 | cut -c1-600
fi
if [[ $what == demo || $what == all ]]; then
  python3 -m slideformer.cli train --steps 60 --output-dir /tmp/demo 2>&1 | tee "$OUT/demo.log" | tail -3
fi
if [[ $what == bench || $what == all ]]; then
  # Issue 3's table, in three calls that each fit the 10-minute limit (one process per case).
  case "${1:-}" in
    table1) set -- "plain qwen3-4b 8" "slideformer qwen3-4b 8" "slideformer qwen3-4b 8 --resident-layers 36" \
                   "plain qwen3-4b 32" "slideformer qwen3-4b 32" "slideformer qwen3-4b 32 --resident-layers 36" \
                   "plain qwen3-4b 64" "slideformer qwen3-4b 64 --gpu-memory-limit-gib 24" ;;
    table2) set -- "deepspeed qwen3-4b 8 --gpu-memory-limit-gib 24" "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24" \
                   "slideformer qwen3-4b 32 --gpu-memory-limit-gib 24" "slideformer llama3-8b 8 --gpu-memory-limit-gib 24" \
                   "slideformer llama3-8b 32 --gpu-memory-limit-gib 24" ;;
    table3) set -- "slideformer llama3-8b 64 --gpu-memory-limit-gib 24" "slideformer llama3-8b 8" \
                   "slideformer llama3-8b 8 --loss-kernel fused" "deepspeed llama3-8b 8 --gpu-memory-limit-gib 24" ;;
    # The predictions in bench/NOTES.md (session 2) that no run has checked yet:
    table4) set -- "slideformer qwen3-4b 8 --resident-layers 0" "slideformer qwen3-4b 8 --resident-layers 0 --host-grad-buffers 36" \
                   "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --host-grad-buffers 24" \
                   "plain qwen3-4b 32" "slideformer qwen3-4b 32 --gpu-memory-limit-gib 24" \
                   "deepspeed qwen3-4b 32 --gpu-memory-limit-gib 24 --ds-loss fused" ;;
    # Session 3: why the optimizer got slower per step at 4B b8 after the chunked stream (NOTES)
    table5) set -- "slideformer qwen3-4b 8 --resident-layers 0" \
                   "slideformer qwen3-4b 8 --resident-layers 0 --grad-chunk-elems 1000000000" \
                   "slideformer qwen3-4b 8 --resident-layers 0 --switch-interval 0.0002" \
                   "plain qwen3-4b 8" "slideformer qwen3-4b 8" ;;
    # Session 3, after the per-unit landing flags: issue 3's 4B rows against plain and DeepSpeed in one run
    table6) set -- "slideformer qwen3-4b 8 --resident-layers 0" "slideformer qwen3-4b 8 --resident-layers 0 --host-grad-buffers 36" \
                   "plain qwen3-4b 8" "slideformer qwen3-4b 8" "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24" \
                   "deepspeed qwen3-4b 8 --gpu-memory-limit-gib 24" "plain qwen3-4b 32" "slideformer qwen3-4b 32 --gpu-memory-limit-gib 24" ;;
    # Liger's RMSNorm and SwiGLU (fused_ops) against transformers' modules, GPU-bound cases
    table7) set -- "slideformer qwen3-4b 32 --gpu-memory-limit-gib 24 --fused-ops liger" \
                   "slideformer qwen3-4b 32 --gpu-memory-limit-gib 24" \
                   "slideformer qwen3-4b 8 --fused-ops liger" "plain qwen3-4b 8" ;;
    # Issue 3's table in one run with the session-3 defaults (Liger on), and plain with the same Liger rebinding
    table8) set -- "plain qwen3-4b 8" "plain qwen3-4b 8 --fused-ops liger" "slideformer qwen3-4b 8" \
                   "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24" "deepspeed qwen3-4b 8 --gpu-memory-limit-gib 24" \
                   "plain qwen3-4b 32" "plain qwen3-4b 32 --fused-ops liger" "slideformer qwen3-4b 32 --gpu-memory-limit-gib 24" \
                   "deepspeed qwen3-4b 32 --gpu-memory-limit-gib 24 --ds-loss fused" ;;
    # Issue 5 at 8B b64: RSS and GPU under 24 GiB, and what offloading every layer input costs (no budget)
    b64) set -- "slideformer llama3-8b 64 --gpu-memory-limit-gib 24" "slideformer llama3-8b 64 --resident-layers 0" \
                "slideformer llama3-8b 64 --resident-layers 0 --offload-activations 0" ;;
    # Session 4: resident layers at the start (the run at 8cb727f also had them at the end), resident edges at 4B b32 (24 GiB)
    # against plain+Liger, and 8B b64 with staged host weights: RSS under 24 GiB, activation offload on/off
    table9) set -- "plain qwen3-4b 8 --fused-ops liger" "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24" \
                   "plain qwen3-4b 32 --fused-ops liger" "slideformer qwen3-4b 32 --gpu-memory-limit-gib 24" \
                   "slideformer qwen3-4b 32 --gpu-memory-limit-gib 24 --resident-layers 0" \
                   "slideformer llama3-8b 64 --gpu-memory-limit-gib 24" \
                   "slideformer llama3-8b 64 --resident-layers 0 --host-weights staged" \
                   "slideformer llama3-8b 64 --resident-layers 0 --host-weights staged --offload-activations 0" ;;
    # Session 4's last call: 4B b32 on the whole card against plain+Liger, and GPU caps below DeepSpeed's peak
    table10) set -- "plain qwen3-4b 32 --fused-ops liger" "slideformer qwen3-4b 32" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 17" "slideformer qwen3-4b 32 --gpu-memory-limit-gib 15" ;;
    # Next: gradient buffers at 4B b8 under 24 GiB (NOTES, session 4: a backlog lets the CPU update during
    # the next forward), and its timeline
    table11) set -- "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24" "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --host-grad-buffers 8" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --host-grad-buffers 12" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --host-grad-buffers 27" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --timeline" "slideformer qwen3-4b 8 --timeline" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --optimizer-state compact" ;;
    # Next: issue 3's rows not yet run (b64 against plain+Liger, 8B b32) and DeepSpeed b8 beside today's default
    table12) set -- "plain qwen3-4b 64 --fused-ops liger" "slideformer qwen3-4b 64 --gpu-memory-limit-gib 24" \
                    "slideformer llama3-8b 32 --gpu-memory-limit-gib 24" "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 17" "deepspeed qwen3-4b 8 --gpu-memory-limit-gib 24" \
                    "slideformer qwen3-4b 32 --gpu-memory-limit-gib 15" "deepspeed qwen3-4b 32 --gpu-memory-limit-gib 24 --ds-loss fused" ;;
    # Session 5: a gradient buffer per streamed layer (table11: 4 -> 27 buffers 0.82 -> 0.73 s) with fp32 and
    # compact state (its GPU update no longer compiles inside steps), streamed alike, beside DeepSpeed; 4B b64
    table13) set -- "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24" "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --host-grad-buffers 36" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --optimizer-state compact" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --optimizer-state compact --host-grad-buffers 36" \
                    "slideformer qwen3-4b 8 --resident-layers 0" "slideformer qwen3-4b 8 --resident-layers 0 --host-grad-buffers 36" \
                    "deepspeed qwen3-4b 8 --gpu-memory-limit-gib 24" \
                    "plain qwen3-4b 64 --fused-ops liger" "slideformer qwen3-4b 64 --gpu-memory-limit-gib 24" ;;
    # Session 5's last call: the new defaults (a gradient buffer per streamed layer) at b8, compact beside them,
    # the 8B rows under 24 GiB, and b32 against plain+Liger and DeepSpeed, in one run
    table14) set -- "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --optimizer-state compact" \
                    "slideformer llama3-8b 32 --gpu-memory-limit-gib 24" "slideformer llama3-8b 8 --gpu-memory-limit-gib 24" \
                    "plain qwen3-4b 32 --fused-ops liger" "slideformer qwen3-4b 32 --gpu-memory-limit-gib 24" \
                    "deepspeed qwen3-4b 32 --gpu-memory-limit-gib 24 --ds-loss fused" ;;
    # Session 6: compact state at 8B b8, where 4B b64 under 24 GiB loses to plain+Liger (profiles of both,
    # resident edges), and what exact clipping (the trainer's default) costs at 4B b8
    table15) set -- "slideformer llama3-8b 8 --gpu-memory-limit-gib 24 --optimizer-state compact" \
                    "slideformer qwen3-4b 64 --gpu-memory-limit-gib 24 --profile-ops 30" \
                    "plain qwen3-4b 64 --fused-ops liger --profile-ops 30" \
                    "slideformer qwen3-4b 64 --gpu-memory-limit-gib 24 --resident-edges" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --max-grad-norm 1" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24" ;;
    # Session 6: is 4B b64's 5% GEMM gap to plain the micro-batches of 32? (kernel and matmul-shape profiles,
    # all layers resident on the whole card with one and two micro-batches); 4B b8's idle CPU, update by update
    table16) set -- "plain qwen3-4b 64 --fused-ops liger --profile-ops 40" \
                    "slideformer qwen3-4b 64 --resident-layers 36 --profile-ops 40" \
                    "slideformer qwen3-4b 64 --resident-layers 36 --micro-batch 32 --profile-ops 40" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --timeline" ;;
    # Session 6: clipping with speculative updates (a spare state per streamed layer) where the norm stays
    # within the limit (1e9) and where it never does (1e-6), beside unclipped and exact waiting; which ops
    # launch 4B b64's extra GEMM kernels (plain against all layers resident, one micro-batch of 64)
    table17) set -- "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --max-grad-norm 1e9" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --max-grad-norm 1e-6" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --max-grad-norm 1e9 --speculative-layers 0" \
                    "slideformer qwen3-4b 32 --gpu-memory-limit-gib 24 --max-grad-norm 1e9" \
                    "plain qwen3-4b 64 --fused-ops liger --profile-ops 40" \
                    "slideformer qwen3-4b 64 --resident-layers 36 --profile-ops 40" ;;
    # Session 6's last call: backward's recompute without the down projection's product (the extra GEMM
    # per layer against plain), at b64 and b32 against plain+Liger; clipping with non-temporal spare writes
    table18) set -- "plain qwen3-4b 64 --fused-ops liger" "slideformer qwen3-4b 64 --gpu-memory-limit-gib 24" \
                    "slideformer qwen3-4b 64 --gpu-memory-limit-gib 24 --resident-edges" \
                    "plain qwen3-4b 32 --fused-ops liger" "slideformer qwen3-4b 32 --gpu-memory-limit-gib 24" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --max-grad-norm 1e9" \
                    "slideformer llama3-8b 32 --gpu-memory-limit-gib 24" ;;
    # Session 7: Llama-8B under 24 GiB with compact state (no host copy to stage; how much of the b8 update
    # waits for gradients), and b32 with fp32 state and two layers of prefetch
    table19) set -- "slideformer llama3-8b 32 --gpu-memory-limit-gib 24 --optimizer-state compact" \
                    "slideformer llama3-8b 8 --gpu-memory-limit-gib 24 --optimizer-state compact" \
                    "slideformer llama3-8b 32 --gpu-memory-limit-gib 24 --depth 2" ;;
    # Session 7: DeepSpeed beside today's defaults at b8 and b32 (last measured in table13/14), and two layers
    # of prefetch at 4B (table19: Llama-8B b32's staged loads hidden, efficiency 0.937 -> 0.987)
    table20) set -- "deepspeed qwen3-4b 8 --gpu-memory-limit-gib 24" "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --depth 2" \
                    "deepspeed qwen3-4b 32 --gpu-memory-limit-gib 24 --ds-loss fused" \
                    "slideformer qwen3-4b 32 --gpu-memory-limit-gib 24" \
                    "slideformer qwen3-4b 32 --gpu-memory-limit-gib 24 --depth 2" ;;
    # Session 7: the new defaults (two visits of prefetch; the planner's GPU term, which gives 4B b64 resident
    # edges) at 4B b64 against plain+Liger, and Llama-8B b64 (RSS target) and b8 under 24 GiB
    table21) set -- "plain qwen3-4b 64 --fused-ops liger" "slideformer qwen3-4b 64 --gpu-memory-limit-gib 24" \
                    "slideformer llama3-8b 64 --gpu-memory-limit-gib 24" "slideformer llama3-8b 8 --gpu-memory-limit-gib 24" ;;
    # Session 7: is the out-of-place update faster in the engine too (4B b8 unclipped against speculative,
    # same run; the optimizer benchmark compares the kernels)? Llama-8B b8 with fp32 state trading staged
    # layers for gradient buffers (table21: 4 buffers, the main thread waited 0.78 s for one); DeepSpeed at b64
    table22) set -- "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --max-grad-norm 1e9" \
                    "slideformer llama3-8b 8 --gpu-memory-limit-gib 24 --host-weights 20 --host-grad-buffers 18" \
                    "deepspeed qwen3-4b 64 --gpu-memory-limit-gib 24 --ds-loss fused" ;;
    # Session 7's last call: where compact state's CPU update loses its speed at Llama-8B b8 (every update and
    # visit), beside the fp32 4B b8 step's
    table23) set -- "slideformer llama3-8b 8 --gpu-memory-limit-gib 24 --optimizer-state compact --timeline" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --timeline" ;;
    # Issue 3's cases never run: DeepSpeed at Llama-8B under 24 GiB (its fp32 state and fp32 gradients may not
    # fit 125 GiB of RAM), and every system unconstrained (table25)
    table24) set -- "deepspeed llama3-8b 8 --gpu-memory-limit-gib 24" "slideformer llama3-8b 8 --gpu-memory-limit-gib 24" \
                    "deepspeed llama3-8b 32 --gpu-memory-limit-gib 24 --ds-loss fused" \
                    "slideformer llama3-8b 32 --gpu-memory-limit-gib 24" ;;
    table25) set -- "deepspeed qwen3-4b 8" "slideformer qwen3-4b 8" "deepspeed qwen3-4b 32 --ds-loss fused" \
                    "slideformer qwen3-4b 32" "deepspeed qwen3-4b 64 --ds-loss fused" "slideformer qwen3-4b 64" ;;
    # The CPU update's threads in the pipeline (issue 4's core budget; measured so far only in isolation)
    # and a shorter GIL switch interval (the handoffs between updates), at 4B b8 under 24 GiB; where
    # Llama-8B b8's fp32 step (4 gradient buffers, efficiency 0.79) loses its time
    table26) set -- "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --optimizer-threads 16" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --optimizer-threads 14" \
                    "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --switch-interval 5e-5" \
                    "slideformer llama3-8b 8 --gpu-memory-limit-gib 24 --timeline" ;;
    # Issue 3's optional baseline, torchao's CPUOffloadOptimizer (fp32 weights on the GPU: Llama-8B's 32 GB
    # cannot fit 24 GiB), beside slideformer, unconstrained and under 24 GiB
    table27) set -- "torchao qwen3-4b 8" "slideformer qwen3-4b 8" "torchao qwen3-4b 32" "slideformer qwen3-4b 32" \
                    "torchao qwen3-4b 8 --gpu-memory-limit-gib 24" ;;
    # Llama-8B unconstrained (DeepSpeed's host state does not fit 125 GiB: killed at 8B b8, table24), and
    # compact state at 8B b8 under 24 GiB with the hand-vectorised update (the default from d257d00)
    table28) set -- "slideformer llama3-8b 8" "slideformer llama3-8b 32" \
                    "slideformer llama3-8b 8 --gpu-memory-limit-gib 24 --optimizer-state compact" ;;
    # Issue 3's last cases: plain under the cap (it cannot fit: the line says so), torchao at b64, and
    # slideformer capped under DeepSpeed's own peak (18.4 GiB at b8, 15.7 at b32) beside it in one run
    table29) set -- "plain qwen3-4b 8 --gpu-memory-limit-gib 24" "torchao qwen3-4b 64" \
                    "deepspeed qwen3-4b 8 --gpu-memory-limit-gib 24" "slideformer qwen3-4b 8 --gpu-memory-limit-gib 18" \
                    "deepspeed qwen3-4b 32 --gpu-memory-limit-gib 24 --ds-loss fused" \
                    "slideformer qwen3-4b 32 --gpu-memory-limit-gib 15" ;;
    # Resident units without host state (77c6019): the RAM freed goes to buffers and host weights
    # (predictions in bench/NOTES.md, session 8)
    table30) set -- "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24" "slideformer llama3-8b 8 --gpu-memory-limit-gib 24" \
                    "slideformer llama3-8b 8" ;;
    # Issue 4's floor with nothing on the GPU's optimizer: every parameter updated by the CPU (session 9)
    table31) set -- "slideformer qwen3-4b 8 --gpu-memory-limit-gib 24 --resident-layers 0" ;;
    # The baselines' missing cases (session 9): plain Llama-8B on the whole card (its fp32 master, moments
    # and gradients: ~134 GiB, at the card's edge) and the cases under 24 GiB that cannot fit, for their lines
    table32) set -- "plain llama3-8b 8" "plain llama3-8b 32" "plain llama3-8b 64" "plain llama3-8b 8 --gpu-memory-limit-gib 24" \
                    "plain qwen3-4b 32 --gpu-memory-limit-gib 24" "plain qwen3-4b 64 --gpu-memory-limit-gib 24" \
                    "torchao qwen3-4b 32 --gpu-memory-limit-gib 24" "torchao qwen3-4b 64 --gpu-memory-limit-gib 24" ;;
    # Where the 4B b8 streamed step loses its last 0.2 s (NOTES, session 3): every update and visit, with
    # 4 and with 36 gradient buffers
    timeline) set -- "slideformer qwen3-4b 8 --resident-layers 0 --timeline" \
                     "slideformer qwen3-4b 8 --resident-layers 0 --host-grad-buffers 36 --timeline" ;;
  esac
  if [[ $# -eq 0 ]]; then
    set -- "plain qwen3-4b 8" "slideformer qwen3-4b 8" "plain qwen3-4b 32" "slideformer qwen3-4b 32" \
           "slideformer llama3-8b 8 --host-weights staged"
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
