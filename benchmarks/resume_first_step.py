"""Where the first step after a portable load goes under ratio="auto" (which builds the state then, and puts the
loaded state into it), against a fresh run's first step: one process, the state in `int8_m24` (or another
precision), a model of LAYERS square bf16 linears.

Each round builds a fresh model and optimizer (ratio="auto") and takes one step, then builds another, loads the
checkpoint saved at the start and takes one step; the loaded run's step is split into the time in
``apply_pending_state`` and, inside it, the checkpoint's reads (``StateReader.saved``), the codes put as they were
saved (``portable_codes.put_as_kept``) and the entries decoded and encoded again (``SplitState.put``).

    python benchmarks/resume_first_step.py --layers 24 --dim 2048 --rounds 2 [--out FILE.json]
"""

import argparse
import contextlib
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine_info, write_json  # noqa: E402
from twinflow import TwinFlowAdam  # noqa: E402
from twinflow.checkpoint import portable, portable_codes, portable_load  # noqa: E402
from twinflow.step import split_state  # noqa: E402


def model_and_optimizer(args: argparse.Namespace, seed: int, ratio: float | str) -> tuple:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.layers)))
    model = model.to(torch.bfloat16)
    return model, TwinFlowAdam(model.parameters(), ratio=ratio, state_precision=args.precision)


def step(model: torch.nn.Module, opt: TwinFlowAdam, args: argparse.Namespace) -> float:
    """One step's seconds (forward, backward and the optimizer's step)."""
    x = torch.randn(4, args.dim, generator=torch.Generator().manual_seed(7), dtype=torch.float32).bfloat16()
    start = time.perf_counter()
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


@contextlib.contextmanager
def timed(owner: object, name: str, totals: dict[str, float], key: str) -> Iterator[None]:
    """`owner.name` (a function or method) wrapped to add its seconds to totals[key] while the block runs."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--precision", default="int8_m24")
    parser.add_argument("--saved-ratio", type=float, default=0.0, help="the ratio of the run that saves")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="resume_first_step_"))
    model, opt = model_and_optimizer(args, 0, args.saved_ratio)
    step(model, opt, args)
    portable.save_portable(folder, "t", model=model, optimizer=opt)
    del model, opt
    rows = []
    for r in range(args.rounds):
        fresh_model, fresh_opt = model_and_optimizer(args, 1, "auto")
        fresh = step(fresh_model, fresh_opt, args)
        fresh_ratio = fresh_opt.ratio
        del fresh_model, fresh_opt
        model, opt = model_and_optimizer(args, 1, "auto")
        start = time.perf_counter()
        portable_load.load_portable(folder, model=model, optimizer=opt)
        load = time.perf_counter() - start
        parts: dict[str, float] = {}
        with (timed(TwinFlowAdam, "apply_pending_state", parts, "apply"),
              timed(portable_load.StateReader, "saved", parts, "reads"),
              timed(portable_codes, "put_as_kept", parts, "put_as_kept"),
              timed(split_state.SplitState, "put", parts, "decoded_and_encoded")):  # fmt: skip
            loaded = step(model, opt, args)
        rows.append({"round": r, "fresh_first_step_s": fresh, "fresh_ratio": fresh_ratio, "load_s": load,
                     "loaded_first_step_s": loaded, "loaded_ratio": opt.ratio,
                     **{f"{k}_s": v for k, v in parts.items()}})  # fmt: skip
        print(rows[-1], flush=True)
        del model, opt
    elements = args.layers * args.dim * args.dim
    median = {k: statistics.median(row[k] for row in rows) for k in rows[0] if k.endswith("_s")}
    result = {"command": sys.argv, "machine": machine_info(), "elements": elements, "precision": args.precision,
              "rows": rows, "median": median,
              "extra_over_fresh_s": median["loaded_first_step_s"] - median["fresh_first_step_s"]}  # fmt: skip
    print(write_json(result, "resume_first_step.json", args.out))


if __name__ == "__main__":
    main()
