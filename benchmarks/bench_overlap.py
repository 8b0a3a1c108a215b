"""End-to-end training steps, OPT shapes, one GPU: twinflow (plain and overlapped) against PyTorch AMP.

    python benchmarks/bench_overlap.py --set acceptance   # AMP floor; ratio 0.4 and 1.0, placements, clipping
    python benchmarks/bench_overlap.py --set sweep        # AMP floor; ratio 0 to 1 (overlapped, "last"); auto

Workload (the anchors'): OPT-2.7B shapes, random init, bf16 compute with fp32
master weights, micro-batch 4 x 1024 tokens, activation checkpointing. Each
system builds its own model on the GPU, takes --warmup steps, then --steps
timed steps (host and device synchronised at the end of each; the CPU side
of an overlapped step may still run then, as it would in training). Reports
the median step and the peak GPU memory (allocated; reserved beside it), and
writes JSON (and, for the sweep, a PNG of step time and memory against
ratio) to $OUT or benchmarks/results/. --trace FILE saves a torch.profiler
trace of one overlapped step at ratio 0.4.
"""

import argparse
import gc
import gzip
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import machine_info, write_json  # noqa: E402
from twinflow import TwinFlowAdam  # noqa: E402
from twinflow.models import build_opt  # noqa: E402
from twinflow.plan import predict_time  # noqa: E402

GIB = 1 << 30


def build(name: str, device: str, dtype: torch.dtype):
    torch.manual_seed(0)
    return build_opt(name, device, dtype)


def batches(vocab: int, batch: int, seq: int, device: str, seed: int = 1):
    gen = torch.Generator(device=device).manual_seed(seed)
    while True:
        yield torch.randint(0, vocab, (batch, seq), device=device, generator=gen)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def clip_of(spec: dict) -> float | None:
    """max_grad_norm: spec["clip"] True means 1.0; a number is the threshold (1e9: clipping that never triggers)."""
    clip = spec.get("clip")
    return None if not clip else 1.0 if clip is True else float(clip)


