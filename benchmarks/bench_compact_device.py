"""The device side's compact Adam step (twinflow.compact_step.step_weight_master_) on the GPU: Gparam/s, eager
and under torch.compile, against the HBM roofline of the bytes it must move.

    python benchmarks/bench_compact_device.py --elements 67108864 --reps 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import machine_info, write_json  # noqa: E402
from twinflow import compact, compact_step, weight_master  # noqa: E402

# bytes per element a fused step must move: weight 2 + residual 1 + codes 2 read and written, the bf16 gradient read
BYTES_PER_ELEMENT = 2 * (2 + 1 + 2) + 2


def timed(fn, reps: int) -> float:
    """Median seconds of `fn()` over `reps` calls (after one warm-up), the device synchronised around each."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=1 << 26)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--hbm-gb-s", type=float, default=3350.0, help="the GPU's memory bandwidth (H100 SXM)")
    parser.add_argument(
        "--no-fp-fusion",
        action="store_true",
        help="compile without mul+add -> fma contraction (inductor's emulate_precision_casts)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n, dev = args.elements, torch.device("cuda")
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True)
    hi, lo = compact.encode_master(torch.randn(n) * 0.02)
    weight, residual = (t.to(dev) for t in weight_master.split(hi, lo))
    codes = {k: t.to(dev) for k, t in zip(compact_step.CODE_KEYS, compact.fresh(n))}
    grad = (torch.randn(n, device=dev) * 1e-3).bfloat16()
    step = 10  # the same step every call: the work does not depend on it, and compiled code is not re-traced

    def eager() -> None:
        compact_step.step_weight_master_(weight, residual, grad, codes, step, 0, hyper)

    result = {"command": sys.argv, "machine": machine_info(), "elements": n, "bytes_per_element": BYTES_PER_ELEMENT,
              "roofline_gparam_s": args.hbm_gb_s / BYTES_PER_ELEMENT, "variants": {}}  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    variants = {"eager": eager}
    if args.no_fp_fusion:
        import torch._inductor.config as inductor

        inductor.emulate_precision_casts = True  # also keeps Triton from fusing a multiply and an add into an fma
    result["no_fp_fusion"] = args.no_fp_fusion
    compiled = torch.compile(compact_step.step_weight_master_, dynamic=False)

    def fused() -> None:
        compiled(weight, residual, grad, codes, step, 0, hyper)

    variants["compiled"] = fused
    # one step from the same state by each: does the compiled step keep the eager (the CPU kernel's) bits?
    state = [weight, residual, *codes.values()]
    start = [t.clone() for t in state]
    after = {}
    for name, fn in variants.items():
        for t, s0 in zip(state, start):
            t.copy_(s0)
        try:
            fn()
            after[name] = [t.clone() for t in state]
        except Exception as exc:
            after[name] = None
            print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    if after.get("compiled") is not None:
        pairs = zip(after["eager"], after["compiled"])
        same = [torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs]
        result["compiled_bit_for_bit"] = all(same)
        print(f"compiled step bit for bit with eager: {all(same)} (weight, residual, codes: {same})", flush=True)
    for name, fn in variants.items():
        try:
            seconds = timed(fn, args.reps)
        except Exception as exc:  # a failure to compile is a result too
            result["variants"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            print(f"{name}: {result['variants'][name]['error']}", flush=True)
            continue
        entry = {"seconds": seconds, "gparam_s": n / seconds / 1e9,
                 "of_roofline": n / seconds / 1e9 / result["roofline_gparam_s"],
                 "peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}  # fmt: skip
        result["variants"][name] = entry
        print(f"{name}: {entry['gparam_s']:.1f} Gparam/s ({entry['of_roofline']:.1%} of the roofline), "
              f"peak scratch {entry['peak_extra_gib']:.1f} GiB", flush=True)  # fmt: skip
        torch.cuda.reset_peak_memory_stats()
    print(f"wrote {write_json(result, 'bench_compact_device.json', args.out)}")


if __name__ == "__main__":
    main()
