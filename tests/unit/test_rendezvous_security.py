"""Machine 0's rendezvous against a stranger on the same network (issue 46's audit): every
finding as a real HTTP request on loopback, and what the rendezvous must do about it: answer 4xx
without a traceback, change nothing, stay available to the job's own launchers."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from unified.launcher.job_secret import JobKey, job_key
from unified.launcher.rendezvous import (
    FAILED,
    MAX_BODY_BYTES,
    REQUEST_SECONDS,
    SIGNATURE_HEADER,
    Rendezvous,
    RendezvousClient,
    RendezvousRefused,
    RendezvousServer,
)

KEY = JobKey("the job's secret for the security tests 0123456789")
STRANGER = JobKey("a stranger's guess at the secret, 0123456789abcdef")
LAUNCHER = "0123456789abcdef"


def _serve(r: Rendezvous, host: str = "127.0.0.1") -> RendezvousServer:
    return RendezvousServer(r, port=0, key=KEY, host=host).start()


def _post(port: int, body: bytes, headers: dict = None, host: str = "127.0.0.1", timeout: float = 10.0):
    """One raw HTTP request; ``(status, body)``, or ``(None, b"")`` when the connection was closed
    unanswered."""
    head = {"Content-Length": str(len(body)), **(headers or {})}
    request = b"POST / HTTP/1.1\r\nHost: x\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in head.items()) + b"\r\n"
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(request + body)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    if not answer:
        return None, b""
    status = int(answer.split(b" ", 2)[1])
    return status, answer.split(b"\r\n\r\n", 1)[1]


def _signed(port: int, fields: dict, key: JobKey = KEY):
    body = json.dumps({"launcher": LAUNCHER, "number": time.time_ns(), **fields}).encode()
    return _post(port, body, {SIGNATURE_HEADER: key.sign(b"request", body)})


def _state(r: Rendezvous):
    return (r.attempt, r.layout, dict(r.joined), dict(r.waiting), dict(r.ended), dict(r.verdicts), r.final)


@pytest.fixture
def running():
    """Machines 0 and 1 joined and run attempt 1 (the real launchers' clients)."""
    r = Rendezvous(2, 2, 2, 0.0, heartbeat_timeout=15.0, pick_port=lambda: 40001)
    server = _serve(r)
    clients = [RendezvousClient(f"127.0.0.1:{server.port}", machine=m, key=KEY, patience=5.0) for m in (0, 1)]
    for client in clients:
        client.join(1)
    assert clients[0].wait_for_attempt()["layout"]["machines"] == [0, 1]
    yield r, server, clients
    server.close(linger=0)


def test_a_stranger_without_the_secret_reads_nothing_and_changes_nothing(running, capfd):
    """Audit: a stranger's poll as machine 0 returned the layout; forged "machine 1 failed"
    reports restarted every machine (three ended the job); forged "done" reports marked the
    attempt finished; a stranger joining as machine 1 with 64 processes changed every group."""
    r, server, clients = running
    before = _state(r)
    forged = [{"op": "poll", "machine": 0},
              {"op": "end", "machine": 1, "attempt": 0, "kind": FAILED, "outcome": "forged"},
              {"op": "end", "machine": 0, "attempt": 0, "kind": "done", "outcome": "forged"},
              {"op": "join", "machine": 1, "processes": 64}]
    for fields in forged:
        for headers in ({}, {SIGNATURE_HEADER: "0" * 64}, {SIGNATURE_HEADER: STRANGER.sign(b"request", b"{}")}):
            body = json.dumps({"launcher": LAUNCHER, "number": time.time_ns(), **fields}).encode()
            status, answer = _post(server.port, body, headers)
            assert status == 401 and b"layout" not in answer, (fields, status, answer)
        status, answer = _signed(server.port, fields, key=STRANGER)
        assert status == 401 and b"layout" not in answer and b"port" not in answer, (fields, status, answer)
    assert _state(r) == before
    assert clients[1]._call("poll", running=0) == {}  # the real attempt goes on: no verdict
    assert "Traceback" not in capfd.readouterr().err


def test_a_request_recorded_and_sent_again_is_refused(running):
    """Someone who sees the traffic cannot play a launcher's signed request again (its "failed"
    report, say): each request's number must be above the launcher's last."""
    r, server, clients = running
    sent = []
    send = clients[1]._send
    clients[1]._send = lambda body, signature: sent.append((body, signature)) or send(body, signature)
    assert clients[1]._call("end", attempt=0, kind="leaves", outcome="preempted") == {}  # machine 0 still runs
    before = _state(r)
    body, signature = sent[-1]
    status, answer = _post(server.port, body, {SIGNATURE_HEADER: signature})
    assert status == 409 and b"used already" in answer, (status, answer)
    assert _state(r) == before
    forged = body.replace(b'"machine": 1', b'"machine": 0')  # the same request as machine 0: the signature fails
    assert _post(server.port, forged, {SIGNATURE_HEADER: signature})[0] == 401


def test_a_signed_request_numbered_at_or_below_the_last_is_refused():
    r = Rendezvous(1, 2, 0, 0.0)
    assert r.admit(0, LAUNCHER, 5) is None
    assert "used already" in r.admit(0, LAUNCHER, 5)
    assert "used already" in r.admit(0, LAUNCHER, 4)
    assert r.admit(0, LAUNCHER, 6) is None


@pytest.mark.parametrize("fields", [
    {"op": "join", "machine": 1, "processes": [1]},          # audit: unhashable sizes killed machine 0's launcher
    {"op": "join", "machine": "x", "processes": 1},          # audit: sorted() failed on every later call
    {"op": "join", "machine": 2, "processes": 1},            # outside [0, max)
    {"op": "join", "machine": -1, "processes": 1},
    {"op": "join", "machine": True, "processes": 1},
    {"op": "join", "machine": 1, "processes": 0},
    {"op": "join", "machine": 1, "processes": 10 ** 9},
    {"op": "join", "machine": 1, "processes": 1.5},
    {"op": "join", "machine": 1, "processes": 1, "extra": 1},
    {"op": "poll", "machine": 1, "running": "0"},
    {"op": "end", "machine": 1, "attempt": -1, "kind": FAILED, "outcome": ""},
    {"op": "end", "machine": 1, "attempt": 0, "kind": "exploded", "outcome": ""},
    {"op": "end", "machine": 1, "attempt": 0, "kind": FAILED, "outcome": "x" * 1000},
    {"op": "shutdown", "machine": 1},
    {"machine": 1},
])
def test_a_malformed_signed_request_is_answered_400_and_changes_nothing(fields, capfd):
    """Even signed with the secret (a launcher of another version, a defect), a bad field is
    refused before any state changes, and the rendezvous goes on answering the real launchers."""
    r = Rendezvous(2, 2, 1, 0.0, pick_port=lambda: 40001)
    server = _serve(r)
    try:
        client = RendezvousClient(f"127.0.0.1:{server.port}", machine=0, key=KEY, patience=5.0)
        client.join(1)
        before = _state(r)
        status, answer = _signed(server.port, fields)
        assert status == 400 and b"error" in answer, (status, answer)
        assert _state(r) == before
        client.join(1)
        RendezvousClient(f"127.0.0.1:{server.port}", machine=1, key=KEY, patience=5.0).join(1)
        assert client.wait_for_attempt()["layout"]["sizes"] == [1, 1]
    finally:
        server.close(linger=0)
    assert "Traceback" not in capfd.readouterr().err


def test_requests_that_would_cost_machine_0_are_bounded(capfd):
    """Audit: a 64 MiB body was read and answered 200 (+193 MiB); 100,000 '[' raised a
    RecursionError that nothing caught; idle connections held a thread each for ever."""
    r = Rendezvous(1, 1, 0, 0.0)
    server = _serve(r)
    try:
        status, _ = _post(server.port, b"x" * 10, {"Content-Length": str(64 << 20)})
        assert status == 413
        assert _post(server.port, b"[" * (MAX_BODY_BYTES + 1))[0] == 413
        deep = b"[" * MAX_BODY_BYTES
        assert _post(server.port, deep)[0] == 401                      # no secret: never parsed
        assert _post(server.port, deep, {SIGNATURE_HEADER: KEY.sign(b"request", deep)})[0] == 400
        assert _post(server.port, b"", {"Content-Length": "abc"})[0] == 411
        started = time.monotonic()
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(80)]  # more than the cap
        try:
            idle[0].sendall(b"POST / HTTP/1.1\r\nContent-Length: 100\r\n\r\n")   # a body that never comes
            client = RendezvousClient(f"127.0.0.1:{server.port}", machine=0, key=KEY, patience=3 * REQUEST_SECONDS)
            client.join(1)                                       # served once the idle ones are cut
            assert client.wait_for_attempt()["layout"]["machines"] == [0]
            assert time.monotonic() - started < 3 * REQUEST_SECONDS
            for sock in idle[1:]:                                # each closed by machine 0, unanswered
                sock.settimeout(2 * REQUEST_SECONDS)
                try:
                    assert sock.recv(1024) == b""
                except ConnectionResetError:
                    pass
        finally:
            for sock in idle:
                sock.close()
    finally:
        server.close(linger=0)
    assert "Traceback" not in capfd.readouterr().err


