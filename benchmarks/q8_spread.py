"""The 8-bit kernel's speed when moments fill the codes' whole range, beside its speed on plain random ones.

    python benchmarks/q8_spread.py --params 268435456 --threads 16 --out FILE

Random normal gradients give moments within a few binades of their block's
largest, so the bottom of the codes' range is seldom used. A trained model's
blocks hold moments many binades apart (outlier features, rows that see few
tokens); `spread` gradients imitate that with magnitudes spread evenly over
2^-16..1 (log scale), which puts about one exp_avg in six in the codes' bottom
binade (94% of 16-lane vectors hold one). Each case steps the same tensors
repeatedly, so its moments settle to its gradients' spread. Uses only the
public op and twinflow.precision.compact.fresh, so one copy of this file times any
version of the kernel (for A/B runs). Writes JSON.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import interleaved_medians, machine_info  # noqa: E402
from twinflow.host import ops  # noqa: E402
from twinflow.precision import compact


def spread_grad(n: int, gen: torch.Generator, bits: float) -> torch.Tensor:
    """Normal signs and mantissas, magnitudes scaled by 2^-U(0, bits)."""
    return (torch.randn(n, generator=gen) * torch.exp2(-bits * torch.rand(n, generator=gen))).bfloat16()


def q8_case(n: int, threads: int, grad: torch.Tensor, gen: torch.Generator):
    p, out, state, step = torch.randn(n, generator=gen), torch.empty(n, dtype=torch.bfloat16), compact.fresh(n), [0]

    def run() -> None:
        step[0] += 1
        ops.adam_step_q8_([p], [grad], *([t] for t in state), [step[0]], lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.01, out_copies=[out], num_threads=threads)  # fmt: skip

    return run


def fp32_case(n: int, threads: int, grad: torch.Tensor, gen: torch.Generator):
    p, m, v, out, step = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n), torch.empty_like(grad), [0]

    def run() -> None:
        step[0] += 1
        ops.adam_step_([p], [grad], [m], [v], [step[0]], lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                       out_copies=[out], num_threads=threads)  # fmt: skip

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1 << 28)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--spread-bits", type=float, default=16.0)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    n, gen = args.params, torch.Generator().manual_seed(0)
    plain = torch.randn(n, generator=gen).bfloat16()
    spread = spread_grad(n, gen, args.spread_bits)
    fns = {
        "int8_plain": q8_case(n, args.threads, plain, gen),
        "int8_spread": q8_case(n, args.threads, spread, gen),
        "fp32_plain": fp32_case(n, args.threads, plain, gen),
        "fp32_spread": fp32_case(n, args.threads, spread, gen),
    }
    medians = interleaved_medians(fns, rounds=args.rounds, warmup=3)
    result = {
        "label": args.label,
        "machine": machine_info(),
        "params": n,
        "threads": args.threads,
        "spread_bits": args.spread_bits,
        "gparam_s": {k: n / s / 1e9 for k, s in medians.items()},
    }
    g = result["gparam_s"]
    result["ratios"] = {"int8_spread_vs_plain": g["int8_spread"] / g["int8_plain"],
                        "int8_vs_fp32_plain": g["int8_plain"] / g["fp32_plain"],
                        "int8_vs_fp32_spread": g["int8_spread"] / g["fp32_spread"]}  # fmt: skip
    print(args.label, {k: round(v, 3) for k, v in {**g, **result["ratios"]}.items()}, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
