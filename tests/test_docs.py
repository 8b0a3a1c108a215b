"""The documentation's code runs as written, and the site's pages are the ones the docs folder holds.

Every page's Python blocks run in order as one script, in a fresh interpreter, from a scratch folder that sees
the repository's examples/ (pages read its configs, and may write checkpoints where they run).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_a_pages_python_runs_as_written(tmp_path: Path, page: Path) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    script = tmp_path / f"page_{page.stem.replace('-', '_')}.py"  # not named like a module it imports
    script.write_text("\n".join(python_blocks(page)))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_pages_with_code_are_the_ones_expected() -> None:
    """A page that loses its code (or a new page with code) is a change this test makes visible."""
    with_code = {p.name for p in PAGES if python_blocks(p)}
    assert with_code == {"checkpoints.md", "engine.md", "lightning.md", "rl.md"}


def test_the_site_lists_every_page_and_readme_links_resolve() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    assert {p.name for p in PAGES} == set(re.findall(r":\s*([\w-]+\.md)\s*$", config, flags=re.M))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)\)", readme)
    assert links and all((ROOT / link).is_file() for link in links), links
    assert len(readme.splitlines()) <= 200
