"""What a portable save leaves when it cannot finish: refused before anything is written, a failure part way (a full
disk, Ctrl-C) or a directory it may not write. In each case the previous tags stay as they were and loadable, and
nothing of the failed save is left behind."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from twinflow import TwinFlowAdam
from twinflow.checkpoint import portable, portable_load, portable_state


def make(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 96), torch.nn.GELU(), torch.nn.Linear(96, 6))


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int, steps: int = 2) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 24, generator=gen)
        F.mse_loss(model(x), x[:, :6]).backward()
        opt.step()
        opt.zero_grad()


def built(precision: str = "fp32") -> tuple[torch.nn.Module, TwinFlowAdam]:
    model = make()
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5, state_precision=precision)
    train(model, opt, 1)
    return model, opt


def listing(root: Path) -> list[tuple[str, int]]:
    """Every file and folder under `root`, with a file's size."""
    return sorted((str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1) for p in root.rglob("*"))


def loads_as_saved(directory: Path, tag: str, weights: list[torch.Tensor], state: dict, precision: str) -> None:
    """`tag` of `directory` (the latest) loads into a fresh, poisoned model: the weights and state given."""
    model = make(seed=5)
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5, state_precision=precision)
    for p in model.parameters():
        p.data.fill_(float("nan"))
    portable_load.load_portable(directory, None, model=model, optimizer=opt)
    assert (directory / "latest").read_text() == tag
    assert all(p.detach().equal(w) for p, w in zip(model.parameters(), weights))
    got = opt.state_dict()["state"]
    assert all(got[i][k].equal(v) for i, entry in state.items() for k, v in entry.items())


@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
def test_a_save_between_backward_and_step_is_refused_and_writes_nothing(tmp_path, precision: str) -> None:
    """With weights first, the CPU may still write the last step's state then: the save would catch it half written."""
    model = make().to(torch.bfloat16)
    opt = TwinFlowAdam(model.parameters(), ratio=0.5, max_grad_norm=1e-3, chunk_bytes=2048, weights_first=True,
                       state_precision=precision).attach(model, eager=False)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(8, 24, generator=gen).bfloat16()
        F.mse_loss(model(x).float(), x[:, :6].float()).backward()
        if step == 0:  # the second step stays open
            opt.step()
            opt.zero_grad()
    before = listing(tmp_path)
    with pytest.raises(RuntimeError, match="middle of a step"):
        portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)
    assert listing(tmp_path) == before  # not even the directory
    opt.step()
    portable.save_portable(tmp_path / "ckpt", "t", model=model, optimizer=opt)  # after step(): saved
    assert (tmp_path / "ckpt" / "latest").read_text() == "t"


class Stop:
    """Raises `error` at the `at`-th piece DCP asks the planner for (what a full disk or Ctrl-C does part way)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, error: BaseException, at: int = 3,
                 mid_tensor: bool = False) -> None:  # fmt: skip
        real, self.asked = portable_state.ReadWhenWritten.resolve_data, 0

        def resolve_data(planner, item):  # noqa: ANN001, ANN202
            later_piece = (item.index.fqn, tuple(item.index.offset or ())) in planner.rows and item.index.offset[0]
            self.asked += not mid_tensor or bool(later_piece)  # mid_tensor: counts only pieces after a tensor's first
            if self.asked == at:
                raise error
            return real(planner, item)

        monkeypatch.setattr(portable_state.ReadWhenWritten, "resolve_data", resolve_data)


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "in_pieces"])
@pytest.mark.parametrize("precision", ["fp32", "int8_m24"])
@pytest.mark.parametrize("how", ["disk_full", "ctrl_c", "ctrl_c_at_the_rename"])
def test_a_save_that_fails_part_way_leaves_the_previous_tag_as_it_was_and_nothing_else(
    tmp_path, monkeypatch: pytest.MonkeyPatch, precision: str, how: str, pieces: bool
) -> None:
    """`pieces`: the state is written in pieces of 512 bytes (5 rows of the 96 x 24 weight), so the failure comes
    part way through a tensor, between two of its ranged reads."""
    if pieces:
        monkeypatch.setattr(portable_state, "PIECE_BYTES", 512)
    model, opt = built(precision)
    portable.save_portable(tmp_path, "old", model=model, optimizer=opt)
    weights = [p.detach().clone() for p in model.parameters()]
    state = {i: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()}
    train(model, opt, 2)
    before = listing(tmp_path)
    if how == "ctrl_c_at_the_rename":
        real_rename = Path.rename

        def rename(path: Path, target):  # noqa: ANN001, ANN202
            if path.name.endswith(portable.SAVING):
                raise KeyboardInterrupt
            return real_rename(path, target)

        monkeypatch.setattr(Path, "rename", rename)
    else:
        error = OSError(errno.ENOSPC, "No space left on device") if how == "disk_full" else KeyboardInterrupt()
        Stop(monkeypatch, error, at=2 if pieces else 3, mid_tensor=pieces)
    with pytest.raises(KeyboardInterrupt if how.startswith("ctrl_c") else OSError) as caught:  # not DCP's wrapper
        portable.save_portable(tmp_path, "new", model=model, optimizer=opt)
    assert how.startswith("ctrl_c") or caught.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert listing(tmp_path) == before  # no new folder, no ".saving" left, "latest" as it was
    loads_as_saved(tmp_path, "old", weights, state, precision)
    train(model, opt, 3)
    portable.save_portable(tmp_path, "new", model=model, optimizer=opt)  # the next save is written
    weights = [p.detach().clone() for p in model.parameters()]
    state = {i: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()}
    loads_as_saved(tmp_path, "new", weights, state, precision)


@pytest.mark.skipif(not portable.ASYNC_SAVE, reason="an asynchronous save needs torch >= 2.9")
@pytest.mark.parametrize("how", ["disk_full", "ctrl_c"])
def test_an_asynchronous_save_that_fails_raises_the_error_itself_at_its_wait(
    tmp_path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The write fails on DCP's thread: wait() raises the error itself (an OSError, a KeyboardInterrupt), not DCP's
    CheckpointException (a BaseException: ``except Exception`` missed it, and a full disk was not an OSError);
    latest and the previous tag stay as they were, and the next save removes what the failed one left."""
    model, opt = built()
    portable.save_portable(tmp_path, "old", model=model, optimizer=opt)
    weights = [p.detach().clone() for p in model.parameters()]
    state = {i: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()}
    train(model, opt, 2)
    Stop(monkeypatch, OSError(errno.ENOSPC, "No space left on device") if how == "disk_full" else KeyboardInterrupt())
    pending = portable.save_portable(tmp_path, "new", model=model, optimizer=opt, asynchronous=True)
    with pytest.raises(OSError if how == "disk_full" else KeyboardInterrupt) as caught:
        pending.wait()
    assert how != "disk_full" or caught.value.errno == errno.ENOSPC
    monkeypatch.undo()
    loads_as_saved(tmp_path, "old", weights, state, "fp32")
    portable.save_portable(tmp_path, "again", model=model, optimizer=opt)  # removes the failed save's folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "latest", "old"]


