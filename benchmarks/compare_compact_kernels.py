"""The compact CPU kernels (`int8`, `int8_m24`) of two checkouts side by side, with their probes, in one run.

    python benchmarks/compare_compact_kernels.py --before OLD_TREE --after . --params 33554432 --threads 2 \
        --rounds 4 [--simd avx2] [--out FILE]

Each round runs one process per tree, the tree that goes first alternating (ABBA), so that drift on the machine
favours neither; each process times its tree's kernels and probes interleaved (bench_cpu_adam.py's q8_fn:
bf16 gradients, a bf16 weight copy, fresh moments and moments spread over the codes' range). Each tree builds
its own kernel (its own TORCH_EXTENSIONS_DIR). Reports, per tree, the median over rounds of Gparam/s and of the
kernel's share of its probe (the probe moves the same bytes with trivial arithmetic), and after/before ratios.
Writes JSON (--out, else $OUT, else benchmarks/results/).
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
SYSTEMS = ("int8", "int8_probe", "int8_spread", "int8_m24", "int8_m24_probe", "int8_m24_spread")


def child(tree: Path, params: int, threads: int, rounds: int) -> dict:
    """Seconds a call (median) of each system, with `tree`'s kernel."""
    sys.path.insert(0, str(tree))
    import torch

    from benchmarks.bench_cpu_adam import q8_fn
    from benchmarks.common import interleaved_medians
    from twinflow.host import ops

    gen = torch.Generator().manual_seed(0)
    out = torch.empty(params, dtype=torch.bfloat16)
    fns = {
        "int8": q8_fn(params, threads, gen, out),
        "int8_probe": q8_fn(params, threads, gen, out, probe=True),
        "int8_spread": q8_fn(params, threads, gen, out, spread=16.0),
        "int8_m24": q8_fn(params, threads, gen, out, m24=True),
        "int8_m24_probe": q8_fn(params, threads, gen, out, probe=True, m24=True),
        "int8_m24_spread": q8_fn(params, threads, gen, out, spread=16.0, m24=True),
    }
    return {"seconds": interleaved_medians(fns, rounds=rounds), "simd": ops.SIMD_NAMES[ops.resolve_simd()]}


def summary(runs: list[dict], params: int) -> dict:
    out = {}
    for name in SYSTEMS:
        rates = [params / r["seconds"][name] / 1e9 for r in runs]
        out[name] = {"gparam_s": statistics.median(rates), "gparam_s_each_round": rates}
    for mode in ("int8", "int8_m24"):
        shares = [r["seconds"][f"{mode}_probe"] / r["seconds"][mode] for r in runs]
        out[mode]["share_of_probe"] = statistics.median(shares)
        out[mode]["share_of_probe_each_round"] = shares
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path)
    parser.add_argument("--after", type=Path, default=ROOT)
    parser.add_argument("--params", type=int, default=1 << 25)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=4, help="processes per tree (ABBA order)")
    parser.add_argument("--calls", type=int, default=7, help="timed calls of each system in a process")
    parser.add_argument("--simd", default=None, help="TWINFLOW_SIMD for both trees (default: the CPU's best)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.params, args.threads, args.calls)))
        return
    if args.before is None:
        parser.error("--before is required: the checkout to compare against")
    sys.path.insert(0, str(ROOT))  # the parent only: a child imports the benchmarks of the tree it times
    from benchmarks.common import abba_sides, machine_info, tree_child, write_json

    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    child_args = ["--params", str(args.params), "--threads", str(args.threads), "--calls", str(args.calls)]
    with tempfile.TemporaryDirectory() as ext_root:
        for r in range(args.rounds):
            for side in abba_sides(r):
                runs[side].append(tree_child(__file__, trees[side], side, Path(ext_root), child_args,
                                             {"TWINFLOW_SIMD": args.simd} if args.simd else None))  # fmt: skip
                rates = "  ".join(f"{k} {args.params / v / 1e9:.3f}" for k, v in runs[side][-1]["seconds"].items())
                print(f"round {r + 1}/{args.rounds} {side}: {rates}", flush=True)

    result = {"machine": machine_info(), "params": args.params, "threads": args.threads, "rounds": args.rounds,
              "calls": args.calls, "simd": runs["after"][0]["simd"], "trees": {k: str(v) for k, v in trees.items()},
              "before": summary(runs["before"], args.params), "after": summary(runs["after"], args.params)}  # fmt: skip
    result["after_over_before"] = {
        name: result["after"][name]["gparam_s"] / result["before"][name]["gparam_s"] for name in SYSTEMS
    }
    print(f"| system ({result['simd']}, {args.threads} threads) | before Gparam/s | after Gparam/s | after/before |"
          " before % of probe | after % of probe |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for name in SYSTEMS:
        b, a = result["before"][name], result["after"][name]
        share = (f"{100 * b['share_of_probe']:.0f}% | {100 * a['share_of_probe']:.0f}%" if "share_of_probe" in a
                 else " | ")  # fmt: skip
        ratio = result["after_over_before"][name]
        print(f"| {name} | {b['gparam_s']:.3f} | {a['gparam_s']:.3f} | {ratio:.2f} | {share} |")
    print("wrote", write_json(result, "compare_compact_kernels.json", args.out))


if __name__ == "__main__":
    main()
