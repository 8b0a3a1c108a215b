"""README's main job runs and learns."""

import importlib.util
import json
import math
import os
import re
import struct
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
    # a line before the optimizer is set up (a first run compiles the kernel there), one once it is ready
    assert re.search(r"params on \w+ \(torch\.\w+\); setting up TwinFlowAdam \(ratio 0\.4\) \.\.\.\n"
                     r"TwinFlowAdam ready in [0-9.]+ s: CPU steps", out), out[: out.index("{")]  # fmt: skip
    assert summary["last_loss"] < 0.5 * summary["first_loss"]
    assert abs(summary["split"]["ratio_achieved"] - 0.4) < 0.01


def test_rl_colocate_cycles_the_state_between_rollouts_and_keeps_the_losses() -> None:
    """The example's own check (identical losses with and without the offload) and its figures."""
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "rl_colocate.py"), "--iterations", "3"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(run.stdout[run.stdout.index("{") :])
    assert summary["identical_losses"] and summary["losses"] == summary["straight_losses"]
    assert len(set(summary["losses"])) == 3  # a real run: the losses differ from step to step
    assert len(summary["cycles"]) == 3 and all(c["bytes"] > 0 and c["reload_s"] >= 0 for c in summary["cycles"])
    assert len({c["bytes"] for c in summary["cycles"]}) == 1  # the same state and gradients, every cycle


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
        # which ratio it recommends follows its measurements here (tests/test_tune_cli.py feeds it fixed ones)
        assert "No GPU here" in out and "ratio='auto' chose " in out
        assert "inf Gparam/s" not in out and "GPU Adam" not in out and "GPU memory budget" not in out
        assert rows[0]["ratio"] in (0.0, 1.0) and all(r["peak_bytes"] is None for r in rows)


def test_tune_cli_has_help_for_every_option() -> None:
    from twinflow.tune.__main__ import build_parser

    missing = [a.option_strings for a in build_parser()._actions if not a.help]
    assert missing == []


def run_train_opt(tmp_path: Path, text: bytes, *flags: str) -> tuple[dict, subprocess.CompletedProcess]:
    """examples/train_opt.py on opt-tiny over `text` (a local file); its JSON summary and the finished process."""
    corpus, summary_path = tmp_path / "corpus.txt", tmp_path / "summary.json"
    corpus.write_bytes(text)
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_opt.py"), "--model", "opt-tiny", "--data", str(corpus),
         "--summary", str(summary_path), *flags],
        capture_output=True, text=True, check=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    return json.loads(summary_path.read_text()), done


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """A PNG file's (width, height), after checking its signature, its IHDR chunk and its closing IEND chunk."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG: {data[:8]!r}"
    assert data[12:16] == b"IHDR" and data[-8:-4] == b"IEND", f"{path} is cut short or malformed"
    assert len(data) > 5_000, f"{path} has {len(data)} bytes: too few for a plotted curve"
    return struct.unpack(">II", data[16:24])


def test_train_opt_learns_from_a_local_text_file_and_plots_its_loss(tmp_path: Path) -> None:
    summary, done = run_train_opt(tmp_path, (ROOT / "README.md").read_bytes(), "--steps", "15", "--seq-len", "64")
    assert summary["last_loss"] < summary["first_loss"] - 0.1
    assert summary["ratio"] == 0.4 and summary["parameters"] > 0 and summary["tokens_per_second_per_rank"] > 0
    assert json.loads(done.stdout) == summary  # stdout is the summary alone; progress goes to stderr
    width, height = png_size(tmp_path / "summary.png")
    assert width >= 300 and height >= 200
    assert f"loss curve written to {tmp_path / 'summary.png'}" in done.stderr
    # the model build is announced before it starts and timed when it ends
    assert re.search(r"building opt-tiny \(random init, torch\.\w+ on [\w:]+\) \.\.\.\n", done.stderr)
    assert re.search(r"built opt-tiny: [0-9.]+M parameters in [0-9.]+ s\n", done.stderr), done.stderr
    assert done.stderr.index("building opt-tiny") < done.stderr.index("built opt-tiny")


def _train_opt_module():
    spec = importlib.util.spec_from_file_location("train_opt_example", ROOT / "examples" / "train_opt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_opt_plot_is_skipped_in_one_line_without_matplotlib(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    train_opt = _train_opt_module()
    losses = torch.rand(12, generator=torch.Generator().manual_seed(3)).add(1).tolist()
    written = train_opt.plot_losses(losses, "a title", tmp_path / "a.png")
    assert written == f"loss curve written to {tmp_path / 'a.png'}" and png_size(tmp_path / "a.png")[0] > 0
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    line = train_opt.plot_losses(losses, "a title", tmp_path / "b.png")
    assert "matplotlib is not installed" in line and "pip install matplotlib" in line and "\n" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png"]  # nothing written, no temporary left


@pytest.mark.parametrize("flops_per_second", [3.7e10, 5.2e11, 1.234e14])
def test_train_opt_shows_a_cpus_tflops_with_its_digits(flops_per_second: float) -> None:
    """A CPU's model FLOP/s (tens of GFLOP/s) once printed as 0.0 TFLOP/s."""
    shown = _train_opt_module().format_rate(flops_per_second)
    assert float(shown) > 0 and abs(float(shown) - flops_per_second / 1e12) <= 0.005 * flops_per_second / 1e12


@pytest.mark.parametrize("script, nproc", [("run_opt13b.sh", 1), ("run_opt13b.sh", 2), ("run_opt30b.sh", 2)])
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
    if script == "run_opt13b.sh":
        assert summary["ratio"] == summary["ratio_requested"] == 0.5
    else:  # the ratio each rank planned at its first step, the same on every rank
        assert summary["ratio_requested"] == "auto" and 0.0 <= summary["ratio"] <= 1.0
    assert all(math.isfinite(x) for x in summary["losses"])
    assert summary["initialize_seconds"] > 0 and summary["first_step_seconds"] > 0


def test_train_opt_runs_at_the_models_full_context(tmp_path: Path) -> None:
    """Sequences of exactly --seq-len tokens: OPT's 2048 positions are usable (one more token overflows them)."""
    summary, _ = run_train_opt(tmp_path, bytes(range(32, 127)) * 30, "--steps", "1", "--seq-len", "2048")
    assert math.isfinite(summary["first_loss"]) and summary["tokens_per_second_per_rank"] > 0
