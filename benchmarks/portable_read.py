"""The read step of a portable load: DCP's own file reader against the one ``load_portable`` uses.

    python benchmarks/portable_read.py [--layers 16] [--precision int8_m24] [--rounds 3] [--threads 1 2]
                                       [--read-threads 1 8]

A stack of bf16 linear layers (2048 x 8192, 16.8M elements each) with TwinFlowAdam at ratio 0.5 takes a step and
is saved with ``save_portable`` (a file a tensor); then ``dcp.load`` reads the whole checkpoint into new host
tensors with ``torch.distributed.checkpoint.FileSystemReader`` and with
:class:`twinflow.checkpoint.portable_load.MappedReader` copying on each count of --read-threads ("mapped:K"),
alternately, in one process (the files in the page cache after the first read), at each torch thread count given
(torchrun leaves a rank one). Every tensor read is compared bit
for bit with the first read's. Writes JSON (--out, else $OUT, else benchmarks/results/): seconds per read.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import machine_info, write_json  # noqa: E402
from twinflow import TwinFlowAdam  # noqa: E402
from twinflow.checkpoint import portable, portable_load  # noqa: E402


def saved(folder: Path, layers: int, precision: str) -> int:
    torch.manual_seed(0)
    shapes = [(2048, 8192), (8192, 2048)] * (layers // 2)
    model = torch.nn.Sequential(*(torch.nn.Linear(*s, bias=False) for s in shapes)).to(torch.bfloat16)
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, state_precision=precision)
    model(torch.randn(2, 2048, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    portable.save_portable(folder, "t", model=model, optimizer=opt)
    return sum(p.numel() for p in model.parameters())


def targets(folder: Path) -> dict:
    """New host tensors for every tensor the checkpoint holds, nested as its keys are."""
    metadata = portable.dcp.FileSystemReader(folder).read_metadata()
    out: dict = {}
    for key, meta in metadata.state_dict_metadata.items():
        *parents, last = key.split(".")
        node = out
        for name in parents:
            node = node.setdefault(name, {})
        if hasattr(meta, "size"):
            node[last] = torch.empty(meta.size, dtype=meta.properties.dtype)
    return out


def leaves(tree: dict) -> list[torch.Tensor]:
    return [t for v in tree.values() for t in (leaves(v) if isinstance(v, dict) else [v])]


def read(folder: Path, reader: str) -> tuple[float, list[torch.Tensor]]:
    tree = targets(folder)
    if reader.startswith("mapped:"):
        storage = portable_load.MappedReader(folder, threads=int(reader.split(":")[1]))
    else:
        storage = portable.dcp.FileSystemReader(folder)
    start = time.perf_counter()
    portable.dcp.load(tree, checkpoint_id=folder, storage_reader=storage)
    return time.perf_counter() - start, leaves(tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--precision", default="int8_m24")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--read-threads", type=int, nargs="+", default=[1, portable_load.READ_THREADS])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ckpt"
        elements = saved(folder, args.layers, args.precision)
        folder = folder / "t"
        _, reference = read(folder, "dcp")  # also puts the files in the page cache
        seconds: dict[str, list[float]] = {}
        readers = ["dcp"] + [f"mapped:{k}" for k in dict.fromkeys(args.read_threads)]
        for r in range(args.rounds):
            for threads in args.threads:
                torch.set_num_threads(threads)
                for reader in readers if r % 2 == 0 else readers[::-1]:  # each round the other order
                    took, got = read(folder, reader)
                    same = all(a.view(-1).view(torch.uint8).equal(b.view(-1).view(torch.uint8))
                               for a, b in zip(reference, got, strict=True))  # fmt: skip
                    if not same:
                        raise SystemExit(f"{reader} read other bits than DCP's reader's first read")
                    seconds.setdefault(f"{reader}@{threads}", []).append(took)
                    print(f"{reader:9} {threads} torch thread(s): {took:.2f} s", flush=True)
    rows = {k: {"seconds": v, "median": statistics.median(v), "fastest": min(v)} for k, v in seconds.items()}
    ratios = {f"{r}@{t}": rows[f"dcp@{t}"]["median"] / rows[f"{r}@{t}"]["median"]
              for t in args.threads for r in readers[1:]}  # fmt: skip
    result = {"command": sys.argv, "elements": elements, "precision": args.precision, "bits_equal": True,
              "rows": rows, "dcp_over_mapped_median": ratios, "machine": machine_info()}  # fmt: skip
    print({t: round(r, 2) for t, r in ratios.items()})
    print(f"wrote {write_json(result, 'portable_read.json', args.out)}")


if __name__ == "__main__":
    main()
