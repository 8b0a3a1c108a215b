"""Host/device copy bandwidth on this machine: what twinflow's staging can reach, and the patterns to avoid.

    python benchmarks/bench_transfer.py [--gib 1] [--chunk-mib 128] [--rounds 5] [--out FILE]

Measures, each as the median of --rounds copies of --gib GiB (GB/s = 1e9 bytes/s):
  d2h_pinned, h2d_pinned     one copy between the device and page-locked host memory
  both_directions_pinned     a download and an upload at once, on two streams (bytes of both counted)
  d2h_pageable, h2d_pageable the same against ordinary (pageable) host memory
  cpu_then_pin_memory        ``gpu_tensor.cpu().pin_memory()``: a pageable copy, then a second one to pin it
  twinflow_chunked           twinflow's path: the tensor in --chunk-mib chunks, each downloaded into its own
                             pinned buffer on the download stream while the previous chunk goes back up on
                             the upload stream (twinflow.base.transfer.Streams and pinned_buffers); bytes of both
                             directions counted, so compare it with both_directions_pinned

Needs a CUDA device. Writes JSON (--out, else $OUT/bench_transfer.json, else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import interleaved_medians, machine_info, write_json  # noqa: E402
from twinflow.base.transfer import Streams, pinned_buffers  # noqa: E402


def timed(fn, rounds: int) -> float:
    """Median seconds of fn() with the device synchronised around it (one untimed warm-up)."""
    return interleaved_medians({"fn": fn}, rounds, warmup=1, cuda_sync=True)["fn"]


def chunked_round_trip(gpu: torch.Tensor, up: torch.Tensor, chunks: list[torch.Tensor], streams: Streams) -> None:
    """Every chunk of `gpu` down into its pinned buffer; each landed chunk back up into `up`, overlapping."""
    nbytes = [c.numel() for c in chunks]
    src, dst = gpu.view(torch.uint8), up.view(torch.uint8)
    landed = [streams.event() for _ in chunks]
    streams.after_compute()
    offset = 0
    for i, buf in enumerate(chunks):
        with streams.d2h():
            buf.copy_(src[offset : offset + nbytes[i]], non_blocking=True)
            landed[i].record()
        with streams.h2d():
            torch.cuda.current_stream().wait_event(landed[i])
            dst[offset : offset + nbytes[i]].copy_(buf, non_blocking=True)
        offset += nbytes[i]
    torch.cuda.current_stream().wait_stream(streams.h2d_stream)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="bytes moved per copy, in GiB")
    parser.add_argument("--chunk-mib", type=int, default=128, help="twinflow's chunk size (its default: 128)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_transfer needs a CUDA device (none found)")
    if args.gib <= 0 or args.chunk_mib <= 0 or args.rounds < 1:
        raise SystemExit(f"--gib {args.gib} --chunk-mib {args.chunk_mib} --rounds {args.rounds}: all must be > 0")
    n = int(args.gib * 2**30) // 4 * 4
    gpu = torch.randn(n // 4, device="cuda")
    gpu2 = torch.randn(n // 4, device="cuda")
    pinned = torch.empty(n // 4, pin_memory=True)
    pinned2 = torch.randn(n // 4).pin_memory()
    pageable = torch.randn(n // 4)
    streams = Streams(torch.device("cuda"))
    chunk = args.chunk_mib * 2**20
    sizes = [min(chunk, n - o) for o in range(0, n, chunk)]
    chunks = pinned_buffers(sizes, True, "the chunked copy")

    def both():
        streams.after_compute()
        with streams.d2h():
            pinned.copy_(gpu, non_blocking=True)
        with streams.h2d():
            gpu2.copy_(pinned2, non_blocking=True)
        torch.cuda.current_stream().wait_stream(streams.d2h_stream)
        torch.cuda.current_stream().wait_stream(streams.h2d_stream)

    seconds = {
        "d2h_pinned": timed(lambda: pinned.copy_(gpu, non_blocking=True), args.rounds),
        "h2d_pinned": timed(lambda: gpu2.copy_(pinned2, non_blocking=True), args.rounds),
        "both_directions_pinned": timed(both, args.rounds),
        "d2h_pageable": timed(lambda: pageable.copy_(gpu), args.rounds),
        "h2d_pageable": timed(lambda: gpu2.copy_(pageable), args.rounds),
        "cpu_then_pin_memory": timed(lambda: gpu.cpu().pin_memory(), max(1, args.rounds // 2)),
        "twinflow_chunked": timed(lambda: chunked_round_trip(gpu, gpu2, chunks, streams), args.rounds),
    }
    # the round trip must bring back exactly what went down
    torch.cuda.synchronize()
    gpu2.zero_()
    chunked_round_trip(gpu, gpu2, chunks, streams)
    torch.cuda.synchronize()
    if not torch.equal(gpu, gpu2):
        raise SystemExit("twinflow_chunked: the round trip changed the data")
    moved = {k: n * (2 if k in ("both_directions_pinned", "twinflow_chunked") else 1) for k in seconds}
    rows = {k: {"seconds": s, "bytes": moved[k], "GB_per_s": moved[k] / s / 1e9} for k, s in seconds.items()}
    result = {
        "benchmark": "bench_transfer",
        "command": "python benchmarks/bench_transfer.py " + " ".join(sys.argv[1:]),
        "machine": machine_info(),
        "gib": args.gib,
        "chunk_mib": args.chunk_mib,
        "rounds": args.rounds,
        "results": rows,
    }
    path = write_json(result, "bench_transfer.json", args.out)
    print("| copy | GB/s |\n| --- | --- |")
    for k, r in rows.items():
        print(f"| {k} | {r['GB_per_s']:.1f} |")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
