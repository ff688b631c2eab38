"""unified/runtime/network.py: which local address reaches the main process (no framework, no traffic)."""
from __future__ import annotations

import pytest

from unified.runtime.network import is_loopback, route_to


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "localhost", "LOCALHOST", "::1", "[::1]"])
def test_loopback_hosts(host):
    assert is_loopback(host)
    assert route_to(host) is None  # one machine: gloo's own choice is right


@pytest.mark.parametrize("host", ["10.231.0.1", "192.168.1.5", "node-0.cluster", ""])
def test_other_hosts_are_not_loopback(host):
    assert not is_loopback(host)


def test_an_unresolvable_host_gives_no_route():
    assert route_to("no-such-host.invalid") is None
