"""Device memory above what is kept, for a 67M-parameter bf16 layer wholly on the device with int8_m24 state:
the build, state_dict(), a portable save and load, and a state dict's load, each as max_memory_allocated over
the memory allocated before and after (what tests/test_device_compact.py bounds by one chunk).

    python benchmarks/compact_device_peaks.py            (writes $OUT/compact_device_peaks.json)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks.common import machine_info, write_json  # noqa: E402
from twinflow import TwinFlowAdam  # noqa: E402
from twinflow.checkpoint import load_portable, save_portable  # noqa: E402


def extra(fn):  # noqa: ANN001, ANN201
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - max(before, torch.cuda.memory_allocated()), out


def measure(folder: Path) -> dict:
    """The peaks (bytes above what is kept) of each phase, the optimizer's chunk and device state bytes, and the
    layer's elements; the portable checkpoint goes to `folder` (tests/test_device_compact.py bounds the peaks)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8192, 8192, bias=False, device="cuda", dtype=torch.bfloat16)
    peaks = {}
    peaks["build"], opt = extra(lambda: TwinFlowAdam(model.parameters(), ratio=0.0, state_precision="int8_m24"))
    model(torch.randn(4, 8192, device="cuda", dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    peaks["state_dict"], state = extra(opt.state_dict)
    peaks["save"], _ = extra(lambda: save_portable(folder, "t", model=model, optimizer=opt))
    peaks["load"], _ = extra(lambda: load_portable(folder, model=model, optimizer=opt))
    peaks["load_state_dict"], _ = extra(lambda: opt.load_state_dict(state))
    return {"peaks": peaks, "chunk_bytes": opt.chunk_bytes, "numel": model.weight.numel(),
            "state_bytes": opt.split_summary["device"]["state_bytes"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="the JSON file (default $OUT/compact_device_peaks.json)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        measured = measure(Path(folder))
    row = {"peaks_mib": {k: v / 2**20 for k, v in measured["peaks"].items()},
           "chunk_mib": measured["chunk_bytes"] / 2**20, "float32_copy_mib": 4 * measured["numel"] / 2**20,
           "machine": machine_info()}  # fmt: skip
    write_json(row, "compact_device_peaks.json", args.out)
    print(row["peaks_mib"], row["chunk_mib"])


if __name__ == "__main__":
    main()
