"""A per-rank checkpoint made portable as a user makes it, timed, its peak host memory measured:
``python -m twinflow.convert CKPT TAG --to-portable OUT_DIR`` in a child process (its own ``VmHWM``), then the sizes
of both checkpoints and how the converted one stores each parameter's state (as kept: codes; or decoded).

    python benchmarks/measure_to_portable.py --ckpt /tmp/ck_r/ckpt --tag moved --out-dir /tmp/ck_r/conv \
        --json $OUT/convert.json

Drops nothing from the page cache: the shards just written may still be in it (the JSON records the host's
memory and the shards' size, so a reader can tell).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
from benchmarks.common import machine_info, write_json  # noqa: E402
from benchmarks.portable_convert_check import PEAK  # noqa: E402


def size_of(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, type=Path)
    parser.add_argument("--tag", default="moved")
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    start = time.perf_counter()
    child = subprocess.run([sys.executable, "-c", PEAK, str(args.ckpt), args.tag, "--to-portable", str(args.out_dir)],
                           capture_output=True, text=True)  # fmt: skip
    seconds = time.perf_counter() - start
    peak_kib = int(child.stderr.rsplit("PEAK_RSS_KIB", 1)[-1].split()[0]) if "PEAK_RSS_KIB" in child.stderr else -1
    result = {"returncode": child.returncode, "seconds": round(seconds, 1), "peak_rss_gib": round(peak_kib / 2**20, 2),
              "source_bytes": size_of(args.ckpt / args.tag), "stderr_tail": child.stderr[-2000:],
              "stdout_tail": child.stdout[-1000:], "machine": machine_info()}  # fmt: skip
    folder = args.out_dir / args.tag
    if child.returncode == 0:
        keys = torch.load(folder / "twinflow.pt", weights_only=True)["state_keys"]
        result.update(converted_bytes=size_of(folder), parameters=len(keys),
                      as_kept=sum("exp_avg.codes" in k for k in keys.values()),
                      masters_24_bit=sum("master.hi" in k for k in keys.values()))  # fmt: skip
    write_json(result, "to_portable.json", args.json)
    print({k: v for k, v in result.items() if k not in ("machine", "stderr_tail")})
    sys.exit(child.returncode)


if __name__ == "__main__":
    main()
