"""The launchers' rendezvous (unified/launcher/rendezvous.py): when attempts start, end and give up, on a
clock the test moves; and its HTTP server and client on loopback."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from unified.launcher.job_secret import JobKey
from unified.launcher.rendezvous import (
    DONE,
    FAILED,
    FINISHED,
    GAVE_UP,
    LEAVES,
    RESTART,
    SIGNATURE_HEADER,
    STOPPED,
    Rendezvous,
    RendezvousClient,
    RendezvousLost,
    RendezvousServer,
)

KEY = JobKey("test secret of the rendezvous tests, 0123456789abcdef")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _rendezvous(low=2, high=3, restarts=2, last_call=5.0, timeout=60.0, heartbeat=15.0):
    clock = Clock()
    ports = iter(range(40000, 40100))
    return Rendezvous(low, high, restarts, last_call, timeout=timeout, heartbeat_timeout=heartbeat,
                      pick_port=lambda: next(ports), clock=clock), clock


def _layout(r, machine):
    return r.poll(machine).get("layout")


def test_an_attempt_starts_at_once_with_every_machine_else_after_the_last_call_with_min():
    r, clock = _rendezvous()
    for m in (2, 0, 1):
        r.join(m, processes=1)
    layout = _layout(r, 1)
    assert layout["machines"] == [0, 1, 2] and layout["attempt"] == 0 and layout["port"] == 40000

    r, clock = _rendezvous()
    r.join(0, processes=2)
    r.join(1, processes=1)
    assert _layout(r, 0) is None                       # MIN joined: the last call for machine 2
    clock.now = 4.9
    assert _layout(r, 0) is None
    clock.now = 5.0
    layout = _layout(r, 0)
    assert layout["machines"] == [0, 1] and layout["sizes"] == [2, 1]


def test_a_failure_ends_the_attempt_for_everyone_and_the_next_starts_when_the_others_are_back():
    r, clock = _rendezvous()
    for m in (0, 1, 2):
        r.join(m, processes=1)
    assert _layout(r, 0)["attempt"] == 0
    assert r.poll(1, running=0) == {}
    verdict = r.end(2, 0, FAILED, "a process failed")
    assert verdict == {"verdict": RESTART, "reason": "machine 2: a process failed"}
    assert r.poll(0, running=0)["verdict"] == RESTART  # what machine 0's beat hears: stop the group
    for m in (1, 0, 2):                                 # all back: no last call
        r.join(m, processes=1)
    layout = _layout(r, 0)
    assert layout["attempt"] == 1 and layout["machines"] == [0, 1, 2] and layout["port"] == 40001


def test_a_machine_that_stops_beating_is_lost_and_the_job_goes_on_without_it():
    r, clock = _rendezvous(heartbeat=15.0)
    for m in (0, 1, 2):
        r.join(m, processes=1)
    _layout(r, 0)
    for t in (5.0, 10.0, 15.5):                         # machine 2 is silent from t=0
        clock.now = t
        assert r.poll(0, running=0) in ({}, {"verdict": RESTART, "reason": "machine(s) 2 stopped answering for 15s"})
        r.poll(1, running=0)
    assert r.poll(1, running=0)["verdict"] == RESTART
    r.join(0, processes=1)
    r.join(1, processes=1)                              # machine 2 never comes back: not waited for
    layout = _layout(r, 1)
    assert layout["machines"] == [0, 1] and layout["attempt"] == 1


def test_a_late_machine_waits_for_the_next_attempt_and_then_takes_part():
    r, clock = _rendezvous(low=2, high=3)
    r.join(0, processes=1)
    r.join(1, processes=1)
    clock.now = 6.0
    assert _layout(r, 0)["machines"] == [0, 1]
    r.join(2, processes=1)                              # late: the attempt runs
    assert r.poll(2) == {}
    r.end(1, 0, FAILED, "the group broke")
    for m in (0, 1):
        r.join(m, processes=1)
    layout = _layout(r, 2)
    assert layout["machines"] == [0, 1, 2] and layout["attempt"] == 1


def test_the_job_ends_finished_when_every_machine_is_done_and_gives_up_after_the_restarts():
    r, clock = _rendezvous(low=2, high=2, restarts=1)
    for m in (0, 1):
        r.join(m, processes=1)
    _layout(r, 0)
    assert r.end(0, 0, DONE, "finished") == {}         # machine 1 still runs
    assert r.end(1, 0, DONE, "finished")["verdict"] == FINISHED
    assert r.poll(0, running=0)["verdict"] == FINISHED
    assert r.untold() == {0, 1}                         # answered, not yet written out (the server says when)
    r.delivered(0)
    r.delivered(1)
    assert r.untold() == set()

    r, clock = _rendezvous(low=2, high=2, restarts=1)
    for attempt in (0, 1):
        for m in (0, 1):
            r.join(m, processes=1)
        assert _layout(r, 0)["attempt"] == attempt
        verdict = r.end(0, attempt, FAILED, "a process failed")
    assert verdict["verdict"] == GAVE_UP and "after 1 restart(s)" in verdict["reason"]
    assert r.poll(1, running=1)["verdict"] == GAVE_UP
    assert r.poll(1)["verdict"] == GAVE_UP              # and to a machine that asks for its next attempt


def test_a_machine_busy_stopping_its_processes_is_still_waited_for_to_hear_that_the_job_gave_up():
    # CI, test_two_machines_restart_together_and_give_up_together[torch]: machine 1 was stopping
    # its crashed processes (no beat for a few seconds) when machine 0's end gave the job up;
    # machine 0 counted it gone after 4 beats (2 s), stopped serving, and machine 1's own end
    # then found no rendezvous ("did not answer for 15s") instead of hearing the verdict
    r, clock = _rendezvous(low=2, high=2, restarts=0, heartbeat=15.0)
    for m in (0, 1):
        r.join(m, processes=1)
    _layout(r, 0)
    _layout(r, 1)
    clock.now = 3.0                                     # machine 1 silent for 3 s: stopping its processes
    assert r.end(0, 0, FAILED, "a process failed")["verdict"] == GAVE_UP
    r.delivered(0)
    assert r.untold() == {1}                            # alive until the heartbeat timeout says otherwise
    clock.now = 16.0                                    # silent beyond the heartbeat timeout: not waited for
    assert r.untold() == set()


def test_a_machine_whose_beat_heard_that_the_job_gave_up_ends_without_machine_0():
    """CI, test_two_machines_restart_together_and_give_up_together[torch] (stop 44): machine 1's
    beat heard that the job gave up, so machine 0 counted it told and stopped serving; machine 1
    then reported its own end to nobody and failed with "did not answer" instead of giving up."""
    r = Rendezvous(2, 2, 0, 0.0, heartbeat_timeout=15.0)
    server = RendezvousServer(r, port=0, key=KEY).start()
    address = f"127.0.0.1:{server.port}"
    clients = [RendezvousClient(address, machine=m, key=KEY, patience=1.0) for m in (0, 1)]
    try:
        for client in clients:
            client.join(1)
        layout = clients[1].wait_for_attempt()["layout"]
        with clients[1].beating(layout["attempt"]) as beat:
            assert clients[0].end(0, FAILED, "a process failed")["verdict"] == GAVE_UP
            give_up = time.monotonic() + 10
            while beat.stop_reason() is None and time.monotonic() < give_up:
                time.sleep(0.05)
        assert "ended on another machine" in (beat.stop_reason() or ""), beat.stop_reason()
    finally:
        server.close(linger=5.0)                        # returns at once: both machines heard the verdict
    verdict = beat.end(FAILED, "a process failed")
    assert verdict["verdict"] == GAVE_UP and "after 0 restart(s)" in verdict["reason"], verdict


def test_a_preempted_machine_leaves_and_too_few_machines_give_up_after_the_timeout():
    r, clock = _rendezvous(low=2, high=2, timeout=60.0)
    for m in (0, 1):
        r.join(m, processes=1)
    _layout(r, 0)
    r.end(0, 0, LEAVES, "preempted")
    assert r.end(1, 0, LEAVES, "preempted")["verdict"] == STOPPED

    r, clock = _rendezvous(low=2, high=3, timeout=60.0)
    r.join(0, processes=1)
    clock.now = 59.0
    assert r.poll(0) == {}
    clock.now = 61.0
    assert r.poll(0) == {"verdict": GAVE_UP, "reason": "1 of at least 2 machine(s) joined attempt 1 within 60s"}


def test_the_server_and_client_on_loopback():
    r, clock = _rendezvous(low=1, high=1)
    server = RendezvousServer(r, port=0, key=KEY).start()
    try:
        client = RendezvousClient(f"127.0.0.1:{server.port}", machine=0, key=KEY)
        client.join(2)
        answer = client.wait_for_attempt()
        assert answer["layout"]["machines"] == [0] and answer["layout"]["sizes"] == [2]
        assert client.end(0, DONE, "finished")["verdict"] == FINISHED
    finally:
        server.close()
    with pytest.raises(RendezvousLost, match=r"did not answer for 0.6s .*cannot go on without machine 0"):
        RendezvousClient(f"127.0.0.1:{server.port}", machine=1, key=KEY, patience=0.6).join(1)


def test_machine_0_counts_a_machine_told_only_once_its_answer_was_written_out():
    """Machine 0 stops serving once every machine still beating heard the final verdict. A
    machine counted as told when its answer was made, not written, lost the race in CI: machine
    0 exited mid-answer and machine 1's launcher failed on the truncated answer."""
    r, clock = _rendezvous(low=1, high=2, last_call=0.0)
    r.join(0, processes=1)
    assert _layout(r, 0)["machines"] == [0]
    assert r.end(0, 0, DONE)["verdict"] == FINISHED    # the final verdict; machine 1 never joined
    r.delivered(0)
    server = RendezvousServer(r, port=0, key=KEY).start()
    untold_while_answering = []
    poll = r.poll

    def poll_and_look(machine, running=None):
        answer = poll(machine, running)
        untold_while_answering.append(r.untold())    # the answer is made, not yet written
        return answer

    r.poll = poll_and_look
    try:
        answer = RendezvousClient(f"127.0.0.1:{server.port}", machine=1, key=KEY).wait_for_attempt()
        assert answer["verdict"] == FINISHED
        assert untold_while_answering == [{1}]
        give_up = time.monotonic() + 5
        while r.untold() and time.monotonic() < give_up:  # told right after the answer was written
            time.sleep(0.01)
        assert r.untold() == set()
    finally:
        server.close()


