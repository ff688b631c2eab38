"""The fault trials: repeated faults in real process groups, on every installed backend, with
their pass counts (docs/benchmarks/faults.md).

Run from the repository root:

    python -m tests.faults            # 20 trials for rows 1-2 and 7-17, 100 damage cases
    python -m tests.faults --short    # CI mode: rows 1-6, 2 trials per row, 10 damage cases
    options: --backends torch,jax --trials N --damage-cases N --timeout S --train-size N
             --seed N --rows 1,2,... --keep --no-picture

Prints one table (fault | backend | trials | passes | worst time to error | notes), then the
failing trials in detail, and exits 1 if any row is below 100%. Draws the share of passing
trials per row and backend in docs/benchmarks/img/faults.png and, when rows 7-8 ran, the time
from the preemption signal to the committed checkpoint in faults-preemption.png
(``--no-picture``: neither; the pictures are drawn by `benchmarks.plot`).

Every group is started by the conformance harness (`unified.testing.harness.run_group`),
whose worker runs scenario functions of `tests/faults/scenarios.py` (and of
`unified/testing/scenarios.py`), named by reference (`module:function`). The rows:

1. A process SIGKILLs itself at a random step of a training loop (`training.make(acc)`, a
   `wait_for_everyone` or `check_trigger` after every step; `Accelerator(timeout=--timeout)`;
   3 processes and 10 s, --short: 2 and 5 s),
   either before its training step (the others are then in the step's collectives: DDP's
   all-reduce, or the jitted step's cross-process reduction) or before the sync. Pass: every
   survivor raised a `unified` error (`BarrierTimeout` / `DistributedError`) and exited, or was
   ended by the watchdog with its message (blocked where it cannot raise), both within
   timeout + 2 s of the kill. "worst time" = the latest survivor error after the kill
   ("never": some survivor raised nothing); the notes give the latest exit. A hung survivor is
   stopped at the harness deadline, and the worker dumps its stacks to its log (faulthandler).
2. The whole group is SIGKILLed at a random moment (0.2-3 s after the first checkpoint; --short: 0.2-1.5 s) of a
   loop that saves after every step (`sync` and `async` trials alternate). Pass: a new group's
   `load_state()` restores exactly the parameter hash recorded before that checkpoint's save,
   on both processes, and the next save leaves no temporaries.
3. Random damage to a good checkpoint, one copy per case, all loaded by one group: a flipped
   byte (random file, random offset), a truncation (random file, random length), a deleted
   file, an edited manifest field (random field, not re-signed), a file copied from another
   checkpoint of the same run (the manifest included). Pass: every process raises
   `CheckpointError` naming the damaged file, and no object was modified.
4. Hostile checkpoints: Accelerate's file names holding pickle payloads (beside a valid manifest:
   loads and ignores them; without one: refused), a pickle where a safetensors file is expected,
   a data file or the manifest replaced by a symlink to a valid copy outside, `..` and absolute
   paths in a re-signed manifest, a huge declared size, a huge safetensors header length and
   shape. Pass: no payload runs (no PWNED file), no file outside the checkpoint is opened
   (os.open / open watched by inode), a `CheckpointError` names the culprit within 5 s.
5. Resume with another number of processes, 2 -> 3 and 3 -> 2 (training state plus a shuffled
   `unified.DataLoader` 6 samples into the epoch). Pass: model, optimizer, scheduler and
   registered state equal the saved ones; the rest of the epoch is exactly the unconsumed
   samples; each process's generators follow the documented rule (seed = crc32("unified/
   {iteration}/{process_index}")); the re-derivation warning appears once, on the main process.
6. Full disk: `safetensors_io.write` raises ENOSPC (after writing 16 bytes) on one process during
   one save (sync, and async + `wait_for_checkpoint`; each process as the victim). Pass: every
   process raises `CheckpointError` naming the process and "No space left"; the failed checkpoint
   does not exist, and `load_state()` loads the previous one with its exact state.
7. Preemption of a worker: a training run (`unified/testing/preemption_run.py`,
   `Accelerator(handle_preemption=True)`, 2 processes) started by `unified launch --grace-period
   60`; at a random step (2-8) a random process gets SIGTERM or SIGUSR1 (random). Pass: the
   launcher exits `unified.PREEMPTED_EXIT_CODE`, every process stopped at that step with
   `preempted` set and saved `checkpoint_0`, the only checkpoint, within the grace period.
   "worst time" and the notes: signal -> committed checkpoint (the slowest process's
   `save_state` returned), median and worst. --short: 1 trial.
8. Preemption of the launcher: the same, with the signal sent to `unified launch`, which forwards
   it to every worker.
9-11. Several machines (`unified/testing/multihost.py`): 2 network namespaces with their own addresses, one
   `unified launch --num-machines 2` each; a random machine is the victim, 0.2-1 s after the group
   works (`--net-timeout`, default 5 s): 9. its cable is pulled (`ip link set down` on its switch
   port) during back-to-back `wait_for_everyone`; 10. the same during back-to-back `save_state`;
   11. its worker gets SIGSTOP during the barriers (SIGCONT once the others ended). Pass: every
   running process raises a `unified` error naming a lost process (or the main machine's
   address) within the timeout + 5 s (or, blocked in a jitted step's device all-reduce, is ended
   by the watchdog with such a reason), every launcher exits non-zero, nothing hangs, and after
   row 10 a new group loads exactly the parameters recorded before the newest checkpoint's save.
   Skipped with the reason where network namespaces cannot be made (needs root).
12. An object store out of reach on one process: on moto's S3 server started on loopback, all
   trials in one group of 2 processes; per trial a random victim whose uploads fail through a
   proxy (`unified.testing.object_store.FaultyEndpoint`: the connection dropped, a 500, or a 503
   SlowDown, at random; 2 attempts per request). Pass: every process raises `CheckpointError`
   naming the victim's object, the failed save is not committed, and the previous checkpoint
   loads exactly. Skipped with the reason without moto and s3fs.
13. The group SIGKILLed at a random moment (0.2-3 s after the first checkpoint) of a loop that
   saves to the store after every step (automatic naming). Pass: the same job restarted (the
   same `UNIFIED_RUN_ID`, so it takes the crashed run's lease over) loads exactly the parameters
   recorded before the newest committed checkpoint, and its next save leaves no prefix without a
   manifest and no unfinished multipart upload.
14. A worker SIGKILLed, healed by the launcher: `tests/scripts/restartable.py` (2 processes, 6
   steps, a save after each, `load_state(if_exists=True)` at the start) under `unified launch
   --max-restarts 2`; a random process kills itself at a random step (1-4), before its step or
   after its save. Pass: the launcher exits 0 with exactly one restart, and both processes end
   with the parameter hash of an uninterrupted run. "worst time": the kill -> the new attempt's
   first step.
15. A crash at start-up: every attempt exits 3 before its first step, under `--max-restarts N`
   (N random, 1-3). Pass: exactly N restarts, "gave up after N restart(s)" in the log, a
   non-zero exit. "worst time": the launcher's whole run.
16. A machine lost for good: three machines (network namespaces, one process each) under
   `unified launch --num-machines 2:3 --max-restarts 1`; after the save of a random step (1-4)
   machine 1 or 2 loses its cable and its launcher is SIGKILLed. Pass: the two launchers left
   exit 0 after exactly one restart onto 2 machines, and both processes resumed after that step
   and end with exactly the parameters of the same resume done by hand (3 processes, then 2).
   "worst time": the loss -> the end of the job. Skipped where namespaces cannot be made.
17. The newest checkpoint damaged, healed by the launcher (issue 46): `restartable.py` (2
   processes, 6 steps, a save after each, `total_limit=2`) under `--max-restarts 1`; on the first
   attempt, after the save of a random step (1-4), the main process flips one byte of the newest
   `checkpoint_N` (a random file of each kind in turn, model / optimizer / rng / registered
   state, in its header or in its data, at a random offset), then a random process SIGKILLs
   itself. Pass: the launcher exits 0 after exactly one
   restart; the new attempt's `load_state(if_exists=True)` resumed every process from the
   checkpoint of the step before; one warning, from process 0, names the checkpoint, the damaged
   file and `checkpoint_N.damaged`, which is still there at the end; every process ends with
   exactly the parameters of the same resume done by hand (`until:STEP`, then a fresh launch;
   once per step and backend). "worst time": the kill -> the new attempt's first step.
   Not in --short (28-44 s for one trial on torch; tests/test_restarts.py and the conformance
   suite's damaged-newest test cover its parts in CI); `--short --rows 17`: 1 trial.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set

from tests.faults import scenarios as fs
from unified.runtime.preemption import PREEMPTED_EXIT_CODE
from unified.testing import harness
from unified.testing.checkpoint_scenarios import ckpt_load_newest

ROOT = Path(__file__).resolve().parents[2]

VERBOSE = False


def run_group(backend, size, scenarios, shared, **kwargs):
    """`harness.run_group`, printing each group's wall time with --verbose."""
    group = harness.run_group(backend, size, scenarios, shared, **kwargs)
    if VERBOSE:
        names = "+".join(s.__name__ for s in scenarios)
        print(f"    {backend} x{size} {names}: {group.elapsed:.1f} s, exit codes {group.returncodes}",
              flush=True)
    return group
