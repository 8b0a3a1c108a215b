"""The code's structure, measured: imports form no cycle and go only downwards; classes and modules stay
small; no module and no test reaches into another object's private attributes.

Every ``import`` in every module of ``twinflow/`` counts, also those inside
functions (they run too) and under ``if TYPE_CHECKING:``.

The checks read files below ``ROOT`` (the checkout this file sits in) and import nothing from it, so a copy
of this file in another checkout measures that checkout. Each checker takes source text, and a test of its
own shows it catching a small example.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator, Set
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "twinflow"


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
            for alias in node.names:  # `from twinflow import ops` imports the module twinflow.host.ops
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
    # portable_state imports the offload at module level, config imports distributed inside a function
    assert "twinflow.base.distributed" in graph()["twinflow.engine.config"]
    assert "twinflow.optim.offload_states" in graph()["twinflow.checkpoint.portable_state"]


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


def test_the_planner_does_not_import_the_optimizer() -> None:
    """ratio='auto' uses twinflow.plan, so the planner (its model and probes) stays below the optimizer. Only the
    command line (``python -m twinflow.tune``, a program above everything) builds optimizers."""
    below = {"twinflow.plan"}
    seen: set[str] = set()
    while below:
        m = below.pop()
        seen.add(m)
        below |= graph()[m] - seen
    assert not {m for m in seen if m.startswith("twinflow.optim")}, sorted(seen)


# --- The sub-packages: one per part of the architecture, stacked ------------------------------------------

MAX_PACKAGE_LEVELS = 8  # the sub-packages (and the modules at the top) over each other
MAX_LEVELS_INSIDE = 6  # the modules inside one sub-package over each other


def part(module: str) -> str:
    """The sub-package a module belongs to (``twinflow.host.ops`` -> ``twinflow.host``); a module at the top,
    ``twinflow`` itself included, is a part of its own."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() else module


def collapse(edges: dict[str, set[str]], unit) -> dict[str, set[str]]:  # noqa: ANN001
    """The graph between the units that `unit` maps modules to (arrows inside a unit dropped)."""
    out: dict[str, set[str]] = {}
    for m, targets in edges.items():
        out.setdefault(unit(m), set()).update(unit(t) for t in targets if unit(t) != unit(m))
    return out


def levels(edges: dict[str, set[str]]) -> dict[str, int]:
    """Each node's level: 1 for a node that imports nothing, else one above the highest it imports (no cycle)."""
    memo: dict[str, int] = {}

    def level(n: str) -> int:
        if n not in memo:
            memo[n] = 1 + max((level(t) for t in edges.get(n, ())), default=0)
        return memo[n]

    return {n: level(n) for n in edges}


def inside(edges: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    members = {m for m in edges if part(m) == package}
    return {m: edges[m] & members for m in members}


def test_the_level_measures_count_floors() -> None:
    assert levels({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}}) == {"a": 3, "b": 2, "c": 1, "d": 2}
    two = {"p.x.a": {"p.y.b"}, "p.y.b": {"p.y.c"}, "p.y.c": set()}
    assert collapse(two, lambda m: m.rpartition(".")[0]) == {"p.x": {"p.y"}, "p.y": set()}


def test_the_sub_packages_form_no_cycle_and_stand_on_few_levels() -> None:
    packages = collapse(graph(), part)
    cycle = find_cycle(packages)
    assert cycle is None, f"the sub-packages import each other in a circle: {' -> '.join(cycle)}"
    floors = levels(packages)
    top = max(floors.values())
    assert top <= MAX_PACKAGE_LEVELS, sorted(floors.items(), key=lambda kv: -kv[1])


@pytest.mark.parametrize("package", sorted({part(m) for m in MODULES if part(m) != m or m == "twinflow"}))
def test_each_sub_package_stands_on_few_levels_inside(package: str) -> None:
    floors = levels(inside(graph(), package))
    assert max(floors.values(), default=0) <= MAX_LEVELS_INSIDE, sorted(floors.items(), key=lambda kv: -kv[1])


# --- Resolved once: a precision or a mode is an object behind an interface, not a string tested where used ---

PRECISION_NAMES = frozenset({"fp32", "int8", "int8_m24"})


