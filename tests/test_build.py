"""Build diagnostics: a missing tool is named, with how to get it."""

import pytest

from twinflow import ops


def test_missing_tools_are_named(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(ops.shutil, "which", lambda name: None)
    monkeypatch.setitem(__import__("sys").modules, "ninja", None)  # import ninja -> ImportError
    monkeypatch.setattr(ops.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    monkeypatch.setattr(ops, "_CSRC", tmp_path / "csrc")
    problems = "\n".join(ops._missing_build_tools())
    assert "'no-such-compiler' not found" in problems and "apt-get install g++" in problems
    assert "ninja not found: `pip install ninja`" in problems
    assert "Python headers not found" in problems and "python3-dev" in problems
    assert "kernel sources" in problems and "TWINFLOW_BUILD_EXT=1" in problems


def test_build_error_lists_every_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "_missing_build_tools", lambda: ["ninja not found: `pip install ninja`"])
    with pytest.raises(ops.BuildError, match=r"cannot build.*\n  - ninja not found"):
        ops._build_and_load()


def test_toolchain_present_here() -> None:
    assert ops._missing_build_tools() == []
