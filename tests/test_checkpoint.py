"""Checkpoints: resume reproduces the uninterrupted run; a bad checkpoint is refused and changes nothing."""

import logging
import os

import pytest
import torch

from twinflow import TwinFlowAdam
from twinflow.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from twinflow.checkpoint.checkpoint_files import format_bytes
from twinflow.engine.schedulers import WarmupDecayLR


def build(ratio: float = 0.5, seed: int = 0, width: int = 16, precision: str = "fp32"):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.GELU(), torch.nn.Linear(width, 3))
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, weight_decay=0.01, ratio=ratio, chunk_bytes=256,
                       state_precision=precision)  # fmt: skip
    sched = WarmupDecayLR(opt, total_num_steps=20, warmup_max_lr=0.02, warmup_num_steps=4, warmup_type="linear")
    return model, opt, sched


def train(model, opt, sched, gen: torch.Generator, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 3, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def snapshot(model, opt, sched) -> list:
    return [{k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict(), sched.state_dict()]


def assert_unchanged(before: list, after: list) -> None:
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    for i, entry in before[1]["state"].items():
        assert all(torch.equal(v, after[1]["state"][i][k]) for k, v in entry.items())
    assert before[2] == after[2]


@pytest.mark.parametrize("precision", ["fp32", "int8", "int8_m24"])
def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path, precision: str) -> None:
    """With compact state too: the checkpoint holds decoded values, which encode back to the same codes."""
    model, opt, sched = build(precision=precision)
    gen = torch.Generator().manual_seed(1)
    train(model, opt, sched, gen, 3)
    save_checkpoint(tmp_path, "step3", model=model, optimizer=opt, scheduler=sched,
                    extra={"rng": gen.get_state(), "step": 3}, meta={"ratio": 0.5})  # fmt: skip
    uninterrupted = train(model, opt, sched, gen, 5)

    model2, opt2, sched2 = build(seed=99, precision=precision)  # other weights: all must come from the checkpoint
    extra, meta = load_checkpoint(tmp_path, model=model2, optimizer=opt2, scheduler=sched2)
    gen2 = torch.Generator()
    gen2.set_state(extra["rng"])
    assert extra["step"] == 3 and meta["meta"] == {"ratio": 0.5} and meta["world_size"] == 1
    assert train(model2, opt2, sched2, gen2, 5) == uninterrupted
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))


def test_resume_under_another_ratio(tmp_path) -> None:
    model, opt, sched = build(ratio=0.2)
    gen = torch.Generator().manual_seed(2)
    train(model, opt, sched, gen, 3)
    save_checkpoint(tmp_path, "a", model=model, optimizer=opt, scheduler=sched, extra={"rng": gen.get_state()})
    uninterrupted = train(model, opt, sched, gen, 4)
    model2, opt2, sched2 = build(ratio=0.9, seed=5)
    extra, _ = load_checkpoint(tmp_path, "a", model=model2, optimizer=opt2, scheduler=sched2)
    gen.set_state(extra["rng"])
    assert train(model2, opt2, sched2, gen, 4) == pytest.approx(uninterrupted, rel=1e-6)


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_meta", "no_latest", "model_shape", "optimizer"])
def test_bad_checkpoint_is_refused_and_changes_nothing(tmp_path, damage: str) -> None:
    model, opt, sched = build()
    train(model, opt, sched, torch.Generator().manual_seed(3), 2)
    save_checkpoint(tmp_path, "t", model=model, optimizer=opt, scheduler=sched)
    shard = tmp_path / "t" / "rank0.pt"
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        shard.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "no_meta":
        (tmp_path / "t" / "meta.json").unlink()
    elif damage == "no_latest":
        (tmp_path / "latest").unlink()
    target = build(width=17 if damage == "model_shape" else 16, seed=7)
    if damage == "optimizer":  # the same model, an optimizer with another parameter grouping
        m = target[0]
        groups = [{"params": list(m[0].parameters())}, {"params": list(m[2].parameters())}]
        opt2 = TwinFlowAdam(groups, ratio=0.5, chunk_bytes=256)
        target = (m, opt2, WarmupDecayLR(opt2, total_num_steps=20))
    train(*target, torch.Generator().manual_seed(4), 1)
    before = snapshot(*target)
    message = {
        "truncate": "truncated or corrupt",
        "flip": "corrupt or was replaced",
        "no_meta": "incomplete",
        "no_latest": "no 'latest' file",
        "model_shape": "shape",
        "optimizer": "optimizer state does not fit",
    }
    with pytest.raises(CheckpointError, match=message[damage]):
        load_checkpoint(tmp_path, model=target[0], optimizer=target[1], scheduler=target[2])
    assert_unchanged(before, snapshot(*target))


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, sched = build()
    save_checkpoint(tmp_path, "old", model=model, optimizer=opt, scheduler=sched)

    real_save = torch.save

    def broken_save(obj, f):
        if not (isinstance(obj, dict) and "model" in obj):  # only the shard (save_checkpoint also checks extra)
            return real_save(obj, f)
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, "new", model=model, optimizer=opt, scheduler=sched)
    assert (tmp_path / "latest").read_text() == "old"
    assert sorted(tmp_path.rglob("*")) == before  # no temporary file, no empty tag folder
    with pytest.raises(CheckpointError, match="no checkpoint 'new'"):
        load_checkpoint(tmp_path, "new", model=model, optimizer=opt, scheduler=sched)
    monkeypatch.undo()
    load_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched)


