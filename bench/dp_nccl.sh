#!/usr/bin/env bash
# Issue 24's run: data parallel over NCCL on two GPUs, in one call of at most 10 minutes (nvidia-h200-x2;
# leave NVLink multicast off, as the device tool's KINDS.md says). Each step has its own limit, so one
# that hangs costs only its share. Results and logs go to $OUT.
#   run from the repo root on the device machine, carrying .whl
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_DEBUG=WARN NCCL_NVLS_ENABLE=0
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
step() { local s=$1; shift; echo "== $*"; timeout -k 5 "$s" "$@"; echo "== rc $?"; }
{ nvidia-smi topo -m; grep MemTotal /proc/meminfo
  python3 -c "import torch; print(torch.__version__, torch.cuda.nccl.version(), torch.cuda.device_count())"
  echo "commit ${SLIDEFORMER_COMMIT:-unset}"; } 2>&1 | tee "$OUT/facts.txt"
# The x2 VM's MemTotal starts at 31 GiB and grows as memory is touched (KINDS.md), and the planner sizes host
# state from MemTotal: touch 96 GiB once, in the background, before the RSS step needs it.
python3 -c "import numpy as np; a = [np.ones(2**30, dtype=np.uint8) for _ in range(96)]" &
# each process's GPU: a rank's worker threads must not open a context on GPU 0
(while sleep 2; do nvidia-smi --query-compute-apps=pid,gpu_bus_id,used_memory --format=csv,noheader; echo; done) \
  > "$OUT/gpu_apps.txt" &
smi=$!
step 60 python3 -m pytest -q -m gpu tests/test_gpu.py -k second_gpu 2>&1 | tee "$OUT/0_threads.log" | tail -3
step 150 python3 -m pytest -x -q -s -m gpu tests/test_parallel.py -k nccl_train_the_global_batch 2>&1 \
  | tee "$OUT/1_parity.log" | tail -15
step 170 python3 -m pytest -x -q -s -m gpu tests/test_parallel.py tests/test_launch.py -k "trainer_on_two_gpus or two_processes" 2>&1 \
  | tee "$OUT/2_trainer.log" | tail -15
kill $smi
step 150 python3 -m pytest -q -s -m gpu tests/test_parallel.py -k dies_on_two_gpus 2>&1 | tee "$OUT/3_die.log" | tail -15
grep MemTotal /proc/meminfo | tee -a "$OUT/facts.txt"
step 110 python3 bench/dp_rss.py --model qwen3-4b --batch 8 --ranks 2 --steps 3 --backend nccl 2>&1 \
  | tee "$OUT/4_dp.jsonl" | tail -3
