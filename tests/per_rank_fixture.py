r"""Per-rank checkpoints (a ``rank{i}.pt`` shard a rank, and meta.json) written by 9bd2b3e, the last twinflow with
the per-rank writer, kept in tests/data/checkpoints_per_rank_9bd2b3e for tests/test_to_portable.py, which converts
them to the portable format (``python -m twinflow.convert CKPT TAG --to-portable OUT``). Beside each checkpoint, what
the tests compare the converted one with, recorded as it was written: the saved state (``state.pt``: ``state``'s
copy; ``optimizer.pt``: the optimizer's state dict), the step count, hyper-parameters, scheduler state and the losses
of the run continued after the save (``record.json``; the two-rank ones: the launcher's record), and what the
per-rank converters gave ``bf16_int8_m24`` (``adamw.pt``, ``hub/model.safetensors``).

Regenerate with the tree of 9bd2b3e (later ones write no per-rank checkpoint) and its worker for the two-rank ones
(``--per-rank``), from the repository's root:

    mkdir -p /tmp/old && git archive 9bd2b3e twinflow csrc setup.py tests/portable_worker.py tests/launch_worker.py \
        | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old:. TORCH_EXTENSIONS_DIR=/tmp/old_ext python tests/per_rank_fixture.py \
        --out tests/data/checkpoints_per_rank_9bd2b3e --written-by 9bd2b3e --worker /tmp/old/tests/portable_worker.py

(At 9bd2b3e itself: ``PYTHONPATH=. python tests/per_rank_fixture.py --out ... --written-by 9bd2b3e``.) The losses
are the writing machine's, on the kernel path and torch CPU capability manifest.json names.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from tests.checkpoint_fixture import BEFORE, PRECISIONS, batches, config, model, strip_layout, train

NAME = "checkpoints_per_rank_9bd2b3e"
TWO_RANKS = [(3, "fp32"), (3, "int8_m24"), (1, "fp32"), (0, "int8_m24")]  # (ZeRO stage, state precision)
BF16 = "bf16_int8_m24"


def two_ranks(stage: int, precision: str) -> str:
    """The name of the two-rank fixture of `stage` and `precision`."""
    return f"two_ranks_{stage}_{precision}"


def engine(precision: str, seed: int, module: torch.nn.Module | None = None, bf16: bool = False):  # noqa: ANN201
    """checkpoint_fixture's engine of `precision` (its model of `seed`, or `module`), with bf16 weights if asked."""
    import twinflow

    settings = config(precision) | ({"bf16": {"enabled": True}} if bf16 else {})
    made, *_ = twinflow.initialize(model=model(seed) if module is None else module, config=settings)
    return made


def state(engine) -> dict:  # noqa: ANN001
    """The optimizer's state and the model's weights, copied."""
    sd = engine.local_optimizer.state_dict()
    copied = {(i, k): v.clone() if isinstance(v, torch.Tensor) else v
              for i, e in sd["state"].items() for k, v in e.items()}  # fmt: skip
    return copied | {k: v.clone() for k, v in engine.module.state_dict().items()}


def schedule(engine) -> dict:  # noqa: ANN001
    """The optimizer's hyper-parameters and the scheduler's state, as JSON holds them."""
    groups = engine.local_optimizer.state_dict()["param_groups"]
    return json.loads(json.dumps({"param_groups": groups, "lr_scheduler": engine.lr_scheduler.state_dict()}))


def train_bf16(engine, data: list) -> list[float]:  # noqa: ANN001
    """checkpoint_fixture's train with bf16 inputs."""
    losses = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


