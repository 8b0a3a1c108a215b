"""Loss curves of the exact CPU update and opt-in modes (delayed, or compact state), the same run otherwise.

    python benchmarks/bench_delay_loss.py --model opt-350m --steps 600 [--delay-after 40]
    python benchmarks/bench_delay_loss.py --mode int8 --model opt-350m --steps 1000
    python benchmarks/bench_delay_loss.py --mode int8 --model opt-1.3b --only exact --out a.json  # one run per
    python benchmarks/bench_delay_loss.py --mode int8 --model opt-1.3b --only int8 --out b.json   # call, then
    python benchmarks/bench_delay_loss.py --merge a.json b.json --out both.json                    # one result
    python benchmarks/bench_delay_loss.py --mode int8_m24 --model opt-1.3b --only int8_m24 --out c.json
    python benchmarks/bench_delay_loss.py --merge a.json b.json c.json --out all.json  # the three in one plot

Trains the model from random init twice with examples/train_opt.py, on the
same local text and the same batches: once exact, once with
``offload_delay_after`` (the CPU share's update lands one step late), or
with ``--mode int8`` (or ``int8_m24``) once with that
``offload_state_precision``. The
text is the ``.md``, ``.rst`` and ``.txt`` files of this Python's packages,
read as UTF-8 bytes (--data names another file). Clipping at 1.0, ratio 0.5,
placement "last", AdamW with a linear warm-up. Writes JSON (--out, else
$OUT/delay_loss_<model>.json or state_loss_<model>.json, else benchmarks/results/) with both loss
series and their step times, and a PNG of both curves when matplotlib is
installed (``--plot FILE.json`` redraws it from a JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import site
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import machine_info, write_json  # noqa: E402


def corpus(path: Path, limit: int) -> int:
    """Writes up to `limit` bytes of the packages' documentation text to `path`; returns the size."""
    written = 0
    with path.open("wb") as out:
        for root in site.getsitepackages():
            for f in sorted(Path(root).rglob("*")):
                if f.suffix not in (".md", ".rst", ".txt") or not f.is_file():
                    continue
                data = f.read_bytes()[: limit - written]
                out.write(data)
                written += len(data)
                if written >= limit:
                    return written
    if written < 1 << 20:
        raise SystemExit(f"only {written} bytes of text found under {site.getsitepackages()}; pass --data FILE")
    return written


def config(args, delay_after: int | None, precision: str = "fp32") -> dict:
    return {
        "offload_state_precision": precision,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr, "warmup_num_steps": args.warmup},
        },  # fmt: skip
        "offload_ratio": args.ratio,
        "offload_placement": "last",
        "offload_delay_after": delay_after,
    }


