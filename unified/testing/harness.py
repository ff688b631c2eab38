"""Run scenario functions in a real process group of fresh interpreters and collect results.

Each process runs `unified.testing.worker`, which executes the scenarios in order and writes
one JSON result file per process; the parent asserts across processes, reading results by
scenario. A group's processes are the ones the backend's launcher starts for `unified launch`
(`Launcher.direct_workers`: its rendezvous service and its workers, with its variables), run by
the launcher's own runner (`unified.launcher.processes.ProcessGroup`). Where a launcher hands its workers to
an agent (torch: torchrun), the suite starts them directly as the agent would, to see each
process's exit code and exit time; `launch_group` runs scenarios through the whole `unified
launch`, agent included. Every run has a deadline; on any failure the per-process logs are shown.

Example (in a test)::

    from unified.testing.harness import run_group
    from unified.testing.scenarios import start, identity

    group = run_group("torch", 2, [start, identity], tmp_path)
    assert [r["process_index"] for r in group.scenario(identity)] == [0, 1]
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from unified.backend.registry import backend_spec, load_object
from unified.launcher.launch import free_port
from unified.launcher.plan import Launcher, LaunchPlan
from unified.launcher.processes import ProcessGroup, Worker
from unified.runtime.environment import BACKEND_VARIABLE, IN_PLACE_VARIABLE

from .scenario import missing_requirements, reference, requirements

WORKER_SCRIPT = Path(__file__).with_name("worker.py")  # for `unified launch`, which takes a script path


def _name(function: Union[Callable, str]) -> str:
    """A scenario's key in the results: its function's name (or the name itself)."""
    return function if isinstance(function, str) else function.__name__


def _runnable(backend: str, size: int, scenarios: Sequence[Callable]) -> Tuple[Dict[str, str], List[str]]:
    """The scenarios ``backend`` cannot run (name -> the capability it lacks), and references to
    the others; a scenario not written for groups of ``size`` is an error."""
    for function in scenarios:
        sizes = requirements(function).processes
        if sizes is not None and size not in sizes:
            raise ValueError(f"scenario {function.__name__} is written for groups of {sizes} processes, not {size}")
    not_run = missing_requirements(backend, scenarios)
    return not_run, [reference(f) for f in scenarios if f.__name__ not in not_run]


def _results(out: Path, size: int) -> List[dict]:
    """What each process of a group wrote into ``out`` (``{}`` for one that wrote nothing)."""
    paths = [out / f"result_{rank}.json" for rank in range(size)]
    return [json.loads(path.read_text()) if path.exists() else {} for path in paths]


def _launcher(backend: str) -> Launcher:
    return load_object(backend_spec(backend).launcher)


def _workers(backend: str, size: int, targets: Sequence[str], local_sizes: Sequence[int]) -> List[Worker]:
    """The children `unified launch` starts for a group of ``size`` (one `LaunchPlan` per
    simulated machine of ``local_sizes``) running the worker with ``targets``; one plain
    process, as ``python script.py`` is, when ``size`` is 1."""
    command = ["-m", "unified.testing.worker", *targets]
    if size == 1:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", BACKEND_VARIABLE: backend}
        return [Worker([sys.executable, *command], env, process_index=0)]
    launcher, port = _launcher(backend), free_port()
    workers: List[Worker] = []
    for machine, machine_size in enumerate(local_sizes):
        plan = LaunchPlan(backend, machine_size, len(local_sizes), machine, "127.0.0.1", port, command,
                          machine_sizes=tuple(local_sizes))
        workers += launcher.direct_workers(plan)
    return workers


@dataclass
class GroupResult:
    """What one group left: each process's results (read them by scenario), exit code, log and
    exit time, and the scenarios it did not run for lack of a capability.

    Example:
        >>> group = run_group("jax", 3, [start, identity], tmp_path).ok()   # doctest: +SKIP
        >>> [r["process_index"] for r in group.scenario(identity)]           # doctest: +SKIP
        [0, 1, 2]
    """

    results: List[dict]        # one dict per process: scenario name -> returned value
    returncodes: List[Optional[int]]
    logs: List[str]
    elapsed: float
    exit_times: List[Optional[float]]  # wall-clock time each process exited (None: killed at the deadline)
    not_run: Dict[str, str] = field(default_factory=dict)  # scenario name -> the capability it lacks
    backend: str = ""
    size: int = 0
    shared: Optional[Path] = None  # the folder the scenarios share (UNIFIED_TEST_SHARED)

    def ok(self) -> "GroupResult":
        """This result, after checking that every process exited with 0 (else: every log)."""
        assert all(rc == 0 for rc in self.returncodes), self.show_logs()
        return self

    def show_logs(self) -> str:
        return "\n".join(
            f"----- process {i} (exit code {rc}) -----\n{log}"
            for i, (rc, log) in enumerate(zip(self.returncodes, self.logs))
        )

    def result(self, rank: int, function: Union[Callable, str]) -> Optional[Any]:
        """Process ``rank``'s result of one scenario; ``None`` when it reported none (it died)."""
        return self.results[rank].get(_name(function))

    def scenario(self, function: Union[Callable, str]) -> List[dict]:
        """Every process's result of one scenario (the function, or its name); fails with the
        logs when one is missing, and skips the calling test when the backend cannot run it."""
        name = _name(function)
        if name in self.not_run:
            import pytest

            pytest.skip(self.not_run[name])
        values = []
        for rank, result in enumerate(self.results):
            if name not in result:
                raise AssertionError(f"process {rank} did not report scenario {name!r}\n{self.show_logs()}")
            if isinstance(result[name], dict) and "error" in result[name] and result[name].get("unexpected"):
                raise AssertionError(f"process {rank} failed in {name!r}: {result[name]['error']}\n{self.show_logs()}")
            values.append(result[name])
        return values