def test_a_rank_held_by_a_live_launcher_is_refused_to_another():
    r = Rendezvous(2, 2, 1, 0.0, heartbeat_timeout=15.0)
    server = _serve(r)
    try:
        RendezvousClient(f"127.0.0.1:{server.port}", machine=1, key=KEY, patience=2.0).join(1)
        with pytest.raises(RendezvousRefused, match="machine rank 1 is held by another live launcher"):
            RendezvousClient(f"127.0.0.1:{server.port}", machine=1, key=KEY, patience=1.0).join(4)
        assert r.joined == {1: 1}
    finally:
        server.close(linger=0)


def test_a_launcher_with_another_secret_is_told_so_at_once():
    r = Rendezvous(1, 2, 0, 0.0)
    server = _serve(r)
    try:
        started = time.monotonic()
        with pytest.raises(RendezvousRefused, match="UNIFIED_RENDEZVOUS_SECRET differs"):
            RendezvousClient(f"127.0.0.1:{server.port}", machine=1, key=STRANGER, patience=30.0).join(1)
        assert time.monotonic() - started < 5
        assert r.joined == {}
    finally:
        server.close(linger=0)


def test_an_answer_not_signed_by_machine_0_is_not_believed():
    """A stranger answering in machine 0's place (or a tampered answer) is no answer."""
    listener = socket.create_server(("127.0.0.1", 0))
    body = json.dumps({"layout": {"attempt": 0, "machines": [0, 1], "sizes": [1, 64], "port": 1}}).encode()

    def serve():
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            with connection:
                connection.recv(65536)
                connection.sendall(b"HTTP/1.1 200 OK\r\n%s: %s\r\nContent-Length: %d\r\n\r\n%s"
                                   % (SIGNATURE_HEADER.encode(), b"0" * 64, len(body), body))

    threading.Thread(target=serve, daemon=True).start()
    try:
        client = RendezvousClient(f"127.0.0.1:{listener.getsockname()[1]}", machine=1, key=KEY, patience=0.8)
        with pytest.raises(Exception, match="not signed with this job's secret"):
            client.wait_for_attempt()
    finally:
        listener.close()


