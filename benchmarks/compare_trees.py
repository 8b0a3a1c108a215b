"""Step times of two checkouts side by side: bench_train.py of each, system by system, in one run.

    python benchmarks/compare_trees.py --before OLD_TREE --after . --systems amp twinflow:0.4 \
        twinflow-spec:0.4 twinflow-delay:0.4 twinflow:1 -- --model opt-2.7b --clip 1.0 --steps 8 --warmup 2

For a change that must not cost speed (a restructure): each system runs once in each tree per round, the
tree that goes first alternating from system to system (ABBA), so drift on the machine favours neither.
Each tree builds its own kernel (its own TORCH_EXTENSIONS_DIR). Writes JSON (--out, else $OUT, else
benchmarks/results/) and prints a Markdown table of medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import machine_info, write_json  # noqa: E402


def git_head(tree: Path) -> str | None:
    """The commit `tree` holds: its COMMIT file (an exported tree), else its git HEAD."""
    marker = tree / "COMMIT"
    if marker.is_file():
        return marker.read_text().strip()
    try:
        return subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


def run_one(tree: Path, side: str, system: str, extra: list[str]) -> dict:
    """One bench_train.py invocation of `system` in `tree`; its result row (status and step times)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               TORCH_EXTENSIONS_DIR=str(Path(tempfile.gettempdir()) / f"twinflow_ext_{side}"))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(tree / "benchmarks" / "bench_train.py"), "--systems", system, "--out", str(out),
               *extra]  # fmt: skip
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.is_file():
            return {"system": system, "status": f"exit {proc.returncode}", "output_tail": proc.stdout[-3000:]}
        (row,) = json.loads(out.read_text())["rows"]
        return row


def median(row: dict) -> float | None:
    return statistics.median(row["step_seconds"]) if row.get("status") == "ok" else None


def summarise(runs: list[dict], systems: list[str], trees: dict, tolerance: float) -> list[dict]:
    """Each system's pooled step times and median per tree, and after / before, from the runs so far."""
    rows = []
    for system in systems:
        entry: dict = {"system": system}
        for side in trees:
            mine = [r for r in runs if r["system"] == system and r["side"] == side]
            steps = [t for r in mine if r.get("status") == "ok" for t in r["step_seconds"]]
            entry[side] = {"median_s": statistics.median(steps) if steps else None, "step_seconds": steps,
                           "status": [r.get("status") for r in mine]}  # fmt: skip
        b, a = entry["before"]["median_s"], entry["after"]["median_s"]
        entry["ratio"] = a / b if a and b else None
        entry["within"] = entry["ratio"] is not None and abs(entry["ratio"] - 1) <= tolerance
        rows.append(entry)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, type=Path, help="the old checkout")
    parser.add_argument("--after", required=True, type=Path, help="the new checkout")
    parser.add_argument("--systems", nargs="+", required=True)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--first",
        choices=("before", "after"),
        default="before",
        help="the tree that goes first for the first system (a second call: the other)",
    )
    parser.add_argument("--tolerance", type=float, default=0.03, help="after/before within 1 +- this")
    parser.add_argument("--out", default=None)
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: passed to bench_train.py")
    args = parser.parse_args()
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: list[dict] = []
    rows: list[dict] = []
    path, machine = None, machine_info()
    for rnd in range(args.rounds):
        for n, system in enumerate(args.systems):
            flip = (n + rnd + (args.first == "after")) % 2
            order = ("after", "before") if flip else ("before", "after")
            for side in order:
                row = run_one(trees[side], side, system, extra)
                runs.append({"round": rnd, "side": side, **row})
                m = median(row)
                print(f"{system:20s} {side:6s} " + (f"{m:.4f} s" if m is not None else row["status"]), flush=True)
                # written after every run: a call stopped at its time limit keeps what it measured
                rows = summarise(runs, args.systems, trees, args.tolerance)
                result = {"command": sys.argv, "trees": {k: str(v) for k, v in trees.items()},
                          "git": {k: git_head(v) for k, v in trees.items()}, "machine": machine,
                          "complete": len(runs) == 2 * args.rounds * len(args.systems), "rows": rows,
                          "runs": runs}  # fmt: skip
                path = write_json(result, "compare_trees.json", args.out)
    within = f"within {args.tolerance:.0%}"
    print(f"\n| system | before (s) | after (s) | after / before | {within} |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
        print(f"| {r['system']} | {fmt(r['before']['median_s'])} | {fmt(r['after']['median_s'])} | "
              f"{fmt(r['ratio'])} | {'yes' if r['within'] else 'no'} |")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
