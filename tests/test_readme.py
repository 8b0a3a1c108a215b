"""README's own commands and code, run as written."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _block(marker: str) -> str:
    """The fenced code block between README's `<!-- marker:start -->` and `<!-- marker:end -->`."""
    section = README.split(f"<!-- {marker}:start -->", 1)[1].split(f"<!-- {marker}:end -->", 1)[0]
    return re.search(r"```\w*\n(.*?)```", section, re.S).group(1)


def test_use_snippet_runs_as_written_and_learns() -> None:
    code = _block("use-snippet")
    assert ".cuda()" not in code  # it must run on a CPU as written
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", done.stdout)]
    assert len(losses) == 2 and losses[1] < 0.5 * losses[0], done.stdout
    assert abs(float(done.stdout.split()[-1]) - 0.4) < 0.01  # the achieved ratio


def test_install_commands_use_a_fresh_virtualenv_and_ci_runs_the_test_command_in_one() -> None:
    assert "python3 -m venv" in README and "pip install -e" in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv" in ci and "test-command:start" in ci


def test_test_extra_covers_what_the_suite_imports() -> None:
    """Every third-party module the tests, examples and benchmarks import is installed by `.[test]`."""
    import ast

    setup = (ROOT / "setup.py").read_text()
    extra = re.search(r'"test": \[(.*?)\]', setup, re.S).group(1)
    installed = {re.split(r"[<>=\[]", name.strip().strip('"'))[0] for name in extra.split(",") if name.strip()}
    required = re.search(r"install_requires=\[(.*?)\]", setup, re.S).group(1)
    installed |= {re.split(r"[<>=\[]", name.strip().strip('"'))[0] for name in required.split(",") if name.strip()}
    # optional comparisons the suite never imports at module level: DeepSpeed and torchao run on the GPU machine
    optional = {"deepspeed", "torchao", "matplotlib"}
    local = {"twinflow", "tests", "benchmarks", "examples", "reference"}
    local |= {path.stem for path in (ROOT / "tests").glob("*.py")}  # a worker script imports its sibling by name
    imported: set[str] = set()
    for path in (ROOT / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m not in local | optional}
    assert third_party <= installed | {"torch", "numpy"}, sorted(third_party - installed)
