"""Freeing the GPU between RL phases: offload_states() / reload_states() against DeepSpeed's and the naive path.

    python benchmarks/bench_offload_states.py [--model opt-6.7b] [--ratio 0.5] [--cycles 20]
        [--systems transfer,twinflow,naive,deepspeed] [--out FILE]

Each system runs in its own process on the same model, after a training step and a second backward (so the
gradients are there to move too):

  transfer   benchmarks/bench_transfer.py: the pinned PCIe bandwidth each way (the targets' reference)
  twinflow   TwinFlowAdam (plain, ratio --ratio): offload_states() / reload_states(), --cycles times; the
             first offload allocates the pinned buffer, the others reuse it (medians over cycles 2..N)
  naive      the path RL frameworks took: per tensor ``.cpu().pin_memory()``, then back with ``.copy_()``, over
             the same tensors (twinflow's device state and gradients; the first --naive-gib GiB of them)
  deepspeed  DeepSpeed ZeRO-3 (no offload, its FusedAdam, torch's AdamW if FusedAdam cannot be built):
             engine.offload_states(include=[optim_states, hp_params, lp_grads, contiguous_grad_buffer]) and
             reload_states(); the bytes are the drop in torch.cuda.memory_allocated

GB/s counts 1e9 bytes a second of the bytes moved. Freed: what torch.cuda.mem_get_info gains over the offload.
Host growth: resident memory after the last cycle against after the second. Writes JSON (--out, else
$OUT/bench_offload_states.json, else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import machine_info, write_json  # noqa: E402

LR = 1e-5
DS_INCLUDE = ["optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer"]


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def timed(fn) -> tuple[object, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    value = fn()
    torch.cuda.synchronize()
    return value, time.perf_counter() - start


def train_step(model, step, tokens) -> None:
    """A step, then a second backward: the gradients are there when the state leaves."""
    model(input_ids=tokens, labels=tokens).loss.backward()
    step()
    model(input_ids=tokens, labels=tokens).loss.backward()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def cycles(offload, reload, n: int, moved_of=None) -> dict:
    """n offload/reload cycles: per cycle the bytes, seconds each way, memory given back, host memory."""
    rows = []
    for _ in range(n):
        free0 = torch.cuda.mem_get_info()[0]
        allocated0 = torch.cuda.memory_allocated()
        moved, out_s = timed(offload)
        free1 = torch.cuda.mem_get_info()[0]
        moved = moved if moved_of is None else moved_of(allocated0)
        back, in_s = timed(reload)
        rows.append({"bytes": moved, "offload_s": out_s, "reload_s": in_s, "freed_bytes": free1 - free0,
                     "host_rss_bytes": rss_bytes()})  # fmt: skip
    steady = rows[1:] or rows
    med = {k: statistics.median(r[k] for r in steady) for k in ("offload_s", "reload_s")}
    moved = rows[-1]["bytes"]
    return {
        "cycles": rows,
        "bytes": moved,
        "first_offload_s": rows[0]["offload_s"],
        "first_reload_s": rows[0]["reload_s"],
        "offload_s": med["offload_s"],
        "reload_s": med["reload_s"],
        "offload_GBps": moved / med["offload_s"] / 1e9,
        "reload_GBps": moved / med["reload_s"] / 1e9,
        "freed_fraction_min": min(r["freed_bytes"] / r["bytes"] for r in rows),
        "host_growth_bytes": rows[-1]["host_rss_bytes"] - steady[0]["host_rss_bytes"],
    }


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def worker(system: str, args) -> dict:
    from twinflow.models import build_opt

    torch.manual_seed(0)
    model = build_opt(args.model, "cuda", torch.bfloat16)
    tokens = torch.randint(0, 50_000, (1, args.seq_len), device="cuda")
    if system == "deepspeed":
        return deepspeed_worker(model, tokens, args)
    from twinflow import TwinFlowAdam

    opt = TwinFlowAdam(model.parameters(), lr=LR, ratio=args.ratio)
    train_step(model, opt.step, tokens)
    checksum = lambda: [float(t.double().sum()) for t in opt.coordinator.split.device_state.tensors()[:8]]  # noqa: E731
    before = checksum() + [float(p.grad.double().sum()) for p in list(model.parameters())[:8]]
    if system == "twinflow":
        result = cycles(opt.offload_states, opt.reload_states, args.cycles)
        result["buffer_allocations"] = opt.offload.allocations
        result["buffer_bytes"] = opt.offload.buffer.numel()
    else:  # naive: per tensor .cpu().pin_memory(), a new pinned copy every time
        tensors = opt.coordinator.split.device_state.tensors() + [p.grad for p in model.parameters()]
        storages, total = {}, 0
        for t in tensors:
            s = t.untyped_storage()
            if id(s) not in storages and total < args.naive_gib * 2**30:
                storages[id(s)] = s
                total += s.nbytes()
        held: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

        def offload() -> int:
            for s in storages.values():
                held.append((s, _bytes(s).cpu().pin_memory()))
                s.resize_(0)
            torch.cuda.empty_cache()
            return total

        def reload() -> int:
            for s, host in held:
                s.resize_(host.numel())
                _bytes(s).copy_(host)
            held.clear()
            return total

        result = cycles(offload, reload, args.naive_cycles)
    after = checksum() + [float(p.grad.double().sum()) for p in list(model.parameters())[:8]]
    result["round_trip_exact"] = before == after
    result["device_state_bytes"] = opt.coordinator.split.device_state.state_bytes
    result["split"] = opt.split_summary
    return result


def deepspeed_worker(model, tokens, args) -> dict:
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
    }
    adam = "FusedAdam"
    try:  # built (JIT) before the engine: a failure leaves the model untouched
        from deepspeed.ops.op_builder import FusedAdamBuilder

        FusedAdamBuilder().load()
    except Exception as exc:  # noqa: BLE001 (its op cannot be built here: torch's AdamW instead)
        adam = f"torch.optim.AdamW (FusedAdam failed: {type(exc).__name__}: {str(exc)[:200]})"
        config["optimizer"]["params"]["torch_adam"] = True
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step() -> None:
        engine.step()

    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    step()
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    include = [OffloadStateTypeEnum(k) for k in DS_INCLUDE]

    def offload() -> None:
        engine.offload_states(include=include, pin_memory=True, non_blocking=False)

    result = cycles(offload, engine.reload_states, args.ds_cycles,
                    moved_of=lambda before: before - torch.cuda.memory_allocated())  # fmt: skip
    result["optimizer"] = adam
    result["include"] = DS_INCLUDE
    return result


def run_worker(system: str, args, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [str(Path(__file__).resolve()), "--worker", system, "--result", str(out), "--model", args.model,
               "--ratio", str(args.ratio), "--cycles", str(args.cycles), "--naive-cycles", str(args.naive_cycles),
               "--naive-gib", str(args.naive_gib), "--ds-cycles", str(args.ds_cycles),
               "--seq-len", str(args.seq_len)]  # fmt: skip
        env = dict(os.environ)
        if system == "deepspeed":
            major, minor = torch.cuda.get_device_capability()
            env["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"  # its op builder cannot parse '9.0a'
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
        else:
            launcher = [sys.executable]
        start = time.perf_counter()
        proc = subprocess.run(launcher + cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        row = json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else {"status": "failed"}
        row["wall_seconds"] = time.perf_counter() - start
        if proc.returncode != 0:
            row["output_tail"] = (proc.stdout + proc.stderr)[-3000:]
        return row


def transfer(timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "t.json"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_transfer.py"), "--gib", "4", "--out", str(out)]
        subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
        rows = json.loads(out.read_text())["results"]
    return {"d2h_pinned_GBps": rows["d2h_pinned"]["GB_per_s"], "h2d_pinned_GBps": rows["h2d_pinned"]["GB_per_s"],
            "cpu_then_pin_memory_GBps": rows["cpu_then_pin_memory"]["GB_per_s"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="opt-6.7b")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--naive-cycles", type=int, default=2)
    parser.add_argument("--naive-gib", type=float, default=16.0, help="bytes the naive path moves (its rate)")
    parser.add_argument("--ds-cycles", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--systems", default="transfer,twinflow,naive,deepspeed")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per system")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_offload_states needs a CUDA device (none found)")
    if args.worker is not None:
        if int(os.environ.get("RANK", "0")) == 0 or args.worker != "deepspeed":
            Path(args.result).write_text(json.dumps(worker(args.worker, args)))
        return
    result = {"benchmark": "bench_offload_states", "command": "python benchmarks/bench_offload_states.py "
              + " ".join(sys.argv[1:]), "machine": machine_info(), "model": args.model, "ratio": args.ratio,
              "systems": {}}  # fmt: skip
    for system in args.systems.split(","):
        try:
            row = transfer(args.timeout) if system == "transfer" else run_worker(system, args, args.timeout)
        except subprocess.TimeoutExpired:
            row = {"status": "timeout", "timeout_s": args.timeout}
        result["systems"][system] = row
        write_json(result, "bench_offload_states.json", args.out)  # what is done so far survives a later failure
        print(system, json.dumps({k: v for k, v in row.items() if k not in ("cycles", "split")}), flush=True)
    ref = result["systems"].get("transfer", {})
    for row in result["systems"].values():
        if "offload_GBps" in row and "d2h_pinned_GBps" in ref:
            row["offload_of_pinned"] = row["offload_GBps"] / ref["d2h_pinned_GBps"]
            row["reload_of_pinned"] = row["reload_GBps"] / ref["h2d_pinned_GBps"]
    path = write_json(result, "bench_offload_states.json", args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
