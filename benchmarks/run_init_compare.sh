#!/usr/bin/env bash
# initialize and the first step of OPT-30B with compact state on 4 GPUs, an older checkout against this one, each
# with a cold torch.compile cache, then this one again with its cache warm (benchmarks/bench_init.py).
#   bash benchmarks/run_init_compare.sh OLD_TREE OUT_DIR [CONFIG]      (WARM=0: no third run)
set -uo pipefail
cd "$(dirname "$0")/.."
old=$1 out=$2 config=${3:-benchmarks/configs/opt-30b-x4-int8_m24-r0.3.json}
nproc=${NPROC:-4}
run() {  # label tree cache seconds
  local label=$1 tree=$2 cache=$3 limit=$4
  (cd "$tree" && TORCH_EXTENSIONS_DIR=/tmp/ext_twinflow python -c "
try:
    from twinflow.host import ops  # the layout by sub-packages
except ImportError:
    from twinflow import ops  # an older tree's flat layout
ops.load()") || return
  PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} TORCH_EXTENSIONS_DIR=/tmp/ext_twinflow TORCHINDUCTOR_CACHE_DIR=$cache timeout "$limit" \
    torchrun --standalone --nproc-per-node "$nproc" benchmarks/bench_init.py --model "${MODEL:-opt-30b}" \
    --config "$config" --steps "${STEPS:-4}" --label "$label" --out "$out/init_$label.json" 2>&1 \
    | grep -v -e Warning -e "output = self" -e "^Consider" -e "losses.append"
}
run after "${NEW:-$PWD}" /tmp/inductor_after "${LIMIT_AFTER:-170}"
run before "$old" /tmp/inductor_before "${LIMIT_BEFORE:-300}"
[ "${WARM:-1}" = 0 ] || run after_warm "${NEW:-$PWD}" /tmp/inductor_after "${LIMIT_AFTER:-170}"
