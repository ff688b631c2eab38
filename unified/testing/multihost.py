"""Groups of `unified launch`, one per simulated machine (`unified.testing.netns.Machines`), and the
judgement of a network fault or of a machine lost for good under `--num-machines MIN:MAX`
(`run_machine_loss`): shared by `tests/test_multihost_netns.py` and the network rows of
`python -m tests.faults`.

Each machine runs ``unified launch --num-machines K --machine-rank r --main-process-ip <machine 0>
-n 1 unified/testing/worker.py <module:scenario>`` inside its namespace; the scenarios are in
`unified.testing.multihost_scenarios`. The checkpoint folder is shared (one filesystem).
"""
from __future__ import annotations

import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from unified.launcher.job_secret import SECRET_VARIABLE
from unified.launcher.processes import ProcessGroup, Worker

from .checkpoint_scenarios import ckpt_load_newest
from .harness import WORKER_SCRIPT
from .multihost_scenarios import mh_barrier_loop, mh_save_loop
from .netns import Machines
from .scenario import reference

PORT = 29400  # every group has namespaces of its own: a fixed port cannot collide
SLACK_S = 5.0  # "within the timeout plus a few seconds"
LAUNCHER_STOP_S = 10.0  # a launcher stops its other children (the JAX coordination service) in this long
WATCHDOG_EXIT = "unified: the process group broke - "  # unified/runtime/watchdog.py's message
FAULTS = ("cut-barrier", "cut-save", "freeze")
SCENARIO = {"cut-barrier": mh_barrier_loop, "cut-save": mh_save_loop, "freeze": mh_barrier_loop}


