"""How a torch group starts: torchrun's variables for one process, the TCPStore beside the
workers (`backends.torch.coordinator`), and `unified launch` through torch's own elastic launcher
(torchrun)."""
from __future__ import annotations

import os
import re
import sys
from typing import Dict, List, Optional

from unified.launcher.parent_watch import PARENT_VARIABLE, watched
from unified.launcher.plan import VERBOSE_VARIABLE, Launcher, LaunchPlan
from unified.launcher.processes import Worker
from unified.runtime.environment import ProcessEnvironment


class TorchrunLauncher(Launcher):
    """torchrun starts this machine's workers; its rank tags are made global."""

    def process_env(self, process: ProcessEnvironment) -> Dict[str, str]:
        """torchrun's variables (``init_process_group`` reads them), for a group whose store
        is hosted at ``process.coordinator``."""
        host, port = (process.coordinator or "127.0.0.1:29500").rsplit(":", 1)
        return {
            "MASTER_ADDR": host, "MASTER_PORT": port, "RANK": str(process.process_index),
            "WORLD_SIZE": str(process.num_processes), "LOCAL_RANK": str(process.local_process_index),
            "LOCAL_WORLD_SIZE": str(process.local_num_processes), "OMP_NUM_THREADS": "1",
            "TORCHELASTIC_USE_AGENT_STORE": "True" if process.service_hosted else "False",
        }

    def service_argv(self, address: str, num_processes: int) -> Optional[List[str]]:
        return [sys.executable, "-m", "backends.torch.coordinator", address, str(num_processes)]

    def workers(self, plan: LaunchPlan) -> List[Worker]:
        args = [
            "--nproc-per-node", str(plan.num_processes),
            "--nnodes", str(plan.num_machines),
            "--node-rank", str(plan.machine_rank),
            "--master-addr", plan.main_process_ip,
            "--master-port", str(plan.port),
            "--tee", "3",
            # torchrun starts each worker in a session of its own; through the wrapper, the worker
            # dies with torchrun (torchrun adds "python -u" itself without --no-python)
            "--no-python", *watched([sys.executable, "-u", *plan.command]),
        ]
        argv = [sys.executable, "-m", "torch.distributed.run", *args]
        # torchrun sets 1 itself when it is unset, with a banner on every launch: set it first, same value
        env = {**plan.base_env(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        output = TorchrunOutput(plan.first_index, plan.command[0], verbose=os.environ.get(VERBOSE_VARIABLE) == "1")
        # --max-restarts: the next attempt's torchrun is started ahead as this module (`serve_as_spare`)
        spare = ([sys.executable, "-m", "backends.torch.launch"], args)
        return [Worker(argv, env, output.label, agent=True, spare=spare)]


class TorchrunOutput:
    """What `unified launch` shows of one torchrun's output: the workers' lines (tagged
    ``[rankN]:`` by ``--tee``) under their global process index; of torchrun's own, what is news to
    the user. Its agent log lines (``W1206 07:28:49.33 ... elastic/...``) and the
    ``ChildFailedError`` traceback with its failure report are left out: the launcher says in its
    own words that a process failed and stopped the others; the report's root cause is kept as one
    line. The ``SignalException`` traceback of a torchrun stopped by a signal is left out too (the
    launcher stops it when the attempt ended on another machine, and says so). Any other traceback
    of torchrun's (it could not start, say) is shown whole. ``verbose``: everything, as torchrun
    printed it (``unified launch --verbose``).

    Example:
        >>> out = TorchrunOutput(first_index=2, script="train.py")
        >>> out.label("[rank1]:step 3"), out.label(
        ...     "W1206 07:28:49.337000 19038 torch/distributed/elastic/api.py:1028] x")
        ('[3] step 3', None)
    """

    _TAG = re.compile(r"\[(?:default|rank)(\d+)\]:")
    _AGENT_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/")
    _ROOT_CAUSE = re.compile(r"^\s*rank\s*:\s*(\d+)|^\s*exitcode\s*:\s*(-?\d+)(?:.*\((SIG\w+)\))?")

    def __init__(self, first_index: int, script: str, verbose: bool = False) -> None:
        self.offset, self.verbose = first_index, verbose
        # torchrun's failure summary names the first argument of the worker command, the wrapper
        self.wrapper_failed, self.script_failed = f"{watched([])[2]} FAILED", f"{script} FAILED"
        self.held: Optional[List[str]] = None  # a traceback of torchrun's, until its exception is known
        self.report = False                      # inside ChildFailedError's report
        self.cause: Dict[str, str] = {}

    def label(self, line: str) -> Optional[str]:
        match = self._TAG.match(line)
        if match:  # torchrun tags every fragment it copies, so tags can also stand after a "\r" mid-line
            return self._TAG.sub(lambda m: f"[{self.offset + int(m.group(1))}] ", line)
        line = line.replace(self.wrapper_failed, self.script_failed)
        if self.verbose:
            return f"[launcher] {line}"
        if self.report:
            return self._in_report(line)
        if self.held is not None:
            if line.startswith("torch.distributed.elastic.multiprocessing.errors.ChildFailedError"):
                self.held, self.report = None, True
                return None
            if line.startswith("torch.distributed.elastic.multiprocessing.api.SignalException"):
                self.held = None  # stopped by a signal (ours, on another machine's failure): the launcher says so
                return None
            self.held.append(line)
            if line and not line.startswith(" "):  # the exception line of another traceback: show it whole
                shown, self.held = self.held, None
                return "\n".join(f"[launcher] {held}" for held in shown)
            return None
        if line.startswith("Traceback (most recent call last):"):
            self.held = [line]
            return None
        if self._AGENT_LOG.match(line) or line.strip("* ") == "" or "Setting OMP_NUM_THREADS" in line:
            return None
        return f"[launcher] {line}"

    def _in_report(self, line: str) -> Optional[str]:
        """ChildFailedError's report: keep its root cause (the last ``rank``/``exitcode`` in it)."""
        found = self._ROOT_CAUSE.match(line)
        if found and found.group(1):
            self.cause["rank"] = found.group(1)
        elif found and found.group(2):
            self.cause["code"] = found.group(2) + (f" ({found.group(3)})" if found.group(3) else "")
        if "Root Cause" in line:
            self.cause = {}
        if line.startswith("=====") and self.cause.get("rank") and "code" in self.cause:
            self.report = False
            return ("[launcher] torchrun: the first process to fail was process "
                    f"{self.offset + int(self.cause['rank'])}, exit code {self.cause['code']}")
        return None


LAUNCHER = TorchrunLauncher()


def serve_as_spare() -> None:
    """torchrun started before its arguments are known (`unified.launcher.processes.Spares`): import torch
    (the slow part of torchrun's start, about 1 s) now, then read ``{"args", "env"}`` from stdin
    and run torchrun with them in this process. End quietly when stdin closes first (the spare
    was not needed)."""
    import json
    import os

    import torch.distributed.run as torchrun

    line = sys.stdin.readline()
    if not line:
        return
    order = json.loads(line)
    own_pid = str(os.getpid())
    os.environ.clear()
    os.environ.update(order["env"])
    os.environ[PARENT_VARIABLE] = own_pid  # the workers' wrapper expects this process as their parent
    torchrun.main(order["args"])


if __name__ == "__main__":
    serve_as_spare()
