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
machine 0 every attempt. It trusts only the job's own launchers (docs/security.md): it listens
on the address the job names (``--main-process-ip``), every request and every answer is signed
with the job's secret (`unified.launcher.job_secret`; a request also carries its launcher's identity and a
number that only grows, so that a recorded request cannot be played again), every field is
checked before anything changes, a machine rank held by a live launcher is refused to another,
and one request may cost little: a body of at most `MAX_BODY_BYTES`, `REQUEST_SECONDS` to send
it, at most `MAX_CONNECTIONS` at once.

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
import re
import secrets
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..errors import see
from .job_secret import SECRET_VARIABLE, JobKey

__all__ = ["Layout", "Rendezvous", "RendezvousServer", "RendezvousClient", "RendezvousLost", "RendezvousRefused",
           "BadRequest", "checked_request", "RESTART", "FINISHED", "STOPPED", "GAVE_UP", "DONE", "FAILED", "LEAVES"]

# What ended an attempt, for every machine of it.
RESTART, FINISHED, STOPPED, GAVE_UP = "restart", "finished", "stopped", "gave up"
# How a machine's group ended, as it reports it (with `unified.launcher.launch`'s outcome for the log): done;
# failed or broke (the attempt ends for everyone); preempted, interrupted or without its output
# (this machine leaves: the job goes on without it at the next restart, if there is one).
DONE, FAILED, LEAVES = "done", "failed", "leaves"
# A launcher beats every BEAT_S while it waits or runs; one silent for HEARTBEAT_TIMEOUT_S is lost
# (torchrun's c10d rendezvous: a keep-alive every 5 s, lost after 3 missed).
BEAT_S = 0.5
HEARTBEAT_TIMEOUT_S = 15.0  # unified launch --rendezvous-heartbeat-timeout
MIN_HEARTBEAT_TIMEOUT_S = 4 * BEAT_S  # the rendezvous counts a machine silent for 4 beats as not there
# What one request may cost machine 0: its body (a launcher's is under 300 bytes), the time to send
# it whole, and the connections served at once (a launcher holds at most one).
MAX_BODY_BYTES = 4096
REQUEST_SECONDS = 5.0
MAX_CONNECTIONS = 64
MAX_PROCESSES_PER_MACHINE = 4096
MAX_OUTCOME_CHARACTERS = 500
SIGNATURE_HEADER = "X-Unified-Signature"
_LAUNCHER_ID = re.compile(r"[0-9a-f]{16}")


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
        self.holders: Dict[int, str] = {}               # machine -> the launcher that holds its rank
        self.numbers: Dict[Tuple[int, str], int] = {}   # (machine, launcher) -> its last request's number
        self.lock = threading.Lock()

    # -- who may call --------------------------------------------------------------------------------
    def admit(self, machine: int, launcher: str, number: int) -> Optional[str]:
        """Why a request of ``launcher`` as ``machine`` numbered ``number`` is refused, or ``None``:
        the rank is held by another launcher that answered within the heartbeat timeout, or the
        number is not above this launcher's last (a request recorded and sent again)."""
        with self.lock:
            holder = self.holders.get(machine)
            if (holder is not None and holder != launcher
                    and self.clock() - self.seen.get(machine, -1e18) <= self.heartbeat_timeout):
                return (f"machine rank {machine} is held by another live launcher; two launchers were given the same "
                        "--machine-rank, or the one before this was stopped less than the heartbeat timeout ago")
            if number <= self.numbers.get((machine, launcher), 0):
                return f"request number {number} of machine {machine} was used already (a request sent again)"
            self.holders[machine] = launcher
            self.numbers[(machine, launcher)] = number
            return None

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
        ``outcome`` says how, for the log (`unified.launcher.launch`'s words)."""
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


class BadRequest(ValueError):
    """A request the rendezvous refuses: ``status`` is the HTTP status of the answer."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


_FIELDS = {"join": {"processes"}, "poll": {"running"}, "end": {"attempt", "kind", "outcome"}}
_COMMON = {"op", "machine", "launcher", "number"}


def _whole(request: Dict[str, Any], name: str, low: int, high: int) -> int:
    value = request[name]
    if type(value) is not int or not low <= value < high:  # bool is an int: refused too
        raise BadRequest(400, f"{name} must be a whole number in [{low}, {high}); received {value!r:.40}")
    return value


def checked_request(request: Any, max_machines: int) -> Tuple[str, Dict[str, Any], str, int]:
    """``(op, arguments, launcher, number)`` of a parsed request body, every field type- and
    range-checked; raises `BadRequest` (400) for anything else, before any state changes.

    Example:
        >>> checked_request({"op": "join", "machine": 1, "launcher": "0" * 16, "number": 5, "processes": 8}, 2)
        ('join', {'machine': 1, 'processes': 8}, '0000000000000000', 5)
    """
    if not isinstance(request, dict) or request.get("op") not in _FIELDS:
        raise BadRequest(400, "expected a JSON object with op join, poll or end")
    op = request["op"]
    allowed = _COMMON | _FIELDS[op]
    unknown = set(request) - allowed
    missing = (allowed - {"running"}) - set(request)
    if unknown or missing:
        raise BadRequest(400, f"{op}: unexpected field(s) {sorted(unknown)[:5]}, missing {sorted(missing)}")
    launcher = request["launcher"]
    if not isinstance(launcher, str) or not _LAUNCHER_ID.fullmatch(launcher):
        raise BadRequest(400, "launcher must be 16 hex digits")
    number = _whole(request, "number", 1, 1 << 63)
    arguments: Dict[str, Any] = {"machine": _whole(request, "machine", 0, max_machines)}
    if op == "join":
        arguments["processes"] = _whole(request, "processes", 1, MAX_PROCESSES_PER_MACHINE + 1)
    elif op == "poll":
        if request.get("running") is not None:
            arguments["running"] = _whole(request, "running", 0, 1 << 31)
    else:
        arguments["attempt"] = _whole(request, "attempt", 0, 1 << 31)
        if request["kind"] not in (DONE, FAILED, LEAVES):
            raise BadRequest(400, f"kind must be {DONE!r}, {FAILED!r} or {LEAVES!r}")
        outcome = request["outcome"]
        if not isinstance(outcome, str) or len(outcome) > MAX_OUTCOME_CHARACTERS:
            raise BadRequest(400, f"outcome must be a string of at most {MAX_OUTCOME_CHARACTERS} characters")
        arguments.update(kind=request["kind"], outcome=outcome)
    return op, arguments, launcher, number


class _BoundedServer(ThreadingHTTPServer):
    """At most `MAX_CONNECTIONS` served at once (one more is closed unanswered), each cut after
    `REQUEST_SECONDS`; nothing printed for a connection that breaks."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: connections beyond it wait for SYN retries, seconds

    def __init__(self, address: Tuple[str, int], handler: Any) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.cuts: Dict[Any, threading.Timer] = {}  # connection -> the timer that ends it
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        cut = self.cuts[request] = threading.Timer(REQUEST_SECONDS, _cut, args=(request,))
        cut.daemon = True
        cut.start()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)

    def _done(self, request: Any) -> None:
        cut = self.cuts.pop(request, None)
        if cut is not None:
            cut.cancel()
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, (OSError, ValueError)):  # a defect of ours: one line, never a traceback
            print(f"unified launch: the rendezvous could not answer {client_address[0]}: "
                  f"{type(error).__name__}: {error}", file=sys.stderr)


