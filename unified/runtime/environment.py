"""Who this process is in its group, read from (and written to) environment variables in one place.

A launcher describes each process it starts with a `ProcessEnvironment` and exports it with
`to_env`; backends, logging and the test harness read it back with `from_env`. The variables
are ``UNIFIED_*``; torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, the
de-facto convention of most launchers, are read when ours are absent.
"""
from __future__ import annotations

import dataclasses
import os
import re
import uuid
from typing import Dict, List, Mapping, Optional, Tuple

__all__ = ["ProcessEnvironment", "BACKEND_VARIABLE", "LAUNCHER_BACKEND_VARIABLE", "RESTART_VARIABLE", "RUN_VARIABLE",
           "run_identity", "IN_PLACE_VARIABLE", "LOAD_COPY_VARIABLE", "restart_count", "cluster_local_process",
           "visible_gpus", "local_device_share"]

# The backend a user asked for, and the one `unified launch` started the group with.
BACKEND_VARIABLE = "UNIFIED_BACKEND"
LAUNCHER_BACKEND_VARIABLE = "UNIFIED_LAUNCHER_BACKEND"
# The attempt `unified launch --max-restarts` is on (0 for the first); torchrun's own is read too.
RESTART_VARIABLE = "UNIFIED_RESTART_COUNT"
IN_PLACE_VARIABLE = "UNIFIED_IN_PLACE_MIN_BYTES"  # loads read arrays this large into place (checkpoint.manager)
# "0": a load from an object store downloads each file twice (verify, then fill) instead of
# keeping the verified copy on the local disk in between (checkpoint.manager)
LOAD_COPY_VARIABLE = "UNIFIED_STORE_LOAD_COPY"
RUN_VARIABLE = "UNIFIED_RUN_ID"  # set once per `unified launch`, kept across its restarts (checkpoint.lease)


def restart_count(environ: Optional[Mapping[str, str]] = None) -> int:
    """How many times the launcher restarted this job's group before this attempt (0 without one)."""
    environ = os.environ if environ is None else environ
    for name in (RESTART_VARIABLE, "TORCHELASTIC_RESTART_COUNT"):
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0

_OURS = {
    "process_index": "UNIFIED_PROCESS_ID",
    "num_processes": "UNIFIED_NUM_PROCESSES",
    "local_process_index": "UNIFIED_LOCAL_PROCESS_ID",
    "local_num_processes": "UNIFIED_LOCAL_NUM_PROCESSES",
}
_COMMON = {
    "process_index": "RANK",
    "num_processes": "WORLD_SIZE",
    "local_process_index": "LOCAL_RANK",
    "local_num_processes": "LOCAL_WORLD_SIZE",
}
_COORDINATOR = "UNIFIED_COORDINATOR_ADDRESS"
_HOSTED = "UNIFIED_COORDINATOR_HOSTED"


@dataclasses.dataclass(frozen=True)
class ProcessEnvironment:
    """One process's place in its group, as its launcher announced it.

    Attributes:
        process_index: index in ``0 .. num_processes - 1``.
        num_processes: processes in the group.
        local_process_index: index among the processes of this machine.
        local_num_processes: processes on this machine.
        coordinator: ``host:port`` of the group's rendezvous service, when the launcher set one.
        service_hosted: the launcher runs that service in a process of its own (no worker
            hosts it, so no worker's exit takes it down).

    Example:
        >>> env = ProcessEnvironment(process_index=1, num_processes=2, coordinator="127.0.0.1:29500")
        >>> ProcessEnvironment.from_env(env.to_env()) == env
        True
    """

    process_index: int = 0
    num_processes: int = 1
    local_process_index: int = 0
    local_num_processes: int = 1
    coordinator: Optional[str] = None
    service_hosted: bool = False

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "ProcessEnvironment":
        """Read the variables of ``environ`` (default: ``os.environ``); a plain process is
        process 0 of 1."""
        environ = os.environ if environ is None else environ

        def number(field: str, default: int) -> int:
            for names in (_OURS, _COMMON):
                value = environ.get(names[field], "").strip()
                if value.isdigit():
                    return int(value)
            return default

        return cls(
            process_index=number("process_index", 0),
            num_processes=number("num_processes", 1),
            local_process_index=number("local_process_index", 0),
            local_num_processes=number("local_num_processes", 1),
            coordinator=environ.get(_COORDINATOR) or None,
            service_hosted=environ.get(_HOSTED) == "1",
        )

    def to_env(self) -> Dict[str, str]:
        """The ``UNIFIED_*`` variables that make `from_env` return this description."""
        env = {name: str(getattr(self, field)) for field, name in _OURS.items()}
        if self.coordinator:
            env[_COORDINATOR] = self.coordinator
        env[_HOSTED] = "1" if self.service_hosted else "0"
        return env

    @property
    def distributed(self) -> bool:
        """True when the launcher described a group of several processes."""
        return self.num_processes > 1


