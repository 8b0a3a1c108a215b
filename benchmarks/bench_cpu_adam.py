"""CPU Adam throughput: twinflow's kernel vs torch fused AdamW vs DeepSpeedCPUAdam, in one run.

    python benchmarks/bench_cpu_adam.py --params 268435456 --threads 16 [--out FILE]

Reports Gparam/s and GB/s (28 bytes per parameter: fp32 param, m, v read and
written, plus an fp32 gradient read; or a bf16 gradient read and a bf16 weight
copy written), the bf16-gradient/bf16-copy variant, the memory ceiling of that
access pattern (a probe that moves the same bytes with trivial arithmetic), and
a thread sweep. Speculation's variant steps out of place (reads the state
from one copy, writes it to another: the same bytes), beside its own probe.
The 8-bit mode (state_precision="int8": int8/uint8 moments with a one-byte
scale per 256 elements each) moves 16.02 bytes per parameter (bf16 gradient
and weight copy); its % of the ceiling is against its own probe (the same loads
and stores, trivial arithmetic). It is timed twice: on plain random moments,
and on moments spread over the codes' whole range, as a trained model's are
(benchmarks/q8_spread.py). "int8_m24" (the same moments, 24-bit masters)
moves 14.02 bytes per parameter, and is timed the same three ways.
Writes JSON (and a PNG of the sweep when matplotlib is present).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import interleaved_medians, machine_info, write_json  # noqa: E402
from twinflow.host import ops  # noqa: E402

BYTES_PER_PARAM = 28
# master r/w, both moments' codes r/w, gradient, copy, both scales r/w per block of 256
Q8_BYTES_PER_PARAM = 8 + 4 + 2 + 2 + 4 / 256
M24_BYTES_PER_PARAM = Q8_BYTES_PER_PARAM - 2  # a 24-bit master read and written: 3 + 3 bytes, not 4 + 4


def fp32_set(n: int, gen: torch.Generator) -> dict:
    return {
        "param": torch.randn(n, generator=gen),
        "grad": torch.randn(n, generator=gen),
        "exp_avg": torch.zeros(n),
        "exp_avg_sq": torch.zeros(n),
    }


def twinflow_fn(s: dict, threads: int, out: torch.Tensor | None = None, probe: bool = False,
                apart: dict | None = None):  # fmt: skip
    """`apart`: a second state set; each call reads one set and writes the other (speculation's steps)."""
    step = [0]
    sets = [s, dict(s, **apart)] if apart else [s]
    keys = ("param", "exp_avg", "exp_avg_sq")

    def run() -> None:
        src, dst = sets[step[0] % len(sets)], sets[(step[0] + 1) % len(sets)]
        step[0] += 1
        extra = dict(out_copies=[out] if out is not None else None,
                     sources=tuple([src[k]] for k in keys) if apart else None)  # fmt: skip
        if probe:
            ops.bandwidth_probe_([dst["param"]], [s["grad"]], [dst["exp_avg"]], [dst["exp_avg_sq"]],
                                 num_threads=threads, **extra)  # fmt: skip
            return
        ops.adam_step_([dst["param"]], [s["grad"]], [dst["exp_avg"]], [dst["exp_avg_sq"]], [step[0]], lr=1e-4,
                       beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, num_threads=threads, **extra)  # fmt: skip

    return run


def q8_fn(n: int, threads: int, gen: torch.Generator, out: torch.Tensor, probe: bool = False, spread: float = 0.0,
          m24: bool = False):  # fmt: skip
    """`spread`: gradient magnitudes spread over 2^-spread..1, so that moments fill the codes' whole range
    (benchmarks/q8_spread.py); `m24`: 24-bit masters."""
    from benchmarks.q8_spread import spread_grad
    from twinflow.precision import compact

    p = torch.randn(n, generator=gen)
    g = spread_grad(n, gen, spread) if spread else torch.randn(n, generator=gen).bfloat16()
    state = compact.fresh(n)
    params, extra = compact.kernel_masters([compact.Master24.empty(n).copy_(p) if m24 else p])
    step = [0]

    def run() -> None:
        step[0] += 1
        if probe:
            ops.bandwidth_probe_q8_(params, [g], *([t] for t in state), out_copies=[out], num_threads=threads,
                                    **extra)  # fmt: skip
            return
        ops.adam_step_q8_(params, [g], *([t] for t in state), [step[0]], lr=1e-4,
                          beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, out_copies=[out],
                          num_threads=threads, **extra)  # fmt: skip

    return run


def torch_fused_fn(s: dict, threads: int):
    p = torch.nn.Parameter(s["param"])
    p.grad = s["grad"]
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, fused=True)

    def run() -> None:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        opt.step()
        torch.set_num_threads(previous)

    return run