WORKER_PATH = str(ROOT)  # the workers import tests.faults.scenarios
TRAIN_STEPS = 30
WATCHDOG_EXIT = "unified: the process group broke"  # unified/runtime/watchdog.py's message
MANIFEST = "manifest.json"


@dataclass
class Row:
    fault: str
    backend: str
    trials: int = 0
    passes: int = 0
    worst: Optional[float] = None
    notes: str = ""
    failures: List[str] = field(default_factory=list)
    skipped: bool = False  # could not run here (the notes say why); not a failure
    commit_times: List[float] = field(default_factory=list)  # rows 7-8: signal -> committed checkpoint (s)

    def record(self, ok: bool, what: str, time_s: Optional[float] = None) -> None:
        self.trials += 1
        self.passes += bool(ok)
        if time_s is not None:
            self.worst = time_s if self.worst is None else max(self.worst, time_s)
        if not ok:
            self.failures.append(what)


JAX_CACHE: Dict[str, str] = {}  # a persistent compilation cache shared by the groups (--no-jax-cache: off)


def _env(shared: Path, **extra: object) -> Dict[str, str]:
    env = {"UNIFIED_TEST_SHARED": str(shared), "PYTHONPATH": WORKER_PATH, **JAX_CACHE}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _first_line(text: str, limit: int = 300) -> str:
    line = (text or "").strip().splitlines()[-1:] or [""]
    return line[0][:limit]


def _group_failed(group: harness.GroupResult, scenario: Callable) -> Optional[str]:
    """A short reason when some process did not finish ``scenario`` normally."""
    scenario = scenario.__name__
    for rank, (rc, result) in enumerate(zip(group.returncodes, group.results)):
        value = result.get(scenario)
        if value is None:
            return f"process {rank} (exit {rc}) did not report {scenario}: {_first_line(group.logs[rank])}"
        if isinstance(value, dict) and value.get("unexpected"):
            return f"process {rank} failed in {scenario}: {value['error'][:300]}"
    return None


# -- 1. a process dies during training ---------------------------------------------------------------------
SLOW_RETRIES = 2  # reruns of a trial whose victim was still alive when a survivor's timeout ran out


def _outrun_by_the_timeout(group: harness.GroupResult, victim: int) -> bool:
    """The victim was told that another process timed out before it reached its planned kill: on
    a loaded machine the trial's short timeout ran out before the fault; nothing was measured."""
    return group.returncodes[victim] != -9 and "BarrierTimeout" in group.logs[victim]


def row_train_kill(backend: str, trials: int, rng: random.Random, work: Path, timeout: float, size: int) -> Row:
    row = Row("1 process SIGKILLed in training loop", backend)
    phases: Dict[str, int] = {}
    worst_exit, retried = 0.0, 0
    for t in range(trials):
        shared = work / f"r1-{backend}-{t}"
        shared.mkdir()
        victim, step = rng.randrange(size), rng.randrange(1, TRAIN_STEPS - 3)
        phase, jitter = rng.choice(["step", "sync"]), rng.uniform(0.0, 0.05)
        phases[phase] = phases.get(phase, 0) + 1
        what = f"trial {t}: victim {victim}, step {step}, before its {phase}"
        for attempt in range(1 + SLOW_RETRIES):
            group = run_group(backend, size, [fs.fault_train_kill], shared, deadline=120 + 3 * timeout,
                              extra_env=_env(shared, FAULT_TIMEOUT=timeout, FAULT_VICTIM=victim, FAULT_KILL_STEP=step,
                                             FAULT_PHASE=phase, FAULT_JITTER=jitter, FAULT_STEPS=TRAIN_STEPS))
            if not _outrun_by_the_timeout(group, victim) or attempt == SLOW_RETRIES:
                break
            retried += 1  # inconclusive, not a failure: the fault never happened
            shutil.rmtree(shared)
            shared.mkdir()
        killed_file = shared / "killed.json"
        if group.returncodes[victim] != -9 or not killed_file.exists():
            row.record(False, f"{what}: the victim did not die as planned (exit {group.returncodes[victim]}): "
                              f"{_first_line(group.logs[victim])}")
            continue
        killed_at = json.loads(killed_file.read_text())["t"]
        problems, slowest_error = [], 0.0
        for rank in range(size):
            if rank == victim:
                continue
            result = group.results[rank].get("fault_train_kill")
            exit_at = group.exit_times[rank]
            if result is None and exit_at is not None and WATCHDOG_EXIT in group.logs[rank]:
                # ended by the watchdog (it could not raise: blocked in a device collective)
                result = {"raised": "watchdog exit", "unified": True, "error_at": exit_at, "step": None, "message": ""}
            if result is None or result.get("unexpected") or result["raised"] is None:
                slowest_error = float("inf")
            else:
                slowest_error = max(slowest_error, result["error_at"] - killed_at)
            if exit_at is None:
                worst_exit = float("inf")
                tail = " | ".join(line.strip() for line in group.logs[rank].strip().splitlines()[-3:])
                problems.append(f"process {rank} hung (killed at the {120 + 3 * timeout:g} s deadline); "
                                f"log ends: {tail[:300]}")
            else:
                worst_exit = max(worst_exit, exit_at - killed_at)
                if exit_at - killed_at > timeout + 2:
                    problems.append(f"process {rank} exited {exit_at - killed_at:.1f} s after the kill")
            if result is None or result.get("unexpected"):
                problems.append(f"process {rank} exited {group.returncodes[rank]} without a result: "
                                f"{_first_line(group.logs[rank])}")
                continue
            if result["raised"] is None:
                problems.append(f"process {rank} finished the loop without an error")
                continue
            to_error = result["error_at"] - killed_at
            if not result["unified"]:
                problems.append(f"process {rank} raised {result['raised']} (not a unified error) at step "
                                f"{result['step']}: {result['message'][:200]}")
            if to_error > timeout + 2:
                problems.append(f"process {rank} raised only {to_error:.1f} s after the kill")
        row.record(not problems, f"{what}: " + "; ".join(problems), slowest_error)
    row.notes = (f"{size} processes, timeout {timeout:g} s; kill before step/sync: "
                 f"{phases.get('step', 0)}/{phases.get('sync', 0)}; "
                 + (f"{retried} trial(s) rerun because a survivor timed out before the planned kill (a loaded "
                    "machine: the fault never happened); " if retried else "")
                 + "worst exit after the kill "
                 f"{'never (hung)' if worst_exit == float('inf') else f'{worst_exit:.1f} s'}")
    return row


# -- 2. the whole group dies during save_state ----------------------------------------------------------------
def _expected_hashes(shared: Path) -> Dict[int, str]:
    """iteration -> parameter hash of every save a killed loop began (its expected.jsonl; a
    line cut by the kill is skipped)."""
    expected = {}
    for line in (shared / "expected.jsonl").read_text().splitlines():
        if line.strip().endswith("}"):
            entry = json.loads(line)
            expected[entry["iteration"]] = entry["hash"]
    return expected


def _loaded_as_saved(rows: List[dict], expected: Dict[int, str]) -> List[str]:
    """What is wrong with the loads after a crash (``rows``: every process's ``iteration`` and
    ``hash``): a checkpoint never saved, other parameters than were saved, processes that differ."""
    problems = []
    if rows[0]["iteration"] not in expected:
        problems.append(f"loaded iteration {rows[0]['iteration']} was never saved")
    elif rows[0]["hash"] != expected[rows[0]["iteration"]]:
        problems.append(f"checkpoint_{rows[0]['iteration']} holds other parameters than were saved")
    if any(r["hash"] != rows[0]["hash"] for r in rows[1:]):
        problems.append("the processes loaded different parameters")
    return problems


