"""``python -m twinflow.tune``: the ratio twinflow would choose for an OPT model here, and a check of it.

Builds a randomly initialised OPT model of the given size, lets
``TwinFlowAdam(ratio="auto")`` decide, then trains a few steps at each of
``--ratios`` and prints the model's predicted step time and peak GPU memory
next to the measured ones.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

import torch

from twinflow.models import OPT_SHAPES, build_opt
from twinflow.tune import Inputs, predict_peak, predict_time
from twinflow.twin_flow_adam import TwinFlowAdam

_NO_GPU = (
    "No GPU here: the 'device side' runs on this CPU too, so offloading saves neither memory nor time.\n"
    "There is no memory budget and no PCIe to measure; 'auto' recommends ratio 0. The table compares\n"
    "predicted and measured step times on this CPU; the memory columns are not measured (shown as -)."
)


def _train_steps(model, opt, batch: int, seq: int, warmup: int, steps: int, device: str) -> dict[str, float]:
    """Median step time and peak GPU memory of a synthetic-token training loop (one sync per step)."""
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
        if step >= warmup:
            times.append(time.perf_counter() - start)
    opt.synchronize()
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else float("nan")
    return {"step_s": sorted(times)[len(times) // 2], "peak_bytes": peak}


def _gib(nbytes: float) -> str:
    return "-" if nbytes != nbytes else f"{nbytes / 2**30:.1f}"  # NaN: not measured


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m twinflow.tune", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="opt-1.3b",
        choices=sorted(OPT_SHAPES),
        help="OPT shape to build, randomly initialised (default: %(default)s)",
    )
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default: %(default)s)")
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
        "--budget-gib",
        type=float,
        default=None,
        help="GPU memory to stay within, in GiB (default: what the GPU has free)",
    )
    parser.add_argument(
        "--ratios",
        type=float,
        nargs="*",
        default=[0.0, 0.25, 0.5, 0.75, 1.0],
        help="ratios to measure against the prediction (default: %(default)s)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at each ratio (default: %(default)s)")
    parser.add_argument(
        "--steps", type=int, default=5, help="timed steps at each ratio; the median is reported (default: %(default)s)"
    )
    parser.add_argument("--json", default=None, help="also write the decision and the table to this file")
    return parser  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    budget = int(args.budget_gib * (1 << 30)) if args.budget_gib else None

    def measure(ratio: float | str) -> tuple[dict[str, float], dict[str, Any] | None]:
        torch.manual_seed(0)
        model = build_opt(args.model, device, dtype)
        opt = TwinFlowAdam(model.parameters(), lr=1e-5, ratio=ratio, placement=args.placement,
                           max_grad_norm=args.clip, delay_after=args.delay_after, speculate=args.speculate,
                           memory_budget=budget).attach(model)  # fmt: skip
        result = _train_steps(model, opt, args.batch, args.seq, args.warmup, args.steps, device)
        opt.detach()
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
            measured = {"step_s": float("nan"), "peak_bytes": float("nan")}
        rows.append({"ratio": ratio, "auto": False, **measured})
    overlap, eager = decision["overlap"], decision["eager"]
    print(f"\n{args.model}, {args.batch}x{args.seq} tokens, placement {args.placement}, clip {args.clip}, "
          f"delay_after {args.delay_after}, speculate {args.speculate}")  # fmt: skip
    if device == "cuda":
        print(f"GPU memory budget {_gib(inputs.budget_bytes)} GiB (what 'auto' plans within, after its margin)")
        print(f"inputs: forward {inputs.forward_s * 1e3:.0f} ms, backward {inputs.backward_s * 1e3:.0f} ms, "
              f"CPU kernel {inputs.cpu_elements_per_s / 1e9:.2f} Gparam/s, "
              f"GPU Adam {inputs.gpu_elements_per_s / 1e9:.1f} Gparam/s, "
              f"PCIe {inputs.pcie_bytes_per_s / 1e9:.1f} GB/s")  # fmt: skip
    else:
        print(_NO_GPU)
        print(f"inputs: forward {inputs.forward_s * 1e3:.0f} ms, backward {inputs.backward_s * 1e3:.0f} ms, "
              f"CPU kernel {inputs.cpu_elements_per_s / 1e9:.2f} Gparam/s")  # fmt: skip
    print(f"{'ratio':>8} {'predicted s':>12} {'measured s':>11} {'pred. GiB':>10} {'peak GiB':>9}")
    for row in rows:
        row["predicted_s"] = predict_time(inputs, row["ratio"], args.placement, overlap, eager, decision["delayed"],
                                          decision["speculative"])  # fmt: skip
        row["predicted_peak_bytes"] = predict_peak(inputs, row["ratio"]) if device == "cuda" else float("nan")
        tag = "  <- auto" if row["auto"] else ""
        print(f"{row['ratio']:8.2f} {row['predicted_s']:12.3f} {row['step_s']:11.3f} "
              f"{_gib(row['predicted_peak_bytes']):>10} {_gib(row['peak_bytes']):>9}{tag}")  # fmt: skip
    print(f"recommendation: ratio={decision['ratio']:.2f}")
    if args.json:
        # Not measured (NaN) is null: the file stays strict JSON.
        rows = [{k: None if v != v else v for k, v in row.items()} for row in rows]
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": device, "decision": decision, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
