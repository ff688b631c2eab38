"""What the benchmarks that measure inside a launched group share: process 0 reports one JSON
line, and the parent launches the script on 2 processes per backend (or as many as it asks for)
and reads that line back."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

ROOT = Path(__file__).resolve().parents[1]
MARKER = "UNIFIED_BENCH_JSON "


def report(result: dict) -> None:
    """Print a worker's result for the parent (call on process 0 only)."""
    print(MARKER + json.dumps(result), flush=True)


def run_launched(script: str, backend: str, worker_args: List[str], timeout: float, processes: int = 2) -> Optional[dict]:
    """``unified launch -n 2 --backend B script --worker ...`` (``processes`` instead of 2);
    process 0's `report`, with the group's wall time as ``wall_s``, or None (and the output on
    stderr) when there is none."""
    command = [sys.executable, "-m", "unified", "launch", "-n", str(processes), "--backend", backend,
               str(Path(script).resolve()), "--worker", *worker_args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    proc = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    pattern = re.compile(r"^\[0\]\s*" + re.escape(MARKER) + r"(.*)$")
    for line in proc.stdout.splitlines():
        match = pattern.match(line)
        if match:
            return {**json.loads(match.group(1)), "wall_s": time.monotonic() - started}
    sys.stderr.write(f"{backend}: no result (exit code {proc.returncode}); output:\n{proc.stdout}\n")
    return None


def launch_each(script: str, backends: str, worker_args: List[str], timeout: float,
                describe: Callable[[dict], str]) -> Optional[List[dict]]:
    """`run_launched` for each of the comma-separated ``backends``, a line per group on stderr
    (``describe(result)`` and its wall time); None as soon as one group gives no result."""
    results = []
    for backend in [b.strip() for b in backends.split(",") if b.strip()]:
        result = run_launched(script, backend, worker_args, timeout)
        if result is None:
            return None
        results.append(result)
        print(f"{backend}: {describe(result)}, {result['wall_s']:.1f} s", file=sys.stderr)
    return results
