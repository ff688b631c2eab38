"""Several `unified launch` "machines" on loopback, one launcher each, for tests."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from unified.launcher.job_secret import SECRET_VARIABLE
from unified.launcher.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
# machine 0's own check, then torch's store and JAX's coordinator when the port went in between
PORT_TAKEN = ("is in use", "EADDRINUSE", "Failed to start RPC server")


def launch_machines(count: int, launch_args: Sequence[str], script: Sequence[str], timeout: float = 300,
                    tries: int = 3, env: Optional[Dict[str, str]] = None,
                    during: Optional[Callable[[int], None]] = None) -> List[subprocess.CompletedProcess]:
    """Start ``count`` launchers (``--machine-rank`` 0..count-1, machine 0 at 127.0.0.1 on a free
    port) and wait for them all; each one's exit code and output (stderr in stdout). Relaunched
    on a new port when another test took the port between free_port() and the listen. The
    launchers share a fresh job secret (``UNIFIED_RENDEZVOUS_SECRET``) unless ``env`` sets one.
    ``during(port)`` runs in a thread while they run (a stranger at machine 0's port)."""
    env = {**os.environ, SECRET_VARIABLE: secrets.token_hex(32), **(env or {})}
    for _ in range(tries):
        port = free_port()
        common = ["--num-machines", str(count), "--main-process-ip", "127.0.0.1",
                  "--main-process-port", str(port), *launch_args, *map(str, script)]
        machines = [subprocess.Popen([sys.executable, "-m", "unified", "launch", "--machine-rank", str(rank), *common],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
                    for rank in range(count)]
        if during is not None:
            threading.Thread(target=during, args=(port,), daemon=True).start()
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


class Stranger:
    """Someone on loopback without the job's secret who hammers machine 0's rendezvous port while a
    job runs (issue 46): forged reports and joins (unsigned, and signed with a wrong secret),
    malformed and oversized bodies, and idle connections. Bounded: at most ``rounds`` rounds and
    ``seconds`` seconds; ``answers`` counts the HTTP statuses it got (``None``: closed unanswered)."""

    def __init__(self, rounds: int = 200, seconds: float = 60.0) -> None:
        self.rounds, self.seconds = rounds, seconds
        self.answers: Dict[Optional[int], int] = {}
        self.stop = threading.Event()

    def __call__(self, port: int) -> None:
        import json
        import socket
        import time

        from unified.launcher.job_secret import JobKey
        from unified.launcher.rendezvous import SIGNATURE_HEADER

        wrong = JobKey("a stranger's guess at the job secret 0123456789abcdef")
        forged = [{"op": "poll", "machine": 0}, {"op": "join", "machine": 1, "processes": 64},
                  {"op": "end", "machine": 1, "attempt": 0, "kind": "failed", "outcome": "forged"},
                  {"op": "end", "machine": 0, "attempt": 0, "kind": "done", "outcome": "forged"},
                  {"op": "join", "machine": 1, "processes": [1]}, {"op": "join", "machine": "x", "processes": 1}]
        idle: List[socket.socket] = []
        give_up = time.monotonic() + self.seconds
        for round_ in range(self.rounds):
            if self.stop.is_set() or time.monotonic() > give_up:
                break
            fields = dict(forged[round_ % len(forged)], launcher="0123456789abcdef", number=time.time_ns())
            body = json.dumps(fields).encode()
            for request in (body, body + b"\n", b"[" * 100_000, b"{" + b"x" * (64 << 10)):
                headers = {SIGNATURE_HEADER: wrong.sign(b"request", request)} if round_ % 2 else {}
                self._send(port, request, headers)
            if len(idle) < 16:
                try:
                    idle.append(socket.create_connection(("127.0.0.1", port), timeout=1))
                except OSError:
                    pass
            time.sleep(0.05)
        for sock in idle:
            sock.close()

    def _send(self, port: int, body: bytes, headers: Dict[str, str]) -> None:
        import socket

        head = {"Content-Length": str(len(body)), **headers}
        request = b"POST / HTTP/1.1\r\nHost: x\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in head.items())
        status: Optional[int] = None
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
                sock.sendall(request + b"\r\n" + body)
                answer = sock.recv(64)
                status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else None
        except OSError:
            pass  # machine 0 not listening yet, or it closed the connection
        self.answers[status] = self.answers.get(status, 0) + 1