def _cut(connection: socket.socket) -> None:
    """End a connection that took longer than `REQUEST_SECONDS` (a slow or idle sender)."""
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class RendezvousServer:
    """`Rendezvous` served over HTTP on ``host``:``port`` (machine 0's address that the job names,
    ``--main-process-ip``), answering only requests signed with ``key`` (the job's secret).

    Example:
        >>> key = JobKey("0123456789abcdef0123456789abcdef")
        >>> server = RendezvousServer(Rendezvous(1, 1, 0, 0.0), port=0, key=key, host="127.0.0.1").start()
        >>> RendezvousClient(f"127.0.0.1:{server.port}", machine=0, key=key).join(1)
        >>> server.close()
    """

    def __init__(self, rendezvous: Rendezvous, port: int, key: JobKey, host: str = "127.0.0.1") -> None:
        self.rendezvous = rendezvous
        state = rendezvous

        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_SECONDS  # each read of the request (the whole is cut by _BoundedServer)

            def do_POST(self) -> None:  # noqa: N802 (the standard library's name)
                machine, signature = None, ""
                try:
                    body, signature = self._signed_body()
                    try:
                        request = json.loads(body)
                    except (ValueError, RecursionError):
                        raise BadRequest(400, "the body is not JSON") from None
                    op, arguments, launcher, number = checked_request(request, state.max)
                    refusal = state.admit(arguments["machine"], launcher, number)
                    if refusal:
                        raise BadRequest(409, refusal)
                    answer, status = json.dumps(getattr(state, op)(**arguments)).encode(), 200  # op: join, poll or end
                    machine = arguments["machine"]
                except BadRequest as err:
                    answer, status = json.dumps({"error": str(err)}).encode(), err.status
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.send_header(SIGNATURE_HEADER, key.sign(b"answer", signature.encode() + b"\0" + answer))
                self.end_headers()
                self.wfile.write(answer)
                self.wfile.flush()
                if machine is not None:
                    state.delivered(machine)

            def _signed_body(self) -> Tuple[bytes, str]:
                """The body, read only once its length is within bounds, and its signature once
                checked: a stranger's request changes nothing and reaches no parser."""
                length = self.headers.get("Content-Length", "")
                if not length.isdigit():
                    raise BadRequest(411, "a Content-Length is required")
                if int(length) > MAX_BODY_BYTES:
                    self.close_connection = True
                    raise BadRequest(413, f"the body may hold at most {MAX_BODY_BYTES} bytes")
                body = self.rfile.read(int(length))
                signature = self.headers.get(SIGNATURE_HEADER, "")
                if len(body) != int(length) or not key.verify(b"request", body, signature):
                    raise BadRequest(401, "not signed with this job's secret")
                return body, signature

            def log_message(self, *args) -> None:  # no access log on our output
                pass

        try:
            self.server = _BoundedServer((host, port), Handler)
        except OSError as err:
            raise SystemExit(
                f"unified launch: machine 0 cannot listen on {host}:{port} for the other machines' launchers "
                f"({err.strerror}); --main-process-ip must be an address of machine 0 that the other machines reach "
                "(or pass --rendezvous-bind-ip with the address of machine 0 to listen on)."
                + see("launch-rendezvous-bind")
            ) from None
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


