"""Host memory of a portable save and load, in fresh processes, for one checkout or two side by side.

    python benchmarks/portable_memory.py [--trees OLD_TREE .] [--layers 8] [--precisions int8_m24 fp32] [--chunk N]

A stack of bf16 linear layers (4M elements each) with TwinFlowAdam at ratio 0.6 takes a step; then
``save_portable`` and, into a second such model, ``load_portable``; in a tree that has it, the checkpoint's
optimizer state converted to torch.optim's layout (``portable_adamw.convert_portable``, phase "adamw"; ``--chunk``:
the elements it reads at a time, ``portable_load.CHUNK``). Each is measured in its own process whose
allocator gives blocks of 64 KiB or more back to the system when freed (``MALLOC_MMAP_THRESHOLD_``), so that the
resident size follows what is alive: the peak above the resident size before (``/proc/self/clear_refs`` and
``VmHWM``) and what stays after, in bytes a parameter. Writes JSON (--out, else $OUT, else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import machine_info, write_json  # noqa: E402

CHILD = r"""
import json, sys, torch
from pathlib import Path
from twinflow import TwinFlowAdam
from twinflow.checkpoint import portable
try:  # the load's module since the batched load; a tree before it has load_portable in portable
    from twinflow.checkpoint.portable_load import load_portable
except ImportError:
    load_portable = portable.load_portable

def size(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

def measured(fn):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current resident size
    before = size("VmRSS")
    fn()
    return size("VmHWM") - before, size("VmRSS") - before

directory, layers, precision, phase = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
chunk = int(sys.argv[5]) if len(sys.argv) > 5 else None

def made(seed):
    torch.manual_seed(seed)
    shapes = [(1024, 4096), (4096, 1024)] * (layers // 2)
    model = torch.nn.Sequential(*(torch.nn.Linear(*s, bias=False) for s in shapes)).to(torch.bfloat16)
    opt = TwinFlowAdam(model.parameters(), ratio=0.6, state_precision=precision)
    model(torch.randn(2, 1024, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt

model, opt = made(0)
if phase == "save":
    peak, kept = measured(lambda: portable.save_portable(directory, "t", model=model, optimizer=opt))
elif phase == "load":
    peak, kept = measured(lambda: load_portable(directory, model=model, optimizer=opt))
else:
    from twinflow.checkpoint import portable_load
    from twinflow.checkpoint.portable_adamw import convert_portable
    if chunk:
        portable_load.CHUNK = chunk
    peak, kept = measured(lambda: convert_portable(directory, "t", directory / "adamw.pt"))
print(json.dumps({"peak_bytes": peak, "kept_bytes": kept, "elements": sum(p.numel() for p in model.parameters())}))
"""


def child(tree: Path, directory: Path, layers: int, precision: str, phase: str, chunk: int | None = None) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(tree))
    extra = [str(chunk)] if chunk else []
    done = subprocess.run([sys.executable, "-c", CHILD, str(directory), str(layers), precision, phase, *extra],
                          cwd=tree, env=env, capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"{phase} in {tree} failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.splitlines()[-1])
    row["peak_bytes_per_parameter"] = row["peak_bytes"] / row["elements"]
    row["kept_bytes_per_parameter"] = row["kept_bytes"] / row["elements"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", type=Path, default=[ROOT])
    parser.add_argument("--layers", type=int, default=8, help="an even number of 4M-element layers")
    parser.add_argument("--precisions", nargs="+", default=["int8_m24", "fp32"])
    parser.add_argument("--chunk", type=int, default=None, help="phase adamw: elements read at a time")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for precision in args.precisions:
        for tree in args.trees:
            with tempfile.TemporaryDirectory() as tmp:
                converts = (tree / "twinflow" / "checkpoint" / "portable_adamw.py").exists()
                for phase in ("save", "load") + (("adamw",) if converts else ()):
                    row = {"tree": str(tree.resolve()), "precision": precision, "phase": phase,
                           **child(tree.resolve(), Path(tmp), args.layers, precision, phase, args.chunk)}  # fmt: skip
                    rows.append(row)
                    print(f"{precision:9s} {phase:5s} {tree}: peak {row['peak_bytes_per_parameter']:.1f}, kept "
                          f"{row['kept_bytes_per_parameter']:.1f} bytes a parameter", flush=True)  # fmt: skip
    path = write_json({"command": sys.argv, "machine": machine_info(), "rows": rows}, "portable_memory.json",
                      args.out)  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
