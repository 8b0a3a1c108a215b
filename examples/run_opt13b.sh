#!/usr/bin/env bash
# OPT-13B on one GPU with twinflow: bf16 compute, fp32 master weights, half of the
# optimizer step on the CPU (examples/configs/opt-13b.json, ratio 0.5).
# Needs a GPU with about 140 GB (one H200) and about 100 GiB of free host memory:
# without offload the fp32 states do not fit the GPU, with all of them on the CPU
# they do not fit 125 GiB of host memory. See BENCHMARKS.md for measured figures.
#   DATA=corpus.txt STEPS=20 bash examples/run_opt13b.sh [more train_opt.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
python examples/train_opt.py --model opt-13b --config examples/configs/opt-13b.json \
  --steps "${STEPS:-20}" --seq-len "${SEQ_LEN:-1024}" ${DATA:+--data "$DATA"} "$@"
