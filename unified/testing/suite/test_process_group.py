"""Conformance: process-group promises on every backend, in real groups of 2 and 3 processes.

One group per (backend, size) runs every scenario in sequence; the last scenario breaks the
group on purpose (a SIGKILLed process at size 2, a stuck one at size 3).
"""
from __future__ import annotations

import pytest

from ..harness import launch_group, run_group
from ..kit import distributed_type, has_health_channel
from ..scenarios import (
    barrier_order,
    collectives,
    dead_at_barrier,
    identity,
    local_main_first_order,
    main_first_exception,
    main_first_order,
    start,
    stuck_at_barrier,
    trigger,
    trigger_late_peer,
)

SCENARIOS = [start, identity, barrier_order, main_first_order, local_main_first_order,
             trigger, trigger_late_peer, collectives, main_first_exception]
# size 3 is split into two simulated machines (2 + 1 processes) to exercise local-main-first.
LAYOUTS = {2: [2], 3: [2, 1]}
FINALE = {2: dead_at_barrier, 3: stuck_at_barrier}

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}-processes")
def group(request, backend, tmp_path_factory):
    size = request.param
    result = run_group(backend, size, SCENARIOS + [FINALE[size]], tmp_path_factory.mktemp("group"),
                       deadline=150, local_sizes=LAYOUTS[size])
    return result


def test_identity(group):
    ids = group.scenario(identity)
    n = group.size
    assert [i["process_index"] for i in ids] == list(range(n))
    assert all(i["num_processes"] == n and i["backend"] == group.backend for i in ids)
    assert [i["is_main_process"] for i in ids] == [True] + [False] * (n - 1)
    assert [i["is_last_process"] for i in ids] == [False] * (n - 1) + [True]
    expected_local = [local for size in LAYOUTS[n] for local in range(size)]
    assert [i["local_process_index"] for i in ids] == expected_local
    assert [i["is_local_main_process"] for i in ids] == [local == 0 for local in expected_local]
    assert len({i["pid"] for i in ids}) == n
    assert all(i["distributed_type"] == distributed_type(group.backend) for i in ids)


def test_barrier_releases_nobody_early(group):
    rows = group.scenario(barrier_order)
    last_arrival = max(r["arrive"] for r in rows)
    assert all(r["leave"] >= last_arrival for r in rows), group.show_logs()
    assert last_arrival - min(r["arrive"] for r in rows) > 0.05  # the arrivals really were staggered


@pytest.mark.parametrize("name", [main_first_order, local_main_first_order], ids=lambda f: f.__name__)
def test_first_runs_first_and_everyone_leaves_together(group, name):
    rows = group.scenario(name)
    firsts = [r for r in rows if r["first"]]
    others = [r for r in rows if not r["first"]]
    assert firsts and others
    first_done = max(r["body_exit"] for r in firsts)
    assert all(o["enter"] >= first_done for o in others), rows
    all_done = max(r["body_exit"] for r in rows)
    assert all(r["leave"] >= all_done for r in rows), rows


def test_trigger_seen_by_all_in_same_call_and_reset(group):
    rows = group.scenario(trigger)
    assert all(r == {"quiet": False, "fired": True, "after_reset": False} for r in rows), rows


def test_trigger_reaches_a_late_peer(group):
    rows = group.scenario(trigger_late_peer)
    assert all(r == {"fired": True, "again": False, "quiet": False} for r in rows), rows


def test_gather_reduce_broadcast(group):
    n = group.size
    for r in group.scenario(collectives):
        assert r["gather_rows"] == [k for k in range(n) for _ in range(2)]
        assert r["gather_scalar"] == [float(k) for k in range(n)]
        assert r["sum"] == [float(n), float(sum(range(n)))]
        assert r["mean"] == pytest.approx([sum(range(n)) / n])
        assert r["broadcast"] == [10 + n - 1] * 2
        assert r["objects"] == [{"rank": k} for k in range(n)]
        assert r["framework_arrays"], r  # the results are the backend's own arrays


def test_exception_in_main_first_reaches_others(group):
    rows = group.scenario(main_first_exception)
    assert rows[0]["caught"] == "ValueError: boom in main body"
    for r in rows[1:]:
        assert r["caught"].startswith("DistributedError"), r
    assert all(r["elapsed"] < 10 for r in rows)


def test_lost_process_gives_survivors_barrier_timeout(group):
    name = FINALE[group.size]
    survivors = list(range(group.size - 1))
    rows = [group.result(i, name) for i in survivors]
    assert all(r is not None for r in rows), group.show_logs()
    limit = (15 if name == dead_at_barrier else 3) + 5  # timeout + slack for a loaded 2-core CI
    for r in rows:
        assert r["raised"] == "BarrierTimeout" and r["is_timeout_error"], group.show_logs()
        assert r["elapsed"] < limit, r
        assert r["missing"] == [group.size - 1], r["message"]
        assert f"process {group.size - 1} did not arrive" in r["message"]
    # Survivors exit promptly, not from a runtime abort. With a watchdog (a backend with a health
    # channel) they exit 1: their group broke, even though their script caught the error, and a
    # launcher and a scheduler must see the run failed. Without one the script's own exit stands.
    watched = has_health_channel(group.backend)
    for i, r in zip(survivors, rows):
        assert group.returncodes[i] == (1 if watched else 0), group.show_logs()
        if watched:
            assert "exiting without finalizers because the process group broke" in group.logs[i], group.show_logs()
        assert group.exit_times[i] is not None and group.exit_times[i] - r["exit_at"] < 10, group.show_logs()
    if name == stuck_at_barrier and watched:  # the watchdog tells the stuck process and ends it, with the reason
        assert group.returncodes[-1] == 1, group.show_logs()
        assert ("unified: the process group broke - process 0 failed: BarrierTimeout"
                in group.logs[-1]), group.show_logs()
        assert "stuck" not in (group.result(-1, name) or {}), "the stuck process should not have finished its sleep"
        assert group.exit_times[-1] - min(r["exit_at"] for r in rows) < 5, group.show_logs()
    elif name == stuck_at_barrier:  # no health channel to tell it: it finishes its sleep, its own exit stands
        assert (group.result(-1, name) or {}).get("stuck") and group.returncodes[-1] == 0, group.show_logs()
    else:
        assert group.returncodes[-1] == -9


def test_a_group_started_by_unified_launch(backend, tmp_path):
    """The same promises in a group started as a user's job is: by `unified launch`, through the
    backend's whole launcher (torch: torchrun's agent), not the suite's direct start."""
    group = launch_group(backend, 2, [start, identity, barrier_order, main_first_order, collectives], tmp_path).ok()
    ids = group.scenario(identity)
    assert [i["process_index"] for i in ids] == [0, 1] and len({i["pid"] for i in ids}) == 2, group.show_logs()
    assert [i["local_process_index"] for i in ids] == [0, 1]
    assert all(i["num_processes"] == 2 and i["distributed_type"] == distributed_type(backend) for i in ids)
    rows = group.scenario(barrier_order)
    assert all(r["leave"] >= max(x["arrive"] for x in rows) for r in rows), rows
    first = group.scenario(main_first_order)
    assert first[1]["enter"] >= first[0]["body_exit"], first
    assert [r["objects"] for r in group.scenario(collectives)] == [[{"rank": 0}, {"rank": 1}]] * 2
