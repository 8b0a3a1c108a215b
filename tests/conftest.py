import pytest
import torch

from twinflow import ops

# Test modules whose verdicts cannot depend on the kernel's SIMD path: they never step the kernel (or replace it),
# or they check wiring (a script's output, a config error, the benchmark harness) without comparing the numbers
# of the run. Every other test that does not take the `simd` fixture (which runs every path this CPU has) is
# marked `kernel_path`, and CI runs those again on each path below the CPU's best (.ci/run). A new module is
# path-dependent until it is listed here.
PATH_INDEPENDENT_MODULES = frozenset({
    "test_bench_train", "test_build", "test_config", "test_examples", "test_partition", "test_readme",
    "test_structure", "test_train_opt_errors", "test_tune_cli",
})  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "simd" not in getattr(item, "fixturenames", ()) and item.path.stem not in PATH_INDEPENDENT_MODULES:
            item.add_marker(pytest.mark.kernel_path)
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
    every run, with no sleeps. Waits come from ``HostPipeline.wait`` (the
    forward pre-hooks, and ``finish()``), so code that waits correctly runs
    as before, only later. A delayed step's late job runs only once
    ``flush()`` waits for it, after the next step's gradients have landed.
    """
    from twinflow.pipeline import HostPipeline

    original_open, original_wait = HostPipeline.open, HostPipeline.wait

    def open_(self, args=None, speculative: bool = False) -> None:
        original_open(self, args, speculative)
        with self._cond:
            self._asked = -1  # no chunk of the new step waited for yet

    def wait(self, chunk_ids: list[int]) -> None:
        if self.phase == "sealed" and chunk_ids:
            with self._cond:
                self._asked = max(getattr(self, "_asked", -1), max(chunk_ids))
                self._cond.notify_all()
        original_wait(self, chunk_ids)

    def pick(self) -> int:  # called with the lock held, once a chunk is ready; lowest waited-for first
        while True:
            if self._stop and not (self._ready and self._args is not None):
                raise SystemExit  # close() while nothing is left to run: the thread ends quietly
            asked = [k for k in self._ready if k <= getattr(self, "_asked", -1)]
            if self._args is not None and (asked or self._stop):
                k = min(asked or self._ready)
                self._ready.remove(k)
                return k
            self._cond.wait()

    # A delayed step's late job runs only once flush() (the next delayed step, or settle()) waits for it.
    original_flush, original_drop = HostPipeline.flush, HostPipeline.drop_late_for

    def ask_late(self) -> None:
        with self._cond:
            self._late_asked = self.late_jobs
            self._cond.notify_all()

    def flush(self, wait: bool = True) -> None:
        ask_late(self)
        original_flush(self, wait)

    def drop_late_for(self, moved: set[int]) -> None:
        ask_late(self)
        original_drop(self, moved)

    def pick_late(self) -> int:  # called with the lock held, once the late job has chunks left
        while getattr(self, "_late_asked", 0) < self.late_jobs and not self._stop:
            self._cond.wait()  # on close() the chunk runs at once, as without this fixture
        return self._late.pop(0)

    monkeypatch.setattr(HostPipeline, "open", open_)
    monkeypatch.setattr(HostPipeline, "wait", wait)
    monkeypatch.setattr(HostPipeline, "_pick", pick)
    monkeypatch.setattr(HostPipeline, "flush", flush)
    monkeypatch.setattr(HostPipeline, "drop_late_for", drop_late_for)
    monkeypatch.setattr(HostPipeline, "_pick_late", pick_late)
