"""The CPU share's state build (TwinFlowAdam's construction at ratio 1) of two checkouts, as a torchrun rank does it.

    python benchmarks/compare_host_build.py --before OLD_TREE --after . --params 300000000 --threads 2 \
        --rounds 4 [--precisions int8_m24 fp32] [--device cpu] [--dtype bfloat16] [--out FILE]

Each process sets torch to one thread (torchrun's OMP_NUM_THREADS=1) and TWINFLOW_NUM_THREADS to --threads (the
rank's share of the host's cores), makes one parameter of --params elements (--dtype, on --device: "cuda" for
the masters' copy from the GPU into host memory, as a run's first step makes it) and times
``TwinFlowAdam([p], ratio=1.0, state_precision=...)``: the host state's allocation and the masters' write, the
part of ``initialize`` that the host does alone. One process per tree, precision and round, the tree that goes
first alternating (ABBA). Each tree builds its own kernel (its own TORCH_EXTENSIONS_DIR). Prints a table of
median seconds and writes JSON (--out, else $OUT, else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(tree: Path, params: int, precision: str, device: str, dtype: str) -> float:
    sys.path.insert(0, str(tree))
    import time

    import torch

    torch.set_num_threads(1)
    from twinflow import TwinFlowAdam
    from twinflow.host import ops

    ops.load()  # built or loaded before the clock starts

    p = torch.nn.Parameter(torch.randn(params, dtype=getattr(torch, dtype), device=device))
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    TwinFlowAdam([p], ratio=1.0, state_precision=precision)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path)
    parser.add_argument("--after", type=Path, default=ROOT)
    parser.add_argument("--params", type=int, default=300_000_000)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="TWINFLOW_NUM_THREADS: the share")
    parser.add_argument("--precisions", nargs="+", default=["int8_m24", "fp32"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps({"seconds": child(args.child, args.params, args.precision, args.device, args.dtype)}))
        return
    if args.before is None:
        parser.error("--before is required: the checkout to compare against")
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import abba_sides, machine_info, tree_child, write_json

    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    seconds: dict[str, dict[str, list[float]]] = {p: {"before": [], "after": []} for p in args.precisions}
    with tempfile.TemporaryDirectory() as ext_root:
        for r in range(args.rounds):
            for precision in args.precisions:
                for side in abba_sides(r):
                    child_args = ["--params", str(args.params), "--precision", precision, "--device", args.device,
                                  "--dtype", args.dtype]  # fmt: skip
                    row = tree_child(__file__, trees[side], side, Path(ext_root), child_args,
                                     {"TWINFLOW_NUM_THREADS": str(args.threads)})  # fmt: skip
                    seconds[precision][side].append(row["seconds"])
                    print(f"round {r + 1} {precision} {side}: {row['seconds']:.2f} s", flush=True)

    result = {"machine": machine_info(), "params": args.params, "threads": args.threads, "rounds": args.rounds,
              "device": args.device, "dtype": args.dtype, "command": sys.argv,
              "trees": {k: str(v) for k, v in trees.items()}, "seconds": seconds,
              "median_s": {p: {s: statistics.median(v) for s, v in d.items()} for p, d in seconds.items()}}  # fmt: skip
    print(f"| precision ({args.params:,} parameters, {args.threads} threads) | before | after | after/before |")
    print("| --- | --- | --- | --- |")
    for precision, m in result["median_s"].items():
        print(f"| {precision} | {m['before']:.2f} s | {m['after']:.2f} s | {m['after'] / m['before']:.2f} |")
    print("wrote", write_json(result, "compare_host_build.json", args.out))


if __name__ == "__main__":
    main()
