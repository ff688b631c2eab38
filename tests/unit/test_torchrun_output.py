"""What `unified launch` shows of torchrun's own output (issue 47): the workers' lines, our own
words for a failure, and none of torchrun's banner, agent log or ChildFailedError traceback,
unless ``--verbose``. The fixture is torchrun 2.13's real output for a process SIGKILLed at
step 37 of examples/crash_and_resume.py, then its next attempt's start (banner included)."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
from backends.torch.launch import TorchrunOutput  # noqa: E402

REPORT = (Path(__file__).parent / "data" / "torchrun_child_failed.txt").read_text().splitlines()


def _shown(output: TorchrunOutput, lines):
    return [shown for shown in map(output.label, lines) if shown is not None]


def test_torchrun_s_failure_report_becomes_one_line_of_ours():
    assert any(line.startswith("Traceback") for line in REPORT) and any("OMP_NUM_THREADS" in line for line in REPORT)
    shown = _shown(TorchrunOutput(first_index=0, script="train.py"), ["[rank1]:worker says hi", *REPORT])
    assert shown == ["[1] worker says hi",
                     "[launcher] torchrun: the first process to fail was process 1, exit code -9 (SIGKILL)"], shown


def test_another_traceback_of_torchrun_s_is_shown_whole():
    lines = ["Traceback (most recent call last):", '  File "run.py", line 1, in <module>',
             "RuntimeError: The server socket has failed to listen on any local network address."]
    assert _shown(TorchrunOutput(0, "train.py"), lines) == ["\n".join(f"[launcher] {line}" for line in lines)]


def test_verbose_shows_everything_as_torchrun_printed_it():
    shown = _shown(TorchrunOutput(4, "train.py", verbose=True), ["[rank0]:x", *REPORT])
    assert shown[0] == "[4] x" and len(shown) == 1 + len(REPORT)
    assert any("ChildFailedError" in line for line in shown)


STOPPED = (Path(__file__).parent / "data" / "torchrun_stopped.txt").read_text().splitlines()


def test_torchrun_stopped_by_the_launcher_shows_no_traceback():
    """A machine whose attempt ended on another machine: our launcher SIGTERMs its torchrun, which
    raises SignalException through its agent. The launcher says so in its own words ("attempt 1
    ended on another machine ...; stopped this machine's processes"); torchrun's traceback of it
    (torchrun 2.13's real output, from CI) is left out. Before, it reached the user's terminal."""
    assert STOPPED[0].startswith("Traceback") and STOPPED[-1].startswith(
        "torch.distributed.elastic.multiprocessing.api.SignalException")
    assert _shown(TorchrunOutput(0, "train.py"), ["[rank0]:x", *STOPPED, "[rank0]:y"]) == ["[0] x", "[0] y"]
    assert len(_shown(TorchrunOutput(0, "train.py", verbose=True), STOPPED)) == len(STOPPED)
