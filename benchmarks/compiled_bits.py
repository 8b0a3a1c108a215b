"""Which of the compact step's operations torch.compile's GPU code computes with other bits than the same
operations run eagerly on the GPU: each one compiled alone, on the same random inputs, and the count of
elements that differ.

    python benchmarks/compiled_bits.py --elements 4194304
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import machine_info, write_json  # noqa: E402
from twinflow.precision import compact, compact_step, weight_master  # noqa: E402

F32 = torch.float32


def cases(n: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, device="cuda", generator=gen) * 1e-3
    b = torch.rand(n, device="cuda", generator=gen) * 1e-4 + 1e-9
    w = (torch.randn(n, device="cuda", generator=gen) * 0.02).bfloat16()
    r = torch.randint(-128, 128, (n,), device="cuda", generator=gen, dtype=torch.int8)
    c = compact_step.constants(7, dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                                       adamw_mode=True), torch.device("cuda"))  # fmt: skip
    codes = [t.cuda() for t in compact.encode(a, b)]
    z = torch.zeros((), dtype=torch.int32, device="cuda")
    bits = compact_step.noise(5, n, compact.key(7), torch.device("cuda"))
    return {
        "sqrt32": (compact_step.sqrt32, (b, z)),
        "sqrt32_times_mul32": (lambda x, y: compact_step.mul32(compact_step.sqrt32(x, z), y, z) + y, (b, a)),
        "div32_into_mul32": (lambda x, y: compact_step.mul32(y, compact_step.div32(x, y, z), z) - x, (a, b)),
        "div32": (compact_step.div32, (a, b, z)),
        "mul32_minus_mul32": (lambda x, y: compact_step.mul32(x, y, z) - compact_step.mul32(y, a, z), (a, b)),
        "float32_div": (lambda x, y: x / y, (a, b)),
        "decode_master": (weight_master.decode, (w, r)),
        "decode_moments": (
            lambda *k: compact.decode_exp_avg(k[0], k[1]) + compact.decode_exp_avg_sq(k[2], k[3]),
            tuple(codes),
        ),  # fmt: skip
        "update_p_new": (lambda m, g: compact_step.update(m, g, codes, c, None, False)[0], (a, a * 0.1)),
        "encode_master_split": (lambda x, h: weight_master.split(*compact.encode_master(x, h & 0xFF)), (a, bits)),
        "noise": (
            lambda base: compact_step.noise(base, n, compact.key(7), torch.device("cuda")),
            (torch.tensor(5, device="cuda"),),
        ),  # fmt: skip
    }


def flat_bits(out) -> list[torch.Tensor]:  # noqa: ANN001
    outs = out if isinstance(out, tuple | list) else (out,)
    return [t.contiguous().view(torch.uint8) if t.dtype != torch.int64 else t for t in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=1 << 22)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {"command": sys.argv, "machine": machine_info(), "elements": args.elements, "cases": {}}
    for name, (fn, inputs) in cases(args.elements).items():
        eager = flat_bits(fn(*inputs))
        for mode, options in (("default", {}), ("no_fma", {"emulate_precision_casts": True})):
            try:
                compiled = flat_bits(torch.compile(fn, dynamic=True, options=options)(*inputs))
                differ = sum(int((x != y).sum()) for x, y in zip(eager, compiled))
            except Exception as exc:  # noqa: BLE001 (a failure to compile is a result too)
                differ = f"{type(exc).__name__}: {str(exc)[:200]}"
            result["cases"].setdefault(name, {})[mode] = differ
            print(f"{name} [{mode}]: {differ} bytes differ", flush=True)
        torch._dynamo.reset()
    print(f"wrote {write_json(result, 'compiled_bits.json', args.out)}")


if __name__ == "__main__":
    main()
