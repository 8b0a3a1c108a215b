#!/usr/bin/env bash
# OPT-13B on one GPU with twinflow: bf16 compute, fp32 master weights, half of the
# optimizer step on the CPU (examples/configs/opt-13b.json, ratio 0.5).
# Needs a GPU with about 140 GB (one H200) and about 100 GiB of free host memory:
# without offload the fp32 states do not fit the GPU, with all of them on the CPU
# they do not fit 125 GiB of host memory. See BENCHMARKS.md for measured figures.
# On several GPUs of one host (NPROC=2: two H100s or H200s) torchrun starts a process a GPU and the config's
# stage 3 shards the model with FSDP2 (one process: no sharding, the optimizer attached to the model).
#   DATA=corpus.txt STEPS=20 bash examples/run_opt13b.sh [more train_opt.py flags]
#   NPROC=2 DATA=corpus.txt STEPS=20 bash examples/run_opt13b.sh
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-1}"
if [ "$NPROC" -gt 1 ]; then
  # FSDP2's all-gathered blocks come and go every layer: segments that grow in place keep the reserve whole
  export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
  launch=(torchrun --standalone --nproc-per-node "$NPROC")
else
  launch=(python)
fi
"${launch[@]}" examples/train_opt.py --model opt-13b --config examples/configs/opt-13b.json \
  --steps "${STEPS:-20}" --seq-len "${SEQ_LEN:-1024}" ${DATA:+--data "$DATA"} "$@"