def run_system(spec: dict, args) -> dict:
    """Builds the model and optimizer of one system, trains, and returns its timings and memory."""
    device = args.device
    amp = spec["kind"] == "amp"
    model = build(args.model, device, torch.float32 if amp else torch.bfloat16)
    if amp:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    else:
        opt = TwinFlowAdam(
            model.parameters(), lr=1e-5, ratio=spec["ratio"], placement=spec.get("placement", "first"),
            max_grad_norm=clip_of(spec), num_threads=spec.get("threads"), speculate=spec.get("speculate", False),
            memory_budget=int(spec["budget_gib"] * GIB) if spec.get("budget_gib") else None,
            **({"chunk_bytes": spec["chunk_mib"] << 20} if spec.get("chunk_mib") else {}),
        )  # fmt: skip
        if spec.get("attach", True):
            opt.attach(model)
    data = batches(model.config.vocab_size, args.batch, args.seq, device)
    if spec.get("ratio") == "auto":  # ratio="auto" times the forward and backward before its first step
        tokens = next(data)
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses, marks = [], [], []
    trace_step = spec.get("trace")
    coordinator = getattr(opt, "coordinator", None)
    pipeline = coordinator.host if coordinator is not None and coordinator.host.chunk_count else None
    for step in range(args.warmup + args.steps):
        tokens = next(data)
        sync(device)
        start = time.perf_counter()
        timed = spec.get("timeline") and pipeline is not None and args.warmup <= step < args.warmup + 3
        if timed and pipeline.timeline is None:
            pipeline.timeline = []
        profiler = None
        if trace_step and step == args.warmup:
            profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            )
            profiler.__enter__()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            loss = model(input_ids=tokens, labels=tokens).loss
        forward_end = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        if amp and spec.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_of(spec))
        opt.step()
        step_end = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        sync(device)
        if timed:
            marks.append({"start": start, "forward_end": forward_end, "backward_end": backward_end,
                          "step_end": step_end, "end": time.perf_counter()})  # fmt: skip
        if profiler is not None:
            if isinstance(opt, TwinFlowAdam):
                opt.synchronize()
                sync(device)
            profiler.__exit__(None, None, None)
            path = Path(trace_step)
            profiler.export_chrome_trace(str(path.with_suffix("")))
            with open(path.with_suffix(""), "rb") as f, gzip.open(path, "wb") as g:
                g.write(f.read())
            os.remove(path.with_suffix(""))
        elif step >= args.warmup:
            times.append(time.perf_counter() - start)
    if isinstance(opt, TwinFlowAdam):
        opt.synchronize()
    sync(device)
    if marks:
        t0 = marks[0]["start"]
        shift = lambda d: {k: (v - t0 if isinstance(v, float) else v) for k, v in d.items()}  # noqa: E731
        timeline = {"iterations": [shift(m) for m in marks], "events": [shift(e) for e in pipeline.timeline]}
        pipeline.timeline = None
    entry = {
        "step_s": statistics.median(times) if times else None,
        "step_times_s": times,
        "losses": losses,
    }
    if marks:
        entry["timeline"] = timeline
    if device == "cuda":
        entry["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        entry["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    if isinstance(opt, TwinFlowAdam):
        entry["split"] = opt.split_summary
        entry["released_grad_gib"] = opt.released_grad_bytes / GIB
        entry["ratio"] = opt.ratio
        if opt.auto_decision is not None:
            entry["auto_decision"] = opt.auto_decision
        if opt.attached:
            opt.detach()
    del model, opt
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return entry


def name_of(spec: dict) -> str:
    if spec["kind"] == "amp":
        return "amp" + ("+clip" if spec.get("clip") else "")
    mode = "overlap" if spec.get("attach", True) else "plain"
    ratio = spec["ratio"]
    name = f"twinflow r={ratio} {spec.get('placement', 'first')} {mode}"
    name += f" +clip {clip_of(spec):g}" if spec.get("clip") else ""
    name += " +speculate" if spec.get("speculate") else ""
    name += f" threads={spec['threads']}" if spec.get("threads") else ""
    name += f" chunk={spec['chunk_mib']}MiB" if spec.get("chunk_mib") else ""
    return name + (f" budget={spec['budget_gib']}GiB" if spec.get("budget_gib") else "")


SETS = {
    "acceptance": [
        {"kind": "amp"},
        {"kind": "tf", "ratio": 0.4, "placement": "first"},
        {"kind": "tf", "ratio": 0.4, "placement": "last"},
        {"kind": "tf", "ratio": 0.4, "placement": "first", "clip": True},
        {"kind": "tf", "ratio": 0.4, "placement": "last", "clip": True},
        {"kind": "tf", "ratio": 0.4, "placement": "first", "attach": False},
        {"kind": "tf", "ratio": 1.0, "placement": "last"},
        {"kind": "tf", "ratio": 1.0, "placement": "last", "clip": True},
        {"kind": "amp", "clip": True},
    ],
    "sweep": [
        {"kind": "amp"},
        *(
            {"kind": "tf", "ratio": r, "placement": "last", "timeline": r in (0.4, 1.0)}
            for r in (0, 0.2, 0.4, 0.6, 0.8, 1)
        ),
        {"kind": "tf", "ratio": "auto", "placement": "last"},
        {"kind": "tf", "ratio": "auto", "placement": "last", "budget_gib": 30},
    ],
    "check": [
        {"kind": "amp"},
        {"kind": "tf", "ratio": 0.4, "placement": "last"},
        {"kind": "tf", "ratio": 1.0, "placement": "last"},
    ],
    "threads": [
        *({"kind": "tf", "ratio": 0.4, "placement": "last", "threads": t} for t in (12, 14, 15, 16)),
        *({"kind": "tf", "ratio": 1.0, "placement": "last", "threads": t} for t in (14, 15, 16)),
    ],
    "knobs": [
        *({"kind": "tf", "ratio": r, "placement": "last", "chunk_mib": c} for r in (0.4, 1.0) for c in (32, 128)),
    ],
    # speculation against the eager (unclipped) and the exact clipped step, with clipping that never triggers
    "speculation": [
        {"kind": "tf", "ratio": 0.4, "placement": "last", "timeline": True},
        {"kind": "tf", "ratio": 0.4, "placement": "last", "clip": 1e9, "timeline": True},
        {"kind": "tf", "ratio": 0.4, "placement": "last", "clip": 1e9, "speculate": True, "timeline": True},
    ],
    "smoke": [
        {"kind": "amp"},
        {"kind": "tf", "ratio": 0.4, "placement": "last", "timeline": True},
        {"kind": "tf", "ratio": "auto"},
    ],
}


def plot_sweep(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(e["ratio"], e) for k, e in result["systems"].items() if k.startswith("twinflow") and "auto" not in k]
    autos = [e for k, e in result["systems"].items() if "auto" in k and "step_s" in e]
    rows.sort(key=lambda x: x[0])
    amp = result["systems"]["amp"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot([r for r, _ in rows], [e["step_s"] for _, e in rows], "o-", label="twinflow (overlapped, last)")
    if "predicted_step_s" in rows[0][1]:
        a.plot([r for r, _ in rows], [e["predicted_step_s"] for _, e in rows], "x--", label="twinflow, predicted")
    a.axhline(amp["step_s"], color="gray", ls=":", label="PyTorch AMP, no offload")
    for auto, marker in zip(autos, ("r*", "m*")):
        budget = (auto.get("auto_decision", {}).get("inputs", {}).get("budget_bytes") or 0) / GIB
        label = f"ratio='auto' -> {auto['ratio']:.2f} (budget {budget:.0f} GiB)"
        a.plot([auto["ratio"]], [auto["step_s"]], marker, ms=14, label=label)
    a.set_xlabel("ratio (share of parameters stepped on the CPU)")
    a.set_ylabel("step time (s)")
    a.legend()
    a.grid(alpha=0.3)
    b.plot([r for r, _ in rows], [e["peak_allocated_gib"] for _, e in rows], "o-", label="twinflow")
    b.axhline(amp["peak_allocated_gib"], color="gray", ls=":", label="PyTorch AMP")
    b.set_xlabel("ratio")
    b.set_ylabel("peak GPU memory allocated (GiB)")
    b.legend()
    b.grid(alpha=0.3)
    fig.suptitle(f"{result['model']}, {result['batch']}x{result['seq']} tokens, {result['machine'].get('gpu', 'CPU')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_timeline(name: str, timeline: dict, path: Path) -> None:
    """Three consecutive steps: the main thread's phases, the CPU worker's chunks, and the forward's waits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 3.2))
    phases = [
        ("start", "forward_end", "forward", "tab:blue"),
        ("forward_end", "backward_end", "backward", "tab:orange"),
        ("backward_end", "step_end", "step()", "tab:green"),
        ("step_end", "end", "sync", "tab:gray"),
    ]
    for it in timeline["iterations"]:
        for a, b, label, color in phases:
            ax.barh(2, (it[b] - it[a]) * 1e3, left=it[a] * 1e3, color=color, edgecolor="k", lw=0.3, label=label)
    horizon = timeline["iterations"][-1]["end"]
    for e in timeline["events"]:
        if e["start"] > horizon:
            continue
        if "chunk" in e:
            color, label = ("tab:pink", "speculative kernel") if e.get("speculative") else ("tab:red", "CPU kernel")
            ax.barh(1, (e["kernel_end"] - e["start"]) * 1e3, left=e["start"] * 1e3, color=color, edgecolor="k",
                    lw=0.2, label=label + " (one chunk)")  # fmt: skip
        elif "verdict" in e:
            ax.barh(1, (e["end"] - e["start"]) * 1e3, left=e["start"] * 1e3, color="tab:olive", edgecolor="k",
                    lw=0.2, label="verdict: keep (or redo) and upload")  # fmt: skip
        elif e["end"] - e["start"] > 2e-4:
            ax.barh(0, (e["end"] - e["start"]) * 1e3, left=e["start"] * 1e3, color="tab:purple",
                    label="forward waits for weights")  # fmt: skip
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=6, fontsize=8)
    ax.set_yticks([0, 1, 2], ["forward waits", "CPU worker", "main thread"])
    ax.set_xlabel("host time (ms) from the start of the first timed step")
    ax.set_title(name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=sorted(SETS), default="acceptance")
    parser.add_argument("--model", default="opt-2.7b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--trace", default=None, help="write a gzipped chrome trace of one step at ratio 0.4 here")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {"machine": machine_info(), "model": args.model, "batch": args.batch, "seq": args.seq,
              "warmup": args.warmup, "steps": args.steps, "set": args.set, "systems": {}}  # fmt: skip
    specs = [dict(s) for s in SETS[args.set]]
    if args.trace:
        for s in specs:
            if s.get("ratio") == 0.4 and s.get("placement") == "last" and not s.get("clip") and s.get("attach", 1):
                s["trace"] = args.trace
                break
    for spec in specs:
        name = name_of(spec)
        t0 = time.perf_counter()
        try:
            entry = run_system(spec, args)
        except torch.OutOfMemoryError as exc:
            entry = {"error": f"out of memory: {exc}"[:300]}
            gc.collect()
            torch.cuda.empty_cache()
        entry["wall_s"] = time.perf_counter() - t0
        result["systems"][name] = entry
        mem = entry.get("peak_allocated_gib")
        step_s = entry.get("step_s")
        print(f"{name:40s} step {step_s if step_s is None else round(step_s, 4)} s  peak "
              f"{mem if mem is None else round(mem, 2)} GiB  ({entry['wall_s']:.0f} s)", flush=True)  # fmt: skip
        write_json(result, f"bench_overlap_{args.set}.json", args.out)
    amp = result["systems"].get("amp", {}).get("step_s")
    if amp:
        for e in result["systems"].values():
            if e.get("step_s"):
                e["over_amp"] = e["step_s"] / amp
    auto = result["systems"].get("twinflow r=auto last overlap", {})
    if "auto_decision" in auto:
        from twinflow.plan import Inputs

        inputs = Inputs(**auto["auto_decision"]["inputs"])
        for name, e in result["systems"].items():
            if name.startswith("twinflow") and "ratio" in e:
                e["predicted_step_s"] = predict_time(inputs, e["ratio"], "last", True, True)
    path = write_json(result, f"bench_overlap_{args.set}.json", args.out)
    if args.set == "sweep":
        plot_sweep(result, path.with_suffix(".png"))
    for name, e in result["systems"].items():
        if "timeline" in e:
            slug = "_".join("".join(c if c.isalnum() else " " for c in name.replace(".", "")).split())
            plot_timeline(name, e["timeline"], path.parent / f"timeline_{slug}.png")
    print(json.dumps({k: (round(v["step_s"], 4) if v.get("step_s") else v.get("error")) for k, v in
                      result["systems"].items()}))  # fmt: skip


if __name__ == "__main__":
    main()
