import builtins
import errno
import os
from pathlib import Path

import pytest
import torch

from twinflow.host import ops

# Test modules whose verdicts cannot depend on the kernel's SIMD path: they never step the kernel (or replace it),
# or they check wiring (a script's output, a config error, the benchmark harness) without comparing the numbers
# of the run. Every other test that does not take the `simd` fixture (which runs every path this CPU has) is
# marked `kernel_path`, and CI runs those again on each path below the CPU's best (.ci/run). A new module is
# path-dependent until it is listed here.
PATH_INDEPENDENT_MODULES = frozenset({
    "test_bench_train", "test_build", "test_config", "test_examples", "test_partition", "test_progress", "test_readme",
    "test_structure", "test_train_opt_errors", "test_tune_cli", "test_weight_master",
})  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "simd" not in getattr(item, "fixturenames", ()) and item.path.stem not in PATH_INDEPENDENT_MODULES:
            item.add_marker(pytest.mark.kernel_path)
    if torch.cuda.device_count() < 2:
        skip_multigpu = pytest.mark.skip(reason="needs two or more CUDA GPUs (NCCL)")
        for item in items:
            if "multigpu" in item.keywords:
                item.add_marker(skip_multigpu)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _built_kernel() -> None:
    ops.load()  # build once, before any test times or threads anything


def simd_paths() -> list[str]:
    """Every kernel path this CPU can run (all three on an AVX-512 machine)."""
    ops.load()
    return [name for name, level in ops.SIMD_LEVELS.items() if level <= ops.cpu_simd_level()]


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def simd(request: pytest.FixtureRequest) -> str:
    if request.param not in simd_paths():
        pytest.skip(f"this CPU lacks {request.param}")
    return request.param


@pytest.fixture
def lazy_cpu_side(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU worker steps a chunk only once the main thread has waited for it (or for a later one).

    A weight read before the wait that covers it is therefore always the old
    one, never a race that a fast worker happens to win: a missing wait fails
    every run, with no sleeps. Waits come from ``HostSide.wait`` (the forward
    pre-hooks, and ``finish()``), so code that waits correctly runs as before,
    only later. A delayed step's late job runs only once ``flush()`` (or
    ``drop_for()``) asks for it, after the next step's gradients have landed.
    The worker's gate (``CpuExecutor.gate``) holds the jobs back.
    """
    from twinflow.host.host_modes import DelayedMode
    from twinflow.host.host_side import HostSide
    from twinflow.host.step_record import Phase

    asked: dict[int, int] = {}  # id(host) -> the highest chunk waited for in this step
    late_asked: dict[int, int] = {}  # id(host) -> the delayed steps whose late job was asked for

    def gate_of(host: HostSide):
        def gate(job) -> bool:
            if job.kind == "chunk":
                return job.chunk <= asked.get(id(host), -1)
            if job.kind == "late":
                return late_asked.get(id(host), 0) >= host.delayed.late_jobs
            return True

        return gate

    original_open, original_wait = HostSide.open, HostSide.wait

    def open_(self, args=None, mode: str = "exact") -> None:
        original_open(self, args, mode)
        with self.executor.condition:
            asked[id(self)] = -1  # no chunk of the new step waited for yet
            self.executor.gate = gate_of(self)

    def wait(self, chunk_ids: list[int]) -> None:
        if self.phase is Phase.SEALED and chunk_ids:
            with self.executor.condition:
                asked[id(self)] = max(asked.get(id(self), -1), max(chunk_ids))
                self.executor.condition.notify_all()
        original_wait(self, chunk_ids)

    original_flush, original_drop = DelayedMode.flush, DelayedMode.drop_for

    def ask_late(mode: DelayedMode) -> None:
        with mode.host.executor.condition:
            late_asked[id(mode.host)] = mode.late_jobs
            mode.host.executor.condition.notify_all()

    def flush(self, wait: bool = True) -> None:
        ask_late(self)
        original_flush(self, wait)

    def drop_for(self, moved: set[int], why: str) -> None:
        ask_late(self)
        original_drop(self, moved, why)

    monkeypatch.setattr(HostSide, "open", open_)
    monkeypatch.setattr(HostSide, "wait", wait)
    monkeypatch.setattr(DelayedMode, "flush", flush)
    monkeypatch.setattr(DelayedMode, "drop_for", drop_for)


@pytest.fixture
def unwritable(monkeypatch: pytest.MonkeyPatch):
    """Makes a folder unwritable: its permission bits, and where they do not stop this process, refused creations."""
    made: list[Path] = []

    def refuse(path) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))

    def make(folder: Path) -> None:
        folder.chmod(0o555)
        made.append(folder)
        try:
            (folder / "probe").touch()
        except PermissionError:
            return  # the bits stop this process
        (folder / "probe").unlink()  # they do not (root): refuse what the kernel would refuse another user
        real_open, real_mkdir = builtins.open, os.mkdir

        def open_(file, mode="r", *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and Path(file).parent == folder and set(mode) & set("wax+"):
                refuse(file)
            return real_open(file, mode, *args, **kwargs)

        def mkdir(path, *args, **kwargs) -> None:
            if Path(path).parent == folder:
                refuse(path)
            real_mkdir(path, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(os, "mkdir", mkdir)

    yield make
    for folder in made:
        folder.chmod(0o755)
