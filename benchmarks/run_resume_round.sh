#!/usr/bin/env bash
# One call's worth of the checkpoint-that-moves round on a machine of several GPUs (bench_resume.py under
# torchrun), logs and JSON to $OUT. The saving run's JSON is kept beside the checkpoint too (/tmp/ck_r), so that a
# later call on the same, still warm machine compares its losses with it:
#   bash benchmarks/run_resume_round.sh save N MODEL [CONFIG]   # N ranks: BEFORE steps, the save, AFTER steps
#   bash benchmarks/run_resume_round.sh load M MODEL [CONFIG]   # M ranks: the load, the same AFTER steps, compared
#   bash benchmarks/run_resume_round.sh async N MODEL [CONFIG]  # N ranks, a fresh checkpoint saved asynchronously
#   bash benchmarks/run_resume_round.sh convert N MODEL         # a per-rank checkpoint saved in $ck/ckpt (by the
#                                                               # tree of 9bd2b3e or before, with bench_resume.py
#                                                               # --per-rank) made portable, timed
#                                                               # (measure_to_portable.py); a load then reads it
#   bash benchmarks/run_resume_round.sh tests                   # the multigpu tests of the checkpoint and engine
# LIMIT (seconds, default 540) bounds each run; STEPS (default 5) is BEFORE and AFTER; PROFILE=1 adds --profile (the
# load and the first step after it, or the asynchronous save's call, profiled into the JSON); READ_THREADS=K (load)
# copies on K threads; NAME=S adds S to the output's name; SPY=1
# samples every thread with py-spy (on the PATH) into $OUT/<the output's name>.spy.txt (benchmarks/spy_summary.py
# reads it; a run that wrote no JSON fails, as py-spy exits 0 whatever its child did). NVLink multicast stays off.
# TWINFLOW_COMMIT=<hash> names the tree's commit in the JSON's "machine" where the tree is a copy without .git.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
what=$1
limit=${LIMIT:-540}
steps=${STEPS:-5}
ck=/tmp/ck_r
if [ "$what" = tests ]; then
    python -m pytest -v -p no:cacheprovider -m multigpu tests/test_portable_checkpoint.py tests/test_engine_cuda.py \
        > "$OUT/multigpu_checkpoint_tests.log" 2>&1
    rc=$?
    tail -20 "$OUT/multigpu_checkpoint_tests.log"
    exit $rc
fi
n=$2 model=$3 cfg=${4:-benchmarks/configs/opt-13b-x4-compact-auto.json}
name="${model}_${what}${n}${NAME:-}"
spy=""
[ "${SPY:-0}" = 1 ] && spy="py-spy record -o $OUT/$name.spy.txt --format raw --rate 20 --subprocesses --idle --threads --"
run="timeout $limit $spy torchrun --standalone --nproc-per-node $n benchmarks/bench_resume.py --model $model --config $cfg"
[ "${PROFILE:-0}" = 1 ] && run="$run --profile"
[ -n "${READ_THREADS:-}" ] && run="$run --read-threads $READ_THREADS"
case $what in
save | async)
    rm -rf "$ck" && mkdir -p "$ck"
    df -h /tmp | tail -1
    extra=()
    [ "$what" = async ] && extra=(--async-only)
    $run --ckpt "$ck/ckpt" --save --before "$steps" --after "$steps" "${extra[@]}" --out "$OUT/$name.json" \
        > "$OUT/$name.log" 2>&1
    rc=$?
    cp "$OUT/$name.json" "$ck/saved.json" 2>/dev/null
    du -sh "$ck/ckpt" 2>/dev/null
    ;;
convert)
    [ -d "$ck/ckpt" ] || { echo "no checkpoint in $ck: the machine was given back since the save" >&2; exit 3; }
    timeout "$limit" python benchmarks/measure_to_portable.py --ckpt "$ck/ckpt" --out-dir "$ck/conv" \
        --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    rc=$?
    du -sh "$ck/ckpt" "$ck/conv" 2>/dev/null
    [ "$rc" = 0 ] && rm -rf "$ck/ckpt" && mv "$ck/conv" "$ck/ckpt"  # the load that follows reads the converted one
    ;;
load)
    [ -f "$ck/saved.json" ] || { echo "no saved run in $ck: the machine was given back since the save" >&2; exit 3; }
    $run --ckpt "$ck/ckpt" --load --after "$steps" --reference "$ck/saved.json" --out "$OUT/$name.json" \
        > "$OUT/$name.log" 2>&1
    rc=$?
    ;;
*)
    echo "unknown part '$what'; expected save, convert, load, async or tests" >&2
    exit 2
    ;;
esac
[ -n "$spy" ] && [ "$rc" = 0 ] && [ ! -s "$OUT/$name.json" ] && { echo "the sampled run wrote no $name.json" >&2; rc=1; }
grep -v -e Warning -e "warnings.warn" "$OUT/$name.log" | tail -25
free -g | head -2
exit $rc