@pytest.mark.parametrize("fresh", [True, False], ids=["new_directory", "existing_directory"])
def test_an_unwritable_directory_is_named_with_the_fix_and_nothing_changes(tmp_path, unwritable, fresh: bool) -> None:
    model, opt = built()
    portable.save_portable(tmp_path / "ckpt", "old", model=model, optimizer=opt)
    weights = [p.detach().clone() for p in model.parameters()]
    state = {i: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()}
    directory = tmp_path / "ckpt" / "sub" if fresh else tmp_path / "ckpt"
    before = listing(tmp_path)
    unwritable(tmp_path / "ckpt")
    with pytest.raises(PermissionError) as caught:
        portable.save_portable(directory, "new", model=model, optimizer=opt)
    message = str(caught.value)
    if fresh:
        assert f"cannot create the checkpoint directory {str(directory)!r}: {str(tmp_path / 'ckpt')!r}" in message
    else:
        assert f"the checkpoint directory {str(directory)!r} is not writable" in message
    assert f"chmod u+rwx {str(tmp_path / 'ckpt')!r}) or pass a directory you can write to" in message
    assert portable.SAVING not in message  # the user's directory, not the folder the save writes first
    assert listing(tmp_path) == before
    (tmp_path / "ckpt").chmod(0o755)
    loads_as_saved(tmp_path / "ckpt", "old", weights, state, "fp32")


@pytest.mark.parametrize("what", ["twinflow.pt", "latest"])
def test_a_file_of_rank_0_that_cannot_be_written_fails_the_save_on_every_rank_and_leaves_the_previous_tag(
    tmp_path, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    """twinflow.pt (written before DCP's collectives) and latest (after them) are rank 0's alone: their failure is
    told to every rank, which would otherwise wait for rank 0 in the next collective."""
    model, opt = built()
    portable.save_portable(tmp_path, "old", model=model, optimizer=opt)
    weights = [p.detach().clone() for p in model.parameters()]
    state = {i: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()}
    train(model, opt, 2)
    before = listing(tmp_path)
    real, told = portable.write_atomic, []

    def write_atomic(path: Path, write):  # noqa: ANN001, ANN202
        if path.name == what:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, write)

    monkeypatch.setattr(portable, "write_atomic", write_atomic)
    real_gathered = portable.gathered
    monkeypatch.setattr(portable, "gathered", lambda mine: told.append(mine) or real_gathered(mine))
    with pytest.raises(OSError, match="No space left on device"):
        portable.save_portable(tmp_path, "new", model=model, optimizer=opt)
    # every rank told: the failure described, and pickled to be raised as itself there
    assert any(any(isinstance(v, tuple) and "No space left" in v[0] for v in mine.values()) for mine in told)
    monkeypatch.undo()
    if what == "twinflow.pt":
        assert listing(tmp_path) == before
    else:  # the tag was in place when latest failed: complete, loadable by its name; latest names the old one
        assert (tmp_path / "latest").read_text() == "old" and not list(tmp_path.glob("*.saving"))
    loads_as_saved(tmp_path, "old", weights, state, "fp32")


@pytest.mark.parametrize("tag", ["latest", ".hidden", "a/b", "", "x.saving", "x.old"])
def test_a_tag_that_is_no_plain_folder_name_is_refused_before_anything_is_written(tmp_path, tag: str) -> None:
    model = make()
    opt = TwinFlowAdam(model.parameters(), ratio=0.5)
    with pytest.raises(ValueError, match=r"expected a plain folder name .*e\.g\. tag='step100'"):
        portable.save_portable(tmp_path / "ckpt", tag, model=model, optimizer=opt)
    assert not (tmp_path / "ckpt").exists()
