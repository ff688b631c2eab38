"""What the benchmarks that measure inside a launched group share: process 0 reports one JSON
line, and the parent launches the script on 2 processes per backend and reads that line back."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]
MARKER = "UNIFIED_BENCH_JSON "


def report(result: dict) -> None:
    """Print a worker's result for the parent (call on process 0 only)."""
    print(MARKER + json.dumps(result), flush=True)


def run_launched(script: str, backend: str, worker_args: List[str], timeout: float) -> Optional[dict]:
    """``unified launch -n 2 --backend B script --worker ...``; process 0's `report`, with the
    group's wall time as ``wall_s``, or None (and the output on stderr) when there is none."""
    command = [sys.executable, "-m", "unified", "launch", "-n", "2", "--backend", backend,
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
