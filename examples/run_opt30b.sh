#!/usr/bin/env bash
# OPT-30B on four GPUs with twinflow and FSDP2 (ZeRO-3 sharding): bf16 compute,
# fp32 master weights, 40% of each rank's optimizer step on the CPU
# (examples/configs/opt-30b.json). Needs 4 GPUs with about 100 GB each (H200s)
# and about 200 GiB of host memory. torchrun gives each process one thread;
# twinflow then gives each rank's CPU kernel its share of the host's cores
# (TWINFLOW_NUM_THREADS or OMP_NUM_THREADS, if set, choose instead).
#   NPROC=4 DATA=corpus.txt STEPS=10 bash examples/run_opt30b.sh [more train_opt.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-4}"
torchrun --standalone --nproc-per-node "$NPROC" examples/train_opt.py --model opt-30b \
  --config examples/configs/opt-30b.json --steps "${STEPS:-10}" --seq-len "${SEQ_LEN:-1024}" \
  ${DATA:+--data "$DATA"} "$@"
