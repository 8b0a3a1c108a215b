"""The files of a checkpoint directory (twinflow.checkpoint.checkpoint_files): the temporaries interrupted saves
leave, removed by the next save only where their writer is certainly gone; torch.save into a stream giving back
what the stream's write raised; sizes for people; and a portable save into new folders that fails part way leaving
no new file or folder."""

from __future__ import annotations

import errno
import io
import logging
import os
from pathlib import Path
from typing import IO

import pytest
import torch

from twinflow import TwinFlowAdam
from twinflow.checkpoint import portable
from twinflow.checkpoint.checkpoint_files import format_bytes, remove_leftovers, save_to_stream, temp_path

NOTICE = "twinflow.notice"


def listing(root: Path) -> list[str]:
    """Every file and folder under `root`, relative to it."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def notices(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == NOTICE]


@pytest.fixture(scope="module")
def dead() -> int:
    """A pid no process can have: one above the kernel's largest (a reaped child's pid could be taken again)."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> str:
    """This machine's name as this process's temporaries carry it (``.<target>.tmp<pid>@<host>``)."""
    name = temp_path(tmp_path_factory.mktemp("names"), "latest").name
    assert name.startswith(f".latest.tmp{os.getpid()}@")
    return name.split("@", 1)[1]


def built(seed: int = 0) -> tuple[torch.nn.Module, TwinFlowAdam]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 4))
    opt = TwinFlowAdam(model.parameters(), lr=1e-2, ratio=0.5)
    model(torch.randn(4, 12)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def written(paths: list[Path]) -> None:
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"partial")  # 7 bytes


# ------------------------------------------------------------- the temporaries of interrupted saves


def test_only_temporaries_whose_writer_is_certainly_gone_are_removed_with_one_notice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, dead: int, host: str
) -> None:
    caplog.set_level(logging.INFO, logger=NOTICE)
    gone = [  # a dead writer's, in the directory and in a tag folder; named as earlier versions did, without a host
        tmp_path / f".latest.tmp{dead}@{host}",
        tmp_path / f".meta.json.tmp{dead}@{host}",
        tmp_path / f".step3.rank0.pt.tmp{dead}@{host}",  # a shard staged before its tag folder was made
        tmp_path / "step3" / f".meta.json.tmp{dead}@{host}",
        tmp_path / "step3" / f".rank0.pt.tmp{dead}",
        tmp_path / f".latest.tmp{dead}",
    ]
    kept = [
        tmp_path / f".latest.tmp{os.getpid()}@{host}",  # this process's own, being written
        tmp_path / "step3" / f".rank1.pt.tmp{os.getppid()}@{host}",  # a live writer's (another rank's, in flight)
        tmp_path / f".latest.tmp{dead}@elsewhere",  # another host's: its pid cannot be checked from here
        tmp_path / "step3" / f".rank1.pt.tmp{dead}@elsewhere",
        tmp_path / f".latest.tmp0@{host}",  # pid 0 would address a process group: never taken as dead
        tmp_path / f".notes.tmp{dead}",  # not a name of ours
        tmp_path / "step3" / f".twinflow.pt.tmp{dead}@{host}",
        tmp_path / f"latest.tmp{dead}@{host}",
        tmp_path / "step3" / "deeper" / f".latest.tmp{dead}@{host}",  # below a tag folder: not a place we write
    ]
    written(gone + kept)
    remove_leftovers(tmp_path)
    assert [p for p in gone if p.exists()] == []
    assert [p for p in kept if not p.exists()] == []
    (line,) = notices(caplog)
    assert line.startswith(f"removed what interrupted checkpoint saves left in {tmp_path}: ")
    assert all(f"temporary {str(p)!r} (7 bytes)" in line for p in gone)
    assert all(repr(str(p)) not in line for p in kept)
    caplog.clear()
    remove_leftovers(tmp_path)  # nothing left to remove: nothing said
    assert notices(caplog) == []
    remove_leftovers(tmp_path / "not_there")  # a directory that is not there yet: nothing to do


def test_the_next_portable_save_removes_a_dead_writers_temporaries_and_keeps_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, dead: int, host: str
) -> None:
    model, opt = built()
    portable.save_portable(tmp_path, "good", model=model, optimizer=opt)
    gone = [tmp_path / f".latest.tmp{dead}@{host}", tmp_path / "good" / f".rank0.pt.tmp{dead}"]
    kept = [  # a live writer's, another host's, and not ours
        tmp_path / f".latest.tmp{os.getppid()}@{host}",
        tmp_path / "good" / f".rank1.pt.tmp{dead}@elsewhere",
        tmp_path / "good" / f".notes.tmp{dead}",
    ]
    written(gone + kept)
    caplog.set_level(logging.INFO, logger=NOTICE)
    portable.save_portable(tmp_path, "next", model=model, optimizer=opt)
    assert sorted(p for p in listing(tmp_path) if ".tmp" in p) == sorted(str(p.relative_to(tmp_path)) for p in kept)
    removed = [line for line in notices(caplog) if line.startswith("removed what interrupted checkpoint saves")]
    assert len(removed) == 1 and all(str(p) in removed[0] for p in gone), notices(caplog)
    assert (tmp_path / "latest").read_text() == "next"