@dataclass
class Group:
    """The launchers of one group, one per machine (run by `unified.launcher.processes.ProcessGroup`), and
    where their output goes."""

    machines: Machines
    shared: Path
    children: ProcessGroup

    @property
    def procs(self) -> List[subprocess.Popen]:
        return self.children.procs

    @property
    def exit_times(self) -> List[Optional[float]]:
        """Wall-clock time each launcher was seen ended (``None``: not yet)."""
        return self.children.exit_times

    def log(self, machine: int) -> str:
        path = self.shared / f"launch-{machine}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def result(self, machine: int, scenario: Callable) -> Optional[dict]:
        path = self.shared / f"result_{machine}.json"
        return json.loads(path.read_text()).get(scenario.__name__) if path.exists() else None

    def logs(self) -> str:
        return "\n".join(f"----- machine {m} (exit {p.returncode}) -----\n{self.log(m)[-4000:]}"
                         for m, p in enumerate(self.procs))

    def wait(self, deadline: float, skip: Sequence[int] = ()) -> None:
        """Wait until every launcher but ``skip`` exited, or the monotonic ``deadline``."""
        while time.monotonic() < deadline:
            codes = self.children.poll()
            if all(codes[m] is not None for m in range(len(codes)) if m not in skip):
                return
            time.sleep(0.05)

    def stop(self) -> None:
        """Kill what still runs (SIGCONT first: a stopped process group would ignore the rest)."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        self.children.kill()
        for proc in self.procs:
            proc.wait()


def launch(machines: Machines, backend: str, scenario: Callable, shared: Path, timeout: float = 5.0,
           extra_env: Optional[Dict[str, str]] = None) -> Group:
    """One `unified launch` per machine running ``scenario``; output into ``shared/launch-<m>.log``."""
    launchers = []
    for m in range(machines.count):
        env = {**os.environ, "UNIFIED_TEST_SHARED": str(shared), "UNIFIED_TEST_OUT": str(shared / f"result_{m}.json"),
               "MULTIHOST_TIMEOUT": f"{timeout:g}",
               **(extra_env or {})}
        argv = machines.argv(m, sys.executable, "-m", "unified", "launch", "--num-machines", str(machines.count),
                             "--machine-rank", str(m), "--main-process-ip", machines.address(0),
                             "--main-process-port", str(PORT), "-n", "1", "--backend", backend, str(WORKER_SCRIPT),
                             reference(scenario))
        launchers.append(Worker(argv, env))
    logs = [str(shared / f"launch-{m}.log") for m in range(machines.count)]
    return Group(machines, shared, ProcessGroup(launchers, logs=logs, cwd=str(shared)).start())


@dataclass
class Trial:
    """What a fault trial found: ``problems`` is empty when it passed."""

    fault: str
    victim: int
    problems: List[str] = field(default_factory=list)
    to_error: Optional[float] = None  # the latest error of a live process after the fault (s)
    watchdog_exits: int = 0           # processes ended by the watchdog (blocked where they cannot raise)
    saves: Optional[int] = None       # cut-save: checkpoints committed before the cut


def _names_lost(message: str, lost: Sequence[int], main_address: Optional[str]) -> bool:
    return any(f"process {r} " in message or f"processes {r}" in message or f", {r} " in message for r in lost) or \
        bool(main_address and main_address in message)


def run_fault(backend: str, fault: str, shared: Path, *, machines_count: int = 2, victim: Optional[int] = None,
              timeout: float = 5.0, delay: Optional[float] = None, rng: Optional[random.Random] = None,
              start_deadline: float = 180.0) -> Trial:
    """Start a group, wait until it works, cause ``fault`` to machine ``victim``, judge every process.

    ``cut-barrier`` / ``cut-save``: the victim's cable is pulled while the group runs barriers /
    saves back to back. ``freeze``: the victim's worker gets SIGSTOP during the barriers, and
    SIGCONT once every other launcher has exited. Pass: every process that runs raises a `unified`
    `DistributedError` naming a lost process (or, cut off, the main machine's address) within
    ``timeout`` + `SLACK_S` of the fault, or, blocked where it cannot raise (a jitted step's device
    all-reduce), is ended by the watchdog with such a reason; every launcher exits non-zero; nothing hangs; after a
    cut during saves a new group's ``load_state()`` picks a complete checkpoint with exactly the
    parameters recorded before its save.
    """
    rng = rng or random.Random()
    victim = rng.randrange(machines_count) if victim is None else victim
    delay = rng.uniform(0.2, 1.0) if delay is None else delay
    trial = Trial(fault, victim)
    scenario = SCENARIO[fault]
    with Machines(machines_count) as machines:
        group = launch(machines, backend, scenario, shared, timeout)
        try:
            ready = [shared / f"ready-{m}" for m in range(machines_count)]
            start = time.monotonic()
            while not all(p.exists() for p in ready):
                if time.monotonic() - start > start_deadline or any(p.poll() is not None for p in group.procs):
                    trial.problems.append(f"the group did not start:\n{group.logs()}")
                    return trial
                time.sleep(0.02)
            time.sleep(delay)
            worker_pid = json.loads(ready[victim].read_text())["pid"]
            fault_at = time.time()
            if fault == "freeze":
                os.kill(worker_pid, signal.SIGSTOP)
            else:
                machines.cut(victim)
            frozen = [victim] if fault == "freeze" else []
            group.wait(time.monotonic() + timeout + SLACK_S + 30, skip=frozen)
            live = [m for m in range(machines_count) if m not in frozen]
            hung = [m for m in live if group.exit_times[m] is None]
            if hung:
                trial.problems.append(f"machines {hung} still ran {timeout + SLACK_S + 30:g} s after the fault")
            latest = 0.0
            for m in live:
                result = group.result(m, scenario)
                lost = [r for r in range(machines_count) if r != m] if m == victim else [victim]
                main = machines.address(0) if 0 in lost else None  # the rendezvous store / service's machine
                ended = next((line for line in group.log(m).splitlines() if WATCHDOG_EXIT in line), None)
                if result is None and ended is not None:
                    # blocked where it cannot raise (JAX: a jitted step's device all-reduce): the
                    # watchdog ended it, naming the reason; its launcher's exit is the time we have
                    trial.watchdog_exits += 1
                    if not _names_lost(ended, lost, main):
                        trial.problems.append(f"machine {m}'s watchdog names none of processes {lost}: {ended[:300]}")
                    if (group.exit_times[m] is None
                            or group.exit_times[m] - fault_at > timeout + SLACK_S + LAUNCHER_STOP_S):
                        trial.problems.append(f"machine {m} was ended by the watchdog too late")
                    if group.procs[m].returncode == 0:
                        trial.problems.append(f"machine {m}'s launcher exited 0 after a broken group")
                    continue
                if result is None or result.get("unexpected") or "raised" not in result:
                    trial.problems.append(f"machine {m} reported no error ({result and result.get('error')}); "
                                          f"log: {group.log(m)[-600:]}")
                    continue
                after = result["error_at"] - fault_at
                latest = max(latest, after)
                if not result["unified"] or result["raised"] not in ("BarrierTimeout", "DistributedError"):
                    trial.problems.append(f"machine {m} raised {result['raised']}: {result['message'][:300]}")
                elif not _names_lost(result["message"], lost, main):
                    trial.problems.append(f"machine {m}'s error names none of processes {lost}"
                                          f"{' nor ' + main if main else ''}: {result['message'][:400]}")
                if after > timeout + SLACK_S:
                    trial.problems.append(f"machine {m} raised {after:.1f} s after the fault (timeout {timeout:g} s)")
                if group.procs[m].returncode == 0:
                    trial.problems.append(f"machine {m}'s launcher exited 0 after a broken group")
                if fault == "cut-save":
                    trial.saves = result.get("saves")
            trial.to_error = latest
            if frozen:
                os.kill(worker_pid, signal.SIGCONT)
                group.wait(time.monotonic() + 30)
                if group.exit_times[victim] is None:
                    trial.problems.append("the frozen machine's launcher still ran 30 s after SIGCONT")
                elif group.procs[victim].returncode == 0:
                    trial.problems.append("the frozen machine's launcher exited 0")
        finally:
            group.stop()
    if fault == "cut-save" and not trial.problems:
        trial.problems += check_checkpoints(backend, shared)
    return trial


def check_checkpoints(backend: str, shared: Path) -> List[str]:
    """A new 2-process group (loopback) loads the newest checkpoint: it must be one whose
    parameters process 0 recorded before saving it, exactly, and leave no temporaries."""
    from . import harness

    expected = {}
    path = shared / "expected.jsonl"
    for line in (path.read_text().splitlines() if path.exists() else []):
        if line.strip().endswith("}"):
            entry = json.loads(line)
            expected[entry["iteration"]] = entry["hash"]
    env = {"UNIFIED_TEST_SHARED": str(shared)}
    loaded = harness.run_group(backend, 2, [ckpt_load_newest], shared / "verify", extra_env=env, deadline=180)
    try:
        rows = loaded.scenario(ckpt_load_newest)
    except AssertionError as err:
        return [f"load_state after the fault failed: {str(err)[-1500:]}"]
    problems = []
    iteration = rows[0]["iteration"]
    if iteration not in expected:
        problems.append(f"load_state picked checkpoint_{iteration}, which was never begun")
    elif any(r["hash"] != expected[iteration] for r in rows):
        problems.append(f"checkpoint_{iteration} holds other parameters than were saved")
    if rows[0]["leftovers"]:
        problems.append(f"temporaries left after a new save: {rows[0]['leftovers']}")
    return problems


@dataclass
class LossTrial:
    """What `run_machine_loss` found: ``problems`` is empty when it passed."""

    victim: int
    step: int
    problems: List[str] = field(default_factory=list)
    to_end: Optional[float] = None    # from the loss to the end of the job (s)
    results: Dict[int, dict] = field(default_factory=dict)
    logs: str = ""


def _tagged(output: str, tag: str) -> Dict[int, dict]:
    return {int(m.group(1)): json.loads(m.group(2)) for m in re.finditer(rf"^\[(\d+)\] {tag} (.*)$", output, re.M)}


def resumed_by_hand(backend: str, script: Path, project: Path, steps: int, before: int, after: int,
                    env: Optional[Dict[str, str]] = None) -> Dict[int, dict]:
    """The reference of a machine loss: ``script`` (tests/scripts/restartable.py) runs ``steps``
    steps on ``before`` processes, then resumes on ``after``; each process's ``RESULT``."""
    for count, mode in ((before, f"until:{steps}"), (after, "none")):
        done = subprocess.run([sys.executable, "-m", "unified", "launch", "-n", str(count), "--backend", backend,
                               str(script), str(project), mode], capture_output=True, text=True, timeout=300,
                              env={**os.environ, **(env or {})})
        if done.returncode != 0:
            raise RuntimeError(f"the reference run on {count} processes failed:\n"
                               f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return _tagged(done.stdout, "RESULT")


def run_machine_loss(backend: str, script: Path, shared: Path, *, victim: int, step: int, expected: Dict[int, dict],
                     machines_count: int = 3, env: Optional[Dict[str, str]] = None,
                     deadline: float = 240.0) -> LossTrial:
    """A machine lost for good under ``--num-machines 2:K --max-restarts 1``: ``script``
    (tests/scripts/restartable.py, mode ``lose:STEP:VICTIM``) runs one process per machine; after
    the save of ``step`` machine ``victim``'s cable is pulled and its launcher SIGKILLed. Pass:
    every other launcher exits 0 after exactly one restart onto K - 1 machines, and each process
    of the last attempt resumed after ``step`` and ends with the parameters of ``expected``
    (`resumed_by_hand`); nothing runs ``deadline`` seconds after the loss."""
    trial = LossTrial(victim, step)
    project = shared / "run"
    survivors = [m for m in range(machines_count) if m != victim]
    secret = secrets.token_hex(32)  # the job's: every launcher has it
    with Machines(machines_count) as machines:
        launchers = [Worker(machines.argv(m, sys.executable, "-m", "unified", "launch", "--num-machines",
                                          f"2:{machines_count}", "--machine-rank", str(m), "--main-process-ip",
                                          machines.address(0), "--main-process-port", str(PORT), "-n", "1",
                                          "--backend", backend, "--max-restarts", "1", "--rendezvous-last-call", "5",
                                          str(script), str(project), f"lose:{step}:{victim}"),
                            {**os.environ, SECRET_VARIABLE: secret, **(env or {})})
                     for m in range(machines_count)]
        logs = [shared / f"launch-{m}.log" for m in range(machines_count)]
        group = ProcessGroup(launchers, logs=[str(log) for log in logs], cwd=str(shared)).start()
        try:
            give_up = time.monotonic() + deadline
            while not (project / "lost-ready").exists():
                if time.monotonic() > give_up or any(p.poll() is not None for p in group.procs):
                    trial.problems.append("the job did not reach the loss")
                    break
                time.sleep(0.1)
            else:
                machines.cut(victim)
                group.kill(only=[group.procs[victim]])
                lost_at = time.monotonic()
                group.wait(lost_at + deadline)
                if any(group.procs[m].poll() is None for m in survivors):
                    trial.problems.append(f"still running {deadline:g} s after the loss")
                else:
                    trial.to_end = time.monotonic() - lost_at
        finally:
            group.kill()
            for proc in group.procs:
                proc.wait()
    outputs = {m: logs[m].read_text() for m in range(machines_count)}
    trial.logs = "\n\n".join(f"machine {m}:\n{text[-4000:]}" for m, text in outputs.items())
    if trial.problems:
        return trial
    for m in survivors:
        if group.procs[m].returncode != 0:
            trial.problems.append(f"machine {m}'s launcher exited {group.procs[m].returncode}")
        if outputs[m].count("joining the next attempt") != 1:
            trial.problems.append(f"machine {m} did not restart exactly once")
        if f"attempt 2 on {machines_count - 1} machine(s)" not in outputs[m]:
            trial.problems.append(f"machine {m}'s second attempt was not on {machines_count - 1} machines")
        trial.results.update(_tagged(outputs[m], "RESULT"))
    if sorted(trial.results) != list(range(machines_count - 1)):
        trial.problems.append(f"results of processes {sorted(trial.results)}")
    for rank, row in trial.results.items():
        if row["num_processes"] != machines_count - 1 or row["restart_count"] != 1 or row["first_step"] != step + 1:
            trial.problems.append(f"process {rank} did not resume after step {step} on {machines_count - 1}: {row}")
        if rank in expected and row["hash"] != expected[rank]["hash"]:
            trial.problems.append(f"process {rank}'s parameters differ from the resume by hand")
    return trial
