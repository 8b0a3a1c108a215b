"""Checkpoints written by an earlier twinflow (tests/checkpoint_fixture.py wrote them and the losses after the
save): the portable format of 4637d54 (the engine's default since c758ae8) loads with today's code and continues
as the run that wrote it did; the per-rank format of 1111190 (the main of 2026-11-27 evening), which twinflow no
longer loads, is refused naming the command that rewrites it (tests/test_to_portable.py resumes it so rewritten).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import twinflow
from tests.checkpoint_fixture import BEFORE, PRECISIONS, batches, config, model, train
from twinflow.checkpoint import CheckpointError, read_meta
from twinflow.checkpoint.any_format import rewrite_command

DATA = Path(__file__).with_name("data")
FIXTURES = {"per-rank": DATA / "checkpoints_1111190", "portable": DATA / "checkpoints_portable_4637d54"}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_portable_checkpoint_of_an_earlier_version_resumes_the_same_run(tmp_path, precision: str) -> None:
    written = FIXTURES["portable"]
    continued = json.loads((written / "continued.json").read_text())["continued"][precision]
    folder = tmp_path / precision
    shutil.copytree(written / precision, folder)  # a load may tidy the folder; the fixture stays as written
    engine, *_ = twinflow.initialize(model=model(seed=1), config=config(precision))
    path, _ = engine.load_checkpoint(folder)
    assert path.name == "global_step4" and engine.global_steps == BEFORE // 2
    assert (path / ".metadata").is_file()
    losses = train(engine, batches()[BEFORE:])
    # Not bit for bit: the fixture's run was on one machine's BLAS and kernel path, this may be another's. A state
    # not loaded, or loaded into the wrong places, is off by a percent (the fresh model's first loss: 1.4%).
    assert losses == pytest.approx(continued, rel=1e-4, abs=0)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_per_rank_checkpoint_is_refused_naming_the_conversion_and_nothing_changes(tmp_path, precision) -> None:
    folder = tmp_path / precision
    shutil.copytree(FIXTURES["per-rank"] / precision, folder)
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    engine, *_ = twinflow.initialize(model=model(seed=1), config=config(precision))
    weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
    with pytest.raises(CheckpointError, match="is a per-rank one") as refused:
        engine.load_checkpoint(folder)
    assert rewrite_command(folder, "global_step4") in str(refused.value)
    assert all(torch.equal(v, weights[k]) for k, v in engine.module.state_dict().items())
    assert engine.global_steps == 0 and not engine.local_optimizer.state
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before
    assert read_meta(folder)[0] == "global_step4"  # its meta is still read, in either format


def test_the_converters_refuse_a_per_rank_checkpoint_naming_the_way(tmp_path, capsys) -> None:
    """OUT.pt and --safetensors read the portable format; a per-rank checkpoint is first rewritten with
    --to-portable, which the error names. Nothing is written."""
    from twinflow.checkpoint.convert_cli import main as convert_main

    folder = FIXTURES["per-rank"] / "int8_m24"
    for outputs in ([str(tmp_path / "out.pt")], ["--safetensors", str(tmp_path / "hub")]):
        assert convert_main([str(folder), "latest", *outputs]) == 1
        err = capsys.readouterr().err
        assert "per-rank checkpoint" in err and rewrite_command(folder, "global_step4") in err, err
    assert not list(tmp_path.iterdir())


def test_the_command_is_quoted_for_the_shell_and_only_a_per_rank_checkpoint_is_sent_to_it(tmp_path) -> None:
    """A directory with a space gets the command with the directory quoted, as pasted; a tag that is no checkpoint
    at all gets the portable load's own message: in an empty directory, no word of the per-rank format; beside a
    per-rank checkpoint, that one listed apart with the command that rewrites it."""
    import shlex

    folder = tmp_path / "per rank"
    shutil.copytree(FIXTURES["per-rank"] / "fp32", folder)
    engine, *_ = twinflow.initialize(model=model(seed=1), config=config("fp32"))
    with pytest.raises(CheckpointError, match="is a per-rank one") as refused:
        engine.load_checkpoint(folder, "latest")
    command = str(refused.value).split("`")[1]
    assert shlex.split(command)[3:6] == [str(folder), "global_step4", "--to-portable"], command
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no complete portable checkpoint") as missing:
        engine.load_checkpoint(tmp_path / "empty")
    assert "per-rank" not in str(missing.value) and "meta.json" not in str(missing.value), missing.value
    with pytest.raises(CheckpointError, match="global_step9 holds no complete portable checkpoint") as missing:
        engine.load_checkpoint(folder, "global_step9")
    message = str(missing.value)
    assert f"rewrite in the portable format one of the per-rank checkpoints {folder} holds" in message, message
    assert "oldest first: ['global_step4']" in message and "pass tag=" not in message, message
    assert f"(the newest: `{rewrite_command(folder, 'global_step4')}`)" in message, message
    assert engine.global_steps == 0 and not engine.local_optimizer.state


def test_a_missing_tag_lists_portable_and_per_rank_tags_apart_and_the_command_fits_the_newest(tmp_path) -> None:
    """Beside a portable tag, two per-rank ones (oldest first by their meta.json), the newest named ``x.old`` (a
    portable save of ``x`` killed between its renames leaves the per-rank ``x`` so): the command the hint names
    writes it as ``x`` (a converted tag may not be named as a save's own folders), and it works. A folder the hint
    cannot read is left out of it, not raised."""
    import os
    import shlex

    from twinflow.checkpoint.convert_cli import main as convert_main

    folder = tmp_path / "runs"
    shutil.copytree(FIXTURES["per-rank"] / "fp32", folder)
    shutil.copytree(folder / "global_step4", folder / "early")
    (folder / "global_step4").rename(folder / "x.old")
    for n, tag in enumerate(("early", "x.old")):
        os.utime(folder / tag / "meta.json", (1_700_000_000 + n, 1_700_000_000 + n))
    engine, *_ = twinflow.initialize(model=model(seed=1), config=config("fp32"))
    engine.save_checkpoint(folder, "mine")
    (folder / "locked").mkdir()
    is_file = Path.is_file

    def unreadable(path: Path) -> bool:
        if path.parent.name == "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return is_file(path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "is_file", unreadable)
        with pytest.raises(CheckpointError, match="gone holds no complete portable checkpoint") as missing:
            engine.load_checkpoint(folder, "gone")
    message = str(missing.value)
    assert f"pass tag= one of those {folder} holds, oldest first: ['mine']" in message, message
    assert "or rewrite in the portable format one of the per-rank checkpoints it also holds" in message, message
    assert "oldest first: ['early', 'x.old']" in message and "locked" not in message, message
    command = message.split("`")[1]
    assert command == rewrite_command(folder, "x.old") and command.endswith("--out-tag x"), command
    args = shlex.split(command.replace("OUT_DIR", shlex.quote(str(tmp_path / "out"))))
    assert convert_main(args[3:]) == 0
    resumed, *_ = twinflow.initialize(model=model(seed=2), config=config("fp32"))
    path, _ = resumed.load_checkpoint(tmp_path / "out")
    assert path.name == "x" and resumed.global_steps == BEFORE // 2
