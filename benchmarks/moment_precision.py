"""Adam's moments kept in fewer bits: how far each storage drifts from float64 on one gradient stream.

    python benchmarks/moment_precision.py [--elements 65536] [--steps 2000] [--out FILE]

Runs the moment recurrence (beta1 0.9, beta2 0.999, bias-corrected) over the
same gradients with the moments stored after every step as:
- float32 (twinflow's exact mode);
- bfloat16 rounded to the nearest (plain bf16 moments);
- bfloat16 rounded stochastically (random bits added below the kept ones);
- the 8-bit codes of ``state_precision="int8"`` (twinflow.precision.compact, with the
  kernel's own rounding noise);
and float64 as the reference. Gradients have per-element scales spread over
2^-16..1 and drifting by up to 2x either way over a few hundred steps (so
that ``exp_avg_sq`` has to follow them), around a small per-element mean.

Reports, at a few steps, the relative error of Adam's update direction
m_hat / (sqrt(v_hat) + eps) against float64 (its norm over all elements,
over the reference's norm; the update does not depend on the gradient's
scale) and the median relative error of ``exp_avg_sq``. No timing: the
figures are the same on any machine. Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import write_json  # noqa: E402
from twinflow.precision import compact  # noqa: E402

F32 = torch.float32
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8


def bf16_nearest(x: torch.Tensor, step: int, gen: torch.Generator) -> torch.Tensor:
    return x.bfloat16().float()


def bf16_stochastic(x: torch.Tensor, step: int, gen: torch.Generator) -> torch.Tensor:
    """Adds 16 random bits to the float32 pattern and cuts them: up with probability (cut part) / 2^16."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    noise = torch.randint(0, 1 << 16, x.shape, generator=gen, dtype=torch.int64)
    return (((bits + noise) >> 16) << 16).to(torch.int32).view(F32)  # int64 -> int32 wraps: the bit pattern


STORAGES = {
    "fp32": None,
    "bf16_nearest": bf16_nearest,
    "bf16_stochastic": bf16_stochastic,
}


def gradients(n: int, steps: int, gen: torch.Generator):
    """Per element: a scale 2^-U(0, 16), drifting by 2^(sin(t / period + phase)), times (mean + normal noise)."""
    scale = torch.exp2(-16 * torch.rand(n, generator=gen, dtype=torch.float64))
    period = 100 + 400 * torch.rand(n, generator=gen, dtype=torch.float64)
    phase = 2 * math.pi * torch.rand(n, generator=gen, dtype=torch.float64)
    mean = 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)
    for t in range(1, steps + 1):
        drift = torch.exp2(torch.sin(t / period + phase))
        yield t, (scale * drift * (mean + torch.randn(n, generator=gen, dtype=torch.float64))).to(F32)


def update(m: torch.Tensor, v: torch.Tensor, step: int) -> torch.Tensor:
    m, v = m.double(), v.double()
    return (m / (1 - BETA1**step)) / ((v / (1 - BETA2**step)).sqrt() + EPS)


def run(n: int, steps: int, report: list[int], seed: int) -> dict:
    gen, noise_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    ref_m, ref_v = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    state = {name: (torch.zeros(n), torch.zeros(n)) for name in [*STORAGES, "int8_codes"]}
    curves: dict[str, dict[str, list[float]]] = {name: {"update": [], "v": []} for name in state}
    steps_seen = []
    for t, g in gradients(n, steps, gen):
        g64 = g.double()
        ref_m = BETA1 * ref_m + (1 - BETA1) * g64
        ref_v = BETA2 * ref_v + (1 - BETA2) * g64 * g64
        ref_u = update(ref_m, ref_v, t)
        for name, (m, v) in state.items():
            # float32, in the kernel's order; then stored
            m_new = torch.tensor(BETA1, dtype=F32) * m + torch.tensor(1 - BETA1, dtype=F32) * g
            v_new = torch.tensor(BETA2, dtype=F32) * v + torch.tensor(1 - BETA2, dtype=F32) * (g * g)
            if name == "int8_codes":
                codes = compact.encode(m_new, v_new, compact.kernel_noise(0, n, t))
                m_new, v_new = compact.decode_exp_avg(codes[0], codes[1]), compact.decode_exp_avg_sq(codes[2], codes[3])
            elif STORAGES[name] is not None:
                m_new, v_new = STORAGES[name](m_new, t, noise_gen), STORAGES[name](v_new, t, noise_gen)
            state[name] = (m_new, v_new)
            if t % 10 == 0 or t in report:
                u = update(m_new, v_new, t)
                curves[name]["update"].append(((u - ref_u).norm() / ref_u.norm()).item())
                curves[name]["v"].append((v_new.double() / ref_v - 1).abs().median().item())
        if t % 10 == 0 or t in report:
            steps_seen.append(t)
        if t % 500 == 0:
            print(f"step {t}: " + "  ".join(f"{k} {c['update'][-1]:.2e}" for k, c in curves.items()), flush=True)
    at = {name: {str(t): {"update_rel_err": c["update"][steps_seen.index(t)], "v_median_rel_err": c["v"][
        steps_seen.index(t)]} for t in report} for name, c in curves.items()}  # fmt: skip
    return {"steps": steps_seen, "curves": curves, "at": at}


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_u, ax_v) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    labels = {"fp32": "float32", "bf16_nearest": "bf16, to nearest", "bf16_stochastic": "bf16, stochastic",
              "int8_codes": "8-bit codes (state_precision='int8')"}  # fmt: skip
    for name, c in result["curves"].items():
        ax_u.plot(result["steps"], c["update"], label=labels[name])
        ax_v.plot(result["steps"], c["v"], label=labels[name])
    ax_u.set(yscale="log", ylabel="update direction error", title="moments stored in fewer bits, against float64")
    ax_v.set(yscale="log", ylabel="exp_avg_sq: median rel. error", xlabel="step")
    for a in (ax_u, ax_v):
        a.grid(alpha=0.3, which="both")
    ax_u.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 16)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = [t for t in (10, 100, 500, 1000, 2000, args.steps) if t <= args.steps]
    result = {"elements": args.elements, "beta1": BETA1, "beta2": BETA2, "command": " ".join(sys.argv)}
    result |= run(args.elements, args.steps, sorted(set(report)), args.seed)
    path = write_json(result, "moment_precision.json", args.out)
    print({name: values[str(args.steps)] for name, values in result["at"].items()})
    plot(result, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
