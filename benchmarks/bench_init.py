"""Where ``twinflow.initialize`` and the first step spend their seconds: an OPT model under torchrun, by phase.

    torchrun --standalone --nproc-per-node 4 benchmarks/bench_init.py --model opt-30b \
        --config examples/configs/opt-30b-int8_m24.json --steps 4 [--out init.json]

Each rank builds the model (random init on its GPU, as examples/train_opt.py does), then runs
``initialize`` and ``--steps`` training steps. Named functions of twinflow and torch are wrapped with timers
(a phase missing from the checkout is left out, so an older tree runs the same script): their seconds are
inclusive (a phase inside another counts in both) and end at a device synchronisation, so queued GPU work is
charged to the phase that queued it. Rank 0 also runs ``cProfile`` over ``initialize`` and the first step, and
keeps the functions that took the most cumulative time. Writes JSON (--out, else $OUT, else
benchmarks/results/) with every rank's phases, the step times, and the peaks. With ``PYTHONPATH=OLD_TREE`` the
twinflow of that checkout is measured (the script itself stays this one).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import io
import json
import os
import pstats
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # after PYTHONPATH: PYTHONPATH=OLD_TREE measures that tree's twinflow
import twinflow  # noqa: E402
from benchmarks.common import machine_info, write_json  # noqa: E402
from twinflow.models import build_opt  # noqa: E402

# phase -> the places its function is reached through (module path, attribute path); the first that exists is
# timed, and every other place that holds the same function object is patched too (today's sub-packages first,
# then an older tree's flat modules, so that one script times both)
PHASES = {
    "fully_shard": [("torch.distributed.fsdp", "fully_shard")],
    "TwinFlowAdam.__init__": [
        ("twinflow.optim.twin_flow_adam", "TwinFlowAdam.__init__"),
        ("twinflow.twin_flow_adam", "TwinFlowAdam.__init__"),
    ],
    "attach": [
        ("twinflow.optim.twin_flow_adam", "TwinFlowAdam.attach"),
        ("twinflow.twin_flow_adam", "TwinFlowAdam.attach"),
    ],
    "kernel load": [("twinflow.host.ops", "load"), ("twinflow.ops", "load")],
    "split build": [("twinflow.step.split_state", "SplitState.build"), ("twinflow.split_state", "SplitState.build")],
    "host state alloc": [
        ("twinflow.host.host_state", "HostState.__init__"),
        ("twinflow.host_state", "HostState.__init__"),
    ],
    "host state write": [("twinflow.host.host_state", "HostState.write"), ("twinflow.host_state", "HostState.write")],
    "master24 copy": [("twinflow.precision.compact", "Master24.copy_"), ("twinflow.compact", "Master24.copy_")],
    "device state (fp32)": [
        ("twinflow.device.device_side", "DeviceState.__init__"),
        ("twinflow.device_side", "DeviceState.__init__"),
    ],
    "device state (compact)": [
        ("twinflow.device.device_compact", "CompactDeviceState.__init__"),
        ("twinflow.device_compact", "CompactDeviceState.__init__"),
    ],
    "pinned buffers": [
        ("twinflow.base.transfer", "pinned_buffers"),
        ("twinflow.host.staging", "pinned_buffers"),
        ("twinflow.transfer", "pinned_buffers"),
        ("twinflow.staging", "pinned_buffers"),
    ],
    "ratio auto decide": [("twinflow.plan", "IterationProbe.decide"), ("twinflow.tune", "IterationProbe.decide")],
    "compact device step": [
        ("twinflow.device.compact_triton", "residual_step_"),
        ("twinflow.device.device_compact", "Compiled.__call__"),
        ("twinflow.device_compact", "Compiled.__call__"),
    ],
    "device step (fp32)": [
        ("twinflow.device.device_side", "DeviceState.step"),
        ("twinflow.device_side", "DeviceState.step"),
    ],
}


class Timers:
    """Seconds and calls per phase; the first call's seconds apart (a compile, a first touch)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.first: dict[str, float] = {}
        self.depth = 0

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.cuda:
                    torch.cuda.synchronize()
                took = time.perf_counter() - start
                self.seconds[name] = self.seconds.get(name, 0.0) + took
                self.calls[name] = self.calls.get(name, 0) + 1
                self.first.setdefault(name, took)

        return timed

    def install(self) -> list[str]:
        """Patches every phase found; returns the names of those that were not."""
        missing = []
        for name, places in PHASES.items():
            patched = False
            for module_name, attr in places:
                try:
                    owner = importlib.import_module(module_name)
                except ImportError:
                    continue
                *path, last = attr.split(".")
                for part in path:
                    owner = getattr(owner, part, None)
                if owner is None or not hasattr(owner, last):
                    continue
                setattr(owner, last, self.wrap(name, getattr(owner, last)))
                patched = True
            if not patched:
                missing.append(name)
        return missing

    def table(self) -> dict[str, dict[str, float]]:
        return {
            name: {"seconds": round(s, 3), "calls": self.calls[name], "first_call_seconds": round(self.first[name], 3)}
            for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])
        }


