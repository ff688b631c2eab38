"""How a torch group starts: torchrun's variables for one process, the TCPStore beside the
workers (`backends.torch.coordinator`), and `unified launch` through torch's own elastic launcher
(torchrun)."""
from __future__ import annotations

import re
import sys
from typing import Dict, List, Optional

from unified.environment import ProcessEnvironment
from unified.launch import Launcher, LaunchPlan, Worker
from unified.parent_watch import PARENT_VARIABLE, watched


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
        offset = plan.first_index
        tag = re.compile(r"\[(?:default|rank)(\d+)\]:")
        # torchrun's failure summary names the first argument of the worker command, the wrapper
        wrapper_failed, script_failed = f"{watched([])[2]} FAILED", f"{plan.command[0]} FAILED"

        def label(line: str) -> str:
            match = tag.match(line)
            if not match:
                return f"[launcher] {line.replace(wrapper_failed, script_failed)}"
            # torchrun tags every fragment it copies, so tags can also stand after a "\r" mid-line
            return tag.sub(lambda m: f"[{offset + int(m.group(1))}] ", line)

        # --max-restarts: the next attempt's torchrun is started ahead as this module (`serve_as_spare`)
        spare = ([sys.executable, "-m", "backends.torch.launch"], args)
        return [Worker(argv, plan.base_env(), label, agent=True, spare=spare)]


LAUNCHER = TorchrunLauncher()


def serve_as_spare() -> None:
    """torchrun started before its arguments are known (`unified.launch.Spares`): import torch
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
