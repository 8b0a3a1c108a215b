"""Where a profiled run's time went, from py-spy's raw output (``py-spy record --format raw --threads --idle``).

    python benchmarks/spy_summary.py SPY.txt[.gz] [--rate 20] [--within train] [--top 40] [--out F.json]

Counts the samples of each process's main thread whose stack holds a frame of the function `--within`
(bench_resume.py's ``train``: the steps after a load, the first of which builds the state), and prints, in
seconds (samples / rate), each process's total, then each function's inclusive time there and each source line's
own time, as the mean over those processes (a rank each, under torchrun; py-spy without --native puts the time of
C++ calls on the Python line that made them). Writes them to --out as JSON.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spy", type=Path)
    parser.add_argument("--rate", type=float, default=20.0, help="py-spy's --rate (samples a second)")
    parser.add_argument("--within", default="train")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    opener = gzip.open if args.spy.suffix == ".gz" else open
    with opener(args.spy, "rt") as f:
        lines = f.read().splitlines()
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    per_process: collections.Counter[str] = collections.Counter()
    for line in lines:
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        main_thread = next((k for k, f in enumerate(frames) if f.startswith("thread (") and "MainThread" in f), None)
        if main_thread is None:
            continue
        process = frames[main_thread - 1] if main_thread else ""
        frames = frames[main_thread + 1 :]
        if not any(f.startswith(args.within + " (") for f in frames):
            continue
        per_process[process.split(":", 1)[0]] += int(count)
        for name in {re.sub(r":\d+\)$", ")", f) for f in frames}:
            inclusive[name] += int(count)
        own[frames[-1]] += int(count)
    ranks = max(1, len(per_process))
    seconds = lambda counter: [(name, n / args.rate / ranks) for name, n in counter.most_common(args.top)]  # noqa: E731
    result = {"within": args.within, "seconds_per_process": {k: n / args.rate for k, n in per_process.items()},
              "seconds": sum(per_process.values()) / args.rate / ranks, "inclusive": seconds(inclusive),
              "own": seconds(own)}  # fmt: skip
    print(f"{args.within}: {result['seconds']:.1f} s of a main thread, the mean over {ranks} process(es)")
    for title in ("inclusive", "own"):
        print(title)
        for name, s in result[title]:
            print(f"{s:8.1f}  {name[:150]}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
