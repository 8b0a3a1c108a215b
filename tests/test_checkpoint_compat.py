"""Checkpoints written by an earlier twinflow load with today's code and continue as the run that wrote them did
(tests/checkpoint_fixture.py wrote them and the losses after the save): the per-rank format of 1111190 (the main of
2026-11-27 evening), and the portable format of 4637d54 (the engine's default since c758ae8)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import twinflow
from tests.checkpoint_fixture import BEFORE, PRECISIONS, batches, config, model, train

DATA = Path(__file__).with_name("data")
FIXTURES = {"per-rank": DATA / "checkpoints_1111190", "portable": DATA / "checkpoints_portable_4637d54"}


@pytest.mark.parametrize("fixture", FIXTURES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_checkpoint_of_an_earlier_version_resumes_the_same_run(tmp_path, precision: str, fixture: str) -> None:
    written = FIXTURES[fixture]
    continued = json.loads((written / "continued.json").read_text())["continued"][precision]
    folder = tmp_path / precision
    shutil.copytree(written / precision, folder)  # a load may tidy the folder; the fixture stays as written
    engine, *_ = twinflow.initialize(model=model(seed=1), config=config(precision))
    path, _ = engine.load_checkpoint(folder)
    assert path.name == "global_step4" and engine.global_steps == BEFORE // 2
    assert (path / ".metadata").is_file() == (fixture == "portable") and (path / "meta.json").is_file() != (
        fixture == "portable"
    )
    losses = train(engine, batches()[BEFORE:])
    # Not bit for bit: the fixture's run was on one machine's BLAS and kernel path, this may be another's. A state
    # not loaded, or loaded into the wrong places, is off by a percent (the fresh model's first loss: 1.4%).
    assert losses == pytest.approx(continued, rel=1e-4, abs=0)
