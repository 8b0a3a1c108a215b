#!/usr/bin/env bash
# One call's worth of the multi-GPU round on a 4-GPU machine, writing under OUT_DIR:
#   bash benchmarks/run_multigpu_round.sh tests  OUT_DIR   # the multigpu and Lightning GPU tests, logs
#   bash benchmarks/run_multigpu_round.sh opt30b OUT_DIR   # OPT-30B: twinflow's plan against DeepSpeed
#   bash benchmarks/run_multigpu_round.sh opt13b OUT_DIR   # OPT-13B: the same, plus compact state
# DeepSpeed (and Lightning, where missing) come as wheels on PYTHONPATH. NVLink multicast stays off.
set -uo pipefail
cd "$(dirname "$0")/.."
part=$1 out=$2
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
kind=${KIND:-h100_x4}
bench() {  # model out-name timeout-per-system systems...
  local model=$1 name=$2 limit=$3
  shift 3
  python benchmarks/bench_train.py --model "$model" --gpus 4 --clip 1.0 --timeout "$limit" --verbose \
    --out "$out/$name" "$@" 2>&1 | grep -v -e Warning -e "warnings.warn" -e "^  " | tail -40
}
case $part in
  tests)
    # whole logs, each test named as it starts (-v): a test that aborts the process is known by its name
    python -m pytest -v -p no:cacheprovider -m "cuda or multigpu" tests/test_lightning.py \
      > "$out/lightning_gpu_tests_$kind.log" 2>&1
    tail -15 "$out/lightning_gpu_tests_$kind.log"
    python -m pytest -v -p no:cacheprovider -m multigpu tests/test_multigpu.py tests/test_launch.py \
      > "$out/multigpu_tests_${kind}_final.log" 2>&1
    tail -25 "$out/multigpu_tests_${kind}_final.log"
    ;;
  opt30b)
    bench opt-30b "bench_train_opt-30b_x4.json" "${LIMIT:-190}" --steps 4 --warmup 2 \
      --systems twinflow:auto ds-z3:0.6 ds-z3:1 --steps-for ds-z3:0.6=1,1 ds-z3:1=1,1
    ;;
  opt13b)
    bench opt-13b "bench_train_opt-13b_x4.json" "${LIMIT:-150}" --steps 6 --warmup 2 \
      --systems twinflow:auto twinflow-m24:auto twinflow-delay:auto ds-z3:0.4 --steps-for ds-z3:0.4=2,1
    bench opt-30b "bench_train_opt-30b_x4_delayed.json" "${LIMIT:-190}" --steps 4 --warmup 2 \
      --systems twinflow-delay:auto
    ;;
  *)
    echo "unknown part '$part'; expected tests, opt30b or opt13b" >&2
    exit 2
    ;;
esac
