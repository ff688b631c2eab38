"""Preemption without a process group: the signal flag, check_trigger, exit_if_preempted, the
variable, and the launcher's exit status from its workers' exit codes and statuses (small plain
Python children, no framework)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

import unified
from unified.launcher import launch as launch_module
from unified.launcher.processes import Worker, run_group
from unified.runtime.preemption import (
    HANDLE_VARIABLE,
    PREEMPTED_EXIT_CODE,
    STATUS_DIR_VARIABLE,
    read_statuses,
    record_status,
    resolve_handle_preemption,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")


def _accelerator_script(body: str, **env: str) -> subprocess.CompletedProcess:
    code = "import os, signal, sys, unified\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "UNIFIED_BACKEND": "torch", **env})


def test_without_handle_preemption_a_signal_keeps_its_default_action():
    run = _accelerator_script("""
        acc = unified.Accelerator()
        print(acc.handle_preemption, signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        print("survived", flush=True)
    """)
    assert run.stdout.split() == ["False", "True"], run.stdout + run.stderr
    assert run.returncode == -signal.SIGTERM


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_fires_the_trigger_once_sets_preempted_and_exits_75(sig):
    run = _accelerator_script(f"""
        acc = unified.Accelerator(handle_preemption=True)
        seen = [acc.check_trigger(), acc.preempted]
        acc.set_trigger()
        seen += [acc.check_trigger(), acc.preempted]       # the user's trigger is not a preemption
        os.kill(os.getpid(), {int(sig)})
        seen += [acc.check_trigger(), acc.preempted, acc.check_trigger()]
        print(seen, flush=True)
        try:
            acc.exit_if_preempted()
        finally:
            print("ended", acc._ended, flush=True)
    """)
    lines = run.stdout.splitlines()
    assert lines == ["[False, False, True, False, True, True, True]", "ended True"], run.stdout + run.stderr
    assert run.returncode == PREEMPTED_EXIT_CODE == unified.PREEMPTED_EXIT_CODE == 75


def test_the_variable_switches_it_on_and_exit_if_preempted_is_a_no_op_otherwise():
    run = _accelerator_script("""
        acc = unified.Accelerator()
        acc.exit_if_preempted()
        print(acc.handle_preemption, signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None), flush=True)
    """, **{HANDLE_VARIABLE: "1"})
    assert run.returncode == 0 and run.stdout.split() == ["True", "True"], run.stdout + run.stderr


def test_resolve_handle_preemption(monkeypatch):
    monkeypatch.delenv(HANDLE_VARIABLE, raising=False)
    assert resolve_handle_preemption(None) is False and resolve_handle_preemption(True) is True
    monkeypatch.setenv(HANDLE_VARIABLE, "off")
    assert resolve_handle_preemption(None) is False
    monkeypatch.setenv(HANDLE_VARIABLE, "maybe")
    with pytest.raises(ValueError, match="UNIFIED_HANDLE_PREEMPTION"):
        resolve_handle_preemption(None)


def test_handle_preemption_outside_the_main_thread_is_a_clear_error():
    from unified.runtime.preemption import SignalFlag

    errors = []
    previous, SignalFlag._instance = SignalFlag._instance, None
    try:
        thread = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, SignalFlag.install)))
        thread.start()
        thread.join()
    finally:
        SignalFlag._instance = previous
    assert "main thread" in str(errors[0].value)


def test_statuses_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv(STATUS_DIR_VARIABLE, str(tmp_path))
    record_status("preempted", 3)
    record_status("broken", 4)
    record_status("preempted", 9)  # another machine's process: not asked about
    assert read_statuses(str(tmp_path), [3, 4]) == {"preempted": [3], "broken": [4]}
    monkeypatch.delenv(STATUS_DIR_VARIABLE)
    record_status("preempted", 5)  # no launcher: nothing, no error


# -- the launcher's exit status ------------------------------------------------------------------
def _worker(index: int, body: str, agent: bool = False) -> Worker:
    code = f"import os, sys, time\nINDEX = {index}\n" + textwrap.dedent(body)
    return Worker([sys.executable, "-c", code], dict(os.environ), agent=agent)


MARK = "open(os.path.join(os.environ['UNIFIED_STATUS_DIR'], f'{KIND}-{INDEX}'), 'w').close()\n"


def _mark(kind: str) -> str:
    return MARK.replace("{KIND}", kind)


def test_the_launcher_exits_75_when_every_worker_exited_preempted():
    body = _mark("preempted") + "sys.exit(75)\n"
    assert run_group([_worker(0, body), _worker(1, body)], process_indices=[0, 1]) == PREEMPTED_EXIT_CODE


def test_the_launcher_reads_the_statuses_behind_an_agent():
    """torchrun summarises its workers' exit codes 75 as 1: the statuses decide."""
    body = "INDEX = 0\n" + _mark("preempted") + "INDEX = 1\n" + _mark("preempted") + "sys.exit(1)\n"
    assert run_group([_worker(0, body, agent=True)], process_indices=[0, 1]) == PREEMPTED_EXIT_CODE
    half = "INDEX = 0\n" + _mark("preempted") + "sys.exit(1)\n"
    assert run_group([_worker(0, half, agent=True)], process_indices=[0, 1]) == 1