def profile_top(profile: cProfile.Profile, n: int = 30) -> list[str]:
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(n)
    return [line for line in text.getvalue().splitlines() if line.strip()][-n - 1 :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="opt-125m")
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    distributed = "LOCAL_RANK" in os.environ
    world = int(os.environ.get("WORLD_SIZE", 1)) if distributed else 1
    config = twinflow.load_config(args.config, world_size=world)
    if distributed:
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    rank = torch.distributed.get_rank() if distributed else 0
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if config.bf16.enabled else torch.float32
    timers = Timers(cuda)
    missing = timers.install()

    torch.manual_seed(0)
    start = time.perf_counter()
    model = build_opt(args.model, device, dtype)
    build_s = time.perf_counter() - start

    profile = cProfile.Profile() if rank == 0 else None
    if profile is not None:
        profile.enable()
    start = time.perf_counter()
    engine, optimizer, _, _ = twinflow.initialize(model=model, config=config)
    if cuda:
        torch.cuda.synchronize()
    init_s = time.perf_counter() - start

    gen = torch.Generator().manual_seed(1 + rank)
    micro = config.train_micro_batch_size_per_gpu
    times, losses = [], []
    for step in range(args.steps):
        tokens = torch.randint(0, model.config.vocab_size, (micro, args.seq_len), generator=gen).to(device)
        start = time.perf_counter()
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if hasattr(optimizer, "synchronize"):
            optimizer.synchronize()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if step == 0 and profile is not None:
            profile.disable()
    row = {
        "rank": rank,
        "build_s": build_s,
        "initialize_s": init_s,
        "first_step_s": times[0],
        "median_step_s_after_first": statistics.median(times[1:]) if len(times) > 1 else None,
        "step_seconds": times,
        "losses": losses,
        "phases": timers.table(),
        "phases_missing": missing,
        "ratio": getattr(engine.local_optimizer, "ratio", None),
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_host_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    rows = [row]
    if distributed:
        rows = [None] * world
        torch.distributed.all_gather_object(rows, row)
    if rank == 0:
        result = {"command": sys.argv, "label": args.label, "twinflow": str(Path(twinflow.__file__).parent),
                  "model": args.model, "config": args.config, "world_size": world, "machine": machine_info(),
                  "rows": rows, "profile_rank0": profile_top(profile)}  # fmt: skip
        path = write_json(result, f"bench_init_{args.model}_x{world}.json", args.out)
        print(json.dumps({k: row[k] for k in ("initialize_s", "first_step_s", "median_step_s_after_first")}))
        for name, entry in row["phases"].items():
            calls, first = entry["calls"], entry["first_call_seconds"]
            print(f"  {name:28s} {entry['seconds']:9.2f} s  ({calls} calls, first {first:.2f} s)")
        print(f"wrote {path}")
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
