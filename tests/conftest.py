import pytest
import torch

from twinflow import ops


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
