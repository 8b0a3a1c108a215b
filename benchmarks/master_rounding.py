"""How far the weight the forward sees is from its 24-bit master: truncation (the CPU form's top half) against
the device form's nearest weight (twinflow.precision.weight_master), in bfloat16 steps, for normal weights.

    python benchmarks/master_rounding.py --std 0.02 --count 4194304
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import machine_info, write_json  # noqa: E402
from twinflow.precision import compact, weight_master  # noqa: E402


def gaps(weight: torch.Tensor, master: torch.Tensor) -> dict:
    """The signed distance |weight| - |master| in bfloat16 steps of the master's binade: mean, RMS, largest."""
    step = torch.ldexp(torch.ones_like(master), torch.frexp(master).exponent - 8)
    gap = (weight.double().abs() - master.abs()) / step
    return {"mean_steps": gap.mean().item(), "rms_steps": gap.square().mean().sqrt().item(),
            "max_abs_steps": gap.abs().max().item()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--std", type=float, default=0.02, help="the weights' standard deviation (OPT's init)")
    parser.add_argument("--count", type=int, default=1 << 22)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    hi, lo = compact.encode_master(torch.randn(args.count, generator=gen) * args.std)
    master = compact.decode_master(hi, lo).double()
    weight, _ = weight_master.split(hi, lo)
    result = {"command": sys.argv, "machine": machine_info(), "std": args.std, "count": args.count,
              "truncation": gaps(hi.float(), master), "nearest": gaps(weight.float(), master)}  # fmt: skip
    for name in ("truncation", "nearest"):
        g = result[name]
        print(f"{name:10s} mean {g['mean_steps']:+.4f}  rms {g['rms_steps']:.4f}  max {g['max_abs_steps']:.4f} steps")
    print(f"wrote {write_json(result, 'master_rounding.json', args.out)}")


if __name__ == "__main__":
    main()
