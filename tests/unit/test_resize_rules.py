"""The rules of a restart on another number of processes, without a process group: the data
position in global samples (`unified.data.resume_position`), the RNG rule
(`unified.checkpoint.rng_state.resolve_rng`) and the open accumulation window
(`GradientState.check_state_dict`). The conformance suite runs them for real (test_resize.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from unified.checkpoint.rng_state import derived_rng_seed, resolve_rng
from unified.data import PreparedDataLoader, PreparedIterableLoader, resume_position
from unified.training.loop import GradientState


def _ceil_batches(n):
    return lambda g: math.ceil(n / g)


@pytest.mark.parametrize("seen,saved,new,expected", [
    (12, 4, 6, (0, 2)),   # 2 -> 3 processes of 2 samples
    (12, 4, 2, (0, 6)),   # 2 -> 1
    (24, 6, 4, (0, 6)),   # 3 -> 2
    (0, 4, 6, (0, 0)),
    (48, 4, 6, (1, 0)),   # the saved epoch was finished: the next one starts
    (12, 4, 4, (0, 3)),   # the same count
])
def test_a_position_continues_at_the_first_sample_not_yet_seen(seen, saved, new, expected):
    assert resume_position(0, seen, saved, new, _ceil_batches(48), "g") == expected


def test_a_position_that_the_new_global_batch_does_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"after 8 of the epoch's samples with g: the next batch would start at "
                                         r"sample 6 \(repeating samples\) or 12 \(skipping samples\)"):
        resume_position(0, 8, 4, 6, _ceil_batches(48), "g")


def test_the_end_of_an_uneven_epoch_resumes_at_the_next_one():
    # 10 samples in global batches of 4: 3 batches, the last padded; 12 "seen" at its end
    assert resume_position(2, 12, 4, 5, _ceil_batches(10), "g") == (3, 0)


class _Placement:
    def __init__(self, rank, size):
        self.process_index, self.num_processes, self.uneven_batches = rank, size, True

    def place_batch(self, batch):
        return batch


class _Source:
    def __init__(self, dataset, batch_size=2):
        self.dataset, self.batch_size, self.shuffle, self.drop_last, self.seed = dataset, batch_size, True, False, 5
        self.collate_fn = lambda samples: samples


def test_loaders_check_without_changing_anything_and_load_in_global_samples():
    data = list(range(48))
    saver = PreparedDataLoader(_Source(data), _Placement(0, 2), 5)
    saver.position = 3
    state = saver.state_dict()
    three = PreparedDataLoader(_Source(data), _Placement(2, 3), 5)
    three.check_state_dict(state)
    assert (three.epoch, three.position) == (0, 0)
    three.load_state_dict(state)
    assert three.position == 2
    order = three.epoch_order(0)
    assert three.batch_indices(order, three.position) == [int(order[i]) for i in (16, 17)]  # process 2's rows of 12..17
    saver.position = 2
    with pytest.raises(ValueError, match="after 8 of the epoch's samples with a global batch of 6 samples"):
        three.check_state_dict(saver.state_dict())


def test_an_iterable_stream_position_converts_between_global_batches():
    stream = type("Stream", (), {"__iter__": lambda self: iter(range(48))})()
    saver = PreparedIterableLoader(_Source(stream), _Placement(0, 2), None)
    saver.position = 3
    one = PreparedIterableLoader(_Source(stream), _Placement(0, 1), None)
    one.load_state_dict(saver.state_dict())
    assert one.position == 6
    saver.position = 1
    three = PreparedIterableLoader(_Source(stream), _Placement(0, 3), None)
    with pytest.raises(ValueError, match="after 4 of the epoch's samples with a global batch of 6 items"):
        three.check_state_dict(saver.state_dict())


def _stream(python, numpy_value, framework):
    return {"host": {"python": {"version": 3, "state": [python, 1], "gauss": None},
                     "numpy": {"keys": np.array([numpy_value], np.uint32), "pos": 0}},
            "framework": {"gen": np.array([framework], np.int64)}}


def test_rng_rule_alike_streams_everywhere_own_streams_kept_new_ones_derived():
    saved = [_stream(10, 7, 100), _stream(11, 7, 101)]  # NumPy alike on both, the others differ
    zero, one, two = (resolve_rng(saved, i) for i in range(3))
    assert zero["host"]["python"]["state"][0] == 10 and one["host"]["python"]["state"][0] == 11
    assert zero["derived"] == {} and one["derived"] == {}
    assert int(two["host"]["numpy"]["keys"][0]) == 7 and "numpy" not in two["derived"]
    assert set(two["derived"]) == {"python", "gen"} and sorted(two["differing"]) == ["gen", "python"]
    assert two["derived"]["python"] == derived_rng_seed("python", 2, 2, saved[0]["host"]["python"])
    assert resolve_rng(saved, 2)["derived"] == two["derived"]  # deterministic
    three = resolve_rng(saved, 3)["derived"]
    assert (three["python"] != two["derived"]["python"]
            and two["derived"]["python"] != two["derived"]["gen"])  # unrelated
    other = [_stream(12, 7, 100), _stream(11, 7, 101)]
    assert resolve_rng(other, 2)["derived"]["python"] != two["derived"]["python"]  # another checkpoint
    assert resolve_rng(saved[:1], 1)["derived"] == {}  # one saving process: its streams everywhere


def test_an_open_accumulation_window_moves_only_with_its_process_count():
    state = GradientState(num_steps=2)
    state.check_state_dict({"step": 1, "num_steps": 2}, 2, 2)
    state.check_state_dict({"step": 0, "num_steps": 2}, 2, 3)
    with pytest.raises(ValueError, match=r"open gradient-accumulation window \(1 of 2 micro-batches\) by 2 processes"):
        state.check_state_dict({"step": 1, "num_steps": 2}, 2, 3)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=3"):
        state.check_state_dict({"step": 0, "num_steps": 3}, 2, 2)
