"""examples/train_opt.py reports a bad --config or --data in one clean line, before any model is built."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def train_opt_error(tmp_path: Path, *flags: str) -> str:
    """Runs train_opt.py with flags that must be refused; returns its stderr after checking the refusal is clean.

    --model-path names a folder that does not exist: had the script gone on to build the model before
    refusing, loading it would end in a traceback, so a clean refusal also shows nothing was built.
    """
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_opt.py"), "--model", "opt-tiny",
         "--model-path", str(tmp_path / "no-model-here"), "--steps", "1", "--seq-len", "16", *flags],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0, out.stdout
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("train_opt.py: error: "), out.stderr
    assert out.stdout == ""
    return out.stderr


def test_a_missing_config_file_is_named_with_the_fix(tmp_path: Path) -> None:
    err = train_opt_error(tmp_path, "--config", "missing.json")
    assert "--config" in err and "'missing.json' not found" in err and "check the path" in err
    assert err.count("\n") == 1


def test_a_config_that_is_not_json_is_named_with_line_and_column(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"train_micro_batch_size_per_gpu": 1,\n "bf16": {enabled: true}}')
    err = train_opt_error(tmp_path, "--config", "bad.json")
    assert "bad.json: not valid JSON at line 2, column 11: Expecting property name enclosed in double quotes" in err
    assert err.count("\n") == 1


def test_an_invalid_config_names_the_file_key_and_expectation(tmp_path: Path) -> None:
    (tmp_path / "yes.json").write_text('{"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": "yes"}}')
    err = train_opt_error(tmp_path, "--config", "yes.json")
    assert "--config yes.json: " in err and 'bf16.enabled = "yes": expected true or false' in err


@pytest.mark.parametrize("kind, expected", [
    ("missing", "no such file: give a local text file, or leave --data out for synthetic tokens"),
    ("directory", "is a directory: give a text file inside it"),
    ("too-short", "3 bytes, need at least --seq-len = 16: give a longer file or a smaller --seq-len"),
])  # fmt: skip
def test_an_unusable_data_file_is_named_with_the_fix(tmp_path: Path, kind: str, expected: str) -> None:
    data = tmp_path / kind
    if kind == "directory":
        data.mkdir()
    elif kind == "too-short":
        data.write_bytes(b"abc")
    err = train_opt_error(tmp_path, "--data", str(data))
    assert f"--data {data}: {expected}" in err and err.count("\n") == 1
