"""PyTorch Lightning and Fabric drive TwinFlowAdam as they drive torch's AdamW (CPU; Lightning 2.x).

A LightningModule returns the optimizer from ``configure_optimizers`` with a per-step LR scheduler; the Trainer
clips (``gradient_clip_val``), accumulates, saves and resumes. Attached (``TwinFlowAdam.attach`` in
``on_fit_start``), twinflow clips itself (``max_grad_norm``) and the Trainer must not.
"""

import pytest
import torch

import twinflow

L = pytest.importorskip("lightning")

STEPS, BATCH, SAMPLES = 12, 8, 96  # one epoch of 12 batches


def _data() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, 16, generator=gen)
    y = torch.tanh(x @ torch.randn(16, 4, generator=gen)) + 0.1 * torch.randn(SAMPLES, 4, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)


class Module(L.LightningModule):
    def __init__(self, optimizer: str, ratio: float = 0.5, attach: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 4))
        self.optimizer, self.ratio, self.attach = optimizer, ratio, attach
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        if self.optimizer == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=3e-2, weight_decay=0.01)
        else:
            opt = twinflow.TwinFlowAdam(self.parameters(), lr=3e-2, weight_decay=0.01, ratio=self.ratio,
                                        max_grad_norm=1.0 if self.attach else None)  # fmt: skip
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.2 * step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_start(self) -> None:
        if self.attach:
            self.optimizers().optimizer.attach(self)


def _trainer(tmp_path, **kwargs) -> "L.Trainer":
    settings = dict(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))  # fmt: skip
    return L.Trainer(**(settings | kwargs))


def _fit(tmp_path, module: Module, **kwargs) -> Module:
    _trainer(tmp_path, **kwargs).fit(module, _data())
    return module


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_fit_with_lightnings_clipping_trains_as_adamw(tmp_path, ratio: float) -> None:
    twin = _fit(tmp_path, Module("twinflow", ratio), gradient_clip_val=1.0)
    adamw = _fit(tmp_path, Module("adamw"), gradient_clip_val=1.0)
    assert len(twin.losses) == STEPS and twin.losses[-1] < 0.7 * twin.losses[0]
    assert twin.losses == pytest.approx(adamw.losses, rel=1e-5, abs=0)


@pytest.mark.parametrize("ratio", [0.5, 1.0])
def test_fit_attached_clips_in_twinflow_as_adamw_clipped_by_lightning(tmp_path, ratio: float) -> None:
    twin = _fit(tmp_path, Module("twinflow", ratio, attach=True))
    adamw = _fit(tmp_path, Module("adamw"), gradient_clip_val=1.0)
    assert twin.losses == pytest.approx(adamw.losses, rel=1e-4, abs=0)


def test_attached_with_lightnings_clipping_is_refused_naming_its_setting(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="gradient_clip_val"):
        _fit(tmp_path, Module("twinflow", 0.5, attach=True), gradient_clip_val=1.0)


