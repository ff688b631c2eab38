"""Conformance: a checkpoint written by N processes loads with M (2 -> 3, 2 -> 1, 3 -> 2) on every
backend: every model, optimizer and registered value as saved, the next batch the first one not
yet seen (global sample indices), training continues, the documented RNG rule, and a clear
`CheckpointError` (nothing restored) where the position or an open accumulation window cannot be
continued. Four groups, one after another, on one shared directory (resize_scenarios.py)."""
from __future__ import annotations

import numpy as np
import pytest

from ..harness import run_group
from ..resize_scenarios import resize_load_1, resize_load_2, resize_load_3, resize_save_2
from ..scenario import backend_features

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def resized(backend, tmp_path_factory):
    shared = tmp_path_factory.mktemp(f"resize-{backend}")
    groups = {}
    for name, size, scenario in (("save2", 2, resize_save_2), ("load3", 3, resize_load_3),
                                 ("load1", 1, resize_load_1), ("load2", 2, resize_load_2)):
        groups[name] = run_group(backend, size, [scenario], shared, deadline=180.0).ok().scenario(scenario)
    groups["backend"] = backend
    return groups


def _global(rows):
    """One global batch from every process's rows, in process order."""
    return [x for r in rows for x in r]


def test_parameters_optimizer_and_registered_values_load_as_saved(resized):
    saved2, load3, load1, load2 = (resized[k] for k in ("save2", "load3", "load1", "load2"))
    at12 = {r["hash"] for r in saved2}
    assert len(at12) == 1  # replicated state: every process holds the same values
    assert {r["hash"] for r in load3} == at12 and {r["hash"] for r in load1} == at12
    from3 = {r["saved_hash"] for r in load3}
    assert len(from3) == 1 and from3 != at12  # the 3-process run trained on
    assert {r["hash"] for r in load2} == from3


def test_the_next_batch_is_the_first_one_not_yet_seen(resized):
    saved2, load3, load1, load2 = (resized[k] for k in ("save2", "load3", "load1", "load2"))
    order = saved2[0]["order"]
    assert [r["positions"] for r in load3] == [[2, 2]] * 3  # 12 samples in global batches of 6
    assert _global(r["next"] for r in load3) == order[12:18]
    assert _global(r["next_items"] for r in load3) == list(range(12, 18))
    assert _global(r["next"] for r in load1) == order[12:14]
    assert _global(r["next_items"] for r in load1) == list(range(12, 14))
    assert _global(r["next"] for r in load2) == order[24:28]  # 3 -> 2 after 24 samples
    assert _global(r["next_items"] for r in load2) == list(range(24, 28))


def test_training_continues_in_step_on_every_process(resized):
    for group, before in (("load3", "saved_hash"), ("load1", "hash"), ("load2", "hash")):
        rows = resized[group]
        trained = {r["trained_hash"] for r in rows}
        assert len(trained) == 1, group
        assert trained != {rows[0][before]}, group


def test_rng_processes_that_existed_continue_and_new_ones_derive_deterministically(resized):
    saved2, load3, load1, load2 = (resized[k] for k in ("save2", "load3", "load1", "load2"))
    # Draws are [Python random, NumPy global, framework]. Processes below the saving count
    # continue their own streams exactly, at 2 -> 3, 2 -> 1 and 3 -> 2.
    assert [r["draws"] for r in load3[:2]] == [r["draws"] for r in saved2]
    assert load1[0]["draws"] == saved2[0]["draws"]
    assert [r["draws"] for r in load2] == [r["saved_draws"] for r in load3[:2]]
    python, numpy_draw, framework = load3[2]["draws"]
    # NumPy's generator was alike on both saving processes: process 2 gets it too.
    assert numpy_draw == saved2[0]["draws"][1] == saved2[1]["draws"][1]
    # Python's and the framework's differed: process 2's are derived, unlike any saved stream...
    assert python not in [r["draws"][0] for r in saved2] and framework not in [r["draws"][2] for r in saved2]
    # ... and the same when the same checkpoint is loaded again.
    assert all(r["draws_again"] == r["draws"] for r in load3)
    # The main process says which generators were derived; a resume on fewer processes derives none.
    assert len(load3[0]["warnings"]) == 1 and "random generator(s) python" in load3[0]["warnings"][0]
    assert "numpy" not in load3[0]["warnings"][0].split("generator(s)")[1].split(",")[0]
    assert all(not r["warnings"] for r in load3[1:] + load1 + load2)


def test_a_position_that_cannot_continue_exactly_is_refused_before_anything_is_restored(resized):
    for r in resized["load3"]:
        refused = r["refused"]
        assert refused["error"] and refused["untouched"] and refused["positions"] == [0, 0]
        assert ("cannot resume dataloader_" in refused["error"]
                and "(saved by 2 processes, loaded by 3)" in refused["error"])
        assert "after 8 of the epoch's samples with a global batch of 6" in refused["error"]
        assert "docs/troubleshooting.md#cannot-resume" in refused["error"]


def test_an_open_accumulation_window_is_refused_and_a_closed_one_resumes(resized):
    saved2, load3 = resized["save2"], resized["load3"]
    if saved2[0].get("window") == "not run":
        assert "TrainingLoop" not in backend_features(resized["backend"])
        pytest.skip(f"backend {resized['backend']!r} lacks TrainingLoop (its accumulation window is not checked)")
    assert saved2[0]["open_step"] == 1
    for r in load3:
        refused = r["window_refused"]
        assert refused["untouched"] and "open gradient-accumulation window" in refused["error"], refused
        assert "cannot resume training_loop" in refused["error"]
        assert r["window_step"] == 0
    # the accumulation setup's regression samples: the rows of the order's samples 24..29
    from ..loop_scenarios import Regression

    expected = Regression(48).x[saved2[0]["window_order"][24:30]].ravel()
    assert np.array_equal(np.array(_global(r["window_next"] for r in load3), np.float32), expected)
