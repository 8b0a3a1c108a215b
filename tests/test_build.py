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


def _unloaded(monkeypatch: pytest.MonkeyPatch, build) -> None:
    """The next ops.load() runs `build` instead of finding the already loaded kernel."""
    monkeypatch.setattr(ops, "_loaded", False)
    monkeypatch.setattr(ops, "_load_prebuilt", lambda: False)
    monkeypatch.setattr(ops, "_build_and_load", build)
    monkeypatch.setattr(ops, "_register_fakes", lambda: None)


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


def test_a_slow_build_prints_one_visible_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import threading

    from torch.utils import cpp_extension

    printed = threading.Event()
    real_notice = ops._print_build_notice

    def notice() -> None:
        real_notice()
        printed.set()

    def slow_compile(**kwargs) -> None:  # returns once the notice is out, as a real compile outlasts it
        assert printed.wait(timeout=60), "no build notice while the kernel compiled"

    monkeypatch.setattr(ops, "_BUILD_NOTICE_AFTER_S", 0.0)
    monkeypatch.setattr(ops, "_print_build_notice", notice)
    monkeypatch.setattr(ops, "_missing_build_tools", lambda: [])
    monkeypatch.setattr(cpp_extension, "load", slow_compile)
    ops._build_and_load()
    err = capsys.readouterr().err
    assert err.count("twinflow: compiling the CPU Adam kernel") == 1 and "first use only" in err


def test_a_lock_left_by_a_killed_build_is_named_not_waited_for_forever(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path) -> None:  # fmt: skip
    """torch waits forever on a build lock whose builder was killed; twinflow gives up and names the file."""
    from torch.utils import cpp_extension

    lock = tmp_path / "twinflow_cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(ops, "_LOCK_WAIT_S", 0.0)
    monkeypatch.setattr(ops, "_missing_build_tools", lambda: [])

    def build(**kwargs) -> None:
        raise AssertionError("the build started with the lock still held: torch would wait for it forever")

    monkeypatch.setattr(cpp_extension, "load", build)
    with pytest.raises(ops.BuildError, match=rf"build lock {lock}.*delete that file"):
        ops._build_and_load()
    assert lock.exists()  # never deleted for the user: another build may hold it