def test_a_truncated_answer_is_asked_again():
    """An answer cut short (machine 0 gone mid-answer: http.client.IncompleteRead, not an OSError)
    is retried like no answer, instead of ending the launcher with a traceback."""
    listener = socket.create_server(("127.0.0.1", 0))
    body = json.dumps({"verdict": FINISHED}).encode()

    def serve():
        for whole in (False, True):
            connection, _ = listener.accept()
            with connection:
                request = connection.recv(65536).decode()
                signature = request.split(f"{SIGNATURE_HEADER}: ", 1)[1].split("\r\n", 1)[0]
                tag = KEY.sign(b"answer", signature.encode() + b"\0" + body)
                head = b"HTTP/1.1 200 OK\r\n%s: %s\r\n" % (SIGNATURE_HEADER.encode(), tag.encode())
                connection.sendall(head + (b"Content-Length: %d\r\n\r\n%s" % (len(body), body) if whole
                                           else b"Content-Length: 74\r\n\r\n"))

    threading.Thread(target=serve, daemon=True).start()
    try:
        client = RendezvousClient(f"127.0.0.1:{listener.getsockname()[1]}", machine=1, key=KEY, patience=10)
        assert client.wait_for_attempt() == {"verdict": FINISHED}
    finally:
        listener.close()


