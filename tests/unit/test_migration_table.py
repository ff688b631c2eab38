"""docs/migration.md's table of Accelerate's surface (issue 24) is the truth: it lists exactly the
public names of Accelerate 1.15's `Accelerator` (`dir()` of the class and what an instance sets;
stored in tests/migration/accelerate_1_15_names.txt, compared with Accelerate itself where it is
installed), every one exists on unified's `Accelerator`, each row says what it means on torch and
on JAX, and the test file a row names really uses the name."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from unified import Accelerator

from .memory_backend import MemoryGroup

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "migration.md"
STORED = ROOT / "tests" / "migration" / "accelerate_1_15_names.txt"
MEANINGS = ("same", "differs", "no-op", "error")


def _rows():
    text = DOC.read_text()
    table = text[text.index("<!-- accelerate-surface:start -->"):text.index("<!-- accelerate-surface:end -->")]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows.append((cells[0].strip("`"), cells[1], cells[2], cells[3].strip("`")))
    return rows


def test_the_table_lists_exactly_accelerates_names_in_order():
    names = [row[0] for row in _rows()]
    assert names == sorted(names)
    assert names == STORED.read_text().split()


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate (the peers extra)")
def test_the_stored_names_are_accelerates_own():
    import accelerate

    if accelerate.__version__ != "1.15.0":
        pytest.skip(f"accelerate {accelerate.__version__} installed; the table is of 1.15.0")
    instance = accelerate.Accelerator(cpu=True)
    theirs = {n for n in dir(accelerate.Accelerator) if not n.startswith("_")} | {
        n for n in vars(instance) if not n.startswith("_")}
    assert sorted(theirs) == STORED.read_text().split()


def test_every_name_exists_on_unified_and_each_row_says_what_it_means():
    acc = MemoryGroup(1).accelerator(0)
    ours = set(dir(Accelerator)) | set(vars(acc))
    for name, torch_meaning, jax_meaning, test_file in _rows():
        assert name in ours, f"{name}: in the table, not on unified.Accelerator"
        for meaning in (torch_meaning, jax_meaning):
            assert meaning.split(":")[0].split(" ")[0] in MEANINGS, f"{name}: {meaning!r}"
        path = ROOT / test_file
        assert path.is_file(), f"{name}: {test_file} does not exist"
        assert re.search(rf"\b{re.escape(name)}\b", path.read_text()), f"{name}: {test_file} does not use it"
