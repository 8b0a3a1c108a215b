"""The package's structure, measured: imports form no cycle and go only downwards; the optimizer stays small.

Every ``import`` in every module of ``twinflow/`` counts, also those inside
functions (they run too) and under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "twinflow"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def resolve(name: str) -> str | None:
    """The twinflow module that importing `name` runs last (a name inside a module: that module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> list[tuple[str, str]]:
    """(imported twinflow module, the names taken from it) for every import statement of `module`."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(resolve(a.name), "") for a in node.names if a.name.split(".")[0] == "twinflow"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from this module's package
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.split(".")[0] != "twinflow":
                continue
            for alias in node.names:  # `from twinflow import ops` imports the module twinflow.ops
                target = f"{base}.{alias.name}"
                found.append((target, "") if target in MODULES else (resolve(base), alias.name))
    return [(target, name) for target, name in found if target is not None]


def graph() -> dict[str, set[str]]:
    return {m: {target for target, _ in imports_of(m) if target != m} for m in MODULES}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = "open"
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(edges):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_walk_sees_imports_inside_functions() -> None:
    # checkpoint imports the optimizer at module level, config imports distributed inside a function
    assert "twinflow.distributed" in graph()["twinflow.config"]
    assert "twinflow.twin_flow_adam" in graph()["twinflow.checkpoint"]


def test_no_import_cycle() -> None:
    assert find_cycle(graph()) is None, f"import cycle: {' -> '.join(find_cycle(graph()))}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "twinflow"))
def test_no_import_up_into_the_package_init(module: str) -> None:
    """The package's __init__ gathers the public names; a module below it takes nothing from it."""
    up = [name for target, name in imports_of(module) if target == "twinflow"]
    assert not up, f"{module} imports {up} from twinflow/__init__; import them from the module that defines them"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_from_another_module(module: str) -> None:
    private = [f"{t}.{n}" for t, n in imports_of(module) if n.startswith("_") and n != "__version__"]
    assert not private, f"{module} imports private names {private}; make them public where they are defined"


def test_the_optimizer_class_is_a_facade() -> None:
    tree = ast.parse(MODULES["twinflow.twin_flow_adam"].read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TwinFlowAdam"]
    lines = cls.end_lineno - cls.lineno + 1
    assert lines <= 300, f"TwinFlowAdam is {lines} lines; move a job into its own module"


def test_tune_does_not_import_the_optimizer() -> None:
    """ratio='auto' uses twinflow.tune, so tune (its model and probe) stays below the optimizer. Only its
    command line (``python -m twinflow.tune``, a program above everything) builds optimizers."""
    below = {"twinflow.tune"}
    seen: set[str] = set()
    while below:
        m = below.pop()
        seen.add(m)
        below |= graph()[m] - seen
    assert "twinflow.twin_flow_adam" not in seen, sorted(seen)
