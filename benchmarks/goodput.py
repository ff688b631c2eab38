"""Goodput under faults (issue 26): the same 2-process training job with a worker SIGKILLed every
``--every`` seconds, run by ``unified launch --max-restarts`` (a unified script) and by
``torchrun --max-restarts`` (an Accelerate 1.15 script that resumes from its newest checkpoint),
side by side, rounds alternating the order (`runner.interleaved`).

Run from the repository root (needs `pip install -e '.[torch,peers]'`):

    python -m benchmarks.goodput [--rounds 3] [--steps 300] [--every 4]

The job (benchmarks/goodput_job.py): ``--steps`` steps of a small torch update plus 30 ms of
"compute", a checkpoint every 10 steps, the same for both. Each round runs every runner once
without faults (its step time and its fresh start: launch to first step) and once with faults:
process 1 of the group is killed once the attempt has been stepping for ``--every`` seconds
(each attempt gets the same productive time; the restart's cost is what the runners differ in).
Reported, min / median / max over the rounds:

1. Goodput: productive step time (steps x the runner's fault-free median step time) over the
   faulty run's wall time; the number of kills.
2. Each restart, from the kill to the first step of the new attempt, broken down by the job's own
   time stamps (the slowest process of the group at each stamp): detection, teardown and spawn
   (kill -> the new processes' first line of Python), start-up (-> the Accelerator and model set
   up), load (-> the checkpoint restored), first step. Against a fresh start plus a load: the
   fault-free run's launch -> first step plus the restarts' median load.
3. Hangs: a run still going after ``HANG_S`` (180 s; a fault-free run takes about 15 s) is
   stopped with its whole process group and counted as hung for that round (a result, not
   a crash of the benchmark), apart from the figures above.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Set

from benchmarks.runner import ROOT, cells, interleaved, log, print_command, table

JOB = ROOT / "benchmarks" / "goodput_job.py"
HANG_S = 180.0  # a run (fault-free: ~15 s) still going after this is stopped and counted as hung
RUNNERS = {
    "unified launch --max-restarts": lambda project, stamps, steps: [
        sys.executable, "-m", "unified", "launch", "-n", "2", "--backend", "torch", "--max-restarts", "50",
        str(JOB), "unified", project, stamps, str(steps)],
    "torchrun --max-restarts + Accelerate": lambda project, stamps, steps: [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "50",
        str(JOB), "accelerate", project, stamps, str(steps)],
}


def read_stamps(path: str) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        return []
    lines = []
    for line in open(path).read().splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:  # a line cut by a kill
            pass
    return lines


class Killer(threading.Thread):
    """Kills process 1 of the running attempt once it has been stepping for ``every`` seconds
    (every attempt gets the same productive time, whatever its restart cost); records each
    kill's time."""

    def __init__(self, stamps: str, every: float) -> None:
        super().__init__(daemon=True)
        self.stamps, self.every, self.kills, self.stop = stamps, every, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            events = read_stamps(self.stamps)
            alive = {e["pid"]: e for e in events if e["event"] == "ready" and e["rank"] == 1
                     and e["t"] > (self.kills[-1] if self.kills else 0)}
            steps = [e["t"] for e in events if e["event"] == "step" and e["pid"] in alive]
            if any(e["event"] == "done" for e in events) or not steps or time.time() < min(steps) + self.every:
                continue  # the attempt has not stepped for `every` seconds yet
            pid = max(alive, key=lambda p: alive[p]["t"])
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append(time.time())


