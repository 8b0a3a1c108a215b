"""The CPU share's compact codes converted on the host against on the GPU: a load's write (float32 moments to
codes) and a state_dict's read (codes to float32) of one parameter's CPU elements, through HostState, each form
timed in the same process with torch's threads at the kernel's share (as a load runs them); every code compared.

    python benchmarks/host_codes_convert.py --elements 33554432 [--precision int8_m24] [--out FILE]
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
from twinflow.host.host_state import HostState, conversion_threads  # noqa: E402
from twinflow.host.staging import plan_pieces  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=1 << 25)
    parser.add_argument("--precision", default="int8_m24")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n = args.elements
    pieces = plan_pieces([Segment(0, 0, n, on_cpu=True)], [2], 1 << 26, 256)
    gen = torch.Generator().manual_seed(0)
    values = {"master": torch.randn(n, generator=gen), "exp_avg": torch.randn(n, generator=gen) * 1e-3,
              "exp_avg_sq": torch.rand(n, generator=gen) * 1e-6}  # fmt: skip
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    result = {"command": sys.argv, "machine": machine_info(), "elements": n, "precision": args.precision, "rows": {}}
    states = {}
    with conversion_threads():
        result["torch_threads"] = torch.get_num_threads()
        for device in devices:
            state = HostState(pieces, args.precision, torch.device(device))
            state.write(0, {"master": values["master"]})  # first touch of the state's memory, untimed
            start = time.perf_counter()
            state.write(0, values)
            write = time.perf_counter() - start
            out = torch.empty(n)
            start = time.perf_counter()
            state.read(0, "exp_avg", out)
            state.read(0, "exp_avg_sq", out)
            read = time.perf_counter() - start
            states[device] = state
            result["rows"][device] = {"write_s": write, "write_melem_s": n / write / 1e6, "read_two_moments_s": read}
            print(f"{device}: write {write:.2f} s ({n / write / 1e6:.0f} M elements/s), read both moments {read:.2f} s",
                  flush=True)  # fmt: skip
    if len(states) == 2:
        same = all(torch.equal(a, b) for qa, qb in zip(states["cpu"].codec.q8, states["cuda"].codec.q8)
                   for a, b in zip(qa, qb))  # fmt: skip
        result["codes_equal"] = same
        speedup = result["rows"]["cpu"]["write_s"] / result["rows"]["cuda"]["write_s"]
        result["write_gpu_over_host"] = speedup
        print(f"codes equal: {same}; the write {speedup:.1f}x faster on the GPU")
    print(f"wrote {write_json(result, 'host_codes_convert.json', args.out)}")


if __name__ == "__main__":
    main()
