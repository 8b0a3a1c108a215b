"""Build diagnostics: a missing tool is named, with how to get it."""

import logging
import re
import threading
from collections.abc import Callable

import pytest

from twinflow.host import ops


def test_missing_tools_are_named(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(ops.shutil, "which", lambda name: None)
    monkeypatch.setitem(__import__("sys").modules, "ninja", None)  # import ninja -> ImportError
    monkeypatch.setattr(ops.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    monkeypatch.setattr(ops, "CSRC", tmp_path / "csrc")
    problems = "\n".join(ops.missing_build_tools())
    assert "'no-such-compiler' not found" in problems and "apt-get install g++" in problems
    assert "ninja not found: `pip install ninja`" in problems
    assert "Python headers not found" in problems and "python3-dev" in problems
    assert "kernel sources" in problems and "TWINFLOW_BUILD_EXT=1" in problems


def test_build_error_lists_every_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "missing_build_tools", lambda: ["ninja not found: `pip install ninja`"])
    with pytest.raises(ops.BuildError, match=r"cannot build.*\n  - ninja not found"):
        ops.build_and_load()


def test_toolchain_present_here() -> None:
    assert ops.missing_build_tools() == []


def _unloaded(monkeypatch: pytest.MonkeyPatch, build) -> None:
    """The next ops.load() runs `build` instead of finding the already loaded kernel."""
    monkeypatch.setattr(ops, "loaded", False)
    monkeypatch.setattr(ops, "load_prebuilt", lambda: False)
    monkeypatch.setattr(ops, "build_and_load", build)
    monkeypatch.setattr(ops, "register_fakes", lambda: None)


def _no_compiler() -> None:
    raise ops.BuildError("cannot build the twinflow CPU Adam kernel:\n  - C++ compiler 'g++' not found")


@pytest.mark.parametrize("ratio", [0.5, 1.0])
def test_build_error_is_raised_at_construction_as_itself(monkeypatch: pytest.MonkeyPatch, ratio: float) -> None:
    import torch

    from twinflow import CPUAdam, TwinFlowAdam

    params = [torch.nn.Parameter(torch.randn(64, 3)), torch.nn.Parameter(torch.randn(5))]
    _unloaded(monkeypatch, _no_compiler)
    with pytest.raises(ops.BuildError, match="'g\\+\\+' not found"):
        TwinFlowAdam(params, ratio=ratio)
    with pytest.raises(ops.BuildError, match="'g\\+\\+' not found"):
        CPUAdam(params)


def test_no_cpu_share_needs_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from twinflow import TwinFlowAdam

    p = torch.nn.Parameter(torch.randn(8, 8))
    _unloaded(monkeypatch, _no_compiler)
    opt = TwinFlowAdam([p], ratio=0.0)
    p.grad = torch.randn_like(p)
    opt.step()  # the device side alone: no build, no error


def test_build_error_in_the_worker_surfaces_as_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from twinflow import TwinFlowAdam

    p = torch.nn.Parameter(torch.randn(64, 8))
    opt = TwinFlowAdam([p], ratio=1.0)
    p.grad = torch.randn_like(p)

    def failing_kernel(*args, **kwargs) -> None:
        _no_compiler()

    monkeypatch.setattr(ops, "adam_step_", failing_kernel)
    with pytest.raises(ops.BuildError, match="'g\\+\\+' not found"):
        opt.step()


def _notices(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "twinflow.notice" and r.levelno == logging.INFO]


def _announced_compile(monkeypatch: pytest.MonkeyPatch, then: Callable[[], None] | None = None) -> Callable[..., None]:
    """A cpp_extension.load that returns (or runs `then`) once the start notice is out, as a real compile
    outlasts it."""
    started = threading.Event()
    real_notice = ops.notice

    def notice(message: str, *args: object) -> None:
        real_notice(message, *args)
        if message.startswith("compiling"):
            started.set()

    def compile_(**kwargs) -> None:
        assert started.wait(timeout=60), "no notice while the kernel compiled"
        if then is not None:
            then()

    monkeypatch.setattr(ops, "BUILD_NOTICE_AFTER_S", 0.0)
    monkeypatch.setattr(ops, "notice", notice)
    monkeypatch.setattr(ops, "missing_build_tools", lambda: [])
    return compile_


def test_a_slow_build_gives_a_start_notice_and_one_with_its_seconds(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", _announced_compile(monkeypatch))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/some/cache")
    with caplog.at_level(logging.INFO, logger="twinflow.notice"):
        ops.build_and_load()
    first, *rest = _notices(caplog)
    assert first.startswith("compiling the CPU Adam kernel (first use only") and "cached under /some/cache" in first
    assert len(rest) == 1 and re.fullmatch(r"CPU Adam kernel compiled in \d+ s", rest[0]), rest


def test_a_cached_load_gives_no_notice(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from torch.utils import cpp_extension

    loads = []
    monkeypatch.setattr(ops, "BUILD_NOTICE_AFTER_S", 3600.0)  # a cached load ends long before this
    monkeypatch.setattr(ops, "missing_build_tools", lambda: [])
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: loads.append(kwargs["name"]))
    with caplog.at_level(logging.INFO, logger="twinflow.notice"):
        ops.build_and_load()
    assert loads == ["twinflow_cpu_adam"] and _notices(caplog) == []


def test_a_failed_build_gives_no_seconds_notice(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    from torch.utils import cpp_extension

    def fail() -> None:
        raise RuntimeError("error: no such header")

    monkeypatch.setattr(cpp_extension, "load", _announced_compile(monkeypatch, then=fail))
    with caplog.at_level(logging.INFO, logger="twinflow.notice"):
        with pytest.raises(ops.BuildError, match=r"no such header\nSet TWINFLOW_VERBOSE_BUILD=1"):
            ops.build_and_load()
    notices = _notices(caplog)  # the error says what happened; no line claims the kernel compiled
    assert len(notices) == 1 and notices[0].startswith("compiling the CPU Adam kernel"), notices


def test_a_lock_left_by_a_killed_build_is_named_not_waited_for_forever(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path) -> None:  # fmt: skip
    """torch waits forever on a build lock whose builder was killed; twinflow gives up and names the file."""
    from torch.utils import cpp_extension

    lock = tmp_path / "twinflow_cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(ops, "LOCK_WAIT_S", 0.0)
    monkeypatch.setattr(ops, "missing_build_tools", lambda: [])

    def build(**kwargs) -> None:
        raise AssertionError("the build started with the lock still held: torch would wait for it forever")

    monkeypatch.setattr(cpp_extension, "load", build)
    with pytest.raises(ops.BuildError, match=rf"build lock {lock}.*delete that file"):
        ops.build_and_load()
    assert lock.exists()  # never deleted for the user: another build may hold it
