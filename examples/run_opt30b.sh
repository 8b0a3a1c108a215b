#!/usr/bin/env bash
# OPT-30B on four GPUs with twinflow and FSDP2 (ZeRO-3 sharding): bf16 compute,
# fp32 master weights and moments, each rank's share on the CPU planned at its
# first step from its GPU's and the node's memory (examples/configs/opt-30b.json:
# offload_ratio "auto"; the ranks take the largest share any of them needs).
# Four 80 GB GPUs (H100s) or more. torchrun gives each process one thread;
# twinflow then gives each rank's CPU kernel its share of the host's cores
# (TWINFLOW_NUM_THREADS or OMP_NUM_THREADS, if set, choose instead).
#   NPROC=4 DATA=corpus.txt STEPS=10 bash examples/run_opt30b.sh [more train_opt.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-4}"
# FSDP2's all-gathered blocks come and go every layer: segments that grow in place keep the reserve from
# fragmenting (the summary's reserved_gib_per_step and alloc_retries show it)
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
torchrun --standalone --nproc-per-node "$NPROC" examples/train_opt.py --model opt-30b \
  --config examples/configs/opt-30b.json --steps "${STEPS:-10}" --seq-len "${SEQ_LEN:-1024}" \
  ${DATA:+--data "$DATA"} "$@"