def deepspeed_fn(s: dict):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    p = torch.nn.Parameter(s["param"])
    p.grad = s["grad"]
    opt = DeepSpeedCPUAdam([p], lr=1e-4, weight_decay=0.01, adamw_mode=True)
    return opt.step


def copy_bandwidth(n: int, rounds: int) -> float:
    """torch's memory copy, GB/s with bytes read and written both counted (for context)."""
    src, dst = torch.randn(n), torch.empty(n)
    seconds = interleaved_medians({"copy": lambda: dst.copy_(src)}, rounds=rounds)["copy"]
    return 2 * n * 4 / seconds / 1e9


def bytes_of(system: str) -> float:
    if "m24" in system:
        return M24_BYTES_PER_PARAM
    return Q8_BYTES_PER_PARAM if "int8" in system else BYTES_PER_PARAM


def rate(n: int, seconds: float, bytes_per_param: float = BYTES_PER_PARAM) -> dict:
    return {"median_s": seconds, "gparam_s": n / seconds / 1e9, "gb_s": n * bytes_per_param / seconds / 1e9,
            "bytes_per_param": bytes_per_param}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1 << 28)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--sweep", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n, threads = args.params, args.threads
    gen = torch.Generator().manual_seed(0)
    result = {"machine": machine_info(), "params": n, "threads": threads, "simd": ops.SIMD_NAMES[ops.resolve_simd()]}
    print(f"{n / 1e6:.0f}M params, {threads} threads, {result['machine']['cpu']}", flush=True)

    result["copy_gb_s"] = copy_bandwidth(n // 4, args.rounds)

    ours, fused, bf16_set = fp32_set(n, gen), fp32_set(n, gen), fp32_set(n, gen)
    bf16_set["grad"] = bf16_set["grad"].bfloat16()
    bf16_out = torch.empty(n, dtype=torch.bfloat16)
    probe = fp32_set(n, gen)
    probe_bf16 = dict(probe, grad=probe["grad"].bfloat16())
    second = {k: torch.empty(n) for k in ("param", "exp_avg", "exp_avg_sq")}  # speculation's other state set
    fns = {
        "twinflow_fp32": twinflow_fn(ours, threads),
        "torch_fused_fp32": torch_fused_fn(fused, threads),
        "twinflow_bf16grad_bf16out": twinflow_fn(bf16_set, threads, out=bf16_out),
        "probe_fp32": twinflow_fn(probe, threads, probe=True),
        "probe_bf16grad_bf16out": twinflow_fn(probe_bf16, threads, out=bf16_out, probe=True),
        "twinflow_bf16_out_of_place": twinflow_fn(bf16_set, threads, out=bf16_out, apart=second),
        "probe_bf16_out_of_place": twinflow_fn(probe_bf16, threads, out=bf16_out, probe=True, apart=second),
        "twinflow_int8_state_bf16grad_bf16out": q8_fn(n, threads, gen, bf16_out),
        "twinflow_int8_state_spread_moments": q8_fn(n, threads, gen, bf16_out, spread=16.0),
        "probe_int8_state_bf16grad_bf16out": q8_fn(n, threads, gen, bf16_out, probe=True),
        "twinflow_int8_m24_state_bf16grad_bf16out": q8_fn(n, threads, gen, bf16_out, m24=True),
        "twinflow_int8_m24_state_spread_moments": q8_fn(n, threads, gen, bf16_out, spread=16.0, m24=True),
        "probe_int8_m24_state_bf16grad_bf16out": q8_fn(n, threads, gen, bf16_out, probe=True, m24=True),
    }
    if not args.no_deepspeed:
        try:
            fns["deepspeed_cpu_adam_fp32"] = deepspeed_fn(fp32_set(n, gen))
        except Exception as exc:  # reported, not hidden
            result["deepspeed_error"] = f"{type(exc).__name__}: {exc}"
            print("DeepSpeedCPUAdam unavailable:", result["deepspeed_error"], flush=True)
    medians = interleaved_medians(fns, rounds=args.rounds)
    result["systems"] = {name: rate(n, s, bytes_of(name)) for name, s in medians.items()}
    for name, r in result["systems"].items():
        print(f"  {name:32s} {r['median_s'] * 1e3:8.1f} ms  {r['gparam_s']:6.2f} Gparam/s  {r['gb_s']:6.1f} GB/s")

    sysr = result["systems"]
    ceiling = max(sysr["probe_bf16grad_bf16out"]["gb_s"], sysr["probe_fp32"]["gb_s"], sysr["torch_fused_fp32"]["gb_s"])
    checks = {
        "fp32_vs_torch_fused": sysr["twinflow_fp32"]["gparam_s"] / sysr["torch_fused_fp32"]["gparam_s"],
        "bf16_variant_vs_ceiling": sysr["twinflow_bf16grad_bf16out"]["gb_s"] / ceiling,
        "ceiling_gb_s": ceiling,
        "out_of_place_vs_in_place": sysr["twinflow_bf16_out_of_place"]["gparam_s"]
        / sysr["twinflow_bf16grad_bf16out"]["gparam_s"],
        "int8_state_vs_fp32_state": sysr["twinflow_int8_state_bf16grad_bf16out"]["gparam_s"]
        / sysr["twinflow_bf16grad_bf16out"]["gparam_s"],
        "int8_spread_moments_vs_fp32_state": sysr["twinflow_int8_state_spread_moments"]["gparam_s"]
        / sysr["twinflow_bf16grad_bf16out"]["gparam_s"],
        "int8_state_vs_ceiling": sysr["twinflow_int8_state_bf16grad_bf16out"]["gb_s"]
        / sysr["probe_int8_state_bf16grad_bf16out"]["gb_s"],
        "int8_probe_vs_fp32_probe": sysr["probe_int8_state_bf16grad_bf16out"]["gparam_s"]
        / sysr["probe_bf16grad_bf16out"]["gparam_s"],
        "int8_m24_state_vs_fp32_state": sysr["twinflow_int8_m24_state_bf16grad_bf16out"]["gparam_s"]
        / sysr["twinflow_bf16grad_bf16out"]["gparam_s"],
        "int8_m24_spread_moments_vs_fp32_state": sysr["twinflow_int8_m24_state_spread_moments"]["gparam_s"]
        / sysr["twinflow_bf16grad_bf16out"]["gparam_s"],
        "int8_m24_state_vs_ceiling": sysr["twinflow_int8_m24_state_bf16grad_bf16out"]["gb_s"]
        / sysr["probe_int8_m24_state_bf16grad_bf16out"]["gb_s"],
        "int8_m24_probe_vs_fp32_probe": sysr["probe_int8_m24_state_bf16grad_bf16out"]["gparam_s"]
        / sysr["probe_bf16grad_bf16out"]["gparam_s"],
    }
    if "deepspeed_cpu_adam_fp32" in sysr:
        checks["fp32_vs_deepspeed"] = sysr["twinflow_fp32"]["gparam_s"] / sysr["deepspeed_cpu_adam_fp32"]["gparam_s"]
    result["ratios"] = checks
    print("  ratios:", {k: round(v, 3) for k, v in checks.items()}, flush=True)

    sweep = {}
    for t in args.sweep:
        m = interleaved_medians(
            {
                "twinflow_fp32": twinflow_fn(ours, t),
                "torch_fused_fp32": torch_fused_fn(fused, t),
                "twinflow_bf16grad_bf16out": twinflow_fn(bf16_set, t, out=bf16_out),
                "twinflow_int8_state_bf16grad_bf16out": q8_fn(n, t, gen, bf16_out),
                "probe_int8_state_bf16grad_bf16out": q8_fn(n, t, gen, bf16_out, probe=True),
                "twinflow_int8_m24_state_bf16grad_bf16out": q8_fn(n, t, gen, bf16_out, m24=True),
            },
            rounds=max(3, args.rounds // 2),
            warmup=1,
        )
        sweep[t] = {name: rate(n, s, bytes_of(name)) for name, s in m.items()}
        print(f"  {t:2d} threads: " + "  ".join(f"{k} {v['gparam_s']:.2f}" for k, v in sweep[t].items()), flush=True)
    result["thread_sweep"] = sweep
    path = write_json(result, "bench_cpu_adam.json", args.out)
    print("wrote", path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name in next(iter(sweep.values())):
            ax.plot(list(sweep), [sweep[t][name]["gparam_s"] for t in sweep], marker="o", label=name)
        ax.set_xlabel("threads")
        ax.set_ylabel("Gparam/s")
        ax.set_xscale("log", base=2)
        ax.set_title(f"CPU Adam, {n / 1e6:.0f}M params")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
