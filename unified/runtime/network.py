"""Which local address and interface this machine uses to reach the main process's machine.

The collectives of both backends on CPU (gloo: torch.distributed's, and JAX's CPU collectives)
announce to their peers an address of their own that, by default, comes from resolving the
machine's host name. Where the host name resolves to a loopback address (``127.0.1.1`` on Debian
and Ubuntu, ``127.0.0.1`` in many containers), every process announces a loopback address and no
other machine can connect to it: the group hangs at its first collective, then times out. With
several machines, the backends ask `route_to` which local address the kernel would use to reach
``--main-process-ip`` and bind their collectives there instead (the address that reaches the
main process is, on a cluster, the one the other machines reach too). ``GLOO_SOCKET_IFNAME``,
when set, still wins.
"""
from __future__ import annotations

import ipaddress
import socket
import struct
import sys
from typing import Optional, Tuple

__all__ = ["route_to", "is_loopback"]

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (``127.0.0.0/8``, ``::1``)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _interface_of(address: str) -> Optional[str]:
    """The name of the interface that holds IPv4 ``address`` (Linux), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def route_to(host: str, port: int = 9) -> Optional[Tuple[str, Optional[str]]]:
    """``(local address, interface name)`` that this machine uses to reach ``host``.

    Sends nothing (a UDP socket's ``connect`` only chooses the route). ``None`` when ``host``
    cannot be resolved or reached, or is a loopback address; the interface is ``None`` where it
    cannot be told (not Linux, IPv6).

    Example:
        >>> route_to("127.0.0.1") is None
        True
    """
    if is_loopback(host):
        return None
    try:
        family, kind, proto, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.connect(target)
            local = sock.getsockname()[0]
    except OSError:
        return None
    if is_loopback(local):
        return None
    return local, (_interface_of(local) if family == socket.AF_INET else None)
