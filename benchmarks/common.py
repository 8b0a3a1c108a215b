"""Shared helpers for the benchmark scripts: machine facts, timing, JSON output."""

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch


def source_commit() -> str | None:
    """The commit these scripts ran from: $TWINFLOW_COMMIT where the caller names it (a copy of the tree without
    .git), else git's HEAD of the repository whose top these scripts' tree is (with "-dirty" where tracked files
    differ from it), else None (not the HEAD of a repository the copy merely lies in)."""
    if os.environ.get("TWINFLOW_COMMIT"):
        return os.environ["TWINFLOW_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    git = ["git", "--no-optional-locks", "-C", str(root)]
    try:
        top, head, dirty = (subprocess.run([*git, *args], capture_output=True, text=True, check=True,
                                           timeout=30).stdout.strip()
                            for args in (["rev-parse", "--show-toplevel"], ["rev-parse", "HEAD"],
                                         ["status", "--porcelain", "--untracked-files=no"]))  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if Path(top).resolve() != root:
        return None
    return head + ("-dirty" if dirty else "")


def machine_info() -> dict:
    cpu, mhz, flags, cores = "unknown", None, "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and cpu == "unknown":
                cpu = value
            elif key == "cpu MHz" and mhz is None:
                mhz = float(value)
            elif key == "flags" and not flags:
                flags = value
            elif key == "core id":
                cores.add(value)
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "cores_seen": len(cores) or None,  # distinct core ids (one socket): hyper-threads share one
        "cpu_mhz": mhz,
        "avx512_bf16": "avx512_bf16" in flags.split(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "commit": source_commit(),
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


def proc_status_bytes(key: str) -> int:
    """A figure of this process's /proc/self/status in bytes (VmRSS: resident now; VmHWM: its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def write_json(result: dict, name: str, out: str | None) -> Path:
    """Writes to --out, else $OUT/<name>, else benchmarks/results/<name>."""
    path = Path(out) if out else Path(os.environ.get("OUT", Path(__file__).parent / "results")) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)
    return path


def abba_sides(round_index: int) -> tuple[str, str]:
    """The order of two trees in a round, the one that goes first alternating (ABBA): drift on the machine favours
    neither."""
    return ("before", "after") if round_index % 2 == 0 else ("after", "before")


def tree_child(script: str, tree: Path, side: str, ext_root: Path, args: list[str], env: dict | None = None) -> dict:
    """`script --child tree *args` in a process of its own, with the tree's own kernel cache (ext_root/side) and
    `env` added; the JSON object its last line prints. Exits naming the side if it fails."""
    import subprocess
    import sys

    full_env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_root / side), **(env or {}))
    done = subprocess.run([sys.executable, script, "--child", str(tree), *args], env=full_env, capture_output=True,
                          text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{side} tree ({tree}) failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
