"""`unified.data.streams`: streams each process reads on its own, in one process with the other
processes stood in for (their row counts and states come from a fake exchange), and the library
adapters (Hugging Face datasets, Grain, torch samplers' seeds) on real libraries."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from unified.data.streams import GrainLoaderStream, HuggingFaceStream, PreparedStreamLoader


class Placement:
    def __init__(self, rank: int, world: int) -> None:
        self.process_index, self.num_processes, self.uneven_batches = rank, world, False

    def place_batch(self, batch):
        return batch


class Exchange:
    """The other processes: their rows at each step and their states, in process order."""

    def __init__(self, rank: int, others_rows, others_state="other") -> None:
        self.rank, self.others_rows, self.others_state, self.steps = rank, list(others_rows), others_state, 0

    def all_gather_json(self, value, operation):
        if operation == "stream_step":
            other = self.others_rows[self.steps] if self.steps < len(self.others_rows) else 0
            self.steps += 1
            return [value, other] if self.rank == 0 else [other, value]
        mine = json.loads(json.dumps(value))
        return [mine, self.others_state] if self.rank == 0 else [self.others_state, mine]


class Batches:
    """A `ProcessStream` over fixed batches of ids; its state is the index of the next batch."""

    described, even = "a test stream", False

    def __init__(self, sizes, batch_size=2) -> None:
        self.batch_size, self.sizes, self.next, self.opened = batch_size, sizes, 0, []
        starts = np.cumsum([0] + list(sizes))
        self.batches = [np.arange(a, b) for a, b in zip(starts[:-1], starts[1:])]

    def open(self, epoch, state):
        self.opened.append((epoch, state))
        self.next = 0 if state is None else int(state)

        def run():
            while self.next < len(self.batches):
                self.next += 1
                yield self.batches[self.next - 1]

        return run()

    def state(self):
        return self.next


def _loader(sizes, others_rows, rank=0, drop_last=False):
    stream = Batches(sizes)
    loader = PreparedStreamLoader(stream, Placement(rank, 2), drop_last)
    loader.connect(Exchange(rank, others_rows))
    return stream, loader


def test_a_share_that_ends_first_gives_repeats_marked_in_the_layout():
    _, loader = _loader([2, 2, 1], others_rows=[2, 2, 2, 2])
    got, layouts = [], []
    for batch in loader:
        got.append(batch.tolist())
        layouts.append(loader.batch_layout())
    assert got == [[0, 1], [2, 3], [4, 4], [4, 4]]  # a short batch filled up; then repeats of the last
    assert [layout.kept for layout in layouts] == [(2, 2), (2, 2), (1, 2), (0, 2)]
    assert all(layout.rows == (2, 2) for layout in layouts) and loader.epoch == 1 and loader.position == 0


def test_drop_last_stops_at_the_first_step_where_a_share_is_short():
    _, loader = _loader([2, 2, 1], others_rows=[2, 2, 2, 2], drop_last=True)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]


def test_an_empty_share_beside_full_ones_is_a_clear_error():
    _, loader = _loader([], others_rows=[2])
    with pytest.raises(ValueError, match="share of a test stream is empty"):
        list(loader)


def test_state_holds_every_process_and_a_resume_continues_this_one():
    stream, loader = _loader([2, 2, 2, 2], others_rows=[2, 2, 2, 2])
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert state["position"] == 2 and state["num_processes"] == 2
    assert [json.loads(s) for s in state["processes"]] == [2, "other"]
    again_stream, again = _loader([2, 2, 2, 2], others_rows=[2, 2])
    again.load_state_dict(state)
    assert again.state_dict()["processes"][0] == "2"  # before iterating: the loaded position
    assert [b.tolist() for b in again] == [[4, 5], [6, 7]]
    assert again_stream.opened == [(0, 2)]


def test_another_process_count_resumes_only_at_an_epoch_boundary():
    _, loader = _loader([2, 2], others_rows=[2, 2])
    mid = {"stream": "a test stream", "epoch": 0, "position": 1, "num_processes": 3, "processes": ["1", "1", "1"]}
    with pytest.raises(ValueError, match="saved by 3, and each process's position belongs to its own share"):
        loader.check_state_dict(mid)
    boundary = {**mid, "epoch": 2, "position": 0, "processes": ["null"] * 3}
    loader.load_state_dict(boundary)
    assert loader.epoch == 2 and loader.position == 0
    with pytest.raises(ValueError, match="was not a stream"):
        loader.check_state_dict({"epoch": 0, "position": 1, "seed": 0})


def test_skip_first_batches_drops_steps_on_the_host_and_never_twice():
    from unified.data import skip_first_batches

    stream, loader = _loader([2, 2, 2], others_rows=[2, 2, 2])
    assert [b.tolist() for b in skip_first_batches(loader, 2)] == [[4, 5]]
    _, restored = _loader([2, 2, 2], others_rows=[2])
    restored.load_state_dict({"stream": "a test stream", "epoch": 0, "position": 2, "num_processes": 2,
                              "processes": ["2", "2"]})
    assert skip_first_batches(restored, 2) is restored  # already there: nothing read again


def test_a_stream_has_no_length():
    _, loader = _loader([2], others_rows=[2])
    with pytest.raises(TypeError, match="is a stream"):
        len(loader)


def _hf(shards: int, per: int):
    datasets = pytest.importorskip("datasets")

    def generate(parts):
        for s in parts:
            for i in range(per):
                yield {"x": s * per + i}

    return datasets.IterableDataset.from_generator(generate,
                                                   gen_kwargs={"parts": list(range(shards))}).with_format("numpy")


def test_a_datasets_stream_gives_each_process_its_own_shards_and_resumes_from_its_state():
    from unified.data import default_collate

    shares = []
    for rank in range(2):
        stream = HuggingFaceStream(_hf(4, 3), rank, 2, 2, default_collate)
        shares.append([x for b in stream.open(0, None) for x in b["x"].tolist()])
    assert sorted(shares[0] + shares[1]) == list(range(12)) and not set(shares[0]) & set(shares[1])
    stream = HuggingFaceStream(_hf(4, 3), 1, 2, 2, default_collate)
    batches = stream.open(0, None)
    first = next(batches)["x"].tolist()
    state = json.loads(json.dumps(stream.state()))
    rest = [b["x"].tolist() for b in batches]
    again = HuggingFaceStream(_hf(4, 3), 1, 2, 2, default_collate)
    assert [b["x"].tolist() for b in again.open(0, state)] == rest and first + sum(rest, []) == shares[1]


def test_a_shuffle_buffer_is_named_at_prepare_because_the_library_does_not_save_it():
    from unified.data import default_collate

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        HuggingFaceStream(_hf(2, 2).shuffle(seed=0, buffer_size=4), 0, 1, 2, default_collate)
        HuggingFaceStream(_hf(2, 2), 0, 1, 2, default_collate)
    assert len(caught) == 1 and "hf-shuffle-buffer" in str(caught[0].message)


def _grain_loader(records: int, shard_options=None, workers: int = 0):
    grain = pytest.importorskip("grain")
    sampler = grain.samplers.IndexSampler(num_records=records, shuffle=True, num_epochs=1, seed=3)
    extra = {} if shard_options is None else {"shard_options": shard_options}
    return grain.DataLoader(data_source=np.arange(records), sampler=sampler,
                            operations=[grain.transforms.Batch(batch_size=2)], worker_count=workers, **extra)


def test_a_grain_loader_handed_whole_is_sharded_evenly_and_resumes_from_its_iterator_state():
    shares = []
    for rank in range(3):
        stream = GrainLoaderStream(_grain_loader(31), rank, 3)
        assert stream.even and stream.batch_size == 2
        shares.append([x for b in stream.open(0, None) for x in b.tolist()])
    assert [len(s) for s in shares] == [10, 10, 10]  # 31 records: the remainder dropped, shares equal
    assert len(set(sum(shares, []))) == 30
    stream = GrainLoaderStream(_grain_loader(31), 1, 3)
    batches = stream.open(0, None)
    next(batches)
    state = stream.state()
    rest = [b.tolist() for b in batches]
    assert [b.tolist() for b in GrainLoaderStream(_grain_loader(31), 1, 3).open(0, state)] == rest


def test_a_grain_loader_with_workers_and_unparsed_absl_flags_is_refused_at_prepare(monkeypatch):
    """Grain itself fails only at the first batch (UnparsedFlagAccessError); prepare says the fix."""
    _grain_loader(4)  # skips without grain
    from absl import flags

    monkeypatch.setattr(type(flags.FLAGS), "is_parsed", lambda self: False)
    with pytest.raises(RuntimeError, match="mark_as_parsed"):
        GrainLoaderStream(_grain_loader(8, workers=2), 0, 2)
    GrainLoaderStream(_grain_loader(8, workers=0), 0, 2)  # no workers: no flags read
    monkeypatch.setattr(type(flags.FLAGS), "is_parsed", lambda self: True)
    assert GrainLoaderStream(_grain_loader(8, workers=2), 0, 2).even


def test_a_grain_loader_sharded_for_another_group_size_is_refused():
    grain = pytest.importorskip("grain")
    with pytest.raises(ValueError, match="sharded 4 ways, but the group has 2 processes"):
        GrainLoaderStream(_grain_loader(8, grain.sharding.ShardOptions(shard_index=0, shard_count=4)), 0, 2)


def test_a_sampler_that_seeded_itself_uses_process_0s_seed_and_keeps_it_in_the_state():
    torch = pytest.importorskip("torch")
    from backends.common import _SamplerSource

    generator = torch.Generator().manual_seed(11)
    source = _SamplerSource(torch.utils.data.RandomSampler(range(20), generator=generator), seed=0, batches=False)
    source.agree(lambda seeds: [7 for _ in seeds])  # what process 0 had
    assert source.state() == {"generator_seeds": [7]}
    reference = _SamplerSource(torch.utils.data.RandomSampler(range(20), generator=torch.Generator().manual_seed(7)),
                               seed=0, batches=False)
    assert source.draw(1).tolist() == reference.draw(1).tolist()
    restarted = _SamplerSource(torch.utils.data.RandomSampler(range(20), generator=torch.Generator().manual_seed(99)),
                               seed=0, batches=False)
    restarted.load({"generator_seeds": [7]})
    assert restarted.draw(1).tolist() == reference.draw(1).tolist()


def test_own_blocks_gives_each_reader_every_readers_th_block_and_counts_what_it_read():
    from unified.data.streams import own_blocks

    read = [0]
    assert list(own_blocks(iter(range(10)), 1, 3, 2, read)) == [2, 3, 8, 9] and read == [10]
    resumed = [4]  # a reader that stood after 4 items: item 4 is the start of block 2
    assert list(own_blocks(iter(range(4, 10)), 2, 3, 2, resumed)) == [4, 5]


def test_a_torch_iterable_dataset_with_workers_resumes_by_replay_without_torchdata():
    """Without torchdata the position is the count of batches taken: a resume reads them again
    and drops them (the loader is a plain torch DataLoader of the user's workers)."""
    torch = pytest.importorskip("torch")
    from backends.torch_readers import AsGlobalReader, Readers
    from unified.data.streams import ReaderStream

    class Whole(torch.utils.data.IterableDataset):  # does not look at its worker info
        def __iter__(self):
            return iter({"x": np.array([i])} for i in range(20))

    def make(epoch):
        return torch.utils.data.DataLoader(Readers(Whole(), 2), batch_size=2, num_workers=2,
                                           worker_init_fn=AsGlobalReader(1, 2, None))

    stream = ReaderStream(Whole(), 2, make, stateful=False)
    batches = stream.open(0, None)
    first = [next(batches)["x"].ravel().tolist() for _ in range(2)]
    state = json.loads(json.dumps(stream.state()))
    rest = [b["x"].ravel().tolist() for b in batches]
    assert first + rest == [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]]  # process 1 of 2: blocks 1, 3, 5...
    assert state == {"batches": 2}
    assert [b["x"].ravel().tolist() for b in ReaderStream(Whole(), 2, make, stateful=False).open(0, state)] == rest