class RendezvousRefused(RendezvousLost):
    """Machine 0's rendezvous refused this launcher (another secret, a rank held by another
    launcher until the client's patience ran out, or a request it found malformed); ``status``
    is the HTTP status of its answer."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class RendezvousClient:
    """A launcher's side: ``address`` is machine 0's ``host:port``; ``machine`` its ``--machine-rank``;
    ``key`` the job's secret (`unified.launcher.job_secret.job_key`).

    Every call retries a rendezvous that does not answer (machine 0 may start later) for
    ``patience`` seconds, then raises `RendezvousLost`. An answer not signed with the job's
    secret counts as no answer. A refused secret raises `RendezvousRefused` at once.
    """

    def __init__(self, address: str, machine: int, key: JobKey, patience: float = HEARTBEAT_TIMEOUT_S) -> None:
        self.url, self.machine, self.patience, self.key = f"http://{address}/", machine, patience, key
        self.launcher = secrets.token_hex(8)
        self._number = time.time_ns()  # grows across this machine's launchers too (a restarted one)
        self._lock = threading.Lock()  # one call at a time: numbers arrive in the order they were given

    def _call(self, op: str, patience: Optional[float] = None, **fields) -> Dict:
        give_up = time.monotonic() + (self.patience if patience is None else patience)
        while True:
            with self._lock:
                self._number = max(self._number + 1, time.time_ns())
                body = json.dumps({"op": op, "machine": self.machine, "launcher": self.launcher,
                                   "number": self._number, **fields}).encode()
                signature = self.key.sign(b"request", body)
                try:
                    return self._send(body, signature)
                except RendezvousRefused as err:
                    if err.status != 409 or time.monotonic() >= give_up:  # 409: a rank held, maybe not for long
                        raise
                    error: BaseException = err
                except (urllib.error.URLError, OSError, ValueError,
                        http.client.HTTPException) as err:  # a truncated answer too
                    error = err
            if time.monotonic() >= give_up:
                raise RendezvousLost(
                    f"unified launch: machine 0's rendezvous at {self.url[7:-1]} did not answer for "
                    f"{self.patience:g}s ({error}); the job cannot go on without machine 0."
                    + see("launch-rendezvous-lost")) from None
            time.sleep(BEAT_S)

    def _send(self, body: bytes, signature: str) -> Dict:
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json",
                                                                        SIGNATURE_HEADER: signature})
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                status, text, tag = answer.status, answer.read(), answer.headers.get(SIGNATURE_HEADER)
        except urllib.error.HTTPError as err:
            status, text, tag = err.code, err.read(), err.headers.get(SIGNATURE_HEADER)
        signed = self.key.verify(b"answer", signature.encode() + b"\0" + text, tag)
        if status == 401:  # machine 0 signed its refusal with its own secret, which this one cannot check
            raise RendezvousRefused(
                f"unified launch: machine 0's rendezvous at {self.url[7:-1]} refused this launcher's requests: "
                f"{SECRET_VARIABLE} differs between this machine and machine 0; every machine of the job must "
                "have the same value." + see("launch-secret"), status)
        if not signed:
            raise ValueError("an answer not signed with this job's secret")
        answer = json.loads(text)
        if status != 200:
            reason = answer.get("error") if isinstance(answer, dict) else answer
            raise RendezvousRefused(f"unified launch: machine 0's rendezvous at {self.url[7:-1]} refused machine "
                                    f"{self.machine}'s request: {reason}." + see("launch-rendezvous-refused"), status)
        return answer

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
    """A TCP port free on every address of this machine a moment ago (torch's store binds all)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
