"""Steps a few hundred million parameters with twinflow's CPU Adam kernel and prints throughput.

python examples/cpu_adam_demo.py --params 256e6 --steps 10
"""

import argparse
import time

import torch

from twinflow.host import ops

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is optional

    def tqdm(iterable, **_):
        return iterable


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=256e6, help="parameter count (default 256e6)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--grad-dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--out-dtype", choices=["none", "bf16", "fp16"], default="bf16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()

    n = int(args.params)
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen).to(DTYPES[args.grad_dtype])
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    out = None if args.out_dtype == "none" else [torch.empty(n, dtype=DTYPES[args.out_dtype])]
    bytes_per_param = 4 * 6 + grad.element_size() + (out[0].element_size() if out else 0)

    simd = ops.SIMD_NAMES[ops.resolve_simd()]
    print(f"{n / 1e6:.0f}M params, grads {args.grad_dtype}, copy {args.out_dtype}, {args.threads} threads, {simd}")
    times = []
    for step in tqdm(range(1, args.steps + 1), desc="adam steps", unit="step"):
        start = time.perf_counter()
        ops.adam_step_([param], [grad], [exp_avg], [exp_avg_sq], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                       eps=1e-8, weight_decay=0.01, out_copies=out, num_threads=args.threads)  # fmt: skip
        times.append(time.perf_counter() - start)
    best = sorted(times[1:] or times)[len(times[1:] or times) // 2]  # median, first step excluded
    print(
        f"median step {best * 1e3:.1f} ms: {n / best / 1e9:.2f} Gparam/s, {n * bytes_per_param / best / 1e9:.1f} GB/s"
    )
    assert torch.isfinite(param).all(), "non-finite weights after the demo"


if __name__ == "__main__":
    main()
