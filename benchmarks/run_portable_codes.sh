#!/usr/bin/env bash
# OPT-2.7B's (or MODEL's) portable checkpoint (int8_m24 on both sides, ratio 0.5) saved and loaded by one process on one GPU, by
# the twinflow found first on PYTHONPATH: its bytes on disk, the save's and the load's seconds and host peaks, and
# the next three losses against the saving run's, and where the load's time went (cProfile).
#   bash benchmarks/run_portable_codes.sh LABEL [MODEL]   # writes $OUT/LABEL_save.json and $OUT/LABEL_load.json
set -euo pipefail
label=$1
model=${2:-opt-2.7b}
cfg=benchmarks/configs/opt-2.7b-x1-int8_m24-r0.5.json
ck=/tmp/ck_$label
rm -rf /tmp/ck_* # a machine still warm keeps the last call's files
run="torchrun --standalone --nproc-per-node 1 benchmarks/bench_resume.py --model $model --config $cfg --ckpt $ck"
$run --save --before 3 --after 3 --out "$OUT/${label}_save.json"
$run --load --after 3 --reference "$OUT/${label}_save.json" --out "$OUT/${label}_load.json" --profile
rm -rf "$ck"