@pytest.mark.parametrize("flags,match", [
    (["--num-machines", "3:2", "--max-restarts", "1"], r"needs 1 <= MIN <= MAX; received 3:2.*#launch-machine-range"),
    (["--nnodes", "2:3"], r"--num-machines 2:3 changes the machines at a restart; pass --max-restarts too"),
    (["--nnodes", "2:3", "--max-restarts", "1", "--machine-rank", "3"],
     r"expected 0 <= --machine-rank < --num-machines"),
    (["--nnodes", "2", "--max-restarts", "1", "--rendezvous-heartbeat-timeout", "0.5"],
     r"--rendezvous-heartbeat-timeout must be at least 2 seconds .*received 0.5.*#launch-heartbeat-timeout"),
])
def test_the_launcher_refuses_a_wrong_machine_range_before_starting_anything(tmp_path, flags, match):
    from unified.launcher import launch as launch_module

    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(SystemExit, match=match):
        launch_module.launch(launch_module.build_parser().parse_args([*flags, str(script)]))


def test_a_machine_count_is_a_number_or_a_range():
    from unified.launcher import launch as launch_module

    parser = launch_module.build_parser()
    assert parser.parse_args(["--nnodes", "2:4", "s.py"]).num_machines == (2, 4)
    assert parser.parse_args(["--num-machines", "3", "s.py"]).num_machines == (3, 3)
    with pytest.raises(SystemExit):
        parser.parse_args(["--num-machines", "two", "s.py"])


def test_the_heartbeat_timeout_reaches_the_rendezvous_and_every_launcher_s_client(tmp_path, monkeypatch):
    """``--rendezvous-heartbeat-timeout 4``: machine 0's rendezvous counts a machine lost after 4 s
    of silence, and each launcher gives machine 0 as long (the default is 15 s)."""
    from unified.launcher import launch as launch_module
    from unified.launcher.launch import free_port

    seen = {}

    class FakeServer:
        def __init__(self, rendezvous, port, key, host):
            seen["heartbeat_timeout"] = rendezvous.heartbeat_timeout

        def start(self):
            return self

        def close(self):
            pass

    class FakeClient:
        def __init__(self, address, machine, key, patience=None):
            seen.setdefault("patience", []).append(patience)

        def join(self, *args, **kwargs):
            raise launch_module.RendezvousLost("recorded")

    monkeypatch.setattr(launch_module, "RendezvousServer", FakeServer)
    monkeypatch.setattr(launch_module, "RendezvousClient", FakeClient)
    monkeypatch.setenv("UNIFIED_RENDEZVOUS_SECRET", "test secret of the rendezvous tests, 0123456789abcdef")
    script = tmp_path / "s.py"
    script.write_text("")
    for flags, want in (([], 15.0), (["--rendezvous-heartbeat-timeout", "4"], 4.0)):
        seen.clear()
        args = launch_module.build_parser().parse_args(
            ["--num-machines", "2", "--max-restarts", "1", "--main-process-port", str(free_port()), *flags,
             str(script)])
        assert launch_module.launch(args) == 1  # the fake client's lost rendezvous
        assert seen == {"heartbeat_timeout": want, "patience": [want]}, flags