def _slurm_tasks_per_node(value: str) -> List[int]:
    """SLURM's compact per-node task counts (``"2(x3),1"``) expanded: ``[2, 2, 2, 1]``."""
    counts: List[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            return []
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def cluster_local_process(environ: Optional[Mapping[str, str]] = None) -> Optional[Tuple[int, int]]:
    """``(local index, local count)`` of this process from a scheduler's variables, for a group
    formed without our launcher: SLURM (``SLURM_LOCALID``; the count from
    ``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_TASKS_PER_NODE`` or ``SLURM_NTASKS_PER_NODE`` at
    ``SLURM_NODEID``) or Open MPI (``OMPI_COMM_WORLD_LOCAL_RANK`` / ``_LOCAL_SIZE``). ``None``
    when neither describes this process.

    Example:
        >>> cluster_local_process({"SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4,2"})
        (1, 2)
    """
    environ = os.environ if environ is None else environ
    local = environ.get("SLURM_LOCALID", "").strip()
    if local.isdigit():
        node = environ.get("SLURM_NODEID", "0").strip()
        node_index = int(node) if node.isdigit() else 0
        for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
            counts = _slurm_tasks_per_node(environ.get(name, ""))
            if len(counts) == 1:
                counts = counts * (node_index + 1)  # one value for every node
            if node_index < len(counts) and counts[node_index] > int(local):
                return int(local), counts[node_index]
        return int(local), int(local) + 1  # the count is not announced: at least this many
    local, size = (environ.get(f"OMPI_COMM_WORLD_LOCAL_{v}", "").strip() for v in ("RANK", "SIZE"))
    if local.isdigit() and size.isdigit():
        return int(local), int(size)
    return None


def visible_gpus(environ: Optional[Mapping[str, str]] = None, driver: str = "/proc/driver/nvidia/gpus") -> int:
    """How many GPUs this process may use, read without starting any framework: the entries of
    ``CUDA_VISIBLE_DEVICES`` when it is set, else the GPUs the NVIDIA driver lists (0 without one).

    Example:
        >>> visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"})
        2
    """
    environ = os.environ if environ is None else environ
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        count = 0
        for entry in listed.split(","):
            if not entry.strip() or entry.strip().startswith("-"):  # CUDA stops at the first invalid id
                break
            count += 1
        return count
    try:
        return len(os.listdir(driver))
    except OSError:
        return 0


def local_device_share(local_index: int, local_count: int, gpus: int) -> Optional[List[int]]:
    """The visible GPUs (indices among the visible ones) that local process ``local_index`` of
    ``local_count`` owns: an equal, contiguous share, so that several processes on one machine
    never use the same GPU. ``None`` when there is nothing to split (one process, no GPUs, or
    fewer GPUs than processes, which the user has then arranged some other way); GPUs left over
    by an uneven split stay unused.

    Example:
        >>> local_device_share(1, 2, 8)
        [4, 5, 6, 7]
        >>> local_device_share(0, 1, 8) is None
        True
    """
    if local_count <= 1 or gpus < local_count:
        return None
    share = gpus // local_count
    return list(range(local_index * share, (local_index + 1) * share))


_THIS_PROCESS_RUN = uuid.uuid4().hex


def run_identity() -> str:
    """What names this job across restarts: `unified launch`'s run id, torchrun's, SLURM's job
    and step ids (kept by a requeue; two ``srun`` steps of one job are two runs), else this
    process's own.

    Example:
        >>> isinstance(run_identity(), str)    # 'UNIFIED_RUN_ID=3f2a...' under `unified launch`
        True
    """
    for name in (RUN_VARIABLE, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(name)
        if value and value != "none":
            step = os.environ.get("SLURM_STEP_ID", "") if name == "SLURM_JOB_ID" else ""
            return f"{name}={value}" + (f".{step}" if step else "")
    return _THIS_PROCESS_RUN
