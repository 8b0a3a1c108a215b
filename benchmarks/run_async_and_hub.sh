#!/usr/bin/env bash
# One GPU: the step time while an asynchronous portable save is written, against a normal step, and the hub
# weights a portable checkpoint converts to, compared with the optimizer's masters (int8_m24 on both sides,
# ratio 0.5). Each part under its own time limit; logs and JSON to $OUT.
#   bash benchmarks/run_async_and_hub.sh async MODEL [AFTER_STEPS]   # --save --asynchronous (a synchronous save first)
#   bash benchmarks/run_async_and_hub.sh async-only MODEL [STEPS]     # the only save is asynchronous (a smaller disk)
#   bash benchmarks/run_async_and_hub.sh hub MODEL                    # portable_convert_check.py
# LABEL=x: the JSON files are named x_... (two trees side by side: the first twinflow on PYTHONPATH runs).
set -uo pipefail
what=$1
model=$2
steps=${3:-20}
cfg=benchmarks/configs/opt-2.7b-x1-int8_m24-r0.5.json
rm -rf /tmp/ck_* # a machine still warm keeps the last call's files
run="torchrun --standalone --nproc-per-node 1"
case $what in
async)
    $run benchmarks/bench_resume.py --model "$model" --config $cfg --ckpt /tmp/ck_a --save --before 6 --after 6 \
        --asynchronous --async-steps "$steps" --out "$OUT/${LABEL:+${LABEL}_}async_${model}.json" ;;
async-only)
    $run benchmarks/bench_resume.py --model "$model" --config $cfg --ckpt /tmp/ck_a --save --before 8 \
        --after "$steps" --async-only --profile --out "$OUT/${LABEL:+${LABEL}_}async_only_${model}.json" ;;
hub)
    $run benchmarks/portable_convert_check.py --model "$model" --config $cfg --ckpt /tmp/ck_h \
        --out "$OUT/${LABEL:+${LABEL}_}hub_${model}.json" ;;
esac
rc=$?
rm -rf /tmp/ck_*
exit $rc
