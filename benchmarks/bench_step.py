"""Optimizer step alone, OPT-2.7B-sized bf16 parameters: TwinFlowAdam at several ratios, in one run.

    python benchmarks/bench_step.py [--ratios 0 0.25 0.5 0.75 1] [--out FILE]

For each ratio r it times, interleaved round by round:
  - step(r): TwinFlowAdam.step() end to end (host and device synchronised),
  - cpu(r):  twinflow's kernel alone over the CPU part (bf16 gradients on the host, bf16 copy out),
  - gpu(r):  the device side alone (fused Adam over the GPU part's fp32 masters),
and checks step(r) <= 1.15 x max(cpu(r), gpu(r)). Reference: torch fused
AdamW on the GPU over fp32 copies of all parameters (ratio 0's yardstick). It
also measures the staging path alone in GB/s: one batched copy per direction
between the CPU part's gradients and weights on the device and their chunk
buffers (benchmarks/bench_transfer.py measures the chunked, overlapped path).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import interleaved_medians, machine_info, write_json  # noqa: E402
from twinflow import TwinFlowAdam  # noqa: E402
from twinflow.host import ops


def opt_shapes(layers: int = 32, hidden: int = 2560, ffn: int = 10240, vocab: int = 50272, positions: int = 2050):
    """Parameter shapes of OPT-2.7B, in module order (2.65e9 parameters)."""
    shapes = [(vocab, hidden), (positions, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (hidden,)] * 4  # q, k, v, out projections
        shapes += [(hidden,), (hidden,)]  # self-attention layer norm
        shapes += [(ffn, hidden), (ffn,), (hidden, ffn), (hidden,)]  # fc1, fc2
        shapes += [(hidden,), (hidden,)]  # final layer norm of the block
    shapes += [(hidden,), (hidden,)]
    return shapes


def median_interleaved(fns: dict, rounds: int) -> dict:
    """Median seconds of each fn, interleaved round by round, the device synchronised around each call."""
    return interleaved_medians(fns, rounds, warmup=1, cuda_sync=True)


def staging_bandwidth(opt: TwinFlowAdam) -> dict:
    """The transfer path alone: every CPU-share gradient down into its chunk buffer, every weight back up."""
    staging = opt.coordinator.host.staging
    streams = staging.streams
    pieces = staging.pieces
    params = opt.coordinator.split.params

    def down() -> None:
        streams.after_compute()
        with streams.d2h():
            sources = [params[pc.param].grad.view(-1)[pc.start : pc.end] for pc in pieces]
            torch._foreach_copy_(staging.hosts, sources, non_blocking=True)
        torch.cuda.current_stream().wait_stream(streams.d2h_stream)

    def up() -> None:
        with streams.h2d():
            torch._foreach_copy_(staging.targets, staging.hosts, non_blocking=True)
        torch.cuda.current_stream().wait_stream(streams.h2d_stream)

    nbytes = sum(h.numel() * h.element_size() for h in staging.hosts)
    t = median_interleaved({"d2h": down, "h2d": up}, rounds=5)
    return {"bytes": nbytes, "d2h_gb_s": nbytes / t["d2h"] / 1e9, "h2d_gb_s": nbytes / t["h2d"] / 1e9}


def measure_ratio(params: list[torch.nn.Parameter], ratio: float, chunk_bytes: int, rounds: int) -> dict:
    opt = TwinFlowAdam(params, lr=1e-5, ratio=ratio, chunk_bytes=chunk_bytes)
    step_and_wait = lambda: (opt.step(), opt.synchronize())  # noqa: E731
    cpu_n = opt.split_summary["cpu"]["elements"]
    fns = {"step": step_and_wait}
    if cpu_n:
        # The same work as the CPU side, on host tensors alone: bf16 gradients in, bf16 copy out.
        p, m, v = torch.randn(cpu_n), torch.zeros(cpu_n), torch.zeros(cpu_n)
        g, o = torch.randn(cpu_n).bfloat16(), torch.empty(cpu_n, dtype=torch.bfloat16)
        counter = [0]

        def cpu_kernel() -> None:
            counter[0] += 1
            ops.adam_step_([p], [g], [m], [v], [counter[0]], lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8,
                           out_copies=[o])  # fmt: skip

        fns["cpu"] = cpu_kernel
    split = opt.coordinator.split
    states = split.device_state.states
    if states:  # the device side alone: every device-side segment, as step() launches it
        args = opt.coordinator.step_args()
        grad_of = lambda i: split.params[i].grad  # noqa: E731
        fns["gpu"] = lambda: split.device_state.step(states, args.groups, split.group_of, grad_of, None)
    t = median_interleaved(fns, rounds=rounds)
    bound = max(t.get("cpu", 0.0), t.get("gpu", 0.0))
    entry = {
        "step_s": t["step"],
        "cpu_kernel_s": t.get("cpu", 0.0),
        "gpu_side_s": t.get("gpu", 0.0),
        "step_over_bound": t["step"] / bound,
        "target_met": t["step"] <= 1.15 * bound,
        "split": opt.split_summary,
    }
    if cpu_n:
        entry["staging"] = staging_bandwidth(opt)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", type=float, nargs="*", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk-mib", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    shapes = opt_shapes()
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    total = sum(p.numel() for p in params)
    result = {"machine": machine_info(), "params": total, "chunk_bytes": args.chunk_mib << 20, "ratios": {}}
    print(f"{total / 1e9:.2f}B bf16 params, {len(params)} tensors; {result['machine']}", flush=True)

    # Reference: torch fused AdamW on the GPU over fp32 copies of everything.
    ref_params = [torch.nn.Parameter(p.detach().float()) for p in params]
    for rp, p in zip(ref_params, params):
        rp.grad = p.grad.float()
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-5, fused=True)
    result["torch_fused_adamw_fp32_s"] = median_interleaved({"ref": ref_opt.step}, rounds=args.rounds)["ref"]
    print(f"  torch fused AdamW (GPU, fp32): {result['torch_fused_adamw_fp32_s'] * 1e3:.1f} ms", flush=True)
    del ref_params, ref_opt
    torch.cuda.empty_cache()

    for ratio in args.ratios:
        entry = measure_ratio(params, ratio, args.chunk_mib << 20, args.rounds)
        result["ratios"][str(ratio)] = entry
        s = entry.get("staging", {})
        print(
            f"  ratio {ratio:4.2f}: step {entry['step_s'] * 1e3:7.1f} ms  cpu {entry['cpu_kernel_s'] * 1e3:7.1f} ms  "
            f"gpu {entry['gpu_side_s'] * 1e3:6.1f} ms  step/max {entry['step_over_bound']:.2f}  "
            f"d2h {s.get('d2h_gb_s', 0):.1f} GB/s  h2d {s.get('h2d_gb_s', 0):.1f} GB/s",
            flush=True,
        )
        torch.cuda.empty_cache()
    path = write_json(result, "bench_step.json", args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