class Spare(torch.nn.Module):
    """The fixture's model, with a layer the forward never uses (its parameters never have state)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net, self.spare = model(seed), torch.nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def chunked_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 48), torch.nn.GELU(), torch.nn.Linear(48, 24))


def chunked_optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    """TwinFlowAdam with int8_m24 state in records of 256 bytes."""
    from twinflow import TwinFlowAdam

    return TwinFlowAdam(net.parameters(), ratio=0.5, state_precision="int8_m24", chunk_bytes=256)


def sgd_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))


def sgd(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def batchnorm_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))


def _record(folder: Path, **values: object) -> None:
    (folder / "record.json").write_text(json.dumps(values, indent=1) + "\n")


def _saved_engine(folder: Path, made, tag: str = "a", train_fn=train) -> None:  # noqa: ANN001
    """`made` trained BEFORE micro-batches and saved per-rank in folder/ckpt as `tag`, with its state and the losses
    of the run continued."""
    data = batches()
    train_fn(made, data[:BEFORE])
    made.save_checkpoint(folder / "ckpt", tag, portable=False)
    torch.save(state(made), folder / "state.pt")
    saved = {"global_steps": made.global_steps, "schedule": schedule(made)}
    _record(folder, **saved, continued=train_fn(made, data[BEFORE:]))


def write_engines(out: Path) -> None:
    """One rank, each precision (int8_m24's is also the source of the refusal and failure tests)."""
    for precision in PRECISIONS:
        _saved_engine(out / precision, engine(precision, seed=0))


def write_bf16(out: Path) -> None:
    """bf16 weights, int8_m24 state, and the AdamW state dict and safetensors the per-rank converters give it."""
    from twinflow.checkpoint.convert_cli import main as convert_main

    folder = out / BF16
    _saved_engine(folder, engine("int8_m24", seed=0, bf16=True), train_fn=train_bf16)
    args = [str(folder / "ckpt"), "a", str(folder / "adamw.pt"), "--safetensors", str(folder / "hub")]
    assert convert_main(args) == 0


def write_two_ranks(out: Path, worker: Path | None) -> None:
    """Two ranks of tests/portable_worker.py, per-rank, with the launcher's record of their losses."""
    import tests.test_portable_checkpoint as launcher
    from tests.test_portable_checkpoint import _launch

    if worker is not None:
        launcher.WORKER = worker
    for stage, precision in TWO_RANKS:
        folder = out / two_ranks(stage, precision)
        folder.mkdir()
        with tempfile.TemporaryDirectory() as tmp:
            first = _launch(Path(tmp), "saved", 2, stage, precision, 0.5, "--save", str(folder / "ckpt"), "--per-rank")
        _record(folder, **first)


def _steps(net: torch.nn.Module, opt: torch.optim.Optimizer, loss, inputs: tuple[int, int]) -> None:  # noqa: ANN001
    for _ in range(2):
        loss(net, torch.randn(*inputs)).backward()
        opt.step()
        opt.zero_grad()


def _saved_optimizer(folder: Path, net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    from twinflow.checkpoint import save_checkpoint

    save_checkpoint(folder / "ckpt", "a", model=net, optimizer=opt)
    torch.save(opt.state_dict(), folder / "optimizer.pt")


def write_small(out: Path) -> None:
    """TwinFlowAdam in small records; SGD with a layer that never gets a gradient."""
    net = chunked_net()
    opt = chunked_optimizer(net)
    _steps(net, opt, lambda n, x: n(x).square().mean(), (4, 48))
    _saved_optimizer(out / "chunked", net, opt)
    net = sgd_net()
    opt = sgd(net)
    _steps(net, opt, lambda n, x: n[0](x).square().sum(), (2, 8))  # net[1] never gets a gradient
    _saved_optimizer(out / "sgd", net, opt)


def write_spare(out: Path) -> None:
    """The engine of a model with a layer the forward never uses, as tag ``per_rank``."""
    _saved_engine(out / "spare", engine("int8_m24", seed=0, module=Spare(0)), tag="per_rank")


def write_batchnorm(out: Path) -> None:
    """BatchNorm's running mean beside a bias of its shape, saved as before the shards recorded their layout."""
    from twinflow.checkpoint import save_checkpoint

    net = batchnorm_net()
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(5, 4)).square().mean().backward()
    opt.step()
    save_checkpoint(out / "batchnorm" / "ckpt", "a", model=net, optimizer=opt)
    strip_layout(out / "batchnorm" / "ckpt" / "a")


def write_runs(out: Path) -> None:
    """runs/exp1 with tags step1 and step2 (one step of fp32)."""
    made = engine("fp32", seed=0)
    train(made, batches()[:2])
    for tag in ("step1", "step2"):
        made.save_checkpoint(out / "runs" / "exp1", tag, portable=False)


def manifest(written_by: str) -> dict:
    from twinflow.host import ops

    return {"written_by": written_by, "torch": torch.__version__, "kernel_path": ops.SIMD_NAMES[ops.resolve_simd()],
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="a folder not there yet")
    parser.add_argument("--written-by", required=True, help="the commit whose twinflow runs (recorded)")
    parser.add_argument("--worker", type=Path, help="a portable_worker.py that saves --per-rank (default: the tests')")
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"{args.out} is there: remove it first")
    write_engines(args.out)
    write_bf16(args.out)
    write_two_ranks(args.out, args.worker)
    write_small(args.out)
    write_spare(args.out)
    write_batchnorm(args.out)
    write_runs(args.out)
    (args.out / "manifest.json").write_text(json.dumps(manifest(args.written_by), indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