class Runs:
    """The results of several groups, read by scenario (from the group that ran it).

    Example:
        >>> runs = Runs(first, second)          # doctest: +SKIP
        >>> runs.scenario(ckpt_resume_run)       # doctest: +SKIP
    """

    def __init__(self, *groups: GroupResult) -> None:
        self.groups = groups

    def scenario(self, function: Union[Callable, str]) -> List[dict]:
        name = _name(function)
        for group in self.groups:
            if name in group.not_run or any(name in result for result in group.results):
                return group.scenario(function)
        raise AssertionError(f"no group ran scenario {name!r}\n" + "\n".join(g.show_logs() for g in self.groups))


def run_group(backend: str, size: int, scenarios: Sequence[Callable], tmp_path: Path, *,
              deadline: float = 120.0, local_sizes: Optional[Sequence[int]] = None,
              extra_env: Optional[Dict[str, str]] = None,
              kill_when: Optional[Path] = None, kill_delay: float = 0.0) -> GroupResult:
    """Run ``scenarios`` (functions decorated with `unified.testing.scenario`) in ``size`` fresh
    processes of ``backend``; never longer than ``deadline``. Scenarios the backend lacks a
    capability for are left out (`GroupResult.not_run`).

    ``tmp_path`` holds the group's logs and results and is the folder the scenarios share
    (``UNIFIED_TEST_SHARED``, unless ``extra_env`` names another).
    ``local_sizes`` splits the processes into simulated machines (e.g. ``[2, 1]``).
    ``kill_when``: once this file exists, wait ``kill_delay`` seconds and SIGKILL every process
    of the group at once (a crash of the whole job).
    """
    local_sizes = list(local_sizes or [size])
    assert sum(local_sizes) == size
    not_run, targets = _runnable(backend, size, scenarios)
    if not targets:  # nothing this backend can run: no processes (reading a result skips the test)
        return GroupResult([{} for _ in range(size)], [0] * size, [""] * size, 0.0, [None] * size, not_run, backend,
                           size, Path(tmp_path))
    out = tmp_path / f"{backend}-{size}-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    workers = _workers(backend, size, targets, local_sizes)
    for worker in workers:
        if worker.process_index is not None:
            # every array a load can read into place is read so (not only those of 1 MiB and more):
            # the two-pass load is what the groups check
            worker.env.update({"UNIFIED_TEST_SHARED": str(tmp_path), IN_PLACE_VARIABLE: "0", **(extra_env or {})})
            worker.env["UNIFIED_TEST_OUT"] = str(out / f"result_{worker.process_index}.json")
    logs = [str(out / (f"log_{w.process_index}.txt" if w.process_index is not None else f"service_{i}.txt"))
            for i, w in enumerate(workers)]
    group = ProcessGroup(workers, logs=logs, cwd=str(out)).start()
    mains = [p for p, w in zip(group.procs, workers) if not w.service]
    start = time.monotonic()
    kill_at: Optional[float] = None
    while time.monotonic() - start < deadline and any(p.poll() is None for p in mains):
        if kill_when is not None and kill_at is None and kill_when.exists():
            kill_at = time.monotonic() + kill_delay
        if kill_at is not None and time.monotonic() >= kill_at:
            group.kill(only=mains)  # a crash of every worker at once
            kill_at = float("inf")
        group.poll()
        time.sleep(0.02)
    group.poll()
    exit_times = [t for t, w in zip(group.exit_times, workers) if not w.service]  # None: still running
    group.stop(only=mains)  # the launcher's escalation: SIGTERM, SIGKILL after its grace
    elapsed = time.monotonic() - start
    group.stop(first=signal.SIGKILL)  # the rendezvous service, which outlived every worker
    return GroupResult(_results(out, size), [p.returncode for p in mains],
                       [(out / f"log_{r}.txt").read_text(errors="replace") for r in range(size)], elapsed,
                       exit_times, not_run, backend, size, Path(tmp_path))


def launch_group(backend: str, size: int, scenarios: Sequence[Callable], tmp_path: Path, *,
                 deadline: float = 180.0) -> GroupResult:
    """Run ``scenarios`` as a user's job runs: ``unified launch -n size --backend backend``, with
    the backend's whole launcher (torch: torchrun's agent) between us and the processes.

    Each process's log is its labelled lines of the launcher's output; each process's exit code
    is the launcher's (an agent does not pass them on one by one), and so is its exit time.

    Example:
        >>> group = launch_group("torch", 2, [start, identity], tmp_path).ok()   # doctest: +SKIP
    """
    not_run, targets = _runnable(backend, size, scenarios)
    out = tmp_path / f"launched-{backend}-{size}-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    argv = [sys.executable, "-m", "unified", "launch", "-n", str(size), "--backend", backend, str(WORKER_SCRIPT),
            *targets]
    env = {**os.environ, "UNIFIED_TEST_SHARED": str(tmp_path), "UNIFIED_TEST_OUT": str(out / "result_{process}.json")}
    launcher = ProcessGroup([Worker(argv, env)], logs=[str(out / "launch.txt")], cwd=str(out)).start()
    start = time.monotonic()
    code = launcher.wait(deadline=start + deadline)[0]
    launcher.stop()
    elapsed = time.monotonic() - start
    text = (out / "launch.txt").read_text(errors="replace")
    logs = ["\n".join(line for line in text.splitlines() if line.startswith(f"[{r}] ")) for r in range(size)]
    logs[0] = text  # process 0's log shows the launcher's own lines too
    return GroupResult(_results(out, size), [code] * size, logs, elapsed, [launcher.exit_times[0]] * size, not_run,
                       backend, size, Path(tmp_path))