def train(args, data: Path, delay_after: int | None, tmp: Path, precision: str = "fp32") -> dict:
    name = "delayed" if delay_after is not None else precision if precision != "fp32" else "exact"
    config_path, summary = tmp / f"{name}.json", tmp / f"{name}_summary.json"
    config_path.write_text(json.dumps(config(args, delay_after, precision)))
    cmd = [sys.executable, str(ROOT / "examples" / "train_opt.py"), "--model", args.model, "--config",
           str(config_path), "--data", str(data), "--steps", str(args.steps), "--seq-len", str(args.seq_len),
           "--seed", "0", "--summary", str(summary)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{name} run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(summary.read_text())


def smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (redraw later with --plot)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_d) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 1))
    runs = result["runs"]
    others = [name for name in runs if name != "exact"]
    labels = {"exact": "exact (fp32 state)", "delayed": "delayed", "int8": "8-bit moments",
              "int8_m24": "8-bit moments, 24-bit masters"}  # fmt: skip
    exact = smooth(runs["exact"]["losses"], 20)
    for k, name in enumerate(["exact", *others]):
        color, losses = f"C{k}", runs[name]["losses"]
        ax.plot(losses, color=color, alpha=0.25, lw=0.8)
        base, _, where = name.partition(" (")
        label = labels.get(base, base) + (f" ({where}" if where else "")
        ax.plot(smooth(losses, 20), color=color, label=f"{label}, 20-step mean")
        if name != "exact":
            ax_d.plot([d - e for d, e in zip(smooth(losses, 20), exact)], color=color, label=label)
    ax_d.axhline(0.0, color="grey", lw=0.6)
    if "delayed" in others:
        ax.axvline(result["delay_after"], color="grey", ls=":", lw=0.8, label="delay starts")
    where = ", unless named" if any("(ratio" in name for name in runs) else ""
    ax.set(ylabel="training loss", title=f"{result['model']}, ratio {result['ratio']}{where}, clipping at 1.0")
    ax_d.set(xlabel="step", ylabel="minus exact (20-step means)")
    ax.legend()
    for a in (ax, ax_d):
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("delayed", "int8", "int8_m24"), default="delayed",
                        help="the run beside the exact one")  # fmt: skip
    parser.add_argument("--model", default="opt-350m")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--delay-after", type=int, default=40, help="exact steps before the delay starts")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=50, help="lr warm-up steps")
    parser.add_argument("--data", default=None, help="a local text file (default: the packages' docs)")
    parser.add_argument("--corpus-bytes", type=int, default=32 << 20)
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None, metavar="JSON", help="only redraw the plot of this JSON")
    parser.add_argument("--only", default=None, help="train only this run (exact, or the mode's); merge later")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="join --only results (one exact)")
    parser.add_argument(
        "--mixed-ratios",
        action="store_true",
        help="--merge: runs at other ratios than the first file's join too, named with their ratio",
    )
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
        return
    if args.merge:
        parts = [json.loads(Path(p).read_text()) for p in args.merge]
        base = parts[0]["ratio"]
        if args.mixed_ratios:  # runs at another ratio than the first file's keep it in their names
            for part in parts:
                if part["ratio"] != base:
                    part["runs"] = {f"{name} (ratio {part['ratio']:g})": run for name, run in part["runs"].items()}
        runs = {name: run for part in parts for name, run in part["runs"].items()}
        names = [name for part in parts for name in part["runs"]]
        if "exact" not in runs or len(runs) < 2 or len(names) != len(runs):
            raise SystemExit(f"--merge: expected the exact run and one or more others, each once; got {names}")
        settings = {(p["model"], p["steps"], p["micro_batch"], p["lr"]) + ((p["ratio"],) * (not args.mixed_ratios))
                    for p in parts}  # fmt: skip
        if len(settings) > 1:
            raise SystemExit(f"--merge: the runs differ in (model, steps, micro-batch, lr, ratio): {sorted(settings)}; "
                             "--mixed-ratios allows other ratios")  # fmt: skip
        mode = next(part["mode"] for part in parts if part["mode"] in runs)
        finish(args, parts[0] | {"mode": mode, "command": [p["command"] for p in parts]}, runs)
        return
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        data = Path(args.data) if args.data else tmp / "corpus.txt"
        size = data.stat().st_size if args.data else corpus(data, args.corpus_bytes)
        runs = {}
        if args.only in (None, "exact"):
            runs["exact"] = train(args, data, None, tmp)
        if args.only in (None, args.mode):
            runs[args.mode] = (train(args, data, args.delay_after, tmp) if args.mode == "delayed"
                               else train(args, data, None, tmp, precision=args.mode))  # fmt: skip
    result = {
        "mode": args.mode, "model": args.model, "steps": args.steps, "delay_after": args.delay_after,
        "ratio": args.ratio, "micro_batch": args.micro_batch, "seq_len": args.seq_len, "lr": args.lr,
        "lr_warmup": args.warmup, "corpus_bytes": size, "machine": machine_info(), "command": " ".join(sys.argv),
    }  # fmt: skip
    finish(args, result, runs)


def finish(args, result: dict, runs: dict) -> None:
    """Writes the result (the tail means when both runs are there) and the plot."""
    result = {**result, "runs": runs}
    if "exact" in runs and len(runs) >= 2:
        tail = max(1, len(runs["exact"]["losses"]) // 10)
        result[f"mean_loss_last_{tail}_steps"] = {name: sum(run["losses"][-tail:]) / tail
                                                  for name, run in runs.items()}  # fmt: skip
    args.mode, args.model = result["mode"], result["model"]
    prefix = "delay_loss" if args.mode == "delayed" else "state_loss"
    out = write_json(result, f"{prefix}_{args.model}.json", args.out)
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "machine")}, indent=2))
    if "exact" in runs and len(runs) >= 2:
        plot(result, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
