"""How the launchers of several machines restart together (`unified launch --max-restarts` and
elastic `--num-machines MIN:MAX`): machine 0's launcher hosts a rendezvous, every launcher joins
each attempt, beats while its group runs, and reports how its group ended.

The rule of an attempt (`Rendezvous`): it starts when every machine (MAX) joined, or when at
least MIN joined and no other joined for the last call; its machines are numbered in the order
of their ``--machine-rank``. It ends at once for every machine when one machine's group failed or
broke, or when a machine stopped beating (lost): the next attempt opens, and the machines still
there join it; a machine that joins while an attempt runs is admitted at the next one. After the
last restart, or when fewer than MIN machines joined within the rendezvous timeout, the job gives
up; a preempted or interrupted machine leaves instead of rejoining.

The rendezvous speaks JSON over HTTP on ``--main-process-port`` of machine 0 (standard library
only): nothing is unpickled, and a group's own store or coordinator gets a fresh port from
machine 0 every attempt.

Example:
    >>> r = Rendezvous(min_machines=1, max_machines=2, max_restarts=1, last_call=0.0, clock=lambda: 0.0)
    >>> r.join(0, processes=2)
    {}
    >>> r.poll(0)["layout"]["machines"]
    [0]
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, List, Optional

from .errors import see

__all__ = ["Layout", "Rendezvous", "RendezvousServer", "RendezvousClient", "RendezvousLost",
           "RESTART", "FINISHED", "STOPPED", "GAVE_UP", "DONE", "FAILED", "LEAVES"]

# What ended an attempt, for every machine of it.
RESTART, FINISHED, STOPPED, GAVE_UP = "restart", "finished", "stopped", "gave up"
# How a machine's group ended, as it reports it (with `unified.launch`'s outcome for the log): done;
# failed or broke (the attempt ends for everyone); preempted, interrupted or without its output
# (this machine leaves: the job goes on without it at the next restart, if there is one).
DONE, FAILED, LEAVES = "done", "failed", "leaves"
# A launcher beats every BEAT_S while it waits or runs; one silent for HEARTBEAT_TIMEOUT_S is lost
# (torchrun's c10d rendezvous: a keep-alive every 5 s, lost after 3 missed).
BEAT_S = 0.5
HEARTBEAT_TIMEOUT_S = 15.0  # unified launch --rendezvous-heartbeat-timeout
MIN_HEARTBEAT_TIMEOUT_S = 4 * BEAT_S  # the rendezvous counts a machine silent for 4 beats as not there


@dataclass(frozen=True)
class Layout:
    """One attempt: its number (0 first), its machines (their ``--machine-rank``, in the order of
    their rank in this attempt), each one's process count, and the port of its group."""

    attempt: int
    machines: List[int]
    sizes: List[int]
    port: int

    def rank_of(self, machine: int) -> int:
        return self.machines.index(machine)


