"""The device side's compact Adam step (twinflow.device.device_compact.CompactDeviceState.step, bf16 parameters under
"int8_m24": the weight, a residual byte and 8-bit moments) on the GPU: Gparam/s as torch operations (eager), compiled
by torch.compile (the step twinflow ran before its Triton kernel), and as twinflow runs it now (the Triton kernel,
twinflow.device.compact_triton), against the HBM roofline of the bytes it must move; the seconds of each variant's
first call (its compilation); and whether the compiled variants keep the eager step's bits (the CPU kernel's).

    python benchmarks/bench_compact_device.py --elements 268435456 --reps 5
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
from twinflow.base.partition import Segment  # noqa: E402
from twinflow.device import device_compact  # noqa: E402
from twinflow.precision import compact_step  # noqa: E402

# bytes per element a fused step must move: weight 2 + residual 1 + codes 2 read and written, the bf16 gradient read
BYTES_PER_ELEMENT = 2 * (2 + 1 + 2) + 2
HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True, bias_correction=True)


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


def make_state(n: int, variant: str) -> tuple[device_compact.CompactDeviceState, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(n, device="cuda", generator=gen) * 0.02).bfloat16()
    state = device_compact.CompactDeviceState([Segment(0, 0, n, on_cpu=False)], [weight], "int8_m24")
    if variant == "eager":  # the torch operations, as the CPU runs them
        state.residual_step, state.master_step = compact_step.residual_step_, compact_step.master_step_
    elif variant == "torch.compile":
        state.residual_step = torch.compile(compact_step.residual_step_, dynamic=True)
        state.master_step = torch.compile(compact_step.master_step_, dynamic=True)
    return state, weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=1 << 28)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--hbm-gb-s", type=float, default=None, help="the GPU's memory bandwidth (default: by name)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n = args.elements
    name = torch.cuda.get_device_name()
    hbm = args.hbm_gb_s or (4800.0 if "H200" in name else 3350.0)  # H200: 4.8 TB/s; H100 SXM: 3.35 TB/s
    gen = torch.Generator(device="cuda").manual_seed(1)
    grad = (torch.randn(n, device="cuda", generator=gen) * 1e-3).bfloat16()
    scale = torch.tensor(0.7, device="cuda")
    result = {"command": sys.argv, "machine": machine_info(), "elements": n, "bytes_per_element": BYTES_PER_ELEMENT,
              "hbm_gb_s": hbm, "roofline_gparam_s": hbm / BYTES_PER_ELEMENT, "variants": {}}  # fmt: skip
    states = {}
    for variant in ("eager", "torch.compile", "triton"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        state, weight = make_state(n, variant)
        state_bytes = torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()

        def step(state=state) -> None:
            state.step(state.states, [HYPER], [0], lambda i: grad, scale)

        torch.cuda.synchronize()
        start = time.perf_counter()
        step()  # one step from the same start: compared below (its seconds: the compilation, if any)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        st = state.states[0]
        states[variant] = [t.clone() for t in (weight, st.residual, *st.codes)]
        seconds = timed(step, args.reps)
        entry = {"seconds": seconds, "first_call_seconds": first, "gparam_s": n / seconds / 1e9,
                 "of_roofline": n / seconds / 1e9 / result["roofline_gparam_s"],
                 "scratch_gib": (torch.cuda.max_memory_allocated() - before) / 2**30,
                 "state_bytes_per_element": state_bytes / n}  # fmt: skip
        result["variants"][variant] = entry
        print(f"{variant}: {entry['gparam_s']:.1f} Gparam/s ({entry['of_roofline']:.1%} of the roofline), "
              f"first call {first:.2f} s, scratch {entry['scratch_gib']:.2f} GiB", flush=True)  # fmt: skip
        del state, weight, step
        torch.cuda.empty_cache()
    for variant in ("torch.compile", "triton"):
        same = [torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(states["eager"], states[variant])]
        result["variants"][variant]["bit_for_bit_with_eager"] = all(same)
        print(f"{variant} bit for bit with eager: {all(same)} (weight, residual, codes and scales: {same})")
    print(f"wrote {write_json(result, 'bench_compact_device.json', args.out)}")


if __name__ == "__main__":
    main()