def _kill_then_load(backend: str, shared: Path, save_loop: Callable, load: Callable, delay: float,
                    save_env: Dict[str, str], load_env: Dict[str, str]
                    ) -> "tuple[Optional[str], List[dict], Dict[int, str]]":
    """A group of 2 running ``save_loop`` SIGKILLed ``delay`` s after its first checkpoint, then a
    new group running ``load``: (what went wrong or None, each process's ``load`` result, the
    hashes the loop recorded before each save)."""
    crashed = run_group(backend, 2, [save_loop], shared, extra_env=save_env, kill_when=shared / "ready",
                        kill_delay=delay, deadline=120)
    if not all(rc == -9 for rc in crashed.returncodes):
        return (f"the group did not run until killed (exit codes {crashed.returncodes}): "
                f"{_group_failed(crashed, save_loop)}", [], {})
    expected = _expected_hashes(shared)
    loaded = run_group(backend, 2, [load], shared, extra_env=load_env, deadline=120)
    failed = _group_failed(loaded, load)
    if failed:
        return f"load after the crash failed: {failed}", [], expected
    return None, loaded.scenario(load), expected


def row_save_kill(backend: str, trials: int, rng: random.Random, work: Path, max_delay: float) -> Row:
    row = Row("2 group SIGKILLed during save_state", backend)
    per_mode = {"sync": [0, 0], "async": [0, 0]}
    saves = []
    for t in range(trials):
        mode = ("sync", "async")[t % 2]
        shared = work / f"r2-{backend}-{t}"
        shared.mkdir()
        delay = rng.uniform(0.2, max_delay)
        what = f"trial {t} ({mode}, kill {delay:.2f} s after the first checkpoint)"
        per_mode[mode][0] += 1
        failed, rows, expected = _kill_then_load(backend, shared, fs.fault_save_loop, ckpt_load_newest, delay,
                                                 _env(shared, FAULT_SAVE_MODE=mode), _env(shared))
        if failed:
            row.record(False, f"{what}: {failed}")
            continue
        saves.append(len(expected))
        problems = _loaded_as_saved(rows, expected)
        if rows[0]["leftovers"]:
            problems.append(f"temporaries left after a new save: {rows[0]['leftovers']}")
        per_mode[mode][1] += not problems
        row.record(not problems, f"{what}: " + "; ".join(problems))
    row.notes = (f"sync {per_mode['sync'][1]}/{per_mode['sync'][0]}, "
                 f"async {per_mode['async'][1]}/{per_mode['async'][0]}; "
                 f"checkpoints begun before the kill: {min(saves, default=0)}-{max(saves, default=0)}; "
                 "loads all succeed (no error expected)")
    return row