class Rendezvous:
    """The state of the rendezvous (no I/O: every call takes the time from ``clock``).

    ``pick_port`` gives the port of each attempt's group (a free port on machine 0).
    """

    def __init__(self, min_machines: int, max_machines: int, max_restarts: int, last_call: float,
                 timeout: float = 600.0, heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
                 pick_port: Callable[[], int] = lambda: 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.min, self.max, self.max_restarts = min_machines, max_machines, max_restarts
        self.last_call, self.timeout, self.heartbeat_timeout = last_call, timeout, heartbeat_timeout
        self.pick_port, self.clock = pick_port, clock
        self.attempt = 0
        self.layout: Optional[Layout] = None            # the attempt running, if one is
        self.joined: Dict[int, int] = {}                # machine -> processes, for the attempt opening
        self.waiting: Dict[int, int] = {}               # joined while an attempt ran: the next one
        self.seen: Dict[int, float] = {}
        self.ended: Dict[int, str] = {}                 # machine -> outcome, in the attempt running
        self.verdicts: Dict[int, Dict[str, str]] = {}   # attempt -> {"verdict", "reason"}
        self.final: Optional[Dict[str, str]] = None
        self.answered: set = set()                      # machines given the final verdict in an answer
        self.told: set = set()                          # ... whose answer was written out in whole
        self.opened_at = clock()
        self.enough_since: Optional[float] = None       # MIN machines joined since then
        self.previous: Optional[set] = None             # after a restart: the last attempt's machines that stay
        self.lock = threading.Lock()

    # -- the calls of a launcher -----------------------------------------------------------------
    def join(self, machine: int, processes: int) -> Dict:
        """``machine`` takes part in the next attempt that starts."""
        with self.lock:
            self.seen[machine] = self.clock()
            (self.waiting if self.layout else self.joined)[machine] = processes
            self._tick()
            return {}

    def poll(self, machine: int, running: Optional[int] = None) -> Dict:
        """A beat. ``running``: the attempt this machine runs; the answer has its verdict once
        there is one. Else the answer has the layout of the attempt it joined once that started,
        or the job's final verdict."""
        with self.lock:
            self.seen[machine] = self.clock()
            self._tick()
            if self.final:
                self.answered.add(machine)
            if running is not None:
                return dict(self.verdicts.get(running, {}))
            if not self.final and self.layout and machine in self.layout.machines and machine not in self.ended:
                return {"layout": asdict(self.layout)}
            return dict(self.final or {})

    def end(self, machine: int, attempt: int, kind: str, outcome: str = "") -> Dict:
        """``machine``'s group of ``attempt`` ended: ``kind`` `DONE`, `FAILED` or `LEAVES`;
        ``outcome`` says how, for the log (`unified.launch`'s words)."""
        with self.lock:
            self.seen[machine] = self.clock()
            if self.layout and self.layout.attempt == attempt and attempt not in self.verdicts:
                self.ended[machine] = kind
                if kind == FAILED:
                    self._restart(f"machine {machine}: {outcome or kind}")
                elif len(self.ended) == len(self.layout.machines):
                    everyone = set(self.ended.values())
                    self._over(FINISHED if everyone == {DONE} else STOPPED, "a machine left (preempted or stopped)")
            self.waiting.pop(machine, None)
            if self.final:
                self.answered.add(machine)
            return dict(self.verdicts.get(attempt, {}))

    def delivered(self, machine: int) -> None:
        """The answer to ``machine``'s call was written out in whole: once it held the final verdict,
        the machine has heard it (machine 0 may stop serving; before, it stopped while an answer
        was still being written, and the machine reading it failed on the truncated answer)."""
        with self.lock:
            if machine in self.answered:
                self.told.add(machine)

    def untold(self) -> set:
        """Machines not lost (heard from within the heartbeat timeout) that have not heard the final
        verdict yet. A machine stopping its processes may be silent for seconds before its own
        call; counting it gone after a few beats stopped machine 0 serving before that call."""
        with self.lock:
            now = self.clock()
            return {m for m, t in self.seen.items() if now - t <= self.heartbeat_timeout} - self.told

    # -- the rules ---------------------------------------------------------------------------------
    def _tick(self) -> None:
        now = self.clock()
        silent = {m for m, t in self.seen.items() if now - t > self.heartbeat_timeout}
        if self.final:
            return
        if self.layout:
            lost = sorted(m for m in self.layout.machines if m in silent and m not in self.ended)
            if lost:
                self._restart(f"machine(s) {', '.join(map(str, lost))} stopped answering for "
                              f"{self.heartbeat_timeout:g}s")
            return
        for machine in silent:
            self.joined.pop(machine, None)
        if len(self.joined) < self.min:
            self.enough_since = None
            if now - self.opened_at > self.timeout:
                self._over(GAVE_UP, f"{len(self.joined)} of at least {self.min} machine(s) joined attempt "
                                    f"{self.attempt + 1} within {self.timeout:g}s")
            return
        if self.enough_since is None:
            self.enough_since = now
        ready = len(self.joined) >= self.max or now - self.enough_since >= self.last_call
        if self.previous is not None:  # a restart needs no last call once the machines still there are back
            ready = ready or (self.previous - silent) <= set(self.joined)
        if ready:
            machines = sorted(self.joined)
            self.layout = Layout(self.attempt, machines, [self.joined[m] for m in machines], self.pick_port())
            self.joined, self.ended, self.previous = {}, {}, None

    def _restart(self, reason: str) -> None:
        if self.attempt >= self.max_restarts:
            self._over(GAVE_UP, f"{reason}; that was attempt {self.attempt + 1}, after {self.max_restarts} restart(s)")
            return
        self.verdicts[self.attempt] = {"verdict": RESTART, "reason": reason}
        assert self.layout is not None
        self.previous = {m for m in self.layout.machines if self.ended.get(m) != LEAVES}
        self.attempt += 1
        self.layout, self.opened_at, self.enough_since = None, self.clock(), None
        self.joined, self.waiting = dict(self.waiting), {}

    def _over(self, verdict: str, reason: str) -> None:
        self.final = {"verdict": verdict, "reason": reason}
        self.verdicts[self.attempt] = self.final


class RendezvousServer:
    """`Rendezvous` served over HTTP on ``port`` of every address of this machine (machine 0).

    Example:
        >>> server = RendezvousServer(Rendezvous(1, 1, 0, 0.0), port=0).start()
        >>> RendezvousClient(f"127.0.0.1:{server.port}", machine=0).join(1)
        >>> server.close()
    """

    def __init__(self, rendezvous: Rendezvous, port: int) -> None:
        self.rendezvous = rendezvous
        state = rendezvous

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the standard library's name)
                machine = None
                try:
                    request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    call = {"join": state.join, "poll": state.poll, "end": state.end}[request.pop("op")]
                    body, status = json.dumps(call(**request)).encode(), 200
                    machine = request["machine"]
                except (ValueError, KeyError, TypeError) as err:
                    body, status = json.dumps({"error": str(err)}).encode(), 400
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()
                if machine is not None:
                    state.delivered(machine)

            def log_message(self, *args) -> None:  # no access log on our output
                pass

        self.server = ThreadingHTTPServer(("", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)

    def start(self) -> "RendezvousServer":
        self.thread.start()
        return self

    def close(self, linger: float = 5.0) -> None:
        """Stop serving, once every machine still beating heard the job's final verdict (at most
        ``linger`` seconds)."""
        give_up = time.monotonic() + linger
        while self.rendezvous.final and self.rendezvous.untold() and time.monotonic() < give_up:
            time.sleep(0.1)
        self.server.shutdown()
        self.server.server_close()


class RendezvousLost(RuntimeError):
    """Machine 0's rendezvous did not answer for longer than the client waits."""


class RendezvousClient:
    """A launcher's side: ``address`` is machine 0's ``host:port``; ``machine`` its ``--machine-rank``.

    Every call retries a rendezvous that does not answer (machine 0 may start later) for
    ``patience`` seconds, then raises `RendezvousLost`.
    """

    def __init__(self, address: str, machine: int, patience: float = HEARTBEAT_TIMEOUT_S) -> None:
        self.url, self.machine, self.patience = f"http://{address}/", machine, patience

    def _call(self, op: str, patience: Optional[float] = None, **fields) -> Dict:
        body = json.dumps({"op": op, "machine": self.machine, **fields}).encode()
        give_up = time.monotonic() + (self.patience if patience is None else patience)
        while True:
            try:
                request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=5) as answer:
                    return json.loads(answer.read())
            except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as err:  # a truncated answer too
                if time.monotonic() >= give_up:
                    raise RendezvousLost(
                        f"unified launch: machine 0's rendezvous at {self.url[7:-1]} did not answer for "
                        f"{self.patience:g}s ({err}); the job cannot go on without machine 0."
                        + see("launch-rendezvous-lost")) from None
                time.sleep(BEAT_S)

    def join(self, processes: int, patience: Optional[float] = None) -> None:
        self._call("join", patience, processes=processes)

    def wait_for_attempt(self, patience: Optional[float] = None) -> Dict:
        """Beat until the attempt this machine joined starts (``{"layout": ...}``) or the job is
        over (``{"verdict": ..., "reason": ...}``)."""
        while True:
            answer = self._call("poll", patience)
            if answer:
                return answer
            time.sleep(BEAT_S)

    def end(self, attempt: int, kind: str, outcome: str) -> Dict:
        """Report how this machine's group ended (`Rendezvous.end`); the verdict of the attempt
        once there is one."""
        answer = self._call("end", attempt=attempt, kind=kind, outcome=outcome)
        while not answer:
            time.sleep(BEAT_S)
            answer = self._call("poll", running=attempt)
        return answer

    def beating(self, attempt: int) -> "Beat":
        return Beat(self, attempt)


class Beat:
    """Beats in the background while ``attempt`` runs; `stop_reason` is why this machine's group
    must stop (the attempt ended elsewhere, or machine 0 is gone: then `lost` says so too), else
    ``None``."""

    def __init__(self, client: RendezvousClient, attempt: int) -> None:
        self.client, self.attempt = client, attempt
        self.reason: Optional[str] = None
        self.lost: Optional[str] = None
        self.final: Optional[Dict] = None  # the job's final verdict, when a beat's answer held it
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Beat":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        while not self.done.wait(BEAT_S):
            try:
                answer = self.client._call("poll", running=self.attempt)
            except RendezvousLost as err:
                self.lost = self.reason = str(err)
                return
            if answer.get("verdict") in (RESTART, GAVE_UP):
                self.reason = f"attempt {self.attempt + 1} ended on another machine ({answer['reason']})"
                self.final = answer if answer["verdict"] == GAVE_UP else None
                return

    def stop_reason(self) -> Optional[str]:
        return self.reason

    def end(self, kind: str, outcome: str) -> Dict:
        """Report how this machine's group ended and return the attempt's verdict
        (`RendezvousClient.end`), unless a beat already heard the job's final verdict: machine 0
        counts this machine told by that answer and may have stopped serving since."""
        return self.final or self.client.end(self.attempt, kind, outcome)


def free_port_everywhere() -> int:
    """A TCP port free on every address of this machine a moment ago (a group's store binds all)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