def test_gradient_accumulation_trains_as_adamw(tmp_path) -> None:
    twin = _fit(tmp_path, Module("twinflow", 0.5), accumulate_grad_batches=2, max_steps=STEPS // 2)
    adamw = _fit(tmp_path, Module("adamw"), accumulate_grad_batches=2, max_steps=STEPS // 2)
    assert len(twin.losses) == STEPS
    assert twin.losses == pytest.approx(adamw.losses, rel=1e-5, abs=0)


@pytest.mark.parametrize("attach", [False, True])
def test_a_lightning_checkpoint_resumes_the_run_exactly(tmp_path, attach: bool) -> None:
    clip = {} if attach else {"gradient_clip_val": 1.0}
    whole = _fit(tmp_path / "whole", Module("twinflow", 0.5, attach), max_steps=2 * STEPS, **clip)
    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=STEPS)
    _fit(tmp_path / "first", Module("twinflow", 0.5, attach), callbacks=[saver], enable_checkpointing=True, **clip)
    resumed = Module("twinflow", 0.5, attach)
    torch.manual_seed(123)  # other weights and RNG: everything must come from the checkpoint
    _trainer(tmp_path / "second", max_steps=2 * STEPS, **clip).fit(
        resumed, _data(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
    )
    assert resumed.losses == whole.losses[STEPS:]


def test_fabric_setup_trains_and_its_checkpoint_round_trips(tmp_path) -> None:
    from lightning.fabric import Fabric

    def run(resume_from=None, steps=STEPS) -> tuple[list[float], dict]:
        fabric = Fabric(accelerator="cpu", devices=1)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 4))
        opt = twinflow.TwinFlowAdam(model.parameters(), lr=3e-2, ratio=0.5)
        model, opt = fabric.setup(model, opt)
        state = {"model": model, "optimizer": opt, "step": 0}
        if resume_from is not None:
            fabric.load(resume_from, state)
        losses = []
        batches = list(_data())
        while state["step"] < steps:
            x, y = batches[state["step"] % len(batches)]
            loss = torch.nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            state["step"] += 1
            if state["step"] == STEPS // 2 and resume_from is None:
                fabric.save(tmp_path / "fabric.ckpt", state)
        return losses, state

    whole, _ = run()
    resumed, _ = run(resume_from=tmp_path / "fabric.ckpt")
    assert whole[-1] < 0.7 * whole[0]
    assert resumed == whole[STEPS // 2 :]


# ----------------------------------------------------------------------------- precisions and strategies


def _on(accelerator: str) -> object:
    """`accelerator` as a test parameter: the CPU everywhere; CUDA marked `cuda`."""
    return "cpu" if accelerator == "cpu" else pytest.param("cuda", marks=pytest.mark.cuda)


@pytest.mark.parametrize("accelerator", [_on("cpu"), _on("cuda")])
def test_bf16_mixed_trains_as_adamw(tmp_path, accelerator: str) -> None:
    """fp32 parameters under bf16 autocast: the same gradients for both optimizers, fp32 updates on both sides."""
    settings = dict(accelerator=accelerator, precision="bf16-mixed", gradient_clip_val=1.0)
    twin = _fit(tmp_path, Module("twinflow", 0.5), **settings)
    adamw = _fit(tmp_path, Module("adamw"), **settings)
    assert len(twin.losses) == STEPS and twin.losses[-1] < 0.7 * twin.losses[0]
    assert twin.losses == pytest.approx(adamw.losses, rel=1e-4, abs=0)


@pytest.mark.parametrize("accelerator", [_on("cpu"), _on("cuda")])
def test_bf16_true_keeps_fp32_masters_on_both_sides(tmp_path, accelerator: str) -> None:
    """bf16 parameters: TwinFlowAdam steps fp32 masters, on the GPU side (ratio 0) and split (0.5) alike, and
    follows AdamW on fp32 weights closer than AdamW stepping the bf16 weights themselves does."""
    settings = dict(accelerator=accelerator, precision="bf16-true", gradient_clip_val=1.0)
    split = _fit(tmp_path, Module("twinflow", 0.5), **settings)
    device_only = _fit(tmp_path, Module("twinflow", 0.0), **settings)
    in_bf16 = _fit(tmp_path, Module("adamw"), **settings)
    fp32 = _fit(tmp_path, Module("adamw"), accelerator=accelerator, gradient_clip_val=1.0)
    assert split.losses[-1] < 0.7 * split.losses[0]
    assert split.losses == pytest.approx(device_only.losses, rel=2e-2, abs=0)

    def gap(run: Module) -> float:
        return sum(abs(a - b) for a, b in zip(run.losses, fp32.losses))

    assert gap(split) < gap(in_bf16)


def _strategy_fit(tmp_path, optimizer: str, strategy: str, accelerator: str, clip: float) -> list[list[float]]:
    """Every rank's losses from tests/lightning_worker.py, two ranks under torchrun."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / f"{optimizer}-{strategy}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(root / "tests" / "lightning_worker.py"), str(out), "--optimizer", optimizer, "--strategy", strategy,
           "--accelerator", accelerator, "--clip", str(clip)]  # fmt: skip
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(Path(f"{out}.rank{rank}").read_text())["losses"] for rank in range(2)]


def _two_gpus(*values: object) -> object:
    enough = torch.cuda.device_count() >= 2
    return pytest.param(*values, marks=[pytest.mark.multigpu, pytest.mark.skipif(not enough, reason="needs 2 GPUs")])


@pytest.mark.parametrize("strategy, accelerator, clip", [
    ("ddp", "cpu", 1.0), _two_gpus("ddp", "cuda", 1.0), _two_gpus("fsdp", "cuda", 0.0),
])  # fmt: skip
def test_two_ranks_under_lightnings_strategies_train_as_adamw(tmp_path, strategy: str, accelerator: str,
                                                               clip: float) -> None:  # fmt: skip
    twin = _strategy_fit(tmp_path, "twinflow", strategy, accelerator, clip)
    adamw = _strategy_fit(tmp_path, "adamw", strategy, accelerator, clip)
    for rank in range(2):
        assert len(twin[rank]) == STEPS and twin[rank][-1] < 0.8 * twin[rank][0]
        assert twin[rank] == pytest.approx(adamw[rank], rel=1e-4, abs=0)
    assert twin[0] != twin[1]  # each rank trained on its own share of the batches


class _OffloadBetweenSteps(L.Callback):
    """An RL-style loop inside Lightning: the optimizer's state leaves the GPU after every step (another phase would
    use the memory) and comes back before the next."""

    def __init__(self) -> None:
        self.moved: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.moved.append(trainer.optimizers[0].offload_states())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if self.moved:
            assert trainer.optimizers[0].reload_states() == self.moved[-1]


@pytest.mark.parametrize("accelerator", [_on("cpu"), _on("cuda")])
def test_offload_states_between_lightning_steps_changes_nothing(tmp_path, accelerator: str) -> None:
    offloading = _OffloadBetweenSteps()
    moved = _fit(tmp_path, Module("twinflow", 0.5), accelerator=accelerator, gradient_clip_val=1.0,
                 callbacks=[offloading])  # fmt: skip
    kept = _fit(tmp_path, Module("twinflow", 0.5), accelerator=accelerator, gradient_clip_val=1.0)
    assert len(offloading.moved) == STEPS
    assert all(n > 0 for n in offloading.moved) or accelerator == "cpu"  # on the CPU there is nothing to move
    assert moved.losses == kept.losses
