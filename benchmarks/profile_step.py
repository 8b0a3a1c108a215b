"""Where TwinFlowAdam.step()'s time goes: kernel, waits on each event, and the rest.

python benchmarks/profile_step.py --ratios 0.5 1.0
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_step import opt_shapes  # noqa: E402
from benchmarks.common import write_json  # noqa: E402
from twinflow import TwinFlowAdam, twin_flow_adam  # noqa: E402


class Timed:
    """Wraps a callable and adds its wall time to a bucket."""

    def __init__(self, fn, buckets: dict, name: str) -> None:
        self.fn, self.buckets, self.name = fn, buckets, name

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.buckets[self.name] = self.buckets.get(self.name, 0.0) + time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", type=float, nargs="*", default=[0.5, 1.0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in opt_shapes()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    result = {}
    for ratio in args.ratios:
        opt = TwinFlowAdam(params, lr=1e-5, ratio=ratio)
        opt.step()  # warm-up
        buckets: dict[str, float] = {}
        original_kernel = twin_flow_adam.ops.adam_step_
        twin_flow_adam.ops.adam_step_ = Timed(original_kernel, buckets, "kernel")
        st = opt._staging
        for name in ("grad_ready", "upload_done"):
            for ev in getattr(st, name):
                ev.synchronize = Timed(ev.synchronize, buckets, f"wait_{name}")
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            opt.step()
        torch.cuda.synchronize()
        total = (time.perf_counter() - start) / args.steps
        twin_flow_adam.ops.adam_step_ = original_kernel
        per_step = {k: v / args.steps for k, v in buckets.items()}
        per_step["other"] = total - sum(per_step.values())
        result[str(ratio)] = {"step_s": total, **per_step, "chunks": len(opt._plan_chunks(opt._cpu))}
        print(
            f"ratio {ratio}: step {total * 1e3:.1f} ms: "
            + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in per_step.items())
        )
        del opt
    write_json(result, "profile_step.json", args.out)


if __name__ == "__main__":
    main()
