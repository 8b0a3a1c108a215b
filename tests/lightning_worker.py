"""One rank of a Lightning ``Trainer.fit`` under torchrun, for tests/test_lightning.py's strategies.

    torchrun --nproc-per-node 2 tests/lightning_worker.py --optimizer twinflow --strategy ddp --accelerator cpu OUT

Lightning finds torchrun's environment and starts no processes of its own. Every rank trains the test module on its
share of the batches and writes its losses to OUT.rank<R> as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--optimizer", choices=["twinflow", "adamw"], required=True)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--clip", type=float, default=0.0)
    args = parser.parse_args()

    import torch

    from tests.test_lightning import STEPS, Module, _data, _trainer

    if args.accelerator == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    module = Module(args.optimizer, args.ratio)
    clip = {"gradient_clip_val": args.clip} if args.clip else {}
    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(Path(tmp), accelerator=args.accelerator, devices=int(os.environ["WORLD_SIZE"]),
                           strategy=args.strategy, precision=args.precision, max_steps=STEPS, **clip)  # fmt: skip
        trainer.fit(module, _data())
    rank = trainer.global_rank
    Path(f"{args.out}.rank{rank}").write_text(json.dumps({"losses": module.losses, "steps": trainer.global_step}))


if __name__ == "__main__":
    main()