# -- 3/4. building damaged and hostile copies ----------------------------------------------------------------
class Payload:
    """Unpickling this creates ``path``: proof that a pickle ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _digest(body: dict) -> str:
    from unified.checkpoint.manifest import _digest as digest

    return digest(body)


def _resign(directory: Path, edit) -> None:
    """Edit the manifest and re-sign it, as an attacker who knows the format could
    (as `_rewrite_manifest` in unified/testing/suite/test_checkpoint.py)."""
    path = directory / MANIFEST
    doc = json.loads(path.read_text())
    doc.pop("manifest_xxh3")
    edit(doc)
    doc["manifest_xxh3"] = _digest(doc)
    path.write_text(json.dumps(doc))


def _file_info(data: bytes) -> dict:
    import xxhash

    return {"size": len(data), "xxh3": xxhash.xxh3_64_hexdigest(data)}


def _leaf_paths(node, prefix=()):
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaf_paths(value, prefix + (key,))
    elif isinstance(node, list) and node:
        for i, value in enumerate(node):
            yield from _leaf_paths(value, prefix + (i,))
    else:
        yield prefix


def _changed(value, rng: random.Random):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + rng.choice([-1, 1]) * rng.randint(1, 1000)
    if isinstance(value, float):
        return value + rng.uniform(0.5, 10.0)
    if isinstance(value, str):
        if value and rng.random() < 0.5:
            i = rng.randrange(len(value))
            return value[:i] + ("0" if value[i] != "0" else "1") + value[i + 1:]
        return value + "x"
    if value is None:
        return 0
    return ["x"]  # an empty list or dict


def make_damaged(pristine: Path, other: Path, root: Path, count: int, rng: random.Random) -> Dict[str, dict]:
    """``count`` damaged copies of ``pristine``: case name -> {"culprits": names, "what": text}."""
    names = sorted(os.listdir(pristine))
    other_manifest = json.loads((other / MANIFEST).read_text())
    kinds = ["flip", "truncate", "delete", "edit_manifest", "copy_other"]
    cases = {}
    for i in range(count):
        kind = kinds[i % len(kinds)]
        case = root / f"damage_{i:03d}_{kind}"
        shutil.copytree(pristine, case)
        if kind == "edit_manifest":
            victim = MANIFEST
        elif kind == "copy_other":
            victim = rng.choice([n for n in names if (pristine / n).read_bytes() != (other / n).read_bytes()])
        else:
            victim = rng.choice(names)
        target = case / victim
        culprits = {victim}
        if kind == "flip":
            data = bytearray(target.read_bytes())
            offset = rng.randrange(len(data))
            data[offset] ^= 0xFF
            target.write_bytes(bytes(data))
            what = f"{victim}: byte {offset} of {len(data)} flipped"
        elif kind == "truncate":
            data = target.read_bytes()
            length = rng.randrange(len(data))
            target.write_bytes(data[:length])
            what = f"{victim}: truncated to {length} of {len(data)} bytes"
        elif kind == "delete":
            target.unlink()
            what = f"{victim}: deleted"
        elif kind == "edit_manifest":
            doc = json.loads(target.read_text())
            top = rng.choice(sorted(doc))
            paths = list(_leaf_paths(doc[top], (top,)))
            path = rng.choice(paths)
            parent = doc
            for key in path[:-1]:
                parent = parent[key]
            old = parent[path[-1]]
            parent[path[-1]] = _changed(old, rng)
            target.write_text(json.dumps(doc, indent=1, sort_keys=True))
            what = (f"manifest field {'/'.join(map(str, path))}: {str(old)[:40]!r} -> "
                    f"{str(parent[path[-1]])[:40]!r} (not re-signed)")
        else:
            shutil.copyfile(other / victim, target)
            if victim == MANIFEST:  # then the data files no longer match what the manifest lists
                culprits |= {n for n in names if n != MANIFEST
                             and other_manifest["files"].get(n) != _file_info((pristine / n).read_bytes())}
            what = f"{victim}: copied from a checkpoint one step later"
        cases[case.name] = {"culprits": sorted(culprits), "what": what}
    return cases


def make_hostile(pristine: Path, root: Path, outside: Path, shared: Path, rng: random.Random) -> Dict[str, dict]:
    """Hostile copies: case -> {"culprit": name or None (must load), "what": text}."""
    data_files = sorted(n for n in os.listdir(pristine) if n != MANIFEST)
    outside.mkdir(exist_ok=True)
    for name in os.listdir(pristine):
        shutil.copyfile(pristine / name, outside / name)  # valid copies: reading them would "work"
    cases: Dict[str, dict] = {}
    pwned = str(shared / "PWNED")

    def copy(name: str, culprit: Optional[str], what: str) -> Path:
        target = root / f"hostile_{name}"
        shutil.copytree(pristine, target)
        cases[target.name] = {"culprit": culprit, "what": what}
        return target

    d = copy("pickles_beside_manifest", None, "Accelerate's names with pickle payloads beside a valid manifest")
    for name in ("optimizer.bin", "random_states_0.pkl", "scheduler.bin", "pytorch_model.bin", "model.safetensors"):
        (d / name).write_bytes(pickle.dumps(Payload(pwned)))
    d = root / "hostile_accelerate_style"
    d.mkdir()
    for name in ("optimizer.bin", "random_states_0.pkl", "scheduler.bin", "pytorch_model.bin", "model.safetensors"):
        (d / name).write_bytes(pickle.dumps(Payload(pwned)))
    cases[d.name] = {"culprit": MANIFEST, "what": "Accelerate-style checkpoint of pickle payloads, no manifest"}
    victim = rng.choice(data_files)
    d = copy("pickle_as_safetensors", victim, f"{victim} is a pickle payload (manifest re-signed to match)")
    payload = pickle.dumps(Payload(pwned))
    (d / victim).write_bytes(payload)
    _resign(d, lambda doc: doc["files"][victim].update(_file_info(payload)))
    victim = rng.choice(data_files)
    d = copy("symlink_file", victim, f"{victim} is a symlink to a valid copy outside")
    (d / victim).unlink()
    (d / victim).symlink_to(outside / victim)
    d = copy("symlink_manifest", MANIFEST, "manifest.json is a symlink to a valid copy outside")
    (d / MANIFEST).unlink()
    (d / MANIFEST).symlink_to(outside / MANIFEST)
    victim = rng.choice(data_files)
    escape = f"../../{outside.name}/{victim}"

    def dotdot(doc):
        doc["files"][escape] = doc["files"].pop(victim)
    d = copy("dotdot_path", escape, f"manifest lists {escape} (re-signed)")
    _resign(d, dotdot)
    victim = rng.choice(data_files)
    absolute = str(outside / victim)

    def abspath(doc):
        doc["files"][absolute] = doc["files"].pop(victim)
    d = copy("absolute_path", absolute, f"manifest lists {absolute} (re-signed)")
    _resign(d, abspath)
    victim = rng.choice(data_files)
    d = copy("huge_size", victim, f"manifest declares {victim} as 10**15 bytes (re-signed)")
    _resign(d, lambda doc: doc["files"][victim].update(size=10**15))
    victim = rng.choice(data_files)
    crafted = struct.pack("<Q", 2**62) + b"{}" + b"\0" * 64
    d = copy("huge_header", victim, f"{victim} declares a 2**62-byte safetensors header (re-signed)")
    (d / victim).write_bytes(crafted)
    _resign(d, lambda doc: doc["files"][victim].update(_file_info(crafted)))
    victim = rng.choice(data_files)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 16]}}).encode()
    header += b" " * (-len(header) % 8)
    crafted_shape = struct.pack("<Q", len(header)) + header + b"\0" * 16
    d = copy("huge_shape", victim, f"{victim} declares a 2**40 x 2**40 array in 16 bytes (re-signed)")
    (d / victim).write_bytes(crafted_shape)
    _resign(d, lambda doc: doc["files"][victim].update(_file_info(crafted_shape)))
    return cases


def _judge_case(results: List[dict], case: str, culprits: List[str], stopped: Optional[str]) -> List[str]:
    problems = []
    for rank, outcome in enumerate(results):
        result = outcome.get(case)
        if result is None:
            problems.append(f"process {rank}: not run (group stopped after {stopped})")
            continue
        if result["raised"] != "CheckpointError":
            problems.append(f"process {rank}: raised {result['raised']}: {result.get('message', '')[:200]}")
        elif not any(c in result["message"] for c in culprits):
            problems.append(f"process {rank}: message does not name {culprits}: {result['message'][:200]}")
        if not result["untouched"]:
            problems.append(f"process {rank}: state was modified")
        if result["outside_reads"]:
            problems.append(f"process {rank}: opened files outside: {result['outside_reads']}")
    return problems


def rows_checkpoint_files(backend: str, shared: Path, load: harness.GroupResult, damaged: Dict[str, dict],
                          hostile: Dict[str, dict], pristine_hash: str) -> List[Row]:
    damage_row = Row("3 checkpoint damaged at random", backend)
    hostile_row = Row("4 hostile checkpoint files", backend)
    failed = _group_failed(load, fs.fault_load_cases)
    if failed:
        for row, cases in ((damage_row, damaged), (hostile_row, hostile)):
            for case in cases:
                row.record(False, f"{case}: {failed}")
        return [damage_row, hostile_row]
    results = [r["fault_load_cases"] for r in load.results]
    stopped = results[0].get("__stopped_after__")
    pwned = any(r["__pwned__"] for r in results) or (shared / "PWNED").exists()
    kinds: Dict[str, int] = {}
    for case, spec in damaged.items():
        kinds[case.split("_", 2)[2]] = kinds.get(case.split("_", 2)[2], 0) + 1
        problems = _judge_case(results, case, spec["culprits"], stopped)
        times = [r[case]["elapsed"] for r in results if case in r]
        damage_row.record(not problems, f"{case} ({spec['what']}): " + "; ".join(problems), max(times, default=None))
    damage_row.notes = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    for case, spec in hostile.items():
        if spec["culprit"] is None:  # must load (the extra files are ignored) and restore the pristine state
            problems = []
            for rank, outcome in enumerate(results):
                result = outcome.get(case)
                if result is None or result["raised"] is not None:
                    problems.append(f"process {rank}: {None if result is None else result['raised']}: "
                                    f"{'' if result is None else result.get('message', '')[:200]}")
                elif result["state_hash"] != pristine_hash:
                    problems.append(f"process {rank}: loaded state differs from the saved one")
                elif result["outside_reads"]:
                    problems.append(f"process {rank}: opened files outside: {result['outside_reads']}")
        else:
            problems = _judge_case(results, case, [spec["culprit"]], stopped)
        times = [r[case]["elapsed"] for r in results if case in r]
        if times and max(times) > 5:
            problems.append(f"took {max(times):.1f} s")
        if pwned:
            problems.append("a pickle payload ran (PWNED exists)")
        hostile_row.record(not problems, f"{case} ({spec['what']}): " + "; ".join(problems), max(times, default=None))
    hostile_row.notes = f"{len(hostile)} cases; payload ran: {'YES' if pwned else 'no'}; outside files opened: " + (
        "YES" if any(r[c]["outside_reads"] for r in results for c in hostile if c in r) else "no")
    return [damage_row, hostile_row]


# -- 5. another number of processes -------------------------------------------------------------------------------
def judge_other_count(saved: harness.GroupResult, loaded: harness.GroupResult, row: Row, label: str) -> None:
    failed = _group_failed(saved, fs.fault_count_save) or _group_failed(loaded, fs.fault_count_load)
    if failed:
        row.record(False, f"{label}: {failed}")
        return
    save = saved.results[0]["fault_count_save"]
    rows = [r["fault_count_load"] for r in loaded.results]
    problems = []
    for rank, r in enumerate(rows):
        if r["raised"] is not None:
            problems.append(f"process {rank}: load raised {r['raised']}: {r['message'][:200]}")
            continue
        if r["state_hash"] != save["state_hash"]:
            problems.append(f"process {rank}: restored state differs from the saved one")
        saving = len(saved.results)
        # the documented rule: processes that existed continue their own streams, new ones derive
        want_draws = saved.results[rank]["fault_count_save"]["draws_after"] if rank < saving else r["expected_draws"]
        if r["draws"] != want_draws:
            problems.append(f"process {rank}: generators do not follow the documented rule (docs/checkpoints.md)")
        want = 1 if rank == 0 and len(rows) > saving else 0
        if len(r["rng_warnings"]) != want:
            problems.append(f"process {rank}: {len(r['rng_warnings'])} derived-generator warnings (want {want})")
    if not problems:
        size = len(rows)
        rest = [x for k in range(len(rows[0]["rows"])) for r in range(size) for x in rows[r]["rows"][k]]
        if rest != save["order"][6:]:
            problems.append(f"data: the rest of the epoch is {rest}, want {save['order'][6:]}")
        if len({json.dumps(r["draws"]) for r in rows}) != size:
            problems.append("some processes share a random stream")
    row.record(not problems, f"{label}: " + "; ".join(problems))


# -- 6. full disk ----------------------------------------------------------------------------------------------------
def judge_enospc(group: harness.GroupResult, rows: Dict[str, Row], cases: List[str]) -> None:
    failed = _group_failed(group, fs.fault_enospc)
    if failed:
        for case in cases:
            rows[case.split(":")[0]].record(False, f"{case}: {failed}")
        return
    results = [r["fault_enospc"] for r in group.results]
    for case in results[0]:
        mode, victim = case.split(":")
        problems = []
        for rank, outcome in enumerate(results):
            r = outcome[case]
            number = int(r["saved_a"].rsplit("_", 1)[1])
            failed_name = f"checkpoint_{number + 1}"
            if r["raised"] != "CheckpointError":
                problems.append(f"process {rank}: raised {r['raised']}"
                                + (f": {r['message'][:200]}" if r["raised"] else ""))
            else:
                missing = [w for w in ("No space left", f"process {victim}") if w not in r["message"]]
                if missing:
                    problems.append(f"process {rank}: message lacks {missing}: {r['message'][:200]!r}")
            if failed_name in r["listing"] or any(".tmp-" in n for n in r["listing"]):
                problems.append(f"process {rank}: after the failed save the folder holds {r['listing']}")
            if r.get("loaded") != r["saved_a"] or not r["loaded_ok"]:
                problems.append(f"process {rank}: load_state() gave {r.get('loaded')} "
                                f"(want {r['saved_a']}, state equal: {r['loaded_ok']}) {r.get('load_error', '')}")
        times = [o[case]["elapsed"] for o in results]
        rows[mode].record(not problems, f"ENOSPC on process {victim}: " + "; ".join(problems), max(times))


# -- 7, 8. preemption: a signal becomes one checkpoint at the same step --------------------------------------
PREEMPTION_RUN = ROOT / "unified" / "testing" / "preemption_run.py"
PREEMPTION_GRACE = 60.0


def _preempted_trial(backend: str, shared: Path, step: int, sig: int, whom: str, size: int) -> tuple:
    """One launched run signalled at ``step``; returns (problems, signal -> committed checkpoint seconds)."""
    log_path = shared / "launch.log"
    with open(log_path, "wb") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "unified", "launch", "-n", str(size), "--backend", backend, "--grace-period",
             f"{PREEMPTION_GRACE:g}", str(PREEMPTION_RUN), str(shared), "t", "--steps", "10", "--signal-at", str(step),
             "--expect-signal", "all" if whom == "launcher" else whom],
            cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **JAX_CACHE})
    ready = [shared / f"t-ready-{rank}" for rank in range(size)]
    deadline = time.monotonic() + 300
    while not all(p.exists() for p in ready):
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()
            launcher.wait()
            return [f"the run never reached step {step}: {_first_line(log_path.read_text(errors='replace'))}"], None
        time.sleep(0.02)
    sent_at = time.time()
    os.kill(launcher.pid if whom == "launcher" else int(ready[int(whom)].read_text()), sig)
    (shared / "t-go").write_text("go")
    try:
        code = launcher.wait(timeout=PREEMPTION_GRACE + 60)
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.wait()
        return ["the launcher did not end"], None
    problems, committed = [], None
    if code != PREEMPTED_EXIT_CODE:
        problems.append(f"launcher exit {code}: {_first_line(log_path.read_text(errors='replace'))}")
    results = []
    for rank in range(size):
        path = shared / f"t-result-{rank}.json"
        if not path.exists():
            problems.append(f"process {rank} wrote no result (killed?)")
            continue
        results.append(json.loads(path.read_text()))
    for rank, r in enumerate(results):
        if not r["preempted"] or r["stopped"] != step or r["saved"] != "checkpoint_0":
            problems.append(f"process {rank}: stopped at {r['stopped']}, preempted {r['preempted']}, "
                            f"saved {r['saved']}")
    folder = shared / "project" / "checkpoints"
    listing = sorted(os.listdir(folder)) if folder.exists() else []
    if listing != ["checkpoint_0"]:
        problems.append(f"checkpoints: {listing}")
    if len(results) == size and all(r["saved_at"] for r in results):
        committed = max(r["saved_at"] for r in results) - sent_at
        if committed > PREEMPTION_GRACE:
            problems.append(f"checkpoint committed {committed:.1f} s after the signal, beyond the grace period")
    return problems, committed


def row_preemption(backend: str, trials: int, rng: random.Random, work: Path, launcher: bool, size: int = 2) -> Row:
    """Rows 7 (a signal to a random worker) and 8 (to the launcher)."""
    row = Row("8 preemption of the launcher" if launcher else "7 preemption of a worker", backend)
    times: List[float] = []
    for t in range(trials):
        shared = work / f"r{8 if launcher else 7}-{backend}-{t}"
        shared.mkdir()
        step, sig = rng.randint(2, 8), rng.choice([signal.SIGTERM, signal.SIGUSR1])
        whom = "launcher" if launcher else str(rng.randrange(size))
        problems, committed = _preempted_trial(backend, shared, step, sig, whom, size)
        if committed is not None:
            times.append(committed)
        row.record(not problems,
                   f"trial {t}: {signal.Signals(sig).name} to {whom} at step {step}: " + "; ".join(problems), committed)
    row.commit_times = times
    if times:
        ordered = sorted(times)
        row.notes = (f"{size} processes via unified launch; signal -> committed checkpoint: median "
                     f"{ordered[len(ordered) // 2]:.2f} s, worst {ordered[-1]:.2f} s, against a {PREEMPTION_GRACE:g} s "
                     "grace period")
    else:
        row.notes = "no checkpoint committed"
    return row


# -- 9-11. several machines: a cut link, a frozen process -------------------------------------------------------
NET_ROWS = {9: ("cut-barrier", "9 link cut during a barrier (2 machines)"),
            10: ("cut-save", "10 link cut during save_state (2 machines)"),
            11: ("freeze", "11 frozen process (SIGSTOP) in a barrier (2 machines)")}


def rows_network(backend: str, trials: int, rng: random.Random, work: Path, timeout: float,
                 wanted: Set[int]) -> List[Row]:
    from unified.testing import multihost
    from unified.testing.netns import unavailable

    rows = []
    reason = unavailable()
    for number, (fault, name) in NET_ROWS.items():
        if number not in wanted:
            continue
        row = Row(name, backend)
        if reason:
            row.notes, row.skipped = f"skipped: {reason}", True
            rows.append(row)
            continue
        times: List[float] = []
        victims = [0, 0]
        ended = 0
        for t in range(trials):
            shared = work / f"r{number}-{backend}-{t}"
            shared.mkdir()
            trial = multihost.run_fault(backend, fault, shared, timeout=timeout, rng=rng)
            victims[trial.victim] += 1
            ended += trial.watchdog_exits
            if trial.to_error is not None:
                times.append(trial.to_error)
            row.record(not trial.problems, f"trial {t} (victim machine {trial.victim}): " + "; ".join(trial.problems),
                       trial.to_error)
        times.sort()
        median = f"{times[len(times) // 2]:.1f} s" if times else "n/a"
        row.notes = (f"timeout {timeout:g} s; victim machine 0/1: {victims[0]}/{victims[1]}; "
                     f"median time to the last error {median}; "
                     f"processes ended by the watchdog (blocked in a device collective): {ended}")
        rows.append(row)
        print(f"  [{backend}] row {number} done ({time.monotonic() - START:.0f} s)", flush=True)
    return rows


# -- 14-15. jobs that heal themselves: unified launch --max-restarts (issue 26) ------------------------------------
RESTARTABLE = ROOT / "tests" / "scripts" / "restartable.py"


def _launch_restartable(backend: str, project: Path, mode: str, restarts: int, timeout: float = 400.0
                        ) -> "tuple[subprocess.CompletedProcess, float]":
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "unified", "launch", "-n", "2", "--backend", backend,
                           "--max-restarts", str(restarts), str(RESTARTABLE), str(project), mode],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": WORKER_PATH, **JAX_CACHE})
    return done, time.monotonic() - start


def _tagged(output: str, tag: str) -> Dict[int, str]:
    import re

    return {int(m.group(1)): m.group(2) for m in re.finditer(rf"^\[(\d+)\] {tag} (.*)$", output, re.M)}


def row_killed_worker_healed(backend: str, trials: int, rng: random.Random, work: Path) -> Row:
    """Row 14: `tests/scripts/restartable.py` (2 processes, 6 steps, a save after each) under
    `unified launch --max-restarts 2`; a random process SIGKILLs itself at a random step, before
    its step (the other is in the step's collectives) or after its save."""
    row = Row("14 worker SIGKILLed, healed by unified launch --max-restarts", backend)
    clean, _ = _launch_restartable(backend, work / f"r14-{backend}-clean", "none", 0)
    expected = {rank: json.loads(text)["hash"] for rank, text in _tagged(clean.stdout, "RESULT").items()}
    if clean.returncode != 0 or sorted(expected) != [0, 1]:
        row.record(False, f"the uninterrupted run failed: {clean.stderr[-1500:]}")
        return row
    gaps: List[float] = []
    for t in range(trials):
        step, rank, when = rng.randint(1, 4), rng.randrange(2), rng.choice(["before-step", "after-save"])
        done, wall = _launch_restartable(backend, work / f"r14-{backend}-{t}", f"kill:{step}:{rank}:{when}", 2)
        got = {r: json.loads(text) for r, text in _tagged(done.stdout, "RESULT").items()}
        problems = []
        if done.returncode != 0:
            problems.append(f"launcher exited {done.returncode}")
        if sorted(got) != [0, 1] or any(got[r]["hash"] != expected[r] for r in got):
            problems.append(f"parameters differ from the uninterrupted run ({got})")
        if any(g.get("restart_count") != 1 for g in got.values()):
            problems.append("not exactly one restart")
        gap = _kill_to_resume(done.stdout, rank, gaps)
        row.record(not problems, f"trial {t}: process {rank} killed at step {step} {when}: " + "; ".join(problems), gap)
    gaps.sort()
    row.notes = ("2 processes, 6 steps, a save per step; kill -> the new attempt's first step: "
                 + (f"median {gaps[len(gaps) // 2]:.1f} s, worst {gaps[-1]:.1f} s" if gaps else "n/a")
                 + "; time = that gap (detection, teardown, start-up, load)")
    return row


def _kill_to_resume(output: str, victim: int, gaps: List[float]) -> Optional[float]:
    """Seconds from the victim's KILLED line to process 0's RESUMED line of the next attempt
    (appended to ``gaps``), or None when either is missing."""
    killed, resumed = _tagged(output, "KILLED"), _tagged(output, "RESUMED")
    if victim not in killed or 0 not in resumed:
        return None
    gaps.append(float(resumed[0]) - float(killed[victim]))
    return gaps[-1]


def row_crash_at_start(backend: str, trials: int, rng: random.Random, work: Path) -> Row:
    """Row 15: every attempt exits 3 before its first step, under `--max-restarts N` (N random in
    1-3): the launcher stops after N restarts, says so, and exits non-zero."""
    row = Row("15 crash at start-up, every attempt", backend)
    for t in range(trials):
        restarts = rng.randint(1, 3)
        done, wall = _launch_restartable(backend, work / f"r15-{backend}-{t}", "crash-at-start", restarts)
        problems = []
        if done.returncode == 0:
            problems.append("the launcher exited 0")
        starts = done.stderr.count("starting the group again")
        if starts != restarts:
            problems.append(f"{starts} restarts, not {restarts}")
        if f"gave up after {restarts} restart(s)" not in done.stderr:
            problems.append("no 'gave up after N restart(s)' line")
        row.record(not problems, f"trial {t} (--max-restarts {restarts}): " + "; ".join(problems), wall)
    row.notes = "--max-restarts 1-3 at random; time = the launcher's whole run (every attempt, then giving up)"
    return row


def row_machine_lost(backend: str, trials: int, rng: random.Random, work: Path) -> Row:
    """Row 16: three machines (network namespaces) under `--num-machines 2:3 --max-restarts 1`;
    after the save of a random step (1-4), machine 1 or 2 (machine 0 hosts the rendezvous) loses
    its cable and its launcher is SIGKILLed: the job must finish on the two left, resumed on 2
    processes with exactly the parameters of the same resume done by hand
    (`unified.testing.multihost.run_machine_loss`)."""
    row = Row("16 machine lost for good, --num-machines 2:3", backend)
    from unified.testing.multihost import resumed_by_hand, run_machine_loss
    from unified.testing.netns import unavailable

    reason = unavailable()
    if reason:
        row.skipped, row.notes = True, f"skipped: {reason}"
        return row
    env = {"PYTHONPATH": WORKER_PATH, **JAX_CACHE}
    references: Dict[int, Dict[int, dict]] = {}
    times: List[float] = []
    for t in range(trials):
        step, victim = rng.randint(1, 4), rng.choice([1, 2])
        if step not in references:
            references[step] = resumed_by_hand(backend, RESTARTABLE, work / f"r16-{backend}-ref{step}", steps=step + 1,
                                               before=3, after=2, env=env)
        shared = work / f"r16-{backend}-{t}"
        shared.mkdir()
        trial = run_machine_loss(backend, RESTARTABLE, shared, victim=victim, step=step, expected=references[step],
                                 env=env)
        if trial.to_end is not None:
            times.append(trial.to_end)
        row.record(not trial.problems, f"trial {t}: machine {victim} lost after step {step}: "
                   + "; ".join(trial.problems), trial.to_end)
    times.sort()
    row.notes = ("3 machines, 1 process each, 6 steps, a save per step; time = from the loss to the end of the job "
                 "(detection 15 s or the collective's timeout 20 s, a new attempt on 2, the rest of the steps): "
                 + (f"median {times[len(times) // 2]:.1f} s" if times else "n/a"))
    return row


# -- 17. the newest checkpoint damaged, the job healed by the launcher (issue 46) --------------------------------------
DAMAGE_KINDS = ("model", "optimizer", "rng", "state")  # restartable.py's damage:...:KIND (state: registered objects)
DAMAGES = [(kind, place) for kind in DAMAGE_KINDS for place in ("header", "data")]  # taken in turn, as row 3's kinds
SKIPPED_WARNING = "load_state(): skipped "  # CheckpointManager._set_aside_damaged's warning


def _resumed_by_hand(backend: str, project: Path, step: int) -> Dict[int, str]:
    """Each process's final parameter hash of the same resume done by hand: restartable.py trains
    to ``step`` - 1 and saves (``until:STEP``), then a fresh launch resumes from that checkpoint
    and trains to the end (`unified.testing.multihost.resumed_by_hand`, on 2 processes both times)."""
    from unified.testing.multihost import resumed_by_hand

    results = resumed_by_hand(backend, RESTARTABLE, project, steps=step, before=2, after=2,
                              env={"PYTHONPATH": WORKER_PATH, **JAX_CACHE})
    got = dict(results)  # rank -> RESULT, parsed
    if sorted(got) != [0, 1] or any(r["loaded"] != f"checkpoint_{step - 1}" for r in got.values()):
        raise RuntimeError(f"the resume by hand did not resume from checkpoint_{step - 1}: {got}")
    return {rank: r["hash"] for rank, r in got.items()}


def _damaged_trial(done: subprocess.CompletedProcess, project: Path, step: int, victim: int,
                   expected: Dict[int, str]) -> List[str]:
    """What is wrong with one run of row 17 (an empty list: it passed)."""
    problems = []
    if done.returncode != 0:
        problems.append(f"launcher exited {done.returncode}: {_first_line(done.stderr)}")
    restarts = done.stderr.count("starting the group again")
    got = {r: json.loads(text) for r, text in _tagged(done.stdout, "RESULT").items()}
    if restarts != 1 or any(g.get("restart_count") != 1 for g in got.values()):
        problems.append(f"not exactly one restart ({restarts} in the log, restart_count "
                        f"{[g.get('restart_count') for g in got.values()]})")
    damaged = {r: json.loads(text) for r, text in _tagged(done.stdout, "DAMAGED").items()}
    newest, previous = f"checkpoint_{step}", f"checkpoint_{step - 1}"
    if sorted(damaged) != [0]:
        problems.append(f"the damage was not done once, by process 0 ({sorted(damaged)})")
        return problems
    damage = damaged[0]
    if damage["checkpoint"] != newest or previous not in damage["listing"]:
        problems.append(f"damaged {damage['checkpoint']} with {damage['listing']} in the folder (want {newest} "
                        f"beside {previous})")
    killed = sorted(_tagged(done.stdout, "KILLED"))
    if killed != [victim]:
        problems.append(f"process {victim} did not die as planned (KILLED from {killed})")
    if sorted(got) != [0, 1]:
        problems.append(f"results from processes {sorted(got)} only: {_first_line(done.stdout)}")
    for rank, r in sorted(got.items()):
        if r.get("loaded") != previous or r.get("first_step") != step:
            problems.append(f"process {rank} resumed from {r.get('loaded')} at step {r.get('first_step')} "
                            f"(want {previous}, step {step})")
        if r["hash"] != expected[rank]:
            problems.append(f"process {rank}'s parameters differ from the same resume done by hand")
    warned = [line for line in (done.stdout + done.stderr).splitlines() if SKIPPED_WARNING in line]
    if len(warned) != 1 or not warned[0].startswith("[0] "):
        problems.append(f"the skipped checkpoint was warned about {len(warned)} time(s), not once by process 0: "
                        + " | ".join(w[:200] for w in warned))
    elif f"{newest}: it is damaged" not in warned[0] or damage["file"] not in warned[0] or \
            f"set aside as {project / 'checkpoints' / newest}.damaged" not in warned[0]:
        problems.append(f"the warning does not name {newest}, {damage['file']} and where it was set aside: "
                        f"{warned[0][:400]}")
    aside = project / "checkpoints" / f"{newest}.damaged"
    if not (aside / damage["file"]).is_file():
        listing = sorted(os.listdir(project / "checkpoints")) if (project / "checkpoints").is_dir() else []
        problems.append(f"{aside.name}/{damage['file']} is not there at the end: {listing}")
    return problems


def row_newest_damaged(backend: str, trials: int, rng: random.Random, work: Path) -> Row:
    """Row 17: `tests/scripts/restartable.py` (2 processes, 6 steps, a save after each,
    ``total_limit=2``) under `unified launch --max-restarts 1`; on the first attempt, after the
    save of a random step (1-4), the main process flips one byte of the newest checkpoint (a
    random file of each kind in turn, in its header or its data, `DAMAGES`), then a random
    process SIGKILLs itself. The next attempt's `load_state(if_exists=True)` must set the damaged checkpoint aside
    and resume from the one before, with exactly the parameters of the same resume done by hand."""
    row = Row("17 newest checkpoint damaged, healed by unified launch --max-restarts", backend)
    references: Dict[int, Dict[int, str]] = {}
    gaps: List[float] = []
    kinds: Dict[str, int] = {}
    steps, victims = [0] * 5, [0, 0]
    for t in range(trials):
        kind, place = DAMAGES[t % len(DAMAGES)]
        step, victim, seed = rng.randint(1, 4), rng.randrange(2), rng.randrange(2**31)
        steps[step] += 1
        victims[victim] += 1
        what = f"trial {t}: {kind} file, {place}, damaged after step {step}, process {victim} killed"
        if step not in references:
            try:
                references[step] = _resumed_by_hand(backend, work / f"r17-{backend}-ref{step}", step)
            except (RuntimeError, subprocess.SubprocessError) as err:
                row.record(False, f"{what}: no reference: {str(err)[-1500:]}")
                continue
        project = work / f"r17-{backend}-{t}"
        try:
            done, wall = _launch_restartable(backend, project, f"damage:{step}:{victim}:{kind}:{place}:{seed}", 1)
        except subprocess.TimeoutExpired:
            row.record(False, f"{what}: the launcher did not end within 400 s")
            continue
        damaged = _tagged(done.stdout, "DAMAGED")
        if 0 in damaged:
            damage = json.loads(damaged[0])
            what += f" ({damage['file']} byte {damage['offset']} of {damage['size']}, {damage['place']})"
            kinds[f"{kind} {damage['place']}"] = kinds.get(f"{kind} {damage['place']}", 0) + 1
        problems = _damaged_trial(done, project, step, victim, references[step])
        gap = _kill_to_resume(done.stdout, victim, gaps)
        row.record(not problems, f"{what}: " + "; ".join(problems), gap)
    gaps.sort()
    row.notes = ("2 processes, 6 steps, a save per step, total_limit 2; damaged after step 1/2/3/4: "
                 f"{'/'.join(map(str, steps[1:]))}; killed process 0/1: {victims[0]}/{victims[1]}; damaged: "
                 + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
                 + "; pass: exit 0 after one restart, resumed from the checkpoint before, one warning (process 0), "
                 "checkpoint_N.damaged kept, parameters of the resume by hand; kill -> the new attempt's first step: "
                 + (f"min {gaps[0]:.1f} s, median {gaps[len(gaps) // 2]:.1f} s, max {gaps[-1]:.1f} s"
                    if gaps else "n/a"))
    return row


# -- driver ------------------------------------------------------------------------------------------------------------
# -- 12. an object store out of reach on one process ------------------------------------------------------
def row_store_unreachable(backend: str, trials: int, rng: random.Random, work: Path) -> Row:
    """All trials in one group of 2 (`scenarios.fault_store_unreachable`): a random victim
    and a random kind of failure (dropped connections, 500, 503 SlowDown) per trial."""
    from unified.testing.object_store import missing_store_packages, s3_server
    from unified.testing.storage_scenarios import STORE_VARIABLE

    row = Row("12 object store out of reach on one process during a save", backend)
    missing = missing_store_packages()
    if missing:
        row.skipped, row.notes = True, missing
        return row
    cases = [[rng.randrange(2), rng.choice(["drop", "500", "503"])] for _ in range(trials)]
    shared = work / f"r12-{backend}"
    shared.mkdir()
    with s3_server() as server:
        group = run_group(backend, 2, [fs.fault_store_unreachable], shared, deadline=60 + 30 * trials,
                          extra_env=_env(shared, **{STORE_VARIABLE: server.bucket(),
                                                    "FAULT_STORE_CASES": json.dumps(cases)}))
    failed = _group_failed(group, fs.fault_store_unreachable)
    if failed:
        for t in range(trials):
            row.record(False, f"trial {t}: {failed}")
        return row
    results = [r["fault_store_unreachable"]["rounds"] for r in group.results]
    for t, (victim, kind) in enumerate(cases):
        got = [rounds[t] for rounds in results]
        problems = []
        for rank, one in enumerate(got):
            if one["error"] is None:
                problems.append(f"process {rank}'s save_state raised nothing")
            elif f"process {victim}" not in one["error"] or "after the storage client's retries" not in one["error"]:
                problems.append(f"process {rank}'s error does not name process {victim}'s object: {one['error'][:200]}")
            if one["loaded"] != one["expected"]:
                problems.append(f"process {rank} did not load the previous checkpoint exactly")
        if got[0]["committed"]:
            problems.append("the failed save was committed")
        row.record(not problems, f"trial {t} (victim {victim}, {kind}): " + "; ".join(problems),
                   max(one["seconds"] for one in got))
    kinds = {k: sum(1 for _, kind in cases if kind == k) for k in ("drop", "500", "503")}
    row.notes = (f"uploads of the victim failed ({', '.join(f'{k}: {n}' for k, n in kinds.items())}), 2 attempts per "
                 "request; pass: every process raises CheckpointError naming the victim's object, nothing committed, "
                 "the previous checkpoint loads exactly; time = until save_state raised")
    return row


# -- 13. the group SIGKILLed while it saves to an object store ------------------------------------------------
def row_store_save_kill(backend: str, trials: int, rng: random.Random, work: Path, max_delay: float) -> Row:
    from unified.testing.object_store import missing_store_packages, s3_server
    from unified.testing.storage_scenarios import STORE_VARIABLE

    row = Row("13 group SIGKILLed during save_state to an object store", backend)
    missing = missing_store_packages()
    if missing:
        row.skipped, row.notes = True, missing
        return row
    with s3_server() as server:
        for t in range(trials):
            shared = work / f"r13-{backend}-{t}"
            shared.mkdir()
            delay = rng.uniform(0.2, max_delay)
            what = f"trial {t} (kill {delay:.2f} s after the first checkpoint)"
            env = _env(shared, **{STORE_VARIABLE: server.bucket(), "UNIFIED_RUN_ID": f"faults-13-{backend}-{t}"})
            failed, got, expected = _kill_then_load(backend, shared, fs.fault_store_save_loop,
                                                    fs.fault_store_load_newest, delay, env, env)
            if failed:
                row.record(False, f"{what}: {failed}")
                continue
            problems = _loaded_as_saved(got, expected)
            if got[0]["uncommitted"]:
                problems.append(f"prefixes without a manifest left after a new save: {got[0]['uncommitted']}")
            if got[0]["unfinished_uploads"]:
                problems.append(f"unfinished uploads left after a new save: {got[0]['unfinished_uploads']}")
            row.record(not problems, f"{what}: " + "; ".join(problems))
    row.notes = ("automatic naming on moto's S3 server, a save after every step; pass: the restarted job (same "
                 "UNIFIED_RUN_ID: it takes the lease over) loads exactly what was saved, and its next save leaves no "
                 "uncommitted prefix and no unfinished upload")
    return row


def run_backend(backend: str, args: argparse.Namespace, rng: random.Random, work: Path, wanted: Set[int]) -> List[Row]:
    rows: List[Row] = []
    if 14 in wanted:
        rows.append(row_killed_worker_healed(backend, args.trials, rng, work))
        print(f"  [{backend}] row 14 done ({time.monotonic() - START:.0f} s)", flush=True)
    if 15 in wanted:
        rows.append(row_crash_at_start(backend, args.trials, rng, work))
        print(f"  [{backend}] row 15 done ({time.monotonic() - START:.0f} s)", flush=True)
    if 16 in wanted:
        rows.append(row_machine_lost(backend, args.trials, rng, work))
        print(f"  [{backend}] row 16 done ({time.monotonic() - START:.0f} s)", flush=True)
    if 17 in wanted:
        rows.append(row_newest_damaged(backend, 1 if args.short else args.trials, rng, work))
        print(f"  [{backend}] row 17 done ({time.monotonic() - START:.0f} s)", flush=True)
    if 12 in wanted:
        rows.append(row_store_unreachable(backend, args.trials, rng, work))
        print(f"  [{backend}] row 12 done ({time.monotonic() - START:.0f} s)", flush=True)
    if 13 in wanted:
        rows.append(row_store_save_kill(backend, args.trials, rng, work, args.max_kill_delay))
        print(f"  [{backend}] row 13 done ({time.monotonic() - START:.0f} s)", flush=True)
    if 1 in wanted:
        rows.append(row_train_kill(backend, args.trials, rng, work, args.timeout, args.train_size))
        print(f"  [{backend}] row 1 done ({time.monotonic() - START:.0f} s)", flush=True)
    if 2 in wanted:
        rows.append(row_save_kill(backend, args.trials, rng, work, args.max_kill_delay))
        print(f"  [{backend}] row 2 done ({time.monotonic() - START:.0f} s)", flush=True)
    for number in (7, 8):
        if number in wanted:
            rows.append(row_preemption(backend, 1 if args.short else args.trials, rng, work, launcher=number == 8))
            print(f"  [{backend}] row {number} done ({time.monotonic() - START:.0f} s)", flush=True)
    if wanted & set(NET_ROWS):
        rows += rows_network(backend, args.trials, rng, work, args.net_timeout, wanted)
    if not wanted & {3, 4, 5, 6}:
        return rows
    shared = work / f"files-{backend}"
    shared.mkdir()
    victims = [0, 1]
    enospc = ",".join(f"{mode}:{v}" for mode in ("sync", "async") for v in victims)
    first = run_group(backend, 2, [fs.fault_save_pristine, fs.fault_count_save, fs.fault_enospc], shared, deadline=240,
                      extra_env=_env(shared, FAULT_COUNT_SAVE_DIR="count_2", FAULT_ENOSPC=enospc))
    third = run_group(backend, 3, [fs.fault_count_load, fs.fault_count_save], shared, deadline=240,
                      extra_env=_env(shared, FAULT_COUNT_LOAD_DIR="count_2", FAULT_COUNT_SAVE_DIR="count_3"))
    cases_root = shared / "cases"
    cases_root.mkdir()
    damaged, hostile = {}, {}
    pristine_failed = _group_failed(first, fs.fault_save_pristine)
    if not pristine_failed:
        damaged = make_damaged(shared / "pristine", shared / "other", cases_root, args.damage_cases, rng)
        hostile = make_hostile(shared / "pristine", cases_root, shared / "outside", shared, rng)
    last = run_group(backend, 2, [fs.fault_count_load, fs.fault_load_cases], shared, deadline=240,
                     extra_env=_env(shared, FAULT_COUNT_LOAD_DIR="count_3", FAULT_CASES="cases"))
    if 3 in wanted or 4 in wanted:
        if pristine_failed:
            for name in ("3 checkpoint damaged at random", "4 hostile checkpoint files"):
                row = Row(name, backend)
                row.record(False, f"could not save the pristine checkpoint: {pristine_failed}")
                rows.append(row)
        else:
            pristine_hash = first.results[0]["fault_save_pristine"]["pristine_hash"]
            rows += [r for r in rows_checkpoint_files(backend, shared, last, damaged, hostile, pristine_hash)
                     if int(r.fault[0]) in wanted]
    if 5 in wanted:
        row = Row("5 resume with another process count", backend)
        judge_other_count(first, third, row, "2 -> 3")
        judge_other_count(third, last, row, "3 -> 2")
        row.notes = "state, data position, RNG rule and warning checked; loads succeed (no error expected)"
        rows.append(row)
    if 6 in wanted:
        enospc_rows = {"sync": Row("6 full disk (ENOSPC), sync save", backend),
                       "async": Row("6 full disk (ENOSPC), async save", backend)}
        judge_enospc(first, enospc_rows, enospc.split(","))
        for row in enospc_rows.values():
            row.notes = "each process once as the victim; time = until save_state / wait_for_checkpoint raised"
        rows += list(enospc_rows.values())
    print(f"  [{backend}] rows 3-6 done ({time.monotonic() - START:.0f} s)", flush=True)
    return rows


def table(rows: List[Row]) -> str:
    lines = ["| fault | backend | trials | passes | worst time to error (s) | notes |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        no_time = r.worst is None or r.fault.split()[0] in ("2", "5")  # rows 2 and 5 expect no error
        worst = "n/a" if no_time else "never" if r.worst == float("inf") else f"{r.worst:.2f}"
        percent = 100.0 * r.passes / r.trials if r.trials else 0.0
        lines.append(f"| {r.fault} | {r.backend} | {r.trials} | {r.passes} ({percent:.0f}%) | {worst} | {r.notes} |")
    return "\n".join(lines)


def picture(rows: List[Row]) -> None:
    """faults.png: the share of passing trials per row and backend (the counts over the bars);
    faults-preemption.png: signal -> committed checkpoint of every trial of rows 7-8."""
    from benchmarks import plot

    ran = sorted((r for r in rows if r.trials and not r.skipped), key=lambda r: int(r.fault.split()[0]))  # stable
    passed = {r.fault: {} for r in ran}
    counts = {r.fault: {} for r in ran}
    for r in ran:
        passed[r.fault][r.backend] = [100.0 * r.passes / r.trials]
        counts[r.fault][r.backend] = f"{r.passes}/{r.trials}"
    plot.draw(plot.image("faults"), "fault trials per row and backend", "% of trials passed", passed, labels=counts,
              subtitle="bar: the share of trials that passed; over it: passes / trials")
    commits = {}
    for r in sorted(rows, key=lambda r: int(r.fault.split()[0])):
        if r.commit_times:
            commits.setdefault(r.fault, {})[r.backend] = r.commit_times
    if commits:
        plot.draw(plot.image("faults", "preemption"), f"preemption: signal -> committed checkpoint "
                  f"(grace period {PREEMPTION_GRACE:g} s)", "seconds", commits)


START = time.monotonic()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__.split("\n")[0])
    parser.add_argument("--short", action="store_true", help="CI mode: 2 trials per row, 10 damage cases")
    parser.add_argument("--backends", default=",".join(b for b in ("torch", "jax") if importlib.util.find_spec(b)))
    parser.add_argument("--trials", type=int, default=None,
                        help="trials of rows 1, 2 and 7-17 (20; --short: 2, rows 7, 8 and 17: 1)")
    parser.add_argument("--damage-cases", type=int, default=None, help="damaged copies for row 3 (100; --short: 10)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="the Accelerator timeout in row 1 (10 s; --short: 5 s)")
    parser.add_argument("--max-kill-delay", type=float, default=None,
                        help="row 2 kills 0.2 s to this many seconds after the first checkpoint (3; --short: 1.5)")
    parser.add_argument("--no-jax-cache", action="store_true",
                        help="no persistent JAX compilation cache for the groups")
    parser.add_argument("--train-size", type=int, default=None, help="processes in row 1 (3; --short: 2)")
    parser.add_argument("--seed", type=int, default=None, help="seed of every random choice (default: time)")
    parser.add_argument("--net-timeout", type=float, default=5.0, help="the Accelerator timeout in rows 9-11 (5 s)")
    parser.add_argument("--rows", default=None,
                        help="rows to run (default: all; --short: 1-6: unified/testing/suite/test_preemption.py "
                             "covers 7-8 and tests/test_multihost_netns.py 9-11 in CI)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--verbose", action="store_true", help="print every group's wall time")
    parser.add_argument("--no-picture", action="store_true",
                        help="do not draw the pictures (by default docs/benchmarks/img/faults*.png; needs matplotlib)")
    args = parser.parse_args(argv)
    global VERBOSE
    VERBOSE = args.verbose
    args.trials = args.trials if args.trials is not None else (2 if args.short else 20)
    args.damage_cases = args.damage_cases if args.damage_cases is not None else (10 if args.short else 100)
    args.train_size = args.train_size if args.train_size is not None else (2 if args.short else 3)
    args.timeout = args.timeout if args.timeout is not None else (5.0 if args.short else 10.0)
    args.max_kill_delay = args.max_kill_delay if args.max_kill_delay is not None else (1.5 if args.short else 3.0)
    seed = args.seed if args.seed is not None else int(time.time())
    args.rows = args.rows or ("1,2,3,4,5,6" if args.short else "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17")
    wanted = {int(x) for x in args.rows.split(",")}
    work = Path(tempfile.mkdtemp(prefix="unified-faults-"))
    if not args.no_jax_cache:
        JAX_CACHE.update(JAX_COMPILATION_CACHE_DIR=str(work / "jax-cache"),
                         JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=str(ROOT), capture_output=True,
                                text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    print(f"fault benchmark: backends {args.backends}, seed {seed}, trials {args.trials}, damage cases "
          f"{args.damage_cases}, code {commit}, work dir {work}", flush=True)
    rows: List[Row] = []
    for backend in args.backends.split(","):
        rows += run_backend(backend, args, random.Random(f"{seed}/{backend}"), work, wanted)
    elapsed = time.monotonic() - START
    print()
    print(table(rows))
    print(f"\n{sum(r.trials for r in rows)} trials in {elapsed:.0f} s (seed {seed}; rerun with --seed {seed})")
    if not args.no_picture:
        picture(rows)
    failing = [r for r in rows if not r.skipped and (r.passes < r.trials or not r.trials)]
    for r in failing:
        print(f"\nFAILED: {r.fault} [{r.backend}] {r.passes}/{r.trials}")
        for what in r.failures[:10]:
            print(f"  - {what}")
        if len(r.failures) > 10:
            print(f"  ... and {len(r.failures) - 10} more")
    if args.keep or failing:
        print(f"\nwork directory kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failing else 0
