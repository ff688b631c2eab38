"""Collective semantics of `unified` (barriers, ordered sections, triggers, trees) on the in-memory backend."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, namedtuple

import numpy as np
import pytest

import unified
from unified import BarrierTimeout, DistributedError
from unified.runtime.tree import flatten

from .memory_backend import MemoryGroup, RankTimeout, run_accelerators, run_threads, unwrap

Point = namedtuple("Point", ["x", "y"])


class Recorder:
    """A thread-safe event list."""

    def __init__(self) -> None:
        self.events = []
        self._lock = threading.Lock()

    def __call__(self, *event) -> None:
        with self._lock:
            self.events.append(event)

    def index(self, event) -> int:
        return self.events.index(event)


# -- the harness itself ------------------------------------------------------------------------------
def test_memory_backend_detects_keys_that_differ_across_ranks():
    group = MemoryGroup(2)

    def fn(rank):
        group.backends[rank].barrier(f"wait_for_everyone #{rank + 1}", 0.3)

    results = run_threads(2, fn, deadline=5, group=group)
    assert any(isinstance(r, AssertionError) for r in results), results
    assert any(isinstance(r, BarrierTimeout) for r in results), results
    assert len(group.key_errors) == 1
    assert "wait_for_everyone #1" in group.key_errors[0] and "wait_for_everyone #2" in group.key_errors[0]


def test_run_threads_never_hangs():
    start = time.monotonic()
    results = run_threads(2, lambda rank: time.sleep(0.8) if rank else "done", deadline=0.2)
    assert results[0] == "done"
    assert isinstance(results[1], RankTimeout)
    assert time.monotonic() - start < 1.5


def test_keys_are_identical_across_ranks_over_mixed_operations():
    def body(acc):
        acc.wait_for_everyone()
        with acc.main_process_first():
            pass
        acc.check_trigger()
        acc.gather(np.array([acc.process_index]))
        acc.reduce({"a": 1.0})
        acc.broadcast([np.zeros(2)])
        acc.gather_object(acc.process_index)
        acc.end_training()

    group, results = run_accelerators(3, body)
    unwrap(results)
    assert group.calls[0] == group.calls[1] == group.calls[2]
    assert len(set(group.calls[0])) == len(group.calls[0]) == 9
    assert group.calls[0][0] == "wait_for_everyone #1"
    assert group.calls[0][-1].startswith("end_training")
    assert all(b.shut_down for b in group.backends)


# -- wait_for_everyone -------------------------------------------------------------------------------
def test_wait_for_everyone_orders_events():
    record = Recorder()

    def body(acc):
        rank = acc.process_index
        if rank == 3:
            time.sleep(0.2)  # the slowest process: nobody may leave before it arrives
        record("before", rank)
        acc.wait_for_everyone()
        record("after", rank)
        return True

    _, results = run_accelerators(4, body)
    assert unwrap(results) == [True] * 4
    last_before = max(record.index(("before", r)) for r in range(4))
    first_after = min(record.index(("after", r)) for r in range(4))
    assert last_before < first_after, record.events


@pytest.mark.parametrize("per_call", [True, False], ids=["timeout-argument", "accelerator-default"])
def test_barrier_timeout_names_the_missing_process(per_call):
    group = MemoryGroup(3)

    def fn(rank):
        acc = group.accelerator(rank, timeout=5.0 if per_call else 0.3)
        if rank == 2:
            return "never called"
        start = time.monotonic()
        try:
            if per_call:
                acc.wait_for_everyone(timeout=0.3)
            else:
                acc.wait_for_everyone()
        except BaseException as err:
            return err, time.monotonic() - start
        return None, time.monotonic() - start

    results = unwrap(run_threads(3, fn, deadline=10, group=group))
    assert results[2] == "never called"
    for rank in (0, 1):
        err, elapsed = results[rank]
        assert isinstance(err, BarrierTimeout), err
        assert isinstance(err, TimeoutError) and isinstance(err, DistributedError)
        assert isinstance(err, unified.UnifiedError)
        assert err.missing == [2]
        assert err.timeout == pytest.approx(0.3)
        assert "did not arrive" in str(err)
        assert "process 2 did not arrive" in str(err)
        assert "wait_for_everyone" in err.operation
        assert f"[process {rank}/3]" in str(err)
        assert 0.25 <= elapsed < 3.0


def test_wait_for_everyone_rejects_non_positive_timeout_and_group_stays_usable():
    def body(acc):
        with pytest.raises(ValueError, match=r"positive number of seconds; received 0"):
            acc.wait_for_everyone(timeout=0)
        with pytest.raises(ValueError, match=r"received -1"):
            acc.wait_for_everyone(timeout=-1)
        acc.wait_for_everyone(timeout=2)
        return acc.gather_object(acc.process_index)

    group, results = run_accelerators(2, body)
    assert unwrap(results) == [[0, 1], [0, 1]]
    assert group.collective_counts()[0] == group.collective_counts()[1]


def test_invalid_default_timeout_is_reported_with_its_value():
    group = MemoryGroup(2)

    def fn(rank):
        with pytest.raises(ValueError, match=r"received -1"):
            group.accelerator(rank, timeout=-1).wait_for_everyone()
        return True

    assert unwrap(run_threads(2, fn, deadline=10, group=group)) == [True, True]


# -- main_process_first / local_main_process_first ---------------------------------------------------
def test_main_process_first_runs_main_body_before_the_others():
    record = Recorder()

    def body(acc):
        rank = acc.process_index
        with acc.main_process_first():
            record("enter", rank)
            if acc.is_main_process:
                time.sleep(0.15)  # if the others did not wait, they would enter now
            record("exit", rank)
        record("left", rank)

    _, results = run_accelerators(3, body)
    unwrap(results)
    main_exit = record.index(("exit", 0))
    for rank in (1, 2):
        assert record.index(("enter", rank)) > main_exit, record.events
    last_body = max(record.index(("exit", r)) for r in range(3))
    first_left = min(record.index(("left", r)) for r in range(3))
    assert last_body < first_left, "everyone must leave together: " + repr(record.events)


def test_local_main_process_first_orders_per_machine():
    record = Recorder()

    def body(acc):
        rank = acc.process_index
        with acc.local_main_process_first():
            record("enter", rank)
            if acc.is_local_main_process:
                time.sleep(0.15)
            record("exit", rank)
        record("left", rank)
        return acc.is_local_main_process

    _, results = run_accelerators(4, body, local_num_processes=2)
    assert unwrap(results) == [True, False, True, False]
    first_group_done = max(record.index(("exit", r)) for r in (0, 2))
    for rank in (1, 3):
        assert record.index(("enter", rank)) > first_group_done, record.events
    last_body = max(record.index(("exit", r)) for r in range(4))
    first_left = min(record.index(("left", r)) for r in range(4))
    assert last_body < first_left, record.events


SECTIONS = [
    pytest.param("main_process_first", None, id="main_process_first"),
    pytest.param("local_main_process_first", 2, id="local_main_process_first"),
]


def _after_failure(acc):
    """Collectives after a failed section: they must line up (no hang, identical keys)."""
    acc.wait_for_everyone(timeout=3)
    return acc.gather(np.array([acc.process_index])).tolist()


@pytest.mark.parametrize("section, local", SECTIONS)
def test_exception_in_first_body_reaches_the_others(section, local):
    ran = Recorder()

    class Boom(Exception):
        pass

    def body(acc):
        rank = acc.process_index
        outcome = None
        try:
            with getattr(acc, section)():
                ran(rank)
                if rank == 0:
                    raise Boom("main failed")
        except BaseException as err:
            outcome = err
        return outcome, _after_failure(acc)

    group, results = run_accelerators(4, body, local_num_processes=local)
    results = unwrap(results)
    assert isinstance(results[0][0], Boom) and str(results[0][0]) == "main failed"
    assert not isinstance(results[0][0], DistributedError)
    for rank in (1, 2, 3):
        assert isinstance(results[rank][0], DistributedError), (rank, results[rank][0])
        assert section in str(results[rank][0])
    go_first = {0} if local is None else {0, 2}
    assert {e[0] for e in ran.events} == go_first, "the others must not run the body after a failure"
    assert all(r[1] == [0, 1, 2, 3] for r in results)
    counts = group.collective_counts()
    assert len(set(counts)) == 1, counts


@pytest.mark.parametrize("section, local", SECTIONS)
def test_exception_in_later_body_reaches_the_first(section, local):
    class Boom(Exception):
        pass

    def body(acc):
        outcome = None
        try:
            with getattr(acc, section)():
                if acc.process_index == 3:
                    raise Boom("late failure")
        except BaseException as err:
            outcome = err
        return outcome, _after_failure(acc)

    group, results = run_accelerators(4, body, local_num_processes=local)
    results = unwrap(results)
    assert isinstance(results[3][0], Boom)
    for rank in (0, 1, 2):
        assert isinstance(results[rank][0], DistributedError), (rank, results[rank][0])
        assert not isinstance(results[rank][0], BarrierTimeout)
    assert all(r[1] == [0, 1, 2, 3] for r in results)
    counts = group.collective_counts()
    assert len(set(counts)) == 1, counts


def test_main_process_first_without_errors_raises_nothing_and_returns_values():
    def body(acc):
        with acc.main_process_first():
            value = acc.process_index * 10
        return value

    _, results = run_accelerators(3, body)
    assert unwrap(results) == [0, 10, 20]


# -- triggers ------------------------------------------------------------------------------------------
def test_trigger_any_rank_sets_all_see_it_then_reset():
    setters = [{1}, set(), {0, 2}, set(), {2}]

    def body(acc):
        seen = []
        for round_setters in setters:
            if acc.process_index in round_setters:
                acc.set_trigger()
            seen.append(acc.check_trigger())
        return seen

    _, results = run_accelerators(3, body)
    expected = [bool(s) for s in setters]
    assert unwrap(results) == [expected] * 3


def test_trigger_not_set_is_false():
    _, results = run_accelerators(2, lambda acc: acc.check_trigger())
    assert unwrap(results) == [False, False]


# -- gather / reduce / broadcast -------------------------------------------------------------------
def _tree(rank):
    return {
        "b": [np.array([rank, rank], dtype=np.int64), (np.float32(rank),)],
        "a": Point(x=np.arange(2) + 10 * rank, y=rank),
        "c": OrderedDict(z=np.array([[rank]], dtype=np.float64), w=2.5 * rank),
    }


def test_gather_nested_tree():
    _, results = run_accelerators(3, lambda acc: acc.gather(_tree(acc.process_index)))
    for out in unwrap(results):
        assert set(out) == {"a", "b", "c"}
        assert isinstance(out["b"], list) and isinstance(out["b"][1], tuple)
        assert isinstance(out["a"], Point)
        assert isinstance(out["c"], OrderedDict)
        np.testing.assert_array_equal(out["b"][0], [0, 0, 1, 1, 2, 2])
        np.testing.assert_array_equal(out["b"][1][0], np.array([0, 1, 2], dtype=np.float32))
        assert out["b"][1][0].dtype == np.float32
        np.testing.assert_array_equal(out["a"].x, [0, 1, 10, 11, 20, 21])
        np.testing.assert_array_equal(out["a"].y, [0, 1, 2])
        assert out["c"]["z"].shape == (3, 1)
        np.testing.assert_array_equal(out["c"]["w"], [0.0, 2.5, 5.0])


def test_gather_single_array_and_0d():
    def body(acc):
        return acc.gather(np.array([acc.process_index])), acc.gather(np.int32(acc.process_index + 1))

    _, results = run_accelerators(2, body)
    for vec, scalar in unwrap(results):
        np.testing.assert_array_equal(vec, [0, 1])
        np.testing.assert_array_equal(scalar, [1, 2])
        assert scalar.dtype == np.int32


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reduce_nested_tree(reduction):
    n = 3
    _, results = run_accelerators(n, lambda acc: acc.reduce(_tree(acc.process_index), reduction))
    divide = n if reduction == "mean" else 1
    for out in unwrap(results):
        assert isinstance(out["a"], Point) and isinstance(out["b"][1], tuple)
        np.testing.assert_allclose(out["b"][0], np.array([3, 3]) / divide)
        np.testing.assert_allclose(out["b"][1][0], 3 / divide)
        np.testing.assert_allclose(out["a"].x, (np.array([0, 1]) * 3 + 30) / divide)
        np.testing.assert_allclose(out["a"].y, 3 / divide)
        np.testing.assert_allclose(out["c"]["z"], [[3 / divide]])
        np.testing.assert_allclose(out["c"]["w"], 7.5 / divide)


def test_reduce_default_is_sum():
    _, results = run_accelerators(2, lambda acc: acc.reduce(np.array([1.0, acc.process_index])))
    for out in unwrap(results):
        np.testing.assert_array_equal(out, [2.0, 1.0])


@pytest.mark.parametrize("src", [0, 1, 2])
def test_broadcast_nested_tree(src):
    def body(acc):
        if src == 0:
            return acc.broadcast(_tree(acc.process_index))
        return acc.broadcast(_tree(acc.process_index), from_process=src)

    _, results = run_accelerators(3, body)
    for out in unwrap(results):
        assert isinstance(out["a"], Point) and isinstance(out["c"], OrderedDict)
        np.testing.assert_array_equal(out["b"][0], [src, src])
        np.testing.assert_array_equal(out["b"][1][0], src)
        np.testing.assert_array_equal(out["a"].x, np.arange(2) + 10 * src)
        np.testing.assert_array_equal(out["a"].y, src)
        np.testing.assert_array_equal(out["c"]["z"], [[src]])
        np.testing.assert_array_equal(out["c"]["w"], 2.5 * src)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("reduction", ["max", "avg", "SUM", None])
def test_invalid_reduction_raises_value_error(n, reduction):
    def body(acc):
        with pytest.raises(ValueError) as info:
            acc.reduce({"x": np.ones(2)}, reduction)
        return str(info.value)

    group, results = run_accelerators(n, body)
    for message in unwrap(results):
        assert "'sum' or 'mean'" in message and repr(reduction) in message
    assert group.collective_counts() == [0] * n, "validation must happen before any collective"


@pytest.mark.parametrize("n, bad", [(1, 1), (2, 2), (2, -1), (3, 7)])
def test_invalid_from_process_raises_value_error(n, bad):
    def body(acc):
        with pytest.raises(ValueError) as info:
            acc.broadcast(np.zeros(1), from_process=bad)
        return str(info.value)

    group, results = run_accelerators(n, body)
    for message in unwrap(results):
        assert "from_process" in message
        assert f"0..{n - 1}" in message and f"received {bad}" in message
    assert group.collective_counts() == [0] * n


def test_unsupported_leaf_raises_type_error():
    def body(acc):
        with pytest.raises(TypeError, match="received str"):
            acc.gather({"name": "not an array"})
        return True

    group, results = run_accelerators(2, body)
    assert unwrap(results) == [True, True]
    assert group.collective_counts() == [0, 0]


# -- gather_object ----------------------------------------------------------------------------------
def test_gather_object_in_process_order():
    def body(acc):
        r = acc.process_index
        return acc.gather_object({"rank": r, "name": f"p{r}", "items": [r] * r, "none": None})

    _, results = run_accelerators(3, body)
    expected = [{"rank": r, "name": f"p{r}", "items": [r] * r, "none": None} for r in range(3)]
    assert unwrap(results) == [expected] * 3


def test_gather_object_rejects_non_json_values_without_a_collective():
    def body(acc):
        with pytest.raises(TypeError):
            acc.gather_object({1, 2})
        return acc.gather_object("still works")

    group, results = run_accelerators(2, body)
    assert unwrap(results) == [["still works"] * 2] * 2


def test_gather_object_single_process_matches_multi_process_semantics():
    acc = MemoryGroup(1).accelerator(0)
    assert acc.gather_object((1, 2)) == [[1, 2]]  # what every process gets with n > 1
    with pytest.raises(TypeError):
        acc.gather_object({1, 2})  # raises with n > 1 (see the test above)


# -- unified.runtime.tree -----------------------------------------------------------------------------------
def test_flatten_visits_dict_keys_sorted_and_rebuilds():
    is_int = lambda x: isinstance(x, int)  # noqa: E731
    leaves, rebuild = flatten({"b": [1, 2], "a": 3, "c": {"z": 4, "y": (5, 6)}}, is_int)
    assert leaves == [3, 1, 2, 5, 6, 4]
    out = rebuild([30, 10, 20, 50, 60, 40])
    assert out == {"a": 30, "b": [10, 20], "c": {"y": (50, 60), "z": 40}}
    assert isinstance(out["c"]["y"], tuple)


def test_flatten_order_is_independent_of_insertion_order():
    is_int = lambda x: isinstance(x, int)  # noqa: E731
    first, _ = flatten({"x": 1, "a": 2, "m": 3}, is_int)
    second, _ = flatten({"m": 3, "x": 1, "a": 2}, is_int)
    assert first == second == [2, 3, 1]


def test_flatten_rebuilds_namedtuples_and_leaf_root():
    is_num = lambda x: isinstance(x, (int, float))  # noqa: E731
    leaves, rebuild = flatten([Point(1, 2.0), (3,)], is_num)
    assert leaves == [1, 2.0, 3]
    out = rebuild([7, 8, 9])
    assert out == [Point(7, 8), (9,)] and isinstance(out[0], Point)
    leaves, rebuild = flatten(5, is_num)
    assert leaves == [5] and rebuild([6]) == 6
    leaves, rebuild = flatten({}, is_num)
    assert leaves == [] and rebuild([]) == {}


def test_flatten_rejects_unknown_nodes():
    with pytest.raises(TypeError, match="received set"):
        flatten({"a": {1, 2}}, lambda x: isinstance(x, int))
