"""The compact CPU kernel of another commit and of this checkout, in one process: the same bits? how fast?

    python benchmarks/compare_kernel_commits.py --before COMMIT [--params 16777216] [--rounds 5] [--out FILE]

Builds benchmarks/kernel_ab/harness.cpp with two copies of the kernel: COMMIT's csrc (taken with `git archive`,
its instruction-set namespaces renamed at compile time) and this checkout's. The harness first runs both on every
path the CPU has (AVX-512, AVX2, scalar) over every gradient and copy dtype, both master kinds, the optional
gradient scale and L2 terms, the step and the peek, random and spread moments and sizes with tails, and counts
the cases whose outputs differ in any bit. Then it times the two on one thread, interleaved round by round
(drift on the machine favours neither): bf16 gradients and copy, a cache-resident size (32,768 elements: the
arithmetic alone) and --params (memory too), beside the probe that moves the same bytes with trivial
arithmetic. Exits 1 if any case differs. Needs g++ (or $CXX); writes JSON (--out, else $OUT, else
benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import machine_info, write_json  # noqa: E402

FLAGS = ["-O3", "-std=c++17", "-fno-math-errno"]
PATHS = {"avx512": "kernel_avx512.cpp", "avx2": "kernel_avx2.cpp", "scalar": "kernel_scalar.cpp"}
OLD_NAMESPACE = {"avx512": "old512", "avx2": "old2", "scalar": "oldscalar"}


def build(before: str, work: Path) -> Path:
    """The harness binary, with `before`'s kernel and this checkout's."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", before, "csrc"], capture_output=True, check=True)
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(work / "old", filter="data")
    cxx = os.environ.get("CXX", "g++")
    jobs = []
    for path, source in PATHS.items():
        jobs.append([cxx, *FLAGS, f"-D{path}={OLD_NAMESPACE[path]}", "-I", str(work / "old" / "csrc"), "-c",
                     str(work / "old" / "csrc" / source), "-o", str(work / f"old_{path}.o")])  # fmt: skip
        jobs.append([cxx, *FLAGS, "-c", str(ROOT / "csrc" / source), "-o", str(work / f"new_{path}.o")])
    harness = ROOT / "benchmarks" / "kernel_ab" / "harness.cpp"
    jobs.append([cxx, *FLAGS, "-I", str(ROOT / "csrc"), "-c", str(harness), "-o", str(work / "harness.o")])
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for done in pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), jobs):
            if done.returncode != 0:
                raise SystemExit(f"build failed: {' '.join(done.args)}\n{done.stderr[-4000:]}")
    binary = work / "harness"
    subprocess.run([cxx, *sorted(str(p) for p in work.glob("*.o")), "-o", str(binary)], check=True)
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the commit to compare against (any git revision)")
    parser.add_argument("--params", type=int, default=1 << 24, help="the memory-resident size timed")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.before], capture_output=True, text=True,
                            check=True).stdout.strip()  # fmt: skip
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "csrc"], capture_output=True,
                                text=True, check=True).stdout.strip())  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(commit, Path(tmp))
        done = subprocess.run([str(binary), str(args.params), str(args.rounds)], capture_output=True, text=True)
    if not done.stdout.strip():
        raise SystemExit(f"the harness printed nothing (exit {done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout)
    result.update(machine=machine_info(), before=commit, after=head, after_has_uncommitted_csrc=dirty)
    for t in result["timings"]:
        t["new_over_old"] = t["new_gparam_s"] / t["old_gparam_s"]
        t["old_share_of_probe"] = t["old_gparam_s"] / t["probe_gparam_s"]
        t["new_share_of_probe"] = t["new_gparam_s"] / t["probe_gparam_s"]
    print(f"bits: {result['bit_cases_differing']} of {result['bit_cases']} cases differ"
          + (f" (first: {result['first_difference']})" if result["bit_cases_differing"] else ""))  # fmt: skip
    print("| path | mode | elements | before Gparam/s | after Gparam/s | after/before | before % of probe |"
          " after % of probe |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for t in result["timings"]:
        shares = f"{100 * t['old_share_of_probe']:.0f}% | {100 * t['new_share_of_probe']:.0f}%"
        print(
            f"| {t['path']} | {t['mode']} | {t['params']:,} | {t['old_gparam_s']:.3f} | {t['new_gparam_s']:.3f} | "
            f"{t['new_over_old']:.2f} | {shares} |"
        )
    print("wrote", write_json(result, "compare_kernel_commits.json", args.out))
    sys.exit(1 if result["bit_cases_differing"] else 0)


if __name__ == "__main__":
    main()
