"""The benchmark scripts' shared pieces: the markdown tables (benchmarks/mdtable.py) and the
pictures (benchmarks/plot.py), and that every script offers ``--no-picture``."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    """A module of benchmarks/ (not a package), without putting benchmarks/ on sys.path."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mdtable, plot = _load("mdtable"), _load("plot")

SCRIPTS = ["checkpoint", "collectives", "data", "faults", "gil_contention", "loop", "prefetch"]


def test_table_keeps_the_scripts_markdown():
    text = mdtable.table(["framework", "load of", "n"], "llr", [["torch", "ours", 3], ["", "samples (s)", ""]])
    assert text.splitlines() == ["| framework | load of | n |", "|---|---|---:|", "| torch | ours | 3 |",
                                 "| | samples (s) | |"]
    with pytest.raises(ValueError, match="2 letters for 3 columns"):
        mdtable.table(["a", "b", "c"], "lr", [])


def test_spread_cells():
    values = [2.0, 4.0, 3.0]
    assert mdtable.spread(values, 1.5, scale=1e3, digits=1) == ["2000.0", "3000.0", "4000.0", "2.000x"]
    assert mdtable.spread(values, 3.0, spread_digits=1, ratio_digits=2) == ["2.000", "3.000", "4.000", "2.0x", "1.00x"]


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
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{script}.py"), "--help"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--no-picture" in run.stdout