def run_job(runner: str, steps: int, every: Optional[float], folder: str) -> Dict[str, Any]:
    project, stamps = os.path.join(folder, "project"), os.path.join(folder, "stamps.jsonl")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    killer = Killer(stamps, every) if every else None
    started = time.time()
    if killer:
        killer.start()
    process = subprocess.Popen(RUNNERS[runner](project, stamps, steps), cwd=folder, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:  # a hung runner is a result: its whole group is stopped
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        if killer:
            killer.stop.set()
            killer.join()
        return {"hung": True, "wall": time.time() - started, "events": read_stamps(stamps),
                "kills": killer.kills if killer else []}
    run = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    wall = time.time() - started
    if killer:
        killer.stop.set()
        killer.join()
    events = read_stamps(stamps)
    if run.returncode != 0 or not any(e["event"] == "done" for e in events):
        raise SystemExit(f"{runner} failed (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return {"wall": wall, "launched": started, "events": events, "kills": killer.kills if killer else []}


def step_time(result: Dict[str, Any]) -> float:
    times = sorted(e["t"] for e in result["events"] if e["event"] == "step" and e["rank"] == 0)
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def first_step(result: Dict[str, Any]) -> float:
    return min(e["t"] for e in result["events"] if e["event"] == "step") - result["launched"]


def restarts(result: Dict[str, Any]) -> List[Dict[str, float]]:
    """Per kill: the phases of the attempt that followed it (the group's slowest process)."""
    events, out = result["events"], []
    kills = result["kills"]

    def when(event: str, after: List[Dict[str, Any]], pids: Set[Any]) -> Optional[float]:
        ts = [e["t"] for e in after if e["event"] == event and e["pid"] in pids]
        return max(ts) if len(ts) >= 2 else None

    for kill, next_kill in zip(kills, kills[1:] + [float("inf")]):
        # only the attempt this kill started: the events before the next kill (counting a later
        # attempt's start here once made every restart but the last look 4 s slower)
        after = [e for e in events if kill < e["t"] < next_kill]
        starts = [e for e in after if e["event"] == "start"]
        if not starts:
            continue
        pids = {e["pid"] for e in starts}
        first = [min(e["t"] for e in after if e["event"] == "step" and e["pid"] == p)
                 for p in pids if any(e["event"] == "step" and e["pid"] == p for e in after)]
        spawn, ready, loaded = when("start", after, pids), when("ready", after, pids), when("loaded", after, pids)
        if None in (spawn, ready, loaded) or len(first) < 2:
            continue
        out.append({"detection, teardown, spawn": spawn - kill, "start-up": ready - spawn, "load": loaded - ready,
                    "first step": max(first) - loaded, "kill -> first step": max(first) - kill})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=float, default=4.0, help="seconds of stepping before each kill")
    args = parser.parse_args()
    print_command()
    measured: Dict[str, Dict[str, List[Any]]] = {r: {"goodput": [], "kills": [], "restarts": [], "fresh": [],
                                                     "rounds": [], "clean wall": [], "wall": [], "hung": []}
                                                 for r in RUNNERS}
    def both_runs(runner: str) -> None:
        """A fault-free run of ``runner``, then one with faults; what each round adds to ``measured``."""
        with tempfile.TemporaryDirectory() as clean_dir, tempfile.TemporaryDirectory() as faulty_dir:
            clean = run_job(runner, args.steps, None, clean_dir)
            faulty = run_job(runner, args.steps, args.every, faulty_dir)
        m, round_ = measured[runner], len(measured[runner]["rounds"]) + 1
        m["rounds"].append(round_)
        if clean.get("hung") or faulty.get("hung"):
            m["hung"].append(f"round {round_}, {'fault-free' if clean.get('hung') else 'faulty'} run, "
                             f"after {len(faulty['kills'])} kill(s)")
            log(f"round {round_}, {runner}: HUNG ({m['hung'][-1]}; stopped after {HANG_S:g} s)")
            return
        m["goodput"].append(args.steps * step_time(clean) / faulty["wall"])
        m["kills"].append(len(faulty["kills"]))
        m["restarts"] += restarts(faulty)
        m["fresh"].append(first_step(clean))
        m["clean wall"].append(clean["wall"])
        m["wall"].append(faulty["wall"])
        log(f"round {round_}, {runner}: goodput {m['goodput'][-1]:.3f}, {m['kills'][-1]} kills, "
            f"wall {faulty['wall']:.1f}s (fault-free {clean['wall']:.1f}s)")

    interleaved({runner: (lambda runner=runner: both_runs(runner)) for runner in RUNNERS}, args.rounds, warmup=0)

    print(f"## Goodput, {args.steps} steps, a worker killed after every {args.every:g} s of stepping "
          f"({args.rounds} rounds)\n")
    rows = []
    for runner, m in measured.items():
        done = [*cells(m["goodput"], digits=3), " / ".join(map(str, m["kills"])), f"{statistics.median(m['wall']):.1f}",
                f"{statistics.median(m['clean wall']):.1f}"] if m["goodput"] else ["-"] * 6
        rows.append([runner, *done, f"{len(m['hung'])} of {args.rounds}"])
    print(table(["runner", "goodput min", "median", "max", "kills per round", "faulty wall (s, median)",
                 "fault-free wall (s, median)", "rounds hung"], "lrrrlrrr", rows))
    for runner, m in measured.items():
        for what in m["hung"]:
            print(f"- {runner} hung: {what} (stopped after {HANG_S:g} s; not in the figures above)")
    print("\n## A restart, from the kill to the first step of the new attempt (seconds)\n")
    rows = []
    phases = ["detection, teardown, spawn", "start-up", "load", "first step", "kill -> first step"]
    for runner, m in measured.items():
        for phase in phases:
            values = [r[phase] for r in m["restarts"]]
            if values:
                rows.append([runner, phase, *cells(values, digits=2)])
        loads = [r["load"] for r in m["restarts"]] or [0.0]
        reference = [f + statistics.median(loads) for f in m["fresh"]]
        rows.append([runner, "reference: a fresh start (launch -> first step) plus a load",
                     *cells(reference, digits=2)])
    print(table(["runner", "phase", "min", "median", "max"], "llrrr", rows))


if __name__ == "__main__":
    main()
