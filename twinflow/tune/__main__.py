"""``python -m twinflow.plan``: the ratio twinflow would choose for an OPT model here, and a check of it.

Builds a randomly initialised OPT model of the given size, lets
``TwinFlowAdam(ratio="auto")`` decide, then trains a few steps at each of
``--ratios`` and prints the model's predicted step time and peak GPU memory
next to the measured ones. Progress goes to stderr as it measures, the
result to stdout. Without a CUDA GPU the defaults are small (opt-tiny, 2x64
tokens, ratios 0 0.5 1: well under a minute on two cores).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from twinflow.base.progress import terminal_bar
from twinflow.models import OPT_SHAPES, build_opt
from twinflow.optim.twin_flow_adam import TwinFlowAdam
from twinflow.plan import Inputs, explain, predict_peak, predict_time

# (GPU, CPU) defaults: OPT-1.3B at 4x1024 tokens had not finished one backward after 150 s on a 2-core CPU
DEFAULTS = {
    "model": ("opt-1.3b", "opt-tiny"),
    "batch": (4, 2),
    "seq": (1024, 64),
    "ratios": ([0.0, 0.25, 0.5, 0.75, 1.0], [0.0, 0.5, 1.0]),
}
_NO_GPU = (
    "No GPU here: the 'device side' is this CPU too (torch's fused Adam, in host memory), so offloading saves no\n"
    "memory; the ratio only chooses which Adam steps faster on these cores, twinflow's kernel or torch's. The\n"
    "memory columns are not measured (shown as -)."
)
_SLOW_STEP_S = 1.0  # a step this long gets its own progress line


class Progress:
    """Progress on stderr: a tqdm bar where tqdm is installed and stderr is a terminal, else one line per
    measurement (and per step that takes over a second), which logs and pipes keep readable."""

    def __init__(self, measurements: int, steps_each: int, bar: bool | None = None) -> None:
        self.total, self.k, self.steps_each = measurements, 0, steps_each
        self.bar = terminal_bar(sys.stderr, bar, total=measurements * steps_each, unit="step")

    def line(self, text: str) -> None:
        """A line above the bar, or alone."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def start(self, label: str) -> None:
        self.k += 1
        if self.bar is not None:
            self.bar.set_description(f"[{self.k}/{self.total}] {label}")
        else:
            self.line(f"[{self.k}/{self.total}] {label}: {self.steps_each} steps ...")

    def step(self, index: int, seconds: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
        elif seconds >= _SLOW_STEP_S:
            self.line(f"    step {index + 1}/{self.steps_each}: {seconds:.1f} s")

    def done(self, text: str) -> None:
        self.line(f"[{self.k}/{self.total}] {text}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _train_steps(model, opt, batch: int, seq: int, warmup: int, steps: int, device: str,
                 tick: Callable[[int, float], None] = lambda i, s: None) -> dict[str, Any]:  # fmt: skip
    """Median step time, every timed step's time and peak GPU memory of a synthetic-token training loop (one
    sync per step); `tick(i, seconds)` after each step, warm-up included."""
    gen = torch.Generator(device=device).manual_seed(1)
    vocab = model.config.vocab_size
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if opt.ratio is None:  # ratio="auto" times the forward and backward before its first step: warm them up
        tokens = torch.randint(0, vocab, (batch, seq), device=device, generator=gen)
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.zero_grad(set_to_none=True)
    times = []
    for step in range(warmup + steps):
        tokens = torch.randint(0, vocab, (batch, seq), device=device, generator=gen)
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        if device == "cuda":
            torch.cuda.synchronize()
        took = time.perf_counter() - start
        if step >= warmup:
            times.append(took)
        tick(step, took)
    opt.synchronize()
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else float("nan")
    return {"step_s": sorted(times)[len(times) // 2], "steps_s": times, "peak_bytes": peak}


def _gib(nbytes: float) -> str:
    return "-" if nbytes != nbytes else f"{nbytes / 2**30:.1f}"  # NaN: not measured


def _strict(value: Any) -> Any:
    """`value` with every non-finite float (not measured, no limit) as None: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return value


def recommend(rows: list[dict[str, Any]], auto_ratio: float) -> tuple[float, str]:
    """The ratio to recommend from the measured `rows` (each with ``ratio`` and ``steps_s``) and why: auto's
    choice, unless another ratio measured faster beyond the run-to-run spread (its slowest step faster than the
    chosen ratio's fastest), when the measurement wins over the prediction."""
    by_ratio: dict[float, list[float]] = {}
    for row in rows:
        by_ratio.setdefault(row["ratio"], []).extend(t for t in row["steps_s"] if t == t)
    measured = {r: sorted(ts) for r, ts in by_ratio.items() if ts}
    if auto_ratio not in measured or len(measured) < 2:
        return auto_ratio, "auto's choice (no other ratio measured to compare it with)"
    median = {r: ts[len(ts) // 2] for r, ts in measured.items()}
    fastest = min(median, key=median.__getitem__)
    if fastest == auto_ratio:
        return auto_ratio, "auto's choice, also the fastest measured"
    if measured[fastest][-1] < measured[auto_ratio][0]:
        return fastest, (
            f"measured fastest ({median[fastest]:.3f} s a step against {median[auto_ratio]:.3f} s at auto's "
            f"{auto_ratio:.2f}, beyond the run-to-run spread): the prediction misses something on this machine; "
            f"set TwinFlowAdam(ratio={fastest:g}) to use it, as ratio='auto' would choose {auto_ratio:.2f}"
        )
    return auto_ratio, (
        f"auto's choice: ratio {fastest:.2f} measured {median[fastest]:.3f} s against {median[auto_ratio]:.3f}"
        " s, within the run-to-run spread (the slowest and fastest steps of the two overlap)"
    )


def _arg(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def _defaults(names: list[str], side: int) -> str:
    return ", ".join(f"--{n} {_arg(DEFAULTS[n][side])}" for n in names)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m twinflow.tune", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    gpu_cpu = "(default: %s with a CUDA GPU, %s without)"
    parser.add_argument(
        "--model",
        default=None,
        choices=sorted(OPT_SHAPES),
        help="OPT shape to build, randomly initialised " + gpu_cpu % DEFAULTS["model"],
    )
    parser.add_argument("--batch", type=int, default=None, help="sequences per step " + gpu_cpu % DEFAULTS["batch"])
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence " + gpu_cpu % DEFAULTS["seq"])
    parser.add_argument(
        "--placement",
        default="last",
        choices=["first", "last"],
        help="which end of the parameter order the CPU steps (default: %(default)s)",
    )
    parser.add_argument(
        "--clip",
        type=float,
        default=None,
        help="max_grad_norm; with clipping the CPU waits for the global norm (default: none)",
    )
    parser.add_argument(
        "--delay-after",
        type=int,
        default=None,
        help="delay_after: the CPU share's update lands one step late after this many exact steps (default: off)",
    )
    parser.add_argument(
        "--speculate",
        action="store_true",
        help="speculate=True: with --clip, the CPU steps as gradients land and steps again if the norm clips",
    )
    parser.add_argument(
        "--weights-first",
        action="store_true",
        help="weights_first=True: with --clip, the CPU writes the new weights first and commits its state behind them",
    )
    parser.add_argument(
        "--state-precision",
        default="fp32",
        choices=["fp32", "int8", "int8_m24"],
        help="state_precision of both sides' optimizer state (default: %(default)s)",
    )
    parser.add_argument(
        "--budget-gib",
        type=float,
        default=None,
        help="GPU memory to stay within, in GiB (default: what the GPU has free)",
    )
    parser.add_argument(
        "--ratios",
        type=float,
        nargs="*",
        default=None,
        help="ratios to measure against the prediction " + gpu_cpu % tuple(map(_arg, DEFAULTS["ratios"])),
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at each ratio (default: %(default)s)")
    parser.add_argument(
        "--steps", type=int, default=5, help="timed steps at each ratio; the median is reported (default: %(default)s)"
    )
    parser.add_argument(
        "--local-ranks",
        type=int,
        default=1,
        help="plan as one of this many ranks sharing this host, as under torchrun --nproc-per-node N: each gets "
        "1/N of the host's memory and of its cores, and the CPU kernel is probed while N-1 copies of it run beside "
        "it (the measured rows run alone) (default: %(default)s)",
    )
    parser.add_argument("--json", default=None, help="also write the decision and the table to this file")
    return parser  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.local_ranks > 1:  # planned as one of a node's ranks: its host share and its cores (twinflow.base.node)
        os.environ["LOCAL_WORLD_SIZE"] = str(args.local_ranks)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        os.environ.setdefault("TWINFLOW_NUM_THREADS", str(max(1, cores // args.local_ranks)))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    side = 0 if device == "cuda" else 1
    defaulted = [name for name in DEFAULTS if getattr(args, name) is None]
    for name in defaulted:
        setattr(args, name, DEFAULTS[name][side])
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    budget = int(args.budget_gib * (1 << 30)) if args.budget_gib else None
    progress = Progress(1 + len(args.ratios), args.warmup + args.steps)
    small = ""
    if device == "cpu" and defaulted:
        ours = ", ".join(f"--{n} {_arg(getattr(args, n))}" for n in defaulted)
        small = f"no CUDA GPU: small defaults for a CPU ({ours}; with a GPU: {_defaults(defaulted, 0)})"
        progress.line(small)

    def measure(ratio: float | str) -> tuple[dict[str, Any], dict[str, Any] | None]:
        label = "ratio='auto' (its first step measures the kernel and the device side's Adam)"
        progress.start(label if ratio == "auto" else f"ratio {ratio:.2f}")
        torch.manual_seed(0)
        model = build_opt(args.model, device, dtype)
        opt = TwinFlowAdam(model.parameters(), lr=1e-5, ratio=ratio, placement=args.placement,
                           max_grad_norm=args.clip, delay_after=args.delay_after, speculate=args.speculate,
                           weights_first=args.weights_first, state_precision=args.state_precision,
                           memory_budget=budget).attach(model)  # fmt: skip
        result = _train_steps(model, opt, args.batch, args.seq, args.warmup, args.steps, device, progress.step)
        opt.detach()
        chosen = f"chose {opt.ratio:.2f}, " if ratio == "auto" else ""
        progress.done(f"{chosen}median step {result['step_s']:.3f} s over {args.steps} steps")
        return result, opt.auto_decision

    auto, decision = measure("auto")
    inputs = Inputs(**decision["inputs"])
    rows = [{"ratio": decision["ratio"], "auto": True, **auto}]
    for ratio in args.ratios:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        try:
            measured, _ = measure(ratio)
        except torch.OutOfMemoryError:
            measured = {"step_s": float("nan"), "steps_s": [], "peak_bytes": float("nan")}
            progress.done("out of device memory")
        rows.append({"ratio": ratio, "auto": False, **measured})
    progress.close()
    overlap, eager = decision["overlap"], decision["eager"]
    if args.local_ranks > 1:
        print(f"\nplanned as one of {args.local_ranks} ranks on this host: {os.environ['TWINFLOW_NUM_THREADS']} "
              "kernel threads and its share of the host's memory; the CPU kernel probed beside the others' (the "
              "measured rows ran alone, so their CPU share is faster than a rank's beside the others)")  # fmt: skip
    print(f"\n{args.model}, {args.batch}x{args.seq} tokens, placement {args.placement}, clip {args.clip}, "
          f"delay_after {args.delay_after}, speculate {args.speculate}, weights_first {args.weights_first}, "
          f"state_precision {args.state_precision}")  # fmt: skip
    if device == "cuda":
        print(f"GPU memory budget {_gib(inputs.budget_bytes)} GiB (what 'auto' plans within, after its margin)")
        print(f"inputs: forward {inputs.forward_s * 1e3:.0f} ms, backward {inputs.backward_s * 1e3:.0f} ms, "
              f"CPU kernel {inputs.cpu_elements_per_s / 1e9:.2f} Gparam/s, "
              f"GPU Adam {inputs.gpu_elements_per_s / 1e9:.1f} Gparam/s, "
              f"PCIe {inputs.pcie_bytes_per_s / 1e9:.1f} GB/s")  # fmt: skip
    else:
        if small:
            print(small)
        print(_NO_GPU)
        print(f"inputs: forward {inputs.forward_s * 1e3:.0f} ms, backward {inputs.backward_s * 1e3:.0f} ms, "
              f"CPU kernel {inputs.cpu_elements_per_s / 1e9:.2f} Gparam/s, "
              f"torch's Adam on this CPU {inputs.gpu_elements_per_s / 1e9:.2f} Gparam/s")  # fmt: skip
    print(f"{'ratio':>8} {'predicted s':>12} {'measured s':>11} {'pred. GiB':>10} {'peak GiB':>9}")
    for row in rows:
        row["predicted_s"] = predict_time(inputs, row["ratio"], args.placement, overlap, eager, decision["delayed"],
                                          decision["speculative"], decision.get("weights_first", False))  # fmt: skip
        row["predicted_peak_bytes"] = predict_peak(inputs, row["ratio"]) if device == "cuda" else float("nan")
        tag = "  <- auto" if row["auto"] else ""
        print(f"{row['ratio']:8.2f} {row['predicted_s']:12.3f} {row['step_s']:11.3f} "
              f"{_gib(row['predicted_peak_bytes']):>10} {_gib(row['peak_bytes']):>9}{tag}")  # fmt: skip
    print(explain(decision))
    ratio, why = recommend(rows, decision["ratio"])
    print(f"recommendation: ratio={ratio:.2f}: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_strict({"args": vars(args), "device": device, "decision": decision, "rows": rows,
                               "recommendation": {"ratio": ratio, "why": why}}), f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
