"""Where the 8-bit kernel's time goes: the kernel with parts switched off at compile time, each in its own build.

    python benchmarks/q8_ablation.py --out FILE

Each variant builds the extension with TWINFLOW_EXTRA_CFLAGS in a fresh directory, then times the 8-bit step (with
and without the bf16 weight copy) beside the 8-bit probe and the fp32 step, at 16 and 8 threads.
"""

import argparse
import json
import os
import subprocess
import sys

VARIANTS = {
    "as_built": "",
    "no_sqrt_div": "-DTF_Q8_NO_SQRTDIV",
    "no_hash": "-DTF_Q8_NO_HASH",
    "prefetch_2_blocks": "-DTF_Q8_PREFETCH=2",
    "prefetch_8_blocks": "-DTF_Q8_PREFETCH=8",
    "no_sqrt_div_no_hash": "-DTF_Q8_NO_SQRTDIV -DTF_Q8_NO_HASH",
}

CHILD = r"""
import json, sys, torch
sys.path.insert(0, ".")
from benchmarks.bench_cpu_adam import q8_fn, twinflow_fn, fp32_set
from benchmarks.common import interleaved_medians
n = 1 << 28
gen = torch.Generator().manual_seed(0)
out = torch.empty(n, dtype=torch.bfloat16)
s = fp32_set(n, gen); s["grad"] = s["grad"].bfloat16()
res = {}
for t in (16, 8):
    fns = {"int8": q8_fn(n, t, gen, out), "int8_no_copy": q8_fn(n, t, gen, None) if False else None,
           "int8_probe": q8_fn(n, t, gen, out, probe=True), "fp32": twinflow_fn(s, t, out=out)}
    fns = {k: v for k, v in fns.items() if v is not None}
    m = interleaved_medians(fns, rounds=5)
    res[t] = {k: n / v / 1e9 for k, v in m.items()}
print(json.dumps(res))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="*", default=list(VARIANTS))
    args = parser.parse_args()
    results = {}
    for name in args.only:
        env = dict(os.environ, TWINFLOW_EXTRA_CFLAGS=VARIANTS[name], TORCH_EXTENSIONS_DIR=f"/tmp/ext_ablation_{name}")
        run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
        line = run.stdout.strip().splitlines()[-1] if run.returncode == 0 else run.stderr[-2000:]
        results[name] = json.loads(line) if run.returncode == 0 else {"error": line}
        print(name, results[name], flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
