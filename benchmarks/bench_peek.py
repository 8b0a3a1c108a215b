"""The kernel's weights-first passes: the peek (new weights only) and the commit (the state), against one pass.

    python benchmarks/bench_peek.py [--params 268435456] [--threads 16] [--rounds 9] [--precision fp32] [--out FILE]

fp32 masters and moments (--precision int8: 8-bit moments; int8_m24: and 24-bit masters), bf16 gradients and
bf16 weight copies, AdamW. Timed interleaved (median of --rounds
after warm-ups), each against its own bandwidth probe (the same loads and stores, trivial arithmetic):

  single  ops.adam_step_ with the weight copy: reads master, moments and gradient, writes all but the gradient
          (28 bytes a parameter)
  peek    ops.adam_step_(peek=True): reads the same, writes only the weight copy (16 bytes)
  commit  ops.adam_step_ without a copy: reads the same, writes master and moments (26 bytes)

(The 8-bit passes are ops.adam_step_q8_'s, with fewer bytes: BYTES below.)

Also reported: peek + commit against single (the CPU's total work per step under weights-first), and what
that means for the CPU shares of the issue's two configurations (OPT-6.7B at ratio 0.5, OPT-2.7B at ratio 0.4):
the CPU seconds on the step's critical path (peek against single) and the CPU seconds per step in all (which
must fit in one iteration). Writes JSON (--out, else $OUT/bench_peek.json, else benchmarks/results/).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import interleaved_medians, machine_info, write_json  # noqa: E402
from twinflow.host import ops  # noqa: E402
from twinflow.precision import compact

# bytes a parameter per pass: masters (4, or 3 for 24 bits), two moments (4 + 4, or 1 + 1) and the gradient (2)
# read; the single pass writes the state and the copy (2), the peek the copy, the commit the state
BYTES = {
    "fp32": {"single": 28, "peek": 16, "commit": 26},
    "int8": {"single": 16, "peek": 10, "commit": 14},
    "int8_m24": {"single": 14, "peek": 9, "commit": 12},
}
# CPU-stepped parameters of the issue's configurations (twinflow's split of the OPT models' parameters)
SHARES = {"opt-6.7b ratio 0.5": 3_329_236_992, "opt-2.7b ratio 0.4": int(0.4 * 2_651_596_800)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1 << 28)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--precision", default="fp32", choices=tuple(BYTES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n, gen = args.params, torch.Generator().manual_seed(0)
    grad, out = torch.randn(n, generator=gen).bfloat16(), torch.empty(n, dtype=torch.bfloat16)
    # the Adam passes' state, and the probes' own (a probe overwrites its state with meaningless values)
    sets = [[torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-6]
            for _ in range(2)]  # fmt: skip
    if args.precision != "fp32":  # masters (float32 or 24-bit) and encoded moments
        sets = [[compact.Master24.empty(n).copy_(p) if args.precision == "int8_m24" else p,
                 compact.encode(m, v)] for p, m, v in sets]  # fmt: skip
    hyper = dict(lr=1e-6, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, num_threads=args.threads)
    step = [0]

    def kernel(kind: str, probe: bool):
        copies = None if kind == "commit" else [out]
        peek = kind == "peek"
        if args.precision == "fp32":
            master, m, v = sets[probe]
        else:
            masters, m24 = compact.kernel_masters([sets[probe][0]])
            q8 = [[t] for t in sets[probe][1]]

        def run() -> None:
            threads = args.threads
            if probe and args.precision == "fp32":
                ops.bandwidth_probe_([master], [grad], [m], [v], out_copies=copies, num_threads=threads, peek=peek)
            elif probe:
                ops.bandwidth_probe_q8_(masters, [grad], *q8, out_copies=copies, num_threads=threads, peek=peek, **m24)
            elif args.precision == "fp32":
                step[0] += 1
                ops.adam_step_([master], [grad], [m], [v], [step[0]], out_copies=copies, peek=peek, **hyper)
            else:
                step[0] += 1
                ops.adam_step_q8_(masters, [grad], *q8, [step[0]], out_copies=copies, peek=peek, **m24, **hyper)

        return run

    ops.load()
    sizes = BYTES[args.precision]
    fns = {f"{kind}{'_probe' if probe else ''}": kernel(kind, probe) for kind in sizes for probe in (False, True)}
    seconds = interleaved_medians(fns, args.rounds, warmup=2)
    rows = {}
    for kind, per in sizes.items():
        s, ceiling = seconds[kind], seconds[f"{kind}_probe"]
        rows[kind] = {"seconds": s, "gparam_s": n / s / 1e9, "gb_s": n * per / s / 1e9, "bytes_per_param": per,
                      "probe_gb_s": n * per / ceiling / 1e9, "of_probe": ceiling / s}  # fmt: skip
    both = seconds["peek"] + seconds["commit"]
    projection = {}
    for name, k in SHARES.items():
        projection[name] = {"single_s": k * seconds["single"] / n, "peek_s": k * seconds["peek"] / n,
                            "peek_plus_commit_s": k * both / n}  # fmt: skip
    result = {
        "benchmark": "bench_peek",
        "command": "python benchmarks/bench_peek.py " + " ".join(sys.argv[1:]),
        "machine": machine_info(),
        "params": n,
        "precision": args.precision,
        "threads": args.threads,
        "rounds": args.rounds,
        "results": rows,
        "peek_plus_commit_over_single": both / seconds["single"],
        "peek_over_single": seconds["peek"] / seconds["single"],
        "cpu_share_seconds": projection,
    }
    name = "bench_peek.json" if args.precision == "fp32" else f"bench_peek_{args.precision}.json"
    path = write_json(result, name, args.out)
    print("| pass | bytes/param | GB/s | probe GB/s | of probe |\n| --- | --- | --- | --- | --- |")
    for kind, r in rows.items():
        print(f"| {kind} | {r['bytes_per_param']} | {r['gb_s']:.1f} | {r['probe_gb_s']:.1f} | {r['of_probe']:.1%} |")
    single = seconds["single"]
    print(f"peek + commit = {both / single:.2f} x single; peek = {seconds['peek'] / single:.2f} x")
    for name, p in projection.items():
        print(f"{name}: single {p['single_s']:.3f} s, peek {p['peek_s']:.3f} s, "
              f"peek + commit {p['peek_plus_commit_s']:.3f} s")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
