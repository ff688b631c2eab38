"""`unified.tqdm` into a log or a pipe: whole lines, first and last state, at most one line per
interval (also for set_postfix); tqdm's own bar on a terminal. Through the launcher:
tests/test_launcher.py."""
from __future__ import annotations

import io
import time

import pytest

import unified
from unified.logging import PROGRESS_INTERVAL


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(file, steps=40, **kwargs):
    bar = unified.tqdm(range(steps), file=file, desc="bar", **kwargs)
    for step in bar:
        bar.set_postfix(step=step)   # tqdm redraws at every call
        time.sleep(0.003)
    return file.getvalue()


def test_a_bar_into_a_file_prints_its_first_and_last_state_as_lines(monkeypatch):
    monkeypatch.delenv("TQDM_MININTERVAL", raising=False)
    out = _run(io.StringIO())
    assert "\r" not in out
    lines = out.splitlines()
    assert len(lines) == 2 and out.endswith("\n"), lines
    assert "| 0/40" in lines[0] and "| 40/40" in lines[1] and "step=39" in lines[1]
    assert PROGRESS_INTERVAL == 30.0


def test_the_interval_comes_from_mininterval_or_tqdm_s_variable(monkeypatch):
    monkeypatch.delenv("TQDM_MININTERVAL", raising=False)
    every = _run(io.StringIO(), steps=5, mininterval=0)
    assert len(every.splitlines()) >= 2 * 5  # a line per redraw: the rate limit is what keeps logs short
    monkeypatch.setenv("TQDM_MININTERVAL", "0")
    assert len(_run(io.StringIO(), steps=5).splitlines()) >= 2 * 5


def test_messages_and_leave_false_write_nothing_extra(monkeypatch):
    monkeypatch.delenv("TQDM_MININTERVAL", raising=False)
    file = io.StringIO()
    with unified.tqdm(total=3, file=file, leave=False) as bar:
        bar.update(1)
        bar.write("note", file=file)
        bar.update(2)
    assert file.getvalue().splitlines()[1:] == ["note"]  # no erasing "\r", no final line


def test_on_a_terminal_it_is_tqdm_s_redrawn_bar_and_silent_off_the_main_process(monkeypatch):
    out = _run(Terminal())
    assert out.count("\r") > 2 and type(unified.tqdm(total=1, file=Terminal())).__name__ == "tqdm_asyncio"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _run(io.StringIO()) == ""
    assert _run(io.StringIO(), main_process_only=False) != ""


@pytest.mark.parametrize("file", [io.StringIO()])
def test_a_closed_or_odd_stream_counts_as_not_a_terminal(file):
    file.close()
    from unified.logging import _is_terminal

    assert _is_terminal(file) is False and _is_terminal(object()) is False
