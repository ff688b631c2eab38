"""Several `unified launch` "machines" on loopback, one launcher each, for tests."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Sequence

from unified.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
# machine 0's own check, then torch's store and JAX's coordinator when the port went in between
PORT_TAKEN = ("is in use", "EADDRINUSE", "Failed to start RPC server")


def launch_machines(count: int, launch_args: Sequence[str], script: Sequence[str], timeout: float = 300,
                    tries: int = 3) -> List[subprocess.CompletedProcess]:
    """Start ``count`` launchers (``--machine-rank`` 0..count-1, machine 0 at 127.0.0.1 on a free
    port) and wait for them all; each one's exit code and output (stderr in stdout). Relaunched
    on a new port when another test took the port between free_port() and the listen."""
    for _ in range(tries):
        common = ["--num-machines", str(count), "--main-process-ip", "127.0.0.1",
                  "--main-process-port", str(free_port()), *launch_args, *map(str, script)]
        machines = [subprocess.Popen([sys.executable, "-m", "unified", "launch", "--machine-rank", str(rank), *common],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
                    for rank in range(count)]
        try:
            first, _ = machines[0].communicate(timeout=timeout)
            if machines[0].returncode != 0 and any(sign in first for sign in PORT_TAKEN):
                continue  # the others waited for machine 0: stopped below
            runs = [subprocess.CompletedProcess(machines[0].args, machines[0].returncode, first)]
            for proc in machines[1:]:
                out, _ = proc.communicate(timeout=timeout)
                runs.append(subprocess.CompletedProcess(proc.args, proc.returncode, out))
            return runs
        finally:
            for proc in machines:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.communicate()
    raise AssertionError(f"the port was taken {tries} times in a row:\n{first}")
