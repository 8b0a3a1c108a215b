"""Checkpoints written by an earlier twinflow, kept in tests/data/ for tests/test_checkpoint_compat.py.

    git archive 1111190 twinflow csrc setup.py | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old TORCH_EXTENSIONS_DIR=/tmp/old_ext python tests/checkpoint_fixture.py \
        --out tests/data/checkpoints_1111190 --written-by 1111190

The portable one, with the tree of 4637d54 (the engine saves the portable format by default since c758ae8):
``python tests/checkpoint_fixture.py --out tests/data/checkpoints_portable_4637d54 --written-by 4637d54``.

Each precision trains a small model through the engine for a few steps, saves a checkpoint, trains on and records
the losses of the steps after the save: a checkpoint loaded by later code must continue the same way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

PRECISIONS = ("fp32", "int8", "int8_m24")
BEFORE, AFTER = 8, 8  # micro-batches before the save and after it (accumulation 2: 4 optimizer steps each)


def config(precision: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 3}},
        "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
        "offload_state_precision": precision,
    }


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 24))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(4, 24, generator=gen), torch.randn(4, 24, generator=gen)) for _ in range(BEFORE + AFTER)]


def train(engine, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:  # noqa: ANN001 (either version's)
    losses = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def strip_layout(folder: Path) -> None:
    """The one-rank per-rank checkpoint in `folder` as written before the shards recorded their layout."""
    shard = folder / "rank0.pt"
    old = torch.load(shard, weights_only=True)
    del old["layout"]
    torch.save(old, shard)
    meta = json.loads((folder / "meta.json").read_text())
    digest = hashlib.sha256(shard.read_bytes()).hexdigest()
    meta["shards"]["rank0.pt"] = {"bytes": shard.stat().st_size, "sha256": digest}
    (folder / "meta.json").write_text(json.dumps(meta))


def main() -> None:
    import twinflow

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--written-by", required=True, help="the commit whose twinflow runs (recorded)")
    args = parser.parse_args()
    record = {"written_by": args.written_by, "torch": torch.__version__, "continued": {}}
    data = batches()
    for precision in PRECISIONS:
        engine, *_ = twinflow.initialize(model=model(), config=config(precision))
        train(engine, data[:BEFORE])
        engine.save_checkpoint(args.out / precision)
        record["continued"][precision] = train(engine, data[BEFORE:])
    (args.out / "continued.json").write_text(json.dumps(record, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
