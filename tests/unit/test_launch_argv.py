"""A script's arguments after its path belong to the script (issue 46's regression: since the
launcher's options got a second spelling, ``unified launch -n 1 train.py --preempt`` was refused
as "ambiguous option: --preempt could match --preemption-signals, --preemption_signals")."""
from __future__ import annotations

import pytest

from unified.launcher import cli
from unified.launcher import launch as launch_module


def _prefixes():
    """Every prefix of every launcher option (both spellings), at least one letter after the dashes."""
    options = sorted({o for a in launch_module.build_parser()._actions for o in a.option_strings})
    return sorted({option[:end] for option in options if option.startswith("--")
                   for end in range(3, len(option) + 1)} | {"-n", "-h", "--", "-"})


def _parsed(argv, monkeypatch):
    seen = []
    monkeypatch.setattr(launch_module, "launch", lambda args: seen.append(args) or 0)
    assert cli.main(argv) == 0
    return seen[0]


def test_every_prefix_of_every_launcher_option_after_the_script_is_the_script_s(monkeypatch):
    prefixes = _prefixes()
    assert "--preempt" in prefixes and "--num" in prefixes and "--grace_period" in prefixes
    for flag in prefixes:
        for tail in ([flag], [flag, "3"], [f"{flag}=3"], [flag, "-n", "5", "--", "x"]):
            args = _parsed(["launch", "-n", "1", "train.py", *tail], monkeypatch)
            assert (args.script, args.script_args, args.num_processes) == ("train.py", tail, 1), (flag, tail)


def test_the_launcher_s_options_before_the_script_still_work(monkeypatch):
    args = _parsed(["launch", "--num_processes", "3", "--grace-period=5", "--max-restarts", "2", "train.py", "-n", "7"],
                   monkeypatch)
    assert (args.num_processes, args.grace_period, args.max_restarts) == (3, 5.0, 2)
    assert (args.script, args.script_args) == ("train.py", ["-n", "7"])
    args = _parsed(["launch", "-n", "2", "--", "train.py", "--", "--max-restarts"], monkeypatch)
    assert (args.num_processes, args.script, args.script_args) == (2, "train.py", ["--", "--max-restarts"])


def test_an_abbreviated_launcher_option_is_refused_as_accelerate_launch_does(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _parsed(["launch", "--num", "2", "train.py"], monkeypatch)
    assert "unrecognized arguments: --num" in capsys.readouterr().err
