"""Who checksums which sharded file (`share_of`): every file exactly once over the processes,
the same split computed on every process, and shares balanced by bytes (a process's load is
at most one file above the lightest process's)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from unified.checkpoint.save import share_of

sizes_st = st.dictionaries(st.text("abcdef/0123", min_size=1, max_size=6), st.integers(0, 10**9), max_size=40)


@settings(max_examples=200, deadline=None)
@given(sizes=sizes_st, count=st.integers(1, 9))
def test_every_file_once_and_balanced(sizes, count):
    shares = [share_of(sizes, rank, count) for rank in range(count)]
    flat = [name for share in shares for name in share]
    assert sorted(flat) == sorted(sizes)
    loads = [sum(sizes[n] for n in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes.values(), default=0)
    assert shares == [share_of(dict(reversed(list(sizes.items()))), rank, count) for rank in range(count)]  # order-free


def test_one_big_file_and_many_small_ones():
    sizes = {"big": 100, **{f"s{i}": 10 for i in range(10)}}
    assert share_of(sizes, 0, 2) == ["big"]
    assert len(share_of(sizes, 1, 2)) == 10
