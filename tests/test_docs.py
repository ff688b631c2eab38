"""The documentation site builds without a warning, and the migration page shows the tested script."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS_PACKAGES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


@pytest.mark.skipif(not all(_installed(p) for p in DOCS_PACKAGES),
                    reason="needs the docs extra: pip install -e '.[docs]'")
def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
         "-d", str(tmp_path / "site")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    site = tmp_path / "site"
    for page in ("index.html", "migration/index.html", "reference/index.html", "benchmarks/data/index.html"):
        assert (site / page).is_file(), page
    reference = (site / "reference" / "index.html").read_text()
    for name in ("unified.Accelerator", "unified.ProjectConfiguration", "unified.DataLoader",
                 "unified.skip_first_batches", "unified.BarrierTimeout", "save_state", "load_state"):
        assert name in reference, f"{name} missing from the generated API reference"


def _block(page: str, marker: str) -> str:
    found = re.search(rf"<!-- migration-script:{marker} -->\n```python\n(.*?)```\n", page, re.S)
    assert found, f"docs/migration.md lost its {marker!r} script block"
    return found.group(1)


def test_migration_page_shows_the_tested_script():
    """docs/migration.md shows tests/migration/accelerate_script.py before and after migration."""
    from tests.test_migration import SCRIPT, to_unified

    page = (REPO / "docs" / "migration.md").read_text()
    source = SCRIPT.read_text()
    assert _block(page, "before") == source, "update the 'Before' block of docs/migration.md"
    assert _block(page, "after") == to_unified(source), "update the 'After' block of docs/migration.md"