def notices(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "twinflow.notice"]


def test_a_save_and_a_load_each_end_with_one_notice_of_path_and_size(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="twinflow.notice")
    model, opt, sched = build()
    folder = save_checkpoint(tmp_path / "ckpt", "step3", model=model, optimizer=opt, scheduler=sched)
    size = format_bytes((folder / "rank0.pt").stat().st_size)
    (line,) = notices(caplog)
    assert line.startswith("saved checkpoint 'step3' to ") and str(folder) in line and f"({size}, " in line
    caplog.clear()
    load_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt, scheduler=sched)
    (line,) = notices(caplog)
    assert line.startswith("loaded checkpoint 'step3' from ") and str(folder / "rank0.pt") in line
    assert f"({size}, " in line


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 bytes"), (999, "999 bytes"), (1000, "1.0 kB"), (999_960, "1.0 MB"), (631_249_999, "631.2 MB"),
     (1_500_000_000, "1.5 GB")],
)  # fmt: skip
def test_sizes_are_written_for_people(n: int, text: str) -> None:
    assert format_bytes(n) == text


class Interrupting:
    """A stream that raises KeyboardInterrupt at its `at`-th write, as Ctrl-C arriving during that write does."""

    def __init__(self, f, at: int) -> None:
        self.f, self.at, self.writes = f, at, 0

    def write(self, data) -> int:
        self.writes += 1
        if self.writes == self.at:
            raise KeyboardInterrupt
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


@pytest.mark.parametrize("where", ["write 2", "write 40", "rename 1", "rename 2", "rename 3"])
def test_ctrl_c_during_a_save_raises_keyboard_interrupt_and_leaves_nothing(tmp_path, monkeypatch, where) -> None:
    """Ctrl-C while torch.save writes the shard (torch's writer wraps it in a RuntimeError), or at a rename."""
    model, opt, sched = build()
    save_checkpoint(tmp_path, "old", model=model, optimizer=opt, scheduler=sched)
    train(model, opt, sched, torch.Generator().manual_seed(5), 1)
    before = sorted(tmp_path.rglob("*"))
    kind, at = where.split()
    if kind == "write":
        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            if isinstance(obj, dict) and "model" in obj:  # the shard (save_checkpoint also checks extra)
                f = Interrupting(f, int(at))
            return real_save(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", save)
    else:
        real_replace, renames = os.replace, []

        def replace(src, dst) -> None:
            renames.append(dst)
            if len(renames) == int(at):
                raise KeyboardInterrupt
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, "new", model=model, optimizer=opt, scheduler=sched)
    monkeypatch.undo()
    assert sorted(tmp_path.rglob("*")) == before  # no temporary, no marker, no tag folder
    assert (tmp_path / "latest").read_text() == "old"
    save_checkpoint(tmp_path, "new", model=model, optimizer=opt, scheduler=sched)  # the next save works
    model2, opt2, sched2 = build(seed=9)
    _, meta = load_checkpoint(tmp_path, model=model2, optimizer=opt2, scheduler=sched2)
    assert meta["tag"] == "new" and all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