def _strings(node: ast.AST) -> set[str]:
    """The string constants of an expression, and of the elements of a tuple, list or set literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_strings(e) for e in node.elts)) if node.elts else set()
    return set()


def _named(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def precision_tests(source: str) -> list[int]:
    """Lines comparing a value with a precision's name ("fp32", "int8", "int8_m24")."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Compare)
                  and any(_strings(x) & PRECISION_NAMES for x in [node.left, *node.comparators]))  # fmt: skip


def mode_parses(source: str) -> list[int]:
    """Lines that read a mode out of a string: a ``*mode*`` name compared with a string or a string's
    ``startswith``/``endswith``, or a dict keyed by strings subscripted with it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any("mode" in _named(x).lower() for x in sides) and any(_strings(x) for x in sides):
                found.append(node.lineno)
        elif isinstance(node, ast.Call) and _named(node.func) in ("startswith", "endswith"):
            if isinstance(node.func, ast.Attribute) and "mode" in _named(node.func.value).lower():
                found.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict) and "mode" in _named(node.slice):
            if any(_strings(k) for k in node.value.keys if k is not None):
                found.append(node.lineno)
    return sorted(found)


def test_the_resolved_once_checks_catch_their_examples() -> None:
    assert precision_tests('a = x == "fp32"\nb = p in ("int8", "int8_m24")\nc = form == "m24"\n') == [1, 2]
    parsed = 'if mode.startswith("spec"):\n    pass\nm = {"exact": 1}[mode]\nok = step_mode is EXACT\n'
    assert mode_parses(parsed + 'x = mode == "delayed"\n') == [1, 3, 5]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith("twinflow.precision")))
def test_no_precision_name_is_compared_outside_the_precision_package(module: str) -> None:
    """A state precision is a :class:`twinflow.precision.state_precision.StatePrecision`, resolved from its name
    where the state is built; the code asks it (``coded_moments``, ``masters24``, ``exact``) instead."""
    lines = precision_tests(MODULES[module].read_text())
    assert not lines, f"{module} compares a precision's name at lines {lines}; ask the StatePrecision instead"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_mode_is_parsed_from_a_string(module: str) -> None:
    """The coordinator hands the CPU side a :class:`twinflow.host.step_record.StepMode`, never a string."""
    lines = mode_parses(MODULES[module].read_text())
    assert not lines, f"{module} reads a mode out of a string at lines {lines}; pass a StepMode"


# --- The checkpoint reads and writes the state through its owner's interface, and only through it ---------

# Where the state's owners and the step's machinery live: the checkpoint imports none of them.
OWNERS_INSIDE = ("twinflow.step", "twinflow.host", "twinflow.device")
# The optimizer's parts behind the interface: its coordinator, the split, the split's sides and their writer.
PAST_THE_OWNER = frozenset({"coordinator", "split", "sides", "host", "device_state", "away", "writer"})


def past_the_owner(source: str, package: str = "twinflow.checkpoint") -> list[tuple[int, str]]:
    """(line, code) where `source` reaches the optimizer's state past
    :class:`twinflow.precision.state_owner.OptimizerState` (``TwinFlowAdam.state_owner``): an attribute of
    ``PAST_THE_OWNER`` (``optimizer.coordinator.split``; a function called by that name, ``weight_master.split(..)``,
    is not one), or an import from a module of ``OWNERS_INSIDE`` (a relative one resolved from `package`)."""
    tree = ast.parse(source)
    split_calls = {
        id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call) and _named(node.func) == "split"
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PAST_THE_OWNER and id(node) not in split_calls:
            found.append((node.lineno, brief(node)))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.startswith(OWNERS_INSIDE)]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from `package`
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            names = [f"{base}.{a.name}" for a in node.names]
            found += [(node.lineno, f"import {n}") for n in names if n.startswith(OWNERS_INSIDE)]
    return sorted(found)


def test_the_owner_check_catches_reaches_past_the_interface() -> None:
    source = """
from twinflow.step.split_state import SplitState
from twinflow.precision.state_owner import RawPart
import twinflow.host.host_state
def f(optimizer, hi, lo):
    split = optimizer.coordinator.split
    owner = optimizer.state_owner
    owner.raw(0), weight_master.split(hi, lo), "a b".split()
    return owner.sides(0), owner.host
