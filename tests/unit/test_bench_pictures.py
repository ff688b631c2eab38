"""The benchmarks' shared pieces: the runner (interleaved rounds, the statistics cells, the
markdown tables: benchmarks/runner.py) and the pictures (benchmarks/plot.py); that every script
offers ``--no-picture``; and that benchmarks/ is a package whose modules edit no ``sys.path``."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import plot, runner

REPO = Path(__file__).resolve().parents[2]

SCRIPTS = ["benchmarks.checkpoint", "benchmarks.collectives", "benchmarks.data", "benchmarks.gil_contention",
           "benchmarks.loop", "benchmarks.prefetch", "tests.faults"]


def test_table_keeps_the_scripts_markdown():
    text = runner.table(["framework", "load of", "n"], "llr", [["torch", "ours", 3], ["", "samples (s)", ""]])
    assert text.splitlines() == ["| framework | load of | n |", "|---|---|---:|", "| torch | ours | 3 |",
                                 "| | samples (s) | |"]
    with pytest.raises(ValueError, match="2 letters for 3 columns"):
        runner.table(["a", "b", "c"], "lr", [])


def test_cells():
    values = [2.0, 4.0, 3.0]
    assert runner.cells(values, "min median max ratio", 1.5, scale=1e3, digits=1) == ["2000.0", "3000.0", "4000.0",
                                                                                       "2.000x"]
    assert runner.cells(values, "min median max spread ratio", 3.0, ratio_digits=2) == ["2.000", "3.000", "4.000",
                                                                                         "2.0x", "1.00x"]
    assert runner.cells(values, "median min-max range", digits=2) == ["3.00", "2.00-4.00", "2.00"]


def test_interleaved_warms_up_then_rotates_and_times_what_returns_nothing(monkeypatch):
    calls, collected = [], []
    monkeypatch.setattr(runner.gc, "collect", lambda: collected.append(len(calls)))
    got = runner.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b") or 7.0,
                              "c": lambda: calls.append("c") or {"x": 1}}, 3, warmup=2)
    assert calls == ["a", "a", "b", "b", "c", "c"] + ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert collected == list(range(len(calls)))  # a collection before every call, none inside one
    assert got["b"] == [7.0] * 3 and got["c"] == [{"x": 1}] * 3
    assert len(got["a"]) == 3 and all(isinstance(s, float) and s >= 0 for s in got["a"])
    assert runner.columns(got["c"]) == {"x": [1, 1, 1]}


def test_a_part_result_is_found_in_its_output():
    assert runner.result_in("noise\n" + runner.MARKER + '{"a": 1}\n') == {"a": 1}
    assert runner.result_in(f"[1] x\n[0] {runner.MARKER}[2, 3]\n") == [2, 3]
    assert runner.result_in("nothing") is None


def test_draw_without_matplotlib_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = tmp_path / "x.png"
    assert plot.draw(str(out), "t", "s", {"g": {"ours": [1.0]}}) is None
    assert not out.exists()
    assert "pip install -e '.[bench]'" in capsys.readouterr().err


def test_draw_writes_a_png_and_skips_empty_groups(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "img" / "x.png"
    samples = {"torch": {"ours": [1.0, 1.2, 0.9], "raw": [0.8, 0.85]}, "jax": {"ours": [2.0], "raw": []},
               "not run": {"ours": []}}
    assert plot.draw(str(out), "t", "s", samples, labels={"torch": {"ours": "3/3"}}, log=True) == out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.draw(str(tmp_path / "none.png"), "t", "s", {"not run": {"ours": []}}) is None
    assert not (tmp_path / "none.png").exists()


def test_image_paths():
    assert plot.image("data", "skip") == REPO / "docs" / "benchmarks" / "img" / "data-skip.png"
    assert plot.image("loop") == REPO / "docs" / "benchmarks" / "img" / "loop.png"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_offers_no_picture(script):
    run = subprocess.run([sys.executable, "-m", script, "--help"], cwd=REPO, env=dict(os.environ),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--no-picture" in run.stdout


def test_benchmarks_are_a_package_that_edits_no_import_path():
    """Each benchmark imports the others' public names as ``benchmarks.<module>`` (run as
    ``python -m benchmarks.<name>``): none edits ``sys.path`` or imports another's private name."""
    assert (REPO / "benchmarks" / "__init__.py").exists()
    offenders = []
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                offenders.append(f"{path.name}:{node.lineno}: sys.path")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks"):
                offenders += [f"{path.name}:{node.lineno}: {alias.name}" for alias in node.names
                              if alias.name.startswith("_")]
    assert not offenders, "\n".join(offenders)