def test_machine_0_listens_only_on_the_address_the_job_names():
    """Audit: the rendezvous bound every interface. Named 127.0.0.1, it is not reachable at
    127.0.0.2 (another address of this machine)."""
    r = Rendezvous(1, 1, 0, 0.0)
    server = _serve(r, host="127.0.0.1")
    try:
        assert server.server.server_address[0] == "127.0.0.1"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", server.port), timeout=5).close()
    finally:
        server.close(linger=0)


def test_machine_0_refuses_an_address_that_is_not_its_own():
    with pytest.raises(SystemExit, match="cannot listen on 192.0.2.1:.*--rendezvous-bind-ip"):
        RendezvousServer(Rendezvous(1, 1, 0, 0.0), port=0, key=KEY, host="192.0.2.1")  # TEST-NET-1: never local


@pytest.mark.parametrize("environ,match", [
    ({}, r"need a secret that every machine of the job shares.*export UNIFIED_RENDEZVOUS_SECRET=.*#launch-secret"),
    ({"UNIFIED_RENDEZVOUS_SECRET": "hunter2"}, r"too weak .*7 characters"),
    ({"UNIFIED_RENDEZVOUS_SECRET": "a" * 64}, r"too weak .*1 different"),
])
def test_a_job_without_a_strong_secret_is_refused_with_how_to_set_one(environ, match):
    with pytest.raises(SystemExit, match=match):
        job_key(environ)


def test_the_launcher_refuses_several_machines_with_restarts_before_starting_anything(tmp_path, monkeypatch):
    from unified.launcher import launch as launch_module

    monkeypatch.delenv("UNIFIED_RENDEZVOUS_SECRET", raising=False)
    started = []
    monkeypatch.setattr(launch_module, "RendezvousServer", lambda *a, **k: started.append(a))
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(SystemExit, match="UNIFIED_RENDEZVOUS_SECRET"):
        launch_module.main(["--num-machines", "2", "--max-restarts", "1", str(script)])
    assert started == []
