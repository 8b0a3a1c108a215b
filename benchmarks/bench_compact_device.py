"""The device side's compact Adam step (twinflow.device.device_compact.CompactDeviceState.step, bf16 parameters under
"int8_m24": the weight, a residual byte and 8-bit moments) on the GPU: Gparam/s as torch operations (eager), compiled
by torch.compile (the step twinflow ran before its Triton kernel), and as twinflow runs it now (the Triton kernel,
twinflow.device.compact_triton), against the HBM roofline of the bytes it must move; the seconds of each variant's
first call (its compilation); and whether the compiled variants keep the eager step's bits (the CPU kernel's).
With ``--before FILE`` (compact_triton.py of another commit) that commit's kernel runs in the same process, its
bits compared with this one's; ``--sweep`` times this kernel at other ROWS and NUM_WARPS; ``--peers`` adds
bitsandbytes' and torchao's ``AdamW8bit`` on a bfloat16 parameter of the same size (where they are installed).

    python benchmarks/bench_compact_device.py --elements 268435456 --reps 5 [--before OLD.py] [--sweep] [--peers]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import machine_info, write_json  # noqa: E402
from twinflow.base.partition import Segment  # noqa: E402
from twinflow.device import compact_triton, device_compact  # noqa: E402
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


def load_module(path: str):  # noqa: ANN201
    """A compact_triton.py of another commit, as a module of its own."""
    spec = importlib.util.spec_from_file_location("compact_triton_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_state(n: int, variant: str, before=None) -> tuple[device_compact.CompactDeviceState, torch.Tensor]:  # noqa: ANN001
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(n, device="cuda", generator=gen) * 0.02).bfloat16()
    state = device_compact.CompactDeviceState([Segment(0, 0, n, on_cpu=False)], [weight], "int8_m24")
    if variant == "eager":  # the torch operations, as the CPU runs them
        state.residual_step, state.master_step = compact_step.residual_step_, compact_step.master_step_
        state.step_batch = device_compact.BATCH  # bounded scratch
    elif variant == "torch.compile":
        state.residual_step = torch.compile(compact_step.residual_step_, dynamic=True)
        state.master_step = torch.compile(compact_step.master_step_, dynamic=True)
        state.step_batch = device_compact.BATCH
    elif variant == "triton before":
        state.residual_step, state.master_step = before.residual_step_, before.master_step_
    return state, weight


def sweep(n: int, reps: int, roofline: float) -> list[dict]:
    """This kernel alone (one launch over `n` elements, no batching) at other blocks a program (ROWS) and warps
    (NUM_WARPS), each configuration timed in turn over `reps` rounds; the module's own configuration restored."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    weight = (torch.randn(n, device="cuda", generator=gen) * 0.02).bfloat16()
    grad = (torch.randn(n, device="cuda", generator=gen) * 1e-3).bfloat16()
    residual = torch.zeros(n, dtype=torch.int8, device="cuda")
    blocks = -(-n // 256)

    def full(size: int, dtype: torch.dtype, fill: int = 0) -> torch.Tensor:
        return torch.full((size,), fill, dtype=dtype, device="cuda")

    codes = [
        full(n, torch.int8),
        full(blocks, torch.uint8, 15),
        full(n, torch.uint8),
        full(blocks, torch.uint8, 31),
    ]
    c = compact_step.constants(1, HYPER).cuda()
    meta = torch.tensor([0, 12345], device="cuda")
    configs = list(itertools.product((1, 2, 4, 8), (1, 2, 4, 8)))
    times = {k: [] for k in configs}
    chosen = (compact_triton.ROWS, compact_triton.NUM_WARPS)
    try:
        for _ in range(reps):
            for compact_triton.ROWS, compact_triton.NUM_WARPS in configs:
                step = lambda: compact_triton.residual_step_(weight, residual, grad, codes, c, None, meta, False)  # noqa: E731
                step()  # compiles a new configuration; keeps the clock warm
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
                times[compact_triton.ROWS, compact_triton.NUM_WARPS].append((time.perf_counter() - start) / 5)
    finally:
        compact_triton.ROWS, compact_triton.NUM_WARPS = chosen
    rows = []
    for (r, w), ts in times.items():
        seconds = sorted(ts)[len(ts) // 2]
        rows.append({"rows": r, "num_warps": w, "seconds": seconds, "of_roofline": n / seconds / 1e9 / roofline})
        print(f"ROWS {r} NUM_WARPS {w}: {rows[-1]['of_roofline']:.1%}", flush=True)
    return rows


def peer_rows(n: int, grad: torch.Tensor, reps: int) -> dict:
    """bitsandbytes' and torchao's AdamW8bit stepping one bfloat16 parameter of `n` elements: seconds, Gparam/s and
    their state's bytes an element (their first step builds the state: not timed)."""
    rows = {}
    makers = {}
    try:
        import bitsandbytes

        makers["bitsandbytes AdamW8bit"] = lambda p: bitsandbytes.optim.AdamW8bit([p], lr=1e-4, weight_decay=0.01)
    except ImportError as error:
        rows["bitsandbytes AdamW8bit"] = {"error": repr(error)}
    try:
        from torchao.optim import AdamW8bit

        makers["torchao AdamW8bit"] = lambda p: AdamW8bit([p], lr=1e-4, weight_decay=0.01)
    except ImportError as error:
        rows["torchao AdamW8bit"] = {"error": repr(error)}
    for name, make in makers.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        param = torch.nn.Parameter((torch.randn(n, device="cuda", generator=gen) * 0.02).bfloat16())
        param.grad = grad
        opt = make(param)
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        state_bytes = sum(t.numel() * t.element_size() for st in opt.state.values() for t in _tensors(st))
        seconds = timed(opt.step, reps)
        rows[name] = {"seconds": seconds, "gparam_s": n / seconds / 1e9, "first_call_seconds": first,
                      "state_bytes_per_element": state_bytes / n, "weight_bytes_per_element": 2}  # fmt: skip
        print(f"{name}: {rows[name]['gparam_s']:.1f} Gparam/s, state {state_bytes / n:.3f} B/element", flush=True)
        del opt, param
        torch.cuda.empty_cache()
    return rows


def _tensors(state: dict) -> list[torch.Tensor]:
    """The tensors of one parameter's optimizer state (torchao keeps subclasses whose storage is their tensors')."""
    out = []
    for value in state.values():
        if isinstance(value, torch.Tensor) and value.numel() > 1:
            inner = getattr(value, "__tensor_flatten__", None)
            out.extend([getattr(value, name) for name in inner()[0]] if inner else [value])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=1 << 28)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--hbm-gb-s", type=float, default=None, help="the GPU's memory bandwidth (default: by name)")
    parser.add_argument("--variants", nargs="+", default=["eager", "torch.compile", "triton"],
                        choices=["eager", "torch.compile", "triton"], help="eager is the bits' reference")  # fmt: skip
    parser.add_argument("--before", default=None, help="compact_triton.py of another commit, run as 'triton before'")
    parser.add_argument("--sweep", action="store_true", help="time this kernel at other ROWS and NUM_WARPS")
    parser.add_argument("--sweep-elements", type=int, default=1 << 30)
    parser.add_argument("--peers", action="store_true", help="bitsandbytes' and torchao's AdamW8bit rows")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    variants = ["eager"] + [v for v in args.variants if v != "eager"] + (["triton before"] if args.before else [])
    before_module = load_module(args.before) if args.before else None
    n = args.elements
    name = torch.cuda.get_device_name()
    hbm = args.hbm_gb_s or (4800.0 if "H200" in name else 3350.0)  # H200: 4.8 TB/s; H100 SXM: 3.35 TB/s
    gen = torch.Generator(device="cuda").manual_seed(1)
    grad = (torch.randn(n, device="cuda", generator=gen) * 1e-3).bfloat16()
    scale = torch.tensor(0.7, device="cuda")
    result = {"command": sys.argv, "machine": machine_info(), "elements": n, "bytes_per_element": BYTES_PER_ELEMENT,
              "hbm_gb_s": hbm, "roofline_gparam_s": hbm / BYTES_PER_ELEMENT, "variants": {}}  # fmt: skip
    states = {}
    for variant in variants:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        state, weight = make_state(n, variant, before_module)
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
    for variant in variants[1:]:
        same = [torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(states["eager"], states[variant])]
        result["variants"][variant]["bit_for_bit_with_eager"] = all(same)
        print(f"{variant} bit for bit with eager: {all(same)} (weight, residual, codes and scales: {same})")
    if args.sweep:
        result["sweep"] = sweep(args.sweep_elements, args.reps, result["roofline_gparam_s"])
    if args.peers:
        result["peers"] = peer_rows(n, grad, args.reps)
    print(f"wrote {write_json(result, 'bench_compact_device.json', args.out)}")


if __name__ == "__main__":
    main()