def test_a_preempted_worker_gives_the_others_the_grace_period_to_finish(tmp_path):
    """The first worker's exit 75 does not stop the one still saving (SIGTERM would end it)."""
    first = _mark("preempted") + "sys.exit(75)\n"
    slow = (f"time.sleep(1.5)\nopen({str(tmp_path / 'finished')!r}, 'w').close()\n" + _mark("preempted")
            + "sys.exit(75)\n")
    assert run_group([_worker(0, first), _worker(1, slow)], process_indices=[0, 1], grace_period=30) == 75
    assert (tmp_path / "finished").exists()


def test_preempted_beside_a_failure_is_the_failure():
    preempted = _mark("preempted") + "sys.exit(75)\n"
    assert run_group([_worker(0, preempted), _worker(1, "sys.exit(3)\n")], process_indices=[0, 1]) == 3


def test_a_group_that_broke_never_exits_0(capfd):
    """Every worker caught the error and exited 0, one reported the break: the launcher says 1
    (before the status folder it said 0)."""
    broken = _mark("broken")
    code = run_group([_worker(0, broken), _worker(1, "pass\n")], process_indices=[0, 1])
    assert code == 1
    assert "the process group broke" in capfd.readouterr().err
    assert run_group([_worker(0, "pass\n"), _worker(1, "pass\n")], process_indices=[0, 1]) == 0


def _launch_refuses(tmp_path, flags, match):
    """`unified launch FLAGS script` exits with a message matching ``match`` before starting anything."""
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(SystemExit, match=match):
        launch_module.launch(launch_module.build_parser().parse_args([*flags, str(script)]))


def test_grace_period_must_not_be_negative(tmp_path):
    _launch_refuses(tmp_path, ["--grace-period", "-1"], "grace-period")


def test_preemption_signals_are_named_by_argument_or_variable_and_uncatchable_ones_refused(monkeypatch):
    from unified.runtime.preemption import SIGNALS_VARIABLE, resolve_preemption_signals

    monkeypatch.delenv(SIGNALS_VARIABLE, raising=False)
    assert resolve_preemption_signals() == (signal.SIGTERM, signal.SIGUSR1)  # the default, unchanged
    assert resolve_preemption_signals(["USR2", int(signal.SIGTERM), "sigusr2"]) == (signal.SIGUSR2, signal.SIGTERM)
    monkeypatch.setenv(SIGNALS_VARIABLE, "SIGTERM, SIGUSR2")
    assert resolve_preemption_signals() == (signal.SIGTERM, signal.SIGUSR2)
    assert resolve_preemption_signals("SIGUSR1") == (signal.SIGUSR1,)  # the argument wins
    with pytest.raises(ValueError, match="Unknown preemption signal 'SIGNOPE'.*#preemption-signals"):
        resolve_preemption_signals("SIGNOPE")
    with pytest.raises(ValueError, match="SIGKILL cannot announce a preemption"):
        resolve_preemption_signals("SIGTERM,SIGKILL")


def test_a_configured_signal_fires_the_trigger_and_the_default_ones_keep_their_action():
    run = _accelerator_script("""
        acc = unified.Accelerator(handle_preemption=True, preemption_signals="SIGUSR2")
        print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
        os.kill(os.getpid(), signal.SIGUSR2)
        print(acc.check_trigger(), acc.preempted, flush=True)
    """)
    assert run.stdout.split() == ["True", "True", "True"], run.stdout + run.stderr


def test_the_launcher_refuses_an_unknown_preemption_signal(tmp_path):
    _launch_refuses(tmp_path, ["--preemption-signals", "SIGWHAT"],
                    "--preemption-signals: Unknown preemption signal 'SIGWHAT'")


def test_the_launcher_forwards_a_configured_signal_and_its_workers_count_it(tmp_path):
    """`unified launch --preemption-signals SIGUSR2`: the launcher forwards SIGUSR2 to the workers
    with the grace period (not a stop), and sets the variable their Accelerators read."""
    from unified.runtime.preemption import SIGNALS_VARIABLE

    ready = tmp_path / "ready"
    body = textwrap.dedent(f"""
        import os, signal, sys, time
        print(os.environ.get({SIGNALS_VARIABLE!r}), flush=True)
        got = []
        signal.signal(signal.SIGUSR2, lambda *_: got.append(1))
        open({str(ready)!r}, "w").close()
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            time.sleep(0.02)
        print("worker got SIGUSR2" if got else "worker got nothing", flush=True)
        sys.exit(0 if got else 1)
    """)
    script = tmp_path / "w.py"
    script.write_text(body)
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys
        from unified.launcher import launch
        from unified.launcher.processes import Worker, run_group_outcome
        from unified.runtime.preemption import resolve_preemption_signals, signal_names
        signals = resolve_preemption_signals("SIGUSR2")
        os.environ[{SIGNALS_VARIABLE!r}] = signal_names(signals)
        code, outcome = run_group_outcome([Worker([sys.executable, {str(script)!r}], dict(os.environ))],
                                          grace_period=30, preemption_signals=signals)
        print("outcome", code, outcome, flush=True)
    """)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = __import__("time").monotonic() + 60
    while not ready.exists() and __import__("time").monotonic() < deadline:
        __import__("time").sleep(0.02)
    launcher.send_signal(signal.SIGUSR2)
    out, _ = launcher.communicate(timeout=60)
    # forwarded, not a stop: the worker ran its handler and ended on its own within the grace period
    assert out.splitlines()[0] == "SIGUSR2" and "worker got SIGUSR2" in out and "outcome 0 " in out, out