# ------------------------------------------------------------- torch.save into a stream


class FailingStream:
    """A stream (into `f`, else memory) whose `at`-th write raises `error`: Ctrl-C arriving during that write, or a
    full disk."""

    def __init__(self, error: BaseException, at: int, f: IO[bytes] | None = None) -> None:
        self.error, self.at, self.writes, self.f = error, at, 0, f if f is not None else io.BytesIO()

    def write(self, data) -> int:  # noqa: ANN001
        self.writes += 1
        if self.writes == self.at:
            raise self.error
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


@pytest.mark.parametrize("at", [1, 2, 40])
@pytest.mark.parametrize("error", [KeyboardInterrupt, lambda: OSError(errno.ENOSPC, "No space left on device")],
                         ids=["ctrl_c", "disk_full"])  # fmt: skip
def test_a_streams_failure_comes_back_as_itself_not_as_torchs_runtime_error(error, at: int) -> None:
    """torch's writer turns what the stream's write raised after its first write into ``RuntimeError: [enforce
    fail at inline_container.cc]``, which ``except KeyboardInterrupt`` (or ``except OSError``) misses."""
    obj = {f"t{i}": torch.full((1000,), float(i)) for i in range(30)}
    whole = FailingStream(KeyboardInterrupt(), at=0)
    save_to_stream(obj, whole)
    assert whole.writes > 40  # every write point asked for is reached
    raised = error()
    with pytest.raises(type(raised)) as caught:
        save_to_stream(obj, FailingStream(raised, at))
    assert caught.value is raised  # the stream's own exception, not one made like it
    assert caught.value.__context__ is None  # and not chained to torch's error


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 bytes"), (999, "999 bytes"), (1000, "1.0 kB"), (999_949, "999.9 kB"), (999_960, "1.0 MB"),
     (631_249_999, "631.2 MB"), (1_500_000_000, "1.5 GB"), (2_500_000_000_000_000, "2500.0 TB")],
)  # fmt: skip
def test_sizes_are_written_for_people(n: int, text: str) -> None:
    assert format_bytes(n) == text


# ------------------------------------------------------------- a save failing part way


@pytest.mark.parametrize(
    ("where", "error"),
    [
        ("twinflow.pt_write", "disk_full"),
        ("twinflow.pt_write", "ctrl_c"),
        ("twinflow.pt_rename", "disk_full"),
        ("twinflow.pt_rename", "ctrl_c"),
        ("sums", "disk_full"),
        ("sums", "ctrl_c"),
    ],
)
def test_a_save_into_new_folders_failing_part_way_leaves_no_new_file_or_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, error: str
) -> None:
    """The save makes the checkpoint directory and its missing parents, then fails: writing twinflow.pt (a write of
    its stream, or its rename into place) or once DCP has written every piece (the sums). It raises the failure
    itself, and removes what it made."""
    model, opt = built()
    before = listing(tmp_path)
    raised = KeyboardInterrupt() if error == "ctrl_c" else OSError(errno.ENOSPC, "No space left on device")
    if where == "twinflow.pt_write":
        real_save = portable.save_to_stream
        monkeypatch.setattr(portable, "save_to_stream", lambda obj, f: real_save(obj, FailingStream(raised, 2, f)))
    elif where == "twinflow.pt_rename":

        def replace(src, dst) -> None:  # noqa: ANN001
            raise raised

        monkeypatch.setattr(os, "replace", replace)
    else:

        def write_sums(*_: object) -> None:
            raise raised

        monkeypatch.setattr(portable, "write_sums", write_sums)
    with pytest.raises(type(raised)) as caught:
        portable.save_portable(tmp_path / "a" / "b", "new", model=model, optimizer=opt)
    assert caught.value is raised
    monkeypatch.undo()
    assert listing(tmp_path) == before  # not "a", "a/b", nor "a/b/new.saving"
    portable.save_portable(tmp_path / "a" / "b", "new", model=model, optimizer=opt)  # the next save is written
    assert (tmp_path / "a" / "b" / "latest").read_text() == "new"
