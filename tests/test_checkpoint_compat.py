"""Checkpoints written by an earlier twinflow (1111190, the main of 2026-11-27 evening) load with today's code and
continue as the run that wrote them did (tests/checkpoint_fixture.py wrote them and the losses after the save)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import twinflow
from tests.checkpoint_fixture import BEFORE, PRECISIONS, batches, config, model, train

FIXTURE = Path(__file__).with_name("data") / "checkpoints_1111190"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_checkpoint_of_an_earlier_version_resumes_the_same_run(tmp_path, precision: str) -> None:
    continued = json.loads((FIXTURE / "continued.json").read_text())["continued"][precision]
    folder = tmp_path / precision
    shutil.copytree(FIXTURE / precision, folder)  # a load may tidy the folder; the fixture stays as written
    engine, *_ = twinflow.initialize(model=model(seed=1), config=config(precision))
    path, _ = engine.load_checkpoint(folder)
    assert path.name == "global_step4" and engine.global_steps == BEFORE // 2
    losses = train(engine, batches()[BEFORE:])
    # Not bit for bit: the fixture's run was on one machine's BLAS and kernel path, this may be another's. A state
    # not loaded, or loaded into the wrong places, is off by a percent (the fresh model's first loss: 1.4%).
    assert losses == pytest.approx(continued, rel=1e-4, abs=0)
