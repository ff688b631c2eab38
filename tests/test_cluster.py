"""Running on a cluster (docs/cluster.md), in a simulated SLURM job on this machine.

- The SLURM recipe of docs/cluster.md, run as written by bash (SLURM's variables set, ``scontrol``
  replaced by a stub that records its arguments): SIGUSR1 to the batch shell, as
  ``--signal=B:USR1@120`` sends it, ends the run with a checkpoint, exit status 75 and a requeue;
  the requeued run resumes from that checkpoint and finishes.
- JAX started by ``srun`` without our launcher (JAX's own SLURM detection forms the group): every
  process takes its local index and count from SLURM's variables, so that
  ``local_main_process_first`` orders the processes of one machine.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import BACKENDS

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="bash, signals")]
ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "unified" / "testing" / "preemption_run.py"
DEADLINE = 300
# Variables srun would set that make our processes (or JAX) think they run in a group: cleared.
GROUP_VARIABLES = ("UNIFIED_PROCESS_ID", "UNIFIED_NUM_PROCESSES", "UNIFIED_LOCAL_PROCESS_ID",
                   "UNIFIED_LOCAL_NUM_PROCESSES", "UNIFIED_COORDINATOR_ADDRESS", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                   "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _recipe() -> str:
    page = (ROOT / "docs" / "cluster.md").read_text()
    found = re.search(r"<!-- slurm-recipe -->\n```bash\n(.*?)```\n", page, re.S)
    assert found, "docs/cluster.md lost its SLURM recipe block"
    return found.group(1)


def _job_env(tmp_path: Path, job_id: str) -> dict:
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    scontrol = stub / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    scontrol.chmod(0o755)
    unified = stub / "unified"  # the console script, from this checkout's interpreter
    unified.write_text(f"#!/bin/sh\nexec {sys.executable} -m unified \"$@\"\n")
    unified.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in GROUP_VARIABLES}
    env.update(PATH=f"{stub}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID=job_id, SLURM_NODELIST="localhost",
               SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0",
               SLURM_NODEID="0", SLURM_JOB_NUM_NODES="1", PYTHONPATH=str(ROOT))
    return env


# One backend is enough (the recipe exercises the launcher and the shell): the first by name, JAX
# when installed, whose launch inside a SLURM job tests/test_launcher.py checks too.
@pytest.mark.parametrize("backend", sorted(BACKENDS)[:1])
def test_the_slurm_recipe_checkpoints_requeues_and_resumes(backend, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()

    def batch(tag: str, *args: str) -> str:
        script = _recipe().replace("--num-processes 4", f"--num-processes 2 --backend {backend}").replace(
            "train.py", f"{RUN} {shared} {tag} --steps 10 {' '.join(args)}")
        path = tmp_path / f"{tag}.sbatch"
        path.write_text(script)
        return str(path)

    env = _job_env(tmp_path, "4242")
    with open(tmp_path / "first.log", "wb") as log:
        shell = subprocess.Popen(["bash", batch("first", "--signal-at", "3", "--expect-signal", "all")],
                                 cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    ready = [shared / f"first-ready-{rank}" for rank in (0, 1)]
    deadline = time.monotonic() + DEADLINE
    while not all(p.exists() for p in ready):
        assert shell.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
        time.sleep(0.05)
    shell.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 does
    (shared / "first-go").write_text("go")
    first_code = shell.wait(timeout=DEADLINE)
    log = (tmp_path / "first.log").read_text(errors="replace")
    assert first_code == 75, log
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"], log
    assert sorted(os.listdir(shared / "project" / "checkpoints")) == ["checkpoint_0"]
    first = [json.loads((shared / f"first-result-{r}.json").read_text()) for r in (0, 1)]
    assert all(r["preempted"] and r["stopped"] == 3 for r in first), first

    second = subprocess.run(["bash", batch("second")], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=DEADLINE)
    assert second.returncode == 0, second.stdout + second.stderr
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]  # no second requeue
    results = [json.loads((shared / f"second-result-{r}.json").read_text()) for r in (0, 1)]
    assert all(r["loaded"] == "checkpoint_0" and r["start"] == 3 and r["steps"] == 10 for r in results), results


LOCAL_SCRIPT = """
import json, sys, time
import unified
acc = unified.Accelerator(backend="jax", timeout=60)
with acc.local_main_process_first():
    entered = time.time()
    time.sleep(0.5 if acc.is_local_main_process else 0)
    left = time.time()
print("RESULT " + json.dumps({"index": acc.process_index, "local": acc.local_process_index,
                              "local_count": acc._backend.local_num_processes, "num": acc.num_processes,
                              "local_main": acc.is_local_main_process, "entered": entered, "left": left}), flush=True)
acc.end_training()
if acc.process_index != 0:  # outlive process 0, which hosts JAX's coordination service here
    time.sleep(1.5)
"""


def _slurm_job_id_with_a_free_port() -> str:
    """JAX's SLURM detection puts the coordinator at port 61440 + job id % 4096."""
    for job in range(1000, 1000 + 4096, 37):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", 61440 + job % 4096))
                return str(job)
            except OSError:
                continue
    pytest.skip("no free port in JAX's SLURM range")


@pytest.mark.skipif("jax" not in BACKENDS, reason="jax is not installed")
def test_jax_under_srun_takes_the_local_index_from_slurm(tmp_path):
    """srun -n 3 on one node: SLURM_LOCALID 0..2, SLURM_STEP_TASKS_PER_NODE=3. Process 0 hosts
    the coordination service and ends first: the others must not be aborted by its exit."""
    script = tmp_path / "local.py"
    script.write_text(LOCAL_SCRIPT)
    env = _job_env(tmp_path, _slurm_job_id_with_a_free_port())
    env.update(SLURM_NTASKS="3", SLURM_STEP_TASKS_PER_NODE="3", SLURM_TASKS_PER_NODE="3")
    procs = [subprocess.Popen([sys.executable, str(script)],
                              env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(3)]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=DEADLINE)[0])
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail("the srun-started group did not finish")
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    rows = [json.loads(line.split("RESULT ", 1)[1])
            for out in outputs for line in out.splitlines() if "RESULT " in line]
    assert (sorted((r["index"], r["local"], r["local_count"], r["num"]) for r in rows)
            == [(i, i, 3, 3) for i in range(3)])
    main = next(r for r in rows if r["local_main"])
    assert [r["local_main"] for r in sorted(rows, key=lambda r: r["index"])] == [True, False, False]
    assert all(r["entered"] >= main["left"] for r in rows if not r["local_main"]), rows
