"""The JAX backend's caller thread: the bound on a control-plane call that never answers, and the
core it runs on (kept on its caller's, so that a hand-off is a switch on one core)."""
from __future__ import annotations

import os
import threading

import pytest

pytest.importorskip("jax")
from backends.jax.control import _Caller, _current_core_function, _NoAnswer  # noqa: E402

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1


def test_a_call_returns_its_value_or_raises_its_error():
    caller = _Caller()
    assert caller.call(lambda: 42, 5.0) == 42
    with pytest.raises(KeyError, match="missing"):
        caller.call(lambda: {}["missing"], 5.0)


def test_a_call_that_does_not_answer_stops_the_wait_at_its_deadline():
    caller, release = _Caller(), threading.Event()
    with pytest.raises(_NoAnswer):
        caller.call(lambda: release.wait(30), 0.2)
    release.set()
    assert caller.call(lambda: "next", 5.0) == "next"  # the thread is free again once the call ended


@pytest.mark.skipif(CORES < 2 or _current_core_function() is None, reason="needs sched_setaffinity and 2 usable cores")
def test_the_thread_runs_on_the_core_of_its_caller_and_follows_it():
    allowed = os.sched_getaffinity(0)
    caller = _Caller()
    where = _current_core_function()
    try:
        for core in sorted(allowed):
            os.sched_setaffinity(0, {core})  # move this (the calling) thread
            assert caller.call(where, 5.0) == core
            assert os.sched_getaffinity(caller._core.thread_id) == {core}
    finally:
        os.sched_setaffinity(0, allowed)


def test_callers_on_several_threads_each_get_their_own_answers():
    caller, answers, threads = _Caller(), {}, []

    def ask(name):
        answers[name] = [caller.call(lambda i=i: (name, i), 5.0) for i in range(50)]

    for name in "abc":
        threads.append(threading.Thread(target=ask, args=(name,)))
        threads[-1].start()
    for thread in threads:
        thread.join(30)
    assert answers == {name: [(name, i) for i in range(50)] for name in "abc"}
