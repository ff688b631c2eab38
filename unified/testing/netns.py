"""Simulated machines on one host: Linux network namespaces joined by a private bridge.

`Machines(k)` creates ``k`` network namespaces ("machines") with one address each in a private
range (``10.231.0.1`` .. ``10.231.0.k``), every one joined by a veth pair to a bridge that lives
in a namespace of its own (the "switch"), so nothing is added to the host's own network. Loopback
is up in each. `Machines.argv(i, ...)` wraps a command to run inside machine ``i``
(``ip netns exec``); `cut(i)` takes machine ``i``'s cable out of the switch (its switch-side veth
goes down: packets are dropped, no connection is reset, as with a pulled cable or a dead switch
port) and `mend(i)` puts it back. Every name carries our process id, and `close` (run by the
context manager on any exit, Ctrl-C included) deletes the namespaces, which deletes their links;
namespaces left by a process that no longer exists (a run killed with SIGKILL) are deleted on the
next start.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and the ``ip`` tool; `unavailable()` says why not.

Example:
    >>> with Machines(2) as machines:                                     # doctest: +SKIP
    ...     subprocess.run(machines.argv(1, "ping", "-c1", machines.address(0)))
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import List, Optional

__all__ = ["Machines", "unavailable"]

PREFIX = "u32n"  # short: interface names have at most 15 characters
SUBNET = "10.231.0"
_NAME = re.compile(rf"^{PREFIX}(\d+)[a-z](\d+)$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=30, check=check)


def _namespaces() -> List[str]:
    run = _ip("netns", "list", check=False)
    return [line.split()[0] for line in run.stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> None:
    """Delete namespaces of ours whose creating process is gone (a run killed with SIGKILL)."""
    for name in _namespaces():
        match = _NAME.match(name)
        if match and not _alive(int(match.group(1))):
            _ip("netns", "del", name, check=False)


_REASON: List[Optional[str]] = []


def unavailable() -> Optional[str]:
    """Why network namespaces cannot be made here (``None`` when they can); probed once."""
    if _REASON:
        return _REASON[0]
    reason = None
    if shutil.which("ip") is None:
        reason = "the `ip` tool (iproute2) is not installed"
    else:
        try:
            with Machines(1):
                pass
        except (OSError, subprocess.SubprocessError) as err:
            output = getattr(err, "output", "") or ""
            reason = f"cannot create network namespaces here (needs root / CAP_NET_ADMIN): {err} {output.strip()}"
    _REASON.append(reason)
    return reason


class Machines:
    """``count`` network namespaces on one private bridge; a context manager that removes them."""

    _serial = 0

    def __init__(self, count: int) -> None:
        Machines._serial += 1
        tag = f"{PREFIX}{os.getpid()}"
        self.count = count
        self.switch = f"{tag}s{Machines._serial}"
        self.names = [f"{tag}{chr(ord('a') + i)}{Machines._serial}" for i in range(count)]
        self._made: List[str] = []

    # -- lifecycle ----------------------------------------------------------------------------------------
    def __enter__(self) -> "Machines":
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _create(self) -> None:
        remove_stale()
        self._add(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            self._add(name)
            # both ends are made in the machine's namespace, then one end moves to the switch
            _ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", f"port{i}")
            _ip("-n", name, "link", "set", f"port{i}", "netns", self.switch)
            _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"port{i}", "up")

    def close(self) -> None:
        """Delete every namespace made (their links go with them); safe to call twice."""
        while self._made:
            _ip("netns", "del", self._made.pop(), check=False)

    # -- use ------------------------------------------------------------------------------------------------
    def address(self, machine: int) -> str:
        return f"{SUBNET}.{machine + 1}"

    def argv(self, machine: int, *command: str) -> List[str]:
        """``command`` run inside ``machine``'s namespace."""
        return ["ip", "netns", "exec", self.names[machine], *command]

    def cut(self, machine: int) -> None:
        """Pull ``machine``'s cable: its switch port goes down, its packets are dropped."""
        _ip("-n", self.switch, "link", "set", f"port{machine}", "down")

    def mend(self, machine: int) -> None:
        _ip("-n", self.switch, "link", "set", f"port{machine}", "up")
