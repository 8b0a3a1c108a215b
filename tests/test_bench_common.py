"""What every benchmark's JSON records of where it ran (benchmarks/common.py): the commit of the tree."""

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def common_at(root: Path):
    """benchmarks/common.py imported from the tree at `root`."""
    spec = importlib.util.spec_from_file_location("common_copy", root / "benchmarks" / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def committed(tree: Path) -> str:
    """`tree` made a git repository with everything in it committed; its HEAD (the test skipped without git)."""
    git = ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t"]
    try:
        subprocess.run([*git, "init", "-q"], check=True)
        subprocess.run([*git, "add", "."], check=True)
        subprocess.run([*git, "commit", "-q", "-m", "c"], check=True)
        return subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no usable git here: {exc}")


def test_a_git_tree_records_its_head_and_whether_tracked_files_differ(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("TWINFLOW_COMMIT", raising=False)
    tree = tmp_path / "tree"
    (tree / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "common.py", tree / "benchmarks")
    head = committed(tree)
    common = common_at(tree)
    assert common.source_commit() == head and common.machine_info()["commit"] == head
    (tree / "untracked.txt").write_text("x")  # not part of the tree: still clean
    assert common.source_commit() == head
    (tree / "benchmarks" / "common.py").write_text((tree / "benchmarks" / "common.py").read_text() + "\n")
    assert common.source_commit() == head + "-dirty"
    monkeypatch.setenv("TWINFLOW_COMMIT", "named")  # the caller's word wins
    assert common.source_commit() == "named"


def test_a_copy_without_git_records_the_commit_its_caller_names(tmp_path: Path, monkeypatch) -> None:
    """Also where the copy lies inside another repository: that one's HEAD is not the copy's commit."""
    outer = tmp_path / "outer"
    copy = outer / "copy"
    (copy / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "common.py", copy / "benchmarks")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no repository above tmp_path is found
    common = common_at(copy)
    monkeypatch.delenv("TWINFLOW_COMMIT", raising=False)
    assert common.source_commit() is None
    committed(outer)
    assert common.source_commit() is None  # the copy lies in outer's repository, which is not its own
    monkeypatch.setenv("TWINFLOW_COMMIT", "0123abc")
    assert common.source_commit() == "0123abc"
