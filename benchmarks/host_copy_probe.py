"""What a copy to host memory costs, by where it lands: an asynchronous save copies the state (from the GPU and from
host memory) into new host tensors while training waits, and did so at 1.5-2 GB/s. Each case copies the same
tensors (--tensors of --mib MiB, bf16 on the GPU, uint8 on the host) --rounds times:

- ``fresh``: into a new tensor each time (what the save does: each page is touched for the first time);
- ``reused``: into the same tensors each round (their pages are mapped already);
- ``pinned``: into the same tensors, registered with CUDA (page-locked) once before the rounds.

    python benchmarks/host_copy_probe.py --tensors 16 --mib 256 --rounds 3

Writes JSON (--out, else $OUT, else benchmarks/results/): GB/s of every round of every case, and the seconds the
first allocation and registration took."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
from benchmarks.common import machine_info, write_json  # noqa: E402


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    n = args.mib * 2**20
    sources = {"host": [torch.randint(0, 255, (n,), dtype=torch.uint8) for _ in range(args.tensors)]}
    if cuda:
        sources["gpu"] = [torch.randn(n // 2, device="cuda", dtype=torch.bfloat16) for _ in range(args.tensors)]
    total = args.tensors * n
    result: dict = {"machine": machine_info(), "bytes_per_round": total, "cases": {}}
    for where, tensors in sources.items():
        start = time.perf_counter()
        kept = [torch.empty_like(t, device="cpu") for t in tensors]
        for k in kept:
            k.view(torch.uint8).fill_(0)  # touched once
        result[f"{where}_first_touch_s"] = time.perf_counter() - start
        cases = {
            "fresh": lambda ts=tensors: [t.to("cpu", copy=True) for t in ts],
            "reused": lambda ts=tensors, ks=kept: [k.copy_(t) for k, t in zip(ks, ts)],
        }
        for case, fn in cases.items():
            result["cases"][f"{where}_{case}"] = [total / timed(fn) / 1e9 for _ in range(args.rounds)]
        if cuda and where == "gpu":
            start = time.perf_counter()
            cudart = torch.cuda.cudart()
            for k in kept:
                cudart.cudaHostRegister(k.data_ptr(), k.nbytes, 0)
            result["register_s"] = time.perf_counter() - start
            fn = cases["reused"]
            result["cases"]["gpu_pinned"] = [total / timed(fn) / 1e9 for _ in range(args.rounds)]
            for k in kept:
                cudart.cudaHostUnregister(k.data_ptr())
        print({k: [round(x, 2) for x in v] for k, v in result["cases"].items()}, flush=True)
    print(write_json(result, "host_copy_probe.json", args.out))


if __name__ == "__main__":
    main()
