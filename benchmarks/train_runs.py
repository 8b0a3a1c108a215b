"""Runs examples/train_opt.py once per named run, one after the other, each in its own process under a time
limit, and writes what each gave: its JSON summary (step times, losses, peak GPU and host memory), its exit
status and the tail of its output (a run that fails, out of memory or over time, is a result too).

    python benchmarks/train_runs.py --out $OUT/opt30b.json \\
        exact=opt-30b:examples/configs/opt-30b-1gpu.json --steps 20 --data-from README.md BENCHMARKS.md

A run is NAME=MODEL:CONFIG[:extra train_opt.py flags, comma-separated]. --data-from concatenates local text
files into the corpus every run reads (--data).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import machine_info  # noqa: E402


def parse_run(text: str) -> tuple[str, str, str, list[str]]:
    name, _, rest = text.partition("=")
    parts = rest.split(":")
    if not name or len(parts) < 2:
        raise SystemExit(f"run {text!r}: expected NAME=MODEL:CONFIG[:flags,...]")
    flags = parts[2].split(",") if len(parts) > 2 and parts[2] else []
    return name, parts[0], parts[1], flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds a run may take")
    parser.add_argument("--data-from", nargs="*", default=[], help="local text files: the corpus")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    corpus = None
    if args.data_from:
        corpus = Path(tempfile.mkdtemp()) / "corpus.txt"
        corpus.write_bytes(b"\n".join(Path(f).read_bytes() for f in args.data_from))
    result = {"command": sys.argv, "machine": machine_info(), "runs": {}}
    for text in args.runs:
        name, model, config, flags = parse_run(text)
        summary = out.with_name(f"{out.stem}_{name}.json")
        cmd = [sys.executable, str(ROOT / "examples/train_opt.py"), "--model", model, "--config", config,
               "--steps", str(args.steps), "--summary", str(summary), *flags]  # fmt: skip
        if corpus is not None:
            cmd += ["--data", str(corpus)]
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc = "timeout"
            output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        entry = {"cmd": cmd, "rc": rc, "wall_s": time.perf_counter() - start, "tail": output[-4000:]}
        if rc == 0 and summary.exists():
            entry["summary"] = json.loads(summary.read_text())
        result["runs"][name] = entry
        out.write_text(json.dumps(result, indent=2) + "\n")  # after every run: a cut-short call keeps the rest
        brief = entry.get("summary", {})
        median = brief.get("median_seconds_per_step_after_first")
        gpu, host = brief.get("peak_gpu_gib"), brief.get("peak_host_gib")
        losses = [round(x, 3) for x in brief.get("losses", [])]
        print(f"{name}: rc {rc}, {entry['wall_s']:.0f} s; median step {median} s, GPU peak {gpu} GiB, host peak "
              f"{host} GiB, losses {losses}", flush=True)  # fmt: skip
        if rc != 0:
            print(output[-2500:], flush=True)


if __name__ == "__main__":
    main()
