"""What `unified launch` starts on one machine (`LaunchPlan`) and how a backend starts it
(`Launcher`, named by the backend's spec): the default runs the backend's rendezvous service on
machine 0 and the workers directly, each told its place by a
`unified.runtime.environment.ProcessEnvironment`; a backend may start its workers otherwise (torch:
through torchrun).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..logging import PROGRESS_INTERVAL
from ..runtime.environment import BACKEND_VARIABLE, LAUNCHER_BACKEND_VARIABLE, ProcessEnvironment
from .processes import Worker

__all__ = ["LaunchPlan", "Launcher", "VERBOSE_VARIABLE", "PROGRESS_ENV"]

# `unified launch --verbose`: a backend's launcher (torchrun) shows its own output unfiltered
VERBOSE_VARIABLE = "UNIFIED_LAUNCH_VERBOSE"
# Workers write into pipes, whose lines we copy: tqdm bars (plain tqdm too, through its own
# variables) refresh at most every PROGRESS_INTERVAL seconds instead of every 0.1 s. A variable
# already set in our environment wins.
PROGRESS_ENV = {"TQDM_MININTERVAL": f"{PROGRESS_INTERVAL:g}", "TQDM_MAXINTERVAL": f"{PROGRESS_INTERVAL:g}"}


@dataclass(frozen=True)
class LaunchPlan:
    """What `unified launch` was asked to start on this machine."""

    backend: str
    num_processes: int           # per machine
    num_machines: int
    machine_rank: int
    main_process_ip: str
    port: int
    command: List[str]           # the script and its arguments
    # processes of every machine, when they differ (the test suite's 2 + 1 layout); else
    # ``num_processes`` on each. ``num_processes`` is then this machine's entry.
    machine_sizes: Tuple[int, ...] = ()

    @property
    def address(self) -> str:
        return f"{self.main_process_ip}:{self.port}"

    @property
    def total(self) -> int:
        """Processes in the whole group."""
        return sum(self.machine_sizes) if self.machine_sizes else self.num_processes * self.num_machines

    @property
    def first_index(self) -> int:
        """The group index of this machine's first process."""
        if self.machine_sizes:
            return sum(self.machine_sizes[: self.machine_rank])
        return self.machine_rank * self.num_processes

    def base_env(self) -> Dict[str, str]:
        """This environment plus the chosen backend, unbuffered output, sparse progress bars."""
        return {**PROGRESS_ENV, **os.environ, LAUNCHER_BACKEND_VARIABLE: self.backend, BACKEND_VARIABLE: self.backend,
                "PYTHONUNBUFFERED": "1"}

    def processes(self, hosted: bool) -> List[ProcessEnvironment]:
        """This machine's processes; ``hosted``: the launcher runs the rendezvous service."""
        return [ProcessEnvironment(self.first_index + local, self.total, local, self.num_processes,
                                   coordinator=self.address, service_hosted=hosted)
                for local in range(self.num_processes)]


class Launcher:
    """How a group of one backend is started (a backend's spec names an instance).

    The default: machine 0 runs `service_argv` (the rendezvous service, when there is one) in a
    child of its own, and every machine starts its workers with `process_env`
    (`direct_workers`). Override `workers` to start them another way (torch uses torchrun's
    agent); `direct_workers` stays what the group's processes are when nothing sits between them
    and the launcher (the conformance suite starts its groups so, to see each process's exit).
    """

    def process_env(self, process: ProcessEnvironment) -> Dict[str, str]:
        """The variables that make a worker join its group as ``process``."""
        return process.to_env()

    def service_argv(self, address: str, num_processes: int) -> Optional[List[str]]:
        """The command of the rendezvous service run beside the workers, or ``None``."""
        return None

    def workers(self, plan: LaunchPlan) -> List[Worker]:
        """This machine's children for `unified launch` (default: `direct_workers`)."""
        return self.direct_workers(plan)

    def direct_workers(self, plan: LaunchPlan) -> List[Worker]:
        """This machine's children started directly: the service (machine 0) and the workers."""
        service = self.service_argv(plan.address, plan.total)
        workers = []
        if plan.machine_rank == 0 and service:
            name = service[2].rsplit(".", 1)[-1] if len(service) > 2 and service[1] == "-m" else "service"
            workers.append(Worker(service, {**plan.base_env(), "TF_CPP_MIN_LOG_LEVEL": "2"},
                                  lambda line: f"[{name}] {line}", service=True))
        for process in plan.processes(hosted=bool(service)):
            workers.append(Worker([sys.executable, *plan.command], {**plan.base_env(), **self.process_env(process)},
                                  lambda line, i=process.process_index: f"[{i}] {line}",
                                  process_index=process.process_index))
        return workers
