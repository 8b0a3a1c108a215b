"""Training steps of one workload under several systems, side by side in one run.

    python benchmarks/bench_train.py --model opt-2.7b --systems amp bf16 twinflow:0.4 ds-z3:0.4 ds-z3:1 ...
    python benchmarks/bench_train.py --model opt-30b --gpus 4 --systems twinflow:0.4 ds-z3:0.4 ds-z3:1

Systems (a ratio after the colon is the share of parameters whose optimizer
step runs on the CPU):
  amp           fp32 parameters, bf16 autocast, torch fused AdamW; no offload
  bf16          bf16 parameters, torch fused AdamW, no fp32 master; no offload
  twinflow:R    twinflow.initialize, bf16 with fp32 masters, ratio R (one GPU:
                TwinFlowAdam attached to the model; several: FSDP2, stage 3);
                R = auto: twinflow plans it (the row's ratio is the plan)
  twinflow-delay:R  the same with offload_delay_after 1: the CPU share's
                update lands one step late (not exact)
  twinflow-spec:R   the same with offload_speculate (exact): under --clip
                the CPU steps as gradients land, redoing clipped steps
  twinflow-wf:R     the same with offload_weights_first (exact): under --clip
                the CPU writes the new weights first (the kernel's peek)
                and commits its state behind them
  twinflow-m24:R, twinflow-m24-delay:R, twinflow-m24-wf:R  the same
                three with offload_state_precision "int8_m24" (8-bit
                moments, 24-bit masters, on both sides)
  ds-z3:R       DeepSpeed ZeRO-3, bf16; R = 0: no offload, 0 < R < 1: its
                Twin-Flow (offload_optimizer.ratio), R = 1: ZeRO-Offload
  ds-z2         DeepSpeed ZeRO-2 with the optimizer offloaded (ZeRO-Offload)
  ds-zenflow    DeepSpeed ZenFlow: ds-z2 plus its tutorial's zenflow block
                (the top 5% of gradient columns step on the GPU every
                step, the rest on the CPU every 4th step, overlapped; not
                exact). Its steps are uneven (a CPU update lands every 4th,
                the optimizer process starts at the 4th): time a multiple
                of 4 steps after 4 warm-up steps (--steps-for
                ds-zenflow=8,4) and read mean_step_seconds_with_drain
  ds-super:R    DeepSpeed SuperOffload (ZeRO-3, offload_optimizer.super_offload,
                built for GH200; speculates on the CPU step, rolls back on
                clipping or overflow), ratio R of the optimizer on the CPU
  torchao       torchao's CPUOffloadOptimizer over bf16 parameters (one GPU)

Every system trains the same model shape (random init, activation
checkpointing) on the same random tokens, with AdamW (lr 1e-5, weight decay
0.01; --clip N clips every system's gradients to global norm N: torch's
clip_grad_norm_ before the step, twinflow's and DeepSpeed's
gradient_clipping), in a process of its own (under torchrun with --gpus
processes), one system after the other. A system that fails (out of memory,
missing package, timeout) is recorded with the tail of its output and the
run goes on. The JSON is rewritten after every system, so a run cut short
keeps what it measured. Step time is the median over the timed steps of the
time between consecutive step ends (so work a system overlaps into the next
step is counted once); peak GPU memory is torch's max_memory_allocated over
the whole run (model, optimizer and activations), the largest over ranks;
host memory is the peak resident set summed over ranks.

Writes JSON (--out, else $OUT/bench_train_<model>.json, else
benchmarks/results/), a PNG of step time and peak GPU memory against ratio
per system, and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.bench_train_systems import (  # noqa: E402
    DEEPSPEED,
    DS_ZERO,
    LR,
    SINGLE_GPU_ONLY,
    TWINFLOW,
    WEIGHT_DECAY,
    ZENFLOW,
    build,
    deepspeed_config,  # noqa: F401  (tests import the configs from here)
    parse_system,
    twinflow_config,  # noqa: F401  (as deepspeed_config)
)
from benchmarks.common import machine_info, write_json  # noqa: E402
from benchmarks.process_tree import failure, stop_tree  # noqa: E402  (failure: tests import it from here)

# ----------------------------------------------------------------------------- worker (one system)


def worker(args) -> None:
    name, ratio = parse_system(args.worker)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = f"cuda:{local_rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not name.startswith("ds-"):  # DeepSpeed starts its own process group
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)

    built = time.perf_counter()
    model, one_step, finish, report = build(name, ratio, args, device, world)
    init_seconds = time.perf_counter() - built
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1 + rank)
    batches = [
        torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=gen)
        for _ in range(args.warmup + args.steps)
    ]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    losses, ends = [], []
    sync()
    start = time.perf_counter()
    for i, tokens in enumerate(batches):
        loss = one_step(tokens.to(device, non_blocking=True))
        losses.append(float(loss.detach().float().item()))
        sync()
        ends.append(time.perf_counter())
        if rank == 0 and args.verbose:
            print(f"[{args.worker}] step {i}: loss {losses[-1]:.4f}, {ends[-1] - (ends[-2] if i else start):.3f} s",
                  flush=True)  # fmt: skip
        if i == args.hold_after:  # a process mid-run at a known point, whatever the machine's speed
            print(f"[{args.worker}] rank {rank} holds after step {i}", flush=True)
            while True:
                signal.pause()  # until a signal ends the process
    finish()
    sync()
    done = time.perf_counter()
    marks = [start, *ends]  # step i runs from marks[i] to marks[i + 1]
    steps = [b - a for a, b in zip(marks[args.warmup : -1], marks[args.warmup + 1 :])]
    timed_from = marks[args.warmup]
    result = {
        "system": args.worker,
        "name": name,
        "ratio": ratio,
        "rank": rank,
        "world_size": world,
        "init_seconds": init_seconds,
        "step_seconds": steps,
        "median_step_seconds": statistics.median(steps),
        # the timed steps' wall time including the wait for work still in flight at the end
        "mean_step_seconds_with_drain": (done - timed_from) / args.steps,
        "losses": losses,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "peak_host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        **report(),
    }
    Path(f"{args.result}.rank{rank}").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- driver (all systems)


def merge(parts: list[dict]) -> dict:
    """One row from the ranks' results: rank 0's times, the largest GPU peak, the summed host peak."""
    first = min(parts, key=lambda r: r["rank"])
    row = {k: first[k] for k in ("system", "name", "ratio", "world_size", "init_seconds", "step_seconds",
                                 "median_step_seconds", "mean_step_seconds_with_drain", "losses")}  # fmt: skip
    gpu = [r["peak_gpu_gib"] for r in parts if r["peak_gpu_gib"] is not None]
    row["peak_gpu_gib"] = max(gpu) if gpu else None
    reserved = [r["peak_gpu_reserved_gib"] for r in parts if r["peak_gpu_reserved_gib"] is not None]
    row["peak_gpu_reserved_gib"] = max(reserved) if reserved else None
    row["peak_host_rss_gib"] = sum(r["peak_host_rss_gib"] for r in parts)
    if "released_grad_gib" in first:  # per rank, in rank order
        row["released_grad_gib_per_rank"] = [r["released_grad_gib"] for r in sorted(parts, key=lambda r: r["rank"])]
        row["attached"] = first["attached"]
        for key in (
            "rollbacks",
            "steps_not_speculated",
            "cpu_chunks_s_per_step",
            "cpu_commits_s_per_step",
            "chunks_per_step",
            "weights_first_chunks_per_step",
            "weights_first_late_steps",
        ):  # rank 0's
            row[key] = first.get(key)
    if row["ratio"] == "auto":  # the row's ratio is the one twinflow planned
        row["ratio_requested"], row["ratio"] = row["ratio"], first["ratio_planned"]
    row["status"] = "ok"
    return row


def run_system(system: str, args, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        worker_args = [str(Path(__file__).resolve()), "--worker", system, "--result", str(result),
                       "--model", args.model, "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len),
                       "--steps", str(args.steps), "--warmup", str(args.warmup),
                       "--placement", args.placement, "--clip", str(args.clip)]  # fmt: skip
        if args.verbose:
            worker_args.append("--verbose")
        if args.hold_after is not None:
            worker_args += ["--hold-after", str(args.hold_after)]
        if system.startswith("ds-") and torch.cuda.is_available():
            # DeepSpeed's op builder cannot parse an architecture such as '9.0a' (set on some images)
            major, minor = torch.cuda.get_device_capability()
            env = dict(env, TORCH_CUDA_ARCH_LIST=f"{major}.{minor}")
        if args.gpus > 1 or system.startswith("ds-"):
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={args.gpus}"]  # fmt: skip
        else:
            launcher = [sys.executable]
        started = time.perf_counter()
        # stderr joins stdout so that the tail reads in time order
        proc = subprocess.Popen(launcher + worker_args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=args.timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            stop_tree(proc)
            output, _ = proc.communicate()
            code = "timeout"
        wall = time.perf_counter() - started
        parts = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("result.json.rank*"))]
        if code == 0 and len(parts) == args.gpus:
            row = merge(parts)
        else:
            row = {"system": system, "status": failure(code, output), "returncode": code}
        row["wall_seconds"] = wall
        noise = ("warn", "return func(*args, **kwargs)", "Failed to load")
        kept = [line for line in output.splitlines() if not any(n in line for n in noise)]
        row["output_tail"] = "\n".join(kept)[-4000:]
        return row


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} GiB"


def markdown(rows: list[dict]) -> str:
    lines = ["| system | ratio | step (median) | peak GPU memory | host RSS | first -> last loss | status |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        if r["status"] == "ok":
            ratio = "-" if r["ratio"] is None else r["ratio"]
            loss = f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}"
            lines.append(f"| {r['system']} | {ratio} | {r['median_step_seconds']:.3f} s | {_gib(r['peak_gpu_gib'])} | "
                         f"{_gib(r['peak_host_rss_gib'])} | {loss} | ok |")  # fmt: skip
        else:
            lines.append(f"| {r['system']} | - | - | - | - | - | {r['status']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return  # nothing measured: no figure
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    families = {}
    for r in ok:
        families.setdefault(r["name"], []).append(r)
    for i, (name, members) in enumerate(sorted(families.items())):
        members.sort(key=lambda r: r["ratio"] if r["ratio"] is not None else -1)
        color = f"C{i}"
        if len(members) > 1 or members[0]["ratio"] is not None and name in (*TWINFLOW, *DEEPSPEED):
            xs = [r["ratio"] for r in members]
            ax_t.plot(xs, [r["median_step_seconds"] for r in members], "o-", color=color, label=name)
            ax_m.plot(xs, [r["peak_gpu_gib"] for r in members], "o-", color=color, label=name)
        else:  # no offload ratio: a horizontal reference line
            r = members[0]
            ax_t.axhline(r["median_step_seconds"], color=color, ls="--", label=name)
            ax_m.axhline(r["peak_gpu_gib"], color=color, ls="--", label=name)
    ax_t.set(xlabel="share of parameters stepped on the CPU (ratio)", ylabel="step time (s, median)", title=title)
    ax_m.set(xlabel="share of parameters stepped on the CPU (ratio)", ylabel="peak GPU memory (GiB)")
    ax_t.set_ylim(bottom=0)
    ax_m.set_ylim(bottom=0)
    for ax in (ax_t, ax_m):
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="opt-2.7b")
    parser.add_argument("--systems", nargs="+", default=["amp", "twinflow:0.4", "ds-z3:0.4"])
    parser.add_argument("--gpus", type=int, default=1, help="processes (GPUs) per system, through torchrun")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps-for", nargs="*", default=[], metavar="SYSTEM=N",
                        help="timed (and warm-up) steps of one system, e.g. ds-z3:1=3,1")  # fmt: skip
    parser.add_argument("--clip", type=float, default=0.0,
                        help="clip every system's gradients to this global norm (0: no clipping)")  # fmt: skip
    parser.add_argument("--placement", default="last", choices=("first", "last"), help="twinflow's CPU share")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS for every system (default: cores / processes)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per system before it is stopped")
    parser.add_argument("--out", default=None)
    parser.add_argument("--verbose", action="store_true", help="print every step of every system")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    # every worker stops after this step and waits to be stopped: the timeout path, exercised at a known point
    parser.add_argument("--hold-after", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    systems = [parse_system(s) for s in args.systems]  # refuse bad names before anything runs
    steps_for = {}
    for item in args.steps_for:
        system, _, counts = item.partition("=")
        count, _, warm = counts.partition(",")
        if system not in args.systems or not count.isdigit() or int(count) < 1 or warm and not warm.isdigit():
            raise SystemExit(
                f"--steps-for {item!r}: expected SYSTEM=N or SYSTEM=N,W with SYSTEM one of --systems, N >= 1 timed "
                "steps and W >= 0 warm-up steps"
            )
        steps_for[system] = (int(count), int(warm) if warm else args.warmup)
    if args.gpus > 1:
        single = [s for s, (name, _) in zip(args.systems, systems) if name in SINGLE_GPU_ONLY]
        if single:
            raise SystemExit(f"--gpus {args.gpus}: {single} run on one GPU only here; drop them or use --gpus 1")
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit(f"--steps {args.steps} --warmup {args.warmup}: need at least 1 timed step, warmup >= 0")
    cores = len(os.sched_getaffinity(0))
    threads = args.threads or max(1, cores // args.gpus)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))  # fmt: skip
    name = f"bench_train_{args.model}" + (f"_x{args.gpus}" if args.gpus > 1 else "")
    result = {
        "benchmark": "bench_train",
        "command": "python benchmarks/bench_train.py " + " ".join(sys.argv[1:]),
        "machine": machine_info() | {"gpus": args.gpus, "omp_num_threads": threads},
        "workload": {
            "model": args.model,
            "micro_batch_per_gpu": args.micro_batch,
            "seq_len": args.seq_len,
            "steps": args.steps,
            "warmup": args.warmup,
            "optimizer": f"AdamW lr {LR} wd {WEIGHT_DECAY}",
            "clip": args.clip,
            "activation_checkpointing": "non-reentrant",
            "deepspeed_zero": DS_ZERO,
            "deepspeed_zenflow": ZENFLOW,
            "twinflow_placement": args.placement,
        },  # fmt: skip
        "steps_for": steps_for,
        "rows": [],
    }
    for system in args.systems:
        print(f"== {system}", flush=True)
        steps, warmup = steps_for.get(system, (args.steps, args.warmup))
        row = run_system(system, argparse.Namespace(**{**vars(args), "steps": steps, "warmup": warmup}), env)
        row["timed_steps"], row["warmup_steps"] = steps, warmup
        result["rows"].append(row)
        summary = {k: row.get(k) for k in ("status", "median_step_seconds", "peak_gpu_gib", "peak_host_rss_gib",
                                           "wall_seconds")}  # fmt: skip
        print(json.dumps(summary), flush=True)
        if row["status"] != "ok":
            print(row["output_tail"][-1500:], flush=True)
        path = write_json(result, f"{name}.json", args.out)
    table = markdown(result["rows"])
    result["markdown"] = table
    path = write_json(result, f"{name}.json", args.out)
    print(table)
    try:
        plot(result["rows"], path.with_suffix(".png"), f"{args.model}, {args.gpus} GPU(s)")
    except Exception as exc:  # a missing matplotlib must not lose the measurements
        print(f"no plot: {exc}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
