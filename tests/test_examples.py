"""README's main job runs and learns."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_train_small_runs_and_loss_falls() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_small.py"), "--steps", "40", "--dim", "128", "--layers", "2"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=300,
    ).stdout
    summary = json.loads(out[out.index("{") :])
    assert summary["last_loss"] < 0.5 * summary["first_loss"]
    assert abs(summary["split"]["ratio_achieved"] - 0.4) < 0.01


def test_tune_cli_prints_a_recommendation_and_the_table(tmp_path: Path) -> None:
    table = tmp_path / "tune.json"
    done = subprocess.run(
        [sys.executable, "-m", "twinflow.tune", "--model", "opt-tiny", "--batch", "2", "--seq", "32",
         "--ratios", "0", "1", "--warmup", "1", "--steps", "2", "--json", str(table)],
        capture_output=True, text=True, check=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    out = done.stdout
    assert "recommendation: ratio=" in out and "<- auto" in out
    rows = json.loads(table.read_text())["rows"]
    assert [r["ratio"] for r in rows[1:]] == [0.0, 1.0] and all(r["step_s"] > 0 for r in rows)
    assert "RuntimeWarning" not in done.stderr and "found in sys.modules" not in done.stderr
    if not torch.cuda.is_available():  # no nonsense budget or infinite GPU rate; what the table means instead
        assert "No GPU here" in out and "recommends ratio 0" in out
        assert "inf Gparam/s" not in out and "GPU Adam" not in out and "GPU memory budget" not in out
        assert rows[0]["ratio"] == 0.0 and all(r["peak_bytes"] is None for r in rows)


def test_tune_cli_has_help_for_every_option() -> None:
    from twinflow.tune.__main__ import build_parser

    missing = [a.option_strings for a in build_parser()._actions if not a.help]
    assert missing == []


def run_train_opt(tmp_path: Path, text: bytes, *flags: str) -> dict:
    """examples/train_opt.py on opt-tiny over `text` (a local file); its JSON summary."""
    corpus, summary_path = tmp_path / "corpus.txt", tmp_path / "summary.json"
    corpus.write_bytes(text)
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_opt.py"), "--model", "opt-tiny", "--data", str(corpus),
         "--summary", str(summary_path), *flags],
        capture_output=True, text=True, check=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    return json.loads(summary_path.read_text())


def test_train_opt_learns_from_a_local_text_file(tmp_path: Path) -> None:
    summary = run_train_opt(tmp_path, (ROOT / "README.md").read_bytes(), "--steps", "15", "--seq-len", "64")
    assert summary["last_loss"] < summary["first_loss"] - 0.1
    assert summary["ratio"] == 0.4 and summary["parameters"] > 0 and summary["tokens_per_second_per_rank"] > 0


@pytest.mark.parametrize("script, nproc", [("run_opt13b.sh", 1), ("run_opt30b.sh", 2)])
def test_the_opt_run_scripts_train_a_small_shape(tmp_path: Path, script: str, nproc: int) -> None:
    """The scripts' wiring (config, torchrun, threads), on opt-tiny so that a CPU machine can run them."""
    summary_path = tmp_path / "summary.json"
    env = dict(os.environ, STEPS="3", SEQ_LEN="32", NPROC=str(nproc))
    env.pop("OMP_NUM_THREADS", None)
    subprocess.run(
        ["bash", str(ROOT / "examples" / script), "--model", "opt-tiny", "--summary", str(summary_path)],
        capture_output=True, text=True, check=True, cwd=tmp_path, env=env, timeout=600,
    )  # fmt: skip
    summary = json.loads(summary_path.read_text())
    assert summary["world_size"] == nproc and summary["steps"] == 3 and len(summary["losses"]) == 3
    assert summary["ratio"] == (0.5 if script == "run_opt13b.sh" else 0.4)
    assert all(math.isfinite(x) for x in summary["losses"])


def test_train_opt_runs_at_the_models_full_context(tmp_path: Path) -> None:
    """Sequences of exactly --seq-len tokens: OPT's 2048 positions are usable (one more token overflows them)."""
    summary = run_train_opt(tmp_path, bytes(range(32, 127)) * 30, "--steps", "1", "--seq-len", "2048")
    assert math.isfinite(summary["first_loss"]) and summary["tokens_per_second_per_rank"] > 0