"""
    assert past_the_owner(source) == [
        (2, "import twinflow.step.split_state.SplitState"),
        (4, "import twinflow.host.host_state"),
        (6, "optimizer.coordinator"),
        (6, "optimizer.coordinator.split"),
        (9, "owner.host"),
        (9, "owner.sides"),
    ]
    assert past_the_owner("from ..step import split_state\n") == [(1, "import twinflow.step.split_state")]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if part(m) == "twinflow.checkpoint"))
def test_the_checkpoint_reaches_the_state_only_through_its_owner(module: str) -> None:
    """The checkpoint asks ``optimizer.state_owner`` (:class:`twinflow.precision.state_owner.OptimizerState`):
    raw parts, step counts, settling; it never walks the optimizer's coordinator, split or sides."""
    found = past_the_owner(MODULES[module].read_text(encoding="utf-8"))
    where = "".join(f"\n  {rel(MODULES[module])}:{line}: {code}" for line, code in found)
    assert not found, (
        f"{module} reaches the optimizer's state past its owner's interface in {len(found)} places:{where}\n"
        "ask optimizer.state_owner (twinflow.precision.state_owner.OptimizerState), or add what is missing there"
    )


# --- Size: a class fits in one reading, a module holds one job -------------------------------------------

MAX_CLASS_LINES = 300
MAX_MODULE_LINES = 500
CHECKED = sorted(p for d in ("twinflow", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py"))
TESTS = sorted(p for p in (ROOT / "tests").glob("*.py") if p.name != Path(__file__).name)


def rel(path: Path) -> str:
    """`path` as the checkout names it (the test ids and messages)."""
    return path.relative_to(ROOT).as_posix()


def long_classes(source: str, limit: int = MAX_CLASS_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every class in `source`, nested ones too, longer than `limit` lines
    (``class`` line to last line of its body, decorators not counted)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and (lines := node.end_lineno - node.lineno + 1) > limit:
            found.append((node.name, node.lineno, lines))
    return sorted(found, key=lambda c: c[1])


def module_lines(source: str) -> int:
    """Lines of a module, as ``wc -l`` counts them for a file ending in a newline."""
    return len(source.splitlines())


def test_the_class_measure_catches_a_long_class() -> None:
    body = [f"x{i} = {i}" for i in range(MAX_CLASS_LINES - 1)]  # with its `class` line: at the limit
    fits = "".join(f"\n    {line}" for line in body)
    over = "".join(f"\n        {line}" for line in [*body, "y = 0"])
    source = f"class Fits:{fits}\n\ndef f():\n    class Over:{over}\n"
    assert long_classes(source) == [("Over", MAX_CLASS_LINES + 3, MAX_CLASS_LINES + 1)]
    assert long_classes(source, limit=MAX_CLASS_LINES + 1) == []


def test_the_module_measure_counts_lines() -> None:
    assert module_lines("x = 1\n" * (MAX_MODULE_LINES + 1)) == MAX_MODULE_LINES + 1
    assert module_lines("x = 1") == 1


@pytest.mark.parametrize("path", CHECKED, ids=rel)
def test_every_class_is_at_most_300_lines(path: Path) -> None:
    """A class longer than this does more than one job; the optimizer's facade TwinFlowAdam included."""
    over = long_classes(path.read_text(encoding="utf-8"))
    assert not over, "; ".join(
        f"{rel(path)}:{line}: class {name} is {lines} lines, over {MAX_CLASS_LINES}; "
        "move one of its jobs into a class of its own and keep a thin method that delegates"
        for name, line, lines in over
    )


@pytest.mark.parametrize("path", CHECKED, ids=rel)
def test_every_module_is_at_most_500_lines(path: Path) -> None:
    """A module longer than this holds more than one job, and nobody reads it whole."""
    lines = module_lines(path.read_text(encoding="utf-8"))
    assert lines <= MAX_MODULE_LINES, (
        f"{rel(path)} is {lines} lines, over {MAX_MODULE_LINES}; split one of its jobs into a module of its own"
    )


# --- Privacy: an object's underscore attributes are for its own class -----------------------------------

# Private names of torch and Python that the code may use (torch's fused kernels, autograd's task id, the
# extension build folder, a child process's hard exit, ...). They never count, even should twinflow define a
# name of the same spelling; other names from outside count only when twinflow defines them too.
TORCH_PRIVATE = frozenset(
    {"_version", "_C", "_dynamo", "_inductor", "_fused_adam_", "_fused_adamw_", "_current_graph_task_id", "_sleep"}
    | {"_get_build_directory", "_exit", "_getframe"}
)
TORCH_PRIVATE_PREFIXES = ("_foreach_",)
# Calls that reach an attribute by its name in a string: getattr(obj, "_x"), monkeypatch.setattr(obj, "_x", v),
# mock.patch.object(obj, "_x"); and the dotted form monkeypatch.setattr("twinflow.pipeline._x", v).
BY_STRING = frozenset({"getattr", "setattr", "hasattr", "delattr", "object"})
BY_DOTTED_STRING = frozenset({"setattr", "delattr", "patch"})


def is_private(name: str) -> bool:
    """One leading underscore (a dunder such as __init__ is public protocol; a lone _ is no name)."""
    return len(name) > 1 and name[0] == "_" and not (name.startswith("__") and name.endswith("__"))


def from_torch_or_python(name: str) -> bool:
    return name in TORCH_PRIVATE or name.startswith(TORCH_PRIVATE_PREFIXES)


def outside_functions(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of `tree` at module or class level: function bodies (their locals) are skipped."""
    for child in ast.iter_child_nodes(tree):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from outside_functions(child)


def string_arg(call: ast.Call, index: int) -> str | None:
    arg = call.args[index] if len(call.args) > index else None
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def private_names_defined(source: str, on_any_object: bool = True) -> set[str]:
    """The private names `source` gives a meaning to: functions and classes at any depth, names bound at
    module or class level, and attributes it stores: ``self._x = ...``, ``setattr(self, "_x", v)``,
    ``self.__dict__["_x"]`` (``.setdefault``), and with `on_any_object` the same on other objects too
    (``ddp._x = True``: the package marks objects it does not own). Imports define nothing
    (``from twinflow.m import _x`` is a use)."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr if on_any_object or is_own(node.value) else "")
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)) and node.args:
            func, owner = node.func, node.args[0]
            if isinstance(func, ast.Attribute) and func.attr == "setdefault" and is_dict_of(func.value):
                owner, name = func.value.value, string_arg(node, 0)
            elif isinstance(func, ast.Name) and func.id == "setattr":
                name = string_arg(node, 1)
            else:
                continue
            names.add((name or "") if on_any_object or is_own(owner) else "")
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and is_dict_of(node.value):
            key = node.slice.value if isinstance(node.slice, ast.Constant) else ""
            names.add(str(key) if on_any_object or is_own(node.value.value) else "")
    names |= {n.id for n in outside_functions(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return {n for n in names if is_private(n)}


def is_dict_of(node: ast.expr) -> bool:
    """`obj.__dict__`: writing a key of it defines the attribute of that name."""
    return isinstance(node, ast.Attribute) and node.attr == "__dict__"


def is_own(node: ast.expr) -> bool:
    """`self`, `cls` or `super()`: the object whose class the code is part of."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


@functools.cache
def twinflow_private() -> frozenset[str]:
    """Every private name the package defines: the names whose use across objects the checks below count."""
    return frozenset().union(*(private_names_defined(p.read_text(encoding="utf-8")) for p in PACKAGE.rglob("*.py")))


def reached_by_string(call: ast.Call) -> str | None:
    """The attribute name a call reaches through a string on an object other than its own, or None."""
    func = call.func
    called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    dotted = string_arg(call, 0)
    if called in BY_DOTTED_STRING and dotted and "." in dotted:
        return dotted.rpartition(".")[2]
    if called in BY_STRING and call.args and not is_own(call.args[0]):
        return string_arg(call, 1)
    return None


def brief(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."


def private_reads(source: str, names: Set[str]) -> list[tuple[int, str]]:
    """(line, code) for each place `source` touches, on an object other than its own, a private attribute
    whose name is in `names`: ``obj._x`` (read, written or deleted), ``getattr(obj, "_x")`` and the like,
    ``from twinflow.m import _x``. Names on the torch/Python list never count."""
    counted = {n for n in names if not from_torch_or_python(n)}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in counted and not is_own(node.value):
            found.append((node.lineno, f"{brief(node.value)}.{node.attr}"))
        elif isinstance(node, ast.Call) and reached_by_string(node) in counted:
            found.append((node.lineno, f"{brief(node.func)}({', '.join(brief(a) for a in node.args[:2])}, ...)"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "twinflow":
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names if a.name in counted]
    return sorted(found)


def report(path: Path, found: list[tuple[int, str]], fix: str) -> str:
    where = "".join(f"\n  {rel(path)}:{line}: {code}" for line, code in found)
    return f"{rel(path)} touches private attributes of other objects in {len(found)} places:{where}\n{fix}"


def test_the_privacy_check_catches_reads_across_objects() -> None:
    source = """
class Late(Base):
    def step(self, opt, p, t):
        opt._split.x
        self._x, cls._x, super()._g(t)
        p._version, torch._foreach_copy_(a, b), sys._getframe()
        getattr(self, "_split"), getattr(opt, "_split", None), opt._other
def test_pick(monkeypatch):
    monkeypatch.setattr(HostPipeline, "_pick", f)
    monkeypatch.setattr("twinflow.pipeline._pick", f)
    from twinflow.pipeline import _pick
"""
    names = {"_split", "_x", "_g", "_pick", "_version", "_foreach_copy_"}
    assert private_reads(source, names) == [
        (4, "opt._split"),
        (7, "getattr(opt, '_split', ...)"),
        (9, "monkeypatch.setattr(HostPipeline, '_pick', ...)"),
        (10, "monkeypatch.setattr('twinflow.pipeline._pick', f, ...)"),
        (11, "from twinflow.pipeline import _pick"),
    ]


def test_the_definitions_are_collected_at_every_level() -> None:
    source = """
import os as _os
from twinflow.pipeline import _pick
_TABLE, __all__ = {}, []
class _Hidden:
    _slot: int = 0
    def __init__(self, other):
        self._x = 1
        other._y = 2
        setattr(self, "_z", 3)
        setattr(other, "_u", 4)
        self.__dict__.setdefault("_w", 5)
        other.__dict__["_v"] = 6
        _local = 7
def _helper(_arg):
    pass
"""
    own = {"_TABLE", "_Hidden", "_slot", "_x", "_z", "_w", "_helper"}
    assert private_names_defined(source) == own | {"_y", "_u", "_v"}
    assert private_names_defined(source, on_any_object=False) == own
    assert twinflow_private() and all(is_private(n) for n in twinflow_private())


@pytest.mark.parametrize("path", CHECKED, ids=rel)
def test_no_module_reads_private_attributes_of_other_objects(path: Path) -> None:
    """An object's underscore attributes may change with its class; other code asks it through public
    methods and properties. Counted: the private names twinflow itself defines, on any object but the
    code's own (``self``, ``cls``, ``super()``); a module's private functions called by plain name are fine."""
    found = private_reads(path.read_text(encoding="utf-8"), twinflow_private())
    fix = "make what it needs public on the owner (a method or property), or move the code into the owner's class"
    assert not found, report(path, found, fix)


def names_of_tests(source: str, conftest: str | None = None) -> set[str]:
    """Private names a test file may use freely: its own and those of `conftest` (tests/conftest.py when
    None). Only attributes stored on `self` count as its own: ``opt._split = None`` in a test is a use of
    twinflow's name."""
    if conftest is None:
        conftest = (ROOT / "tests" / "conftest.py").read_text(encoding="utf-8")
    return private_names_defined(source, on_any_object=False) | private_names_defined(conftest, on_any_object=False)


def test_a_test_may_use_its_own_private_helpers() -> None:
    source = """
class _Fake:
    def __init__(self):
        self._calls = 0
def test(fake, opt):
    opt._split = None
    fake._calls, opt._split
"""
    conftest = "def _helper():\n    pass\n"
    own = names_of_tests(source, conftest)
    assert own == {"_Fake", "_calls", "_helper"}
    assert private_reads(source + "fake._helper()\n", {"_calls", "_split", "_helper"} - own) == [
        (6, "opt._split"),
        (7, "opt._split"),
    ]


@pytest.mark.parametrize("path", TESTS, ids=rel)
def test_tests_drive_the_public_protocol(path: Path) -> None:
    """A test that reaches into twinflow's private attributes pins the implementation, not the behaviour:
    it breaks on a refactor that keeps every promise, and passes on one that breaks a promise."""
    source = path.read_text(encoding="utf-8")
    found = private_reads(source, twinflow_private() - names_of_tests(source))
    fix = "drive the object through its public methods, or make what the test needs public where it is defined"
    assert not found, report(path, found, fix)
