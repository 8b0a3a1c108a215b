"""Shared helpers for the benchmark scripts: machine facts, timing, JSON output."""

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def machine_info() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def interleaved_medians(
    fns: dict[str, Callable[[], None]], rounds: int, warmup: int = 2, cuda_sync: bool = False
) -> dict[str, float]:
    """Times each fn once per round, round-robin, and returns each one's median seconds.

    Interleaving spreads drift (clock, other tenants) evenly over all systems.
    With `cuda_sync` the device is synchronised before and after each call, so
    queued GPU work counts.
    """
    sync = torch.cuda.synchronize if cuda_sync else (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def write_json(result: dict, name: str, out: str | None) -> Path:
    """Writes to --out, else $OUT/<name>, else benchmarks/results/<name>."""
    path = Path(out) if out else Path(os.environ.get("OUT", Path(__file__).parent / "results")) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)
    return path
