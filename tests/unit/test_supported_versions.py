"""The supported versions are written once per place and agree everywhere: the floors in
pyproject.toml, the pins of CI's floor environment (.ci/floors.txt), the backends'
`tested_versions` (what `unified env` compares with) and the README's support table."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Dict

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from unified.backend.registry import _DEFAULTS, backend_spec
from unified.launcher.report import version_range_note

REPO = Path(__file__).resolve().parents[2]
TESTED = {dist: (oldest, newest) for name in _DEFAULTS for dist, oldest, newest in backend_spec(name).tested_versions}


def _floors(extra: str) -> Dict[str, Version]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    floors = {}
    for line in project["optional-dependencies"][extra]:
        requirement = Requirement(line)
        bounds = [s for s in requirement.specifier if s.operator == ">="]
        assert len(bounds) == 1, f"{line!r} in the {extra!r} extra needs exactly one >= floor"
        floors[requirement.name] = Version(bounds[0].version)
    return floors


def test_every_built_in_backend_says_what_was_tested():
    for name in _DEFAULTS:
        spec = backend_spec(name)
        assert {dist for dist, _, _ in spec.tested_versions} == set(spec.distributions), name
    for dist, (oldest, newest) in TESTED.items():
        assert Version(oldest) <= Version(newest), dist


@pytest.mark.parametrize("extra", ["torch", "jax", "cuda"])
def test_pyproject_floors_are_the_tested_oldest_versions(extra):
    floors = _floors(extra)
    assert floors, extra
    for dist, floor in floors.items():
        assert dist in TESTED, f"{dist} (extra {extra!r}) has no tested range in its backend's spec"
        assert floor == Version(TESTED[dist][0]), f"pyproject says {dist}>={floor}, the spec {TESTED[dist][0]}"


def test_ci_floor_environment_installs_exactly_the_floors():
    pins = {}
    for line in (REPO / ".ci" / "floors.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            dist, _, version = line.partition("==")
            pins[dist] = version
    assert pins == {dist: TESTED[dist][0] for dist in _floors("jax")}


def test_readme_table_shows_the_tested_ranges():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Supported versions", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for match in re.finditer(r"^\| ([^|]+) \| ([^|]+) \| ([^|]+) \|", section, re.MULTILINE):
        for dist in match.group(1).split(","):
            rows[dist.strip()] = (match.group(2).strip(), match.group(3).strip())
    for dist, tested in TESTED.items():
        assert rows.get(dist) == tested, f"README's support table: {dist} {rows.get(dist)}, tested {tested}"


def test_unified_env_notes_tell_inside_from_outside():
    assert version_range_note("2.13.0+cpu", "2.6.0", "2.13.0") == (True, "tested: 2.6.0 to 2.13.0")
    assert version_range_note("2.6", "2.6.0", "2.13.0")[0]
    inside, note = version_range_note("2.5.1", "2.6.0", "2.13.0")
    assert not inside and note.startswith("OLDER than the oldest tested 2.6.0")
    inside, note = version_range_note("0.11.0", "0.8.2", "0.10.2")
    assert not inside and note.startswith("newer than the newest tested 0.10.2")
    assert version_range_note("not-a-version", "0.8.2", "0.10.2")[0] is False


def test_unified_env_names_a_version_outside_the_tested_range(monkeypatch):
    import unified.launcher.report as report
    from unified.backend import registry

    oldest = TESTED["jax"][0]
    real = report._version
    monkeypatch.setattr(report, "_version", lambda dist: "0.7.1" if dist == "jax" else real(dist))
    monkeypatch.setattr(registry, "available_backends", lambda: [])  # no device lines: no framework import
    lines = report.report().splitlines()
    assert f"- jax: 0.7.1 (OLDER than the oldest tested {oldest} (tested: {oldest} to {TESTED['jax'][1]}))" in lines
    assert "- installed versions inside the tested ranges: no (jax 0.7.1; see the README's support table)" in lines
