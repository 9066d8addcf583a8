"""`KeptPrompts` and `common_prefix`, the index `IdLists` and `HashReuse` find a new prompt's kept prefix in
(each tested through it too: test_id_lists.py, tests/unit/connector/test_block_hashes.py)."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.server.engine._kept_prompts import KeptPrompts, common_prefix


def naive(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(
    base=st.lists(st.integers(0, 3), max_size=40),
    length=st.integers(0, 20_000),
    part=st.integers(0, 20_000),
    cut=st.integers(0, 20_000),
)
def test_common_prefix_is_where_lists_arrays_and_texts_part(
    base: list[int], length: int, part: int, cut: int
) -> None:
    # Long runs put the parting point past the first slices, at any offset within a later one.
    a = (base or [1]) * (length // max(len(base), 1) + 1)
    b = list(a)
    if b and part < len(b):
        b[part] += 1
    b = b[: cut or None]
    want = naive(a, b)
    assert common_prefix(a, b) == want == common_prefix(b, a)
    assert common_prefix(array("I", a), array("I", b)) == want
    assert common_prefix(array("I", a), b) == 0  # an array and a list: nothing is taken as shared
    text_a, text_b = "".join(map(str, a)), "".join(map(str, b))  # the tokenizer cache's texts
    assert common_prefix(text_a, text_b) == naive(list(text_a), list(text_b))


def test_find_takes_the_longest_shared_prefix_under_the_key_only() -> None:
    kept: KeptPrompts[str] = KeptPrompts(max_ids=1000, tries=8)
    kept.keep("k", [1, 2, 3, 4], "short")
    kept.keep("k", [1, 2, 3, 9, 9, 9], "longer")
    kept.keep("other", [1, 2, 3, 4, 5, 6], "elsewhere")
    shared, found = kept.find("k", [1, 2, 3, 4, 5])
    assert shared == 4 and found is not None and found.value == "short"
    assert kept.find("k", [7, 7]) == (0, None)
    assert kept.find("nothing", [1, 2, 3]) == (0, None)


def test_the_newest_prompt_a_new_one_extends_whole_ends_the_search() -> None:
    kept: KeptPrompts[int] = KeptPrompts(max_ids=1000, tries=8)
    kept.keep("k", [1, 2, 3, 4, 5, 6], 0)  # older: shares more, but the search stops before it
    kept.keep("k", [1, 2, 3], 1)
    shared, found = kept.find("k", [1, 2, 3, 4, 5, 6, 7])
    assert (shared, found and found.value) == (3, 1)


def test_only_the_newest_tries_are_compared() -> None:
    kept: KeptPrompts[int] = KeptPrompts(max_ids=1000, tries=2)
    kept.keep("k", [1, 2, 3, 4], 0)
    kept.keep("k", [1, 9], 1)
    kept.keep("k", [1, 8], 2)
    shared, found = kept.find("k", [1, 2, 3, 4, 5])
    assert (shared, found and found.value) == (1, 2)


def test_a_replaced_prompt_is_dropped_and_the_oldest_go_first_past_the_bound() -> None:
    kept: KeptPrompts[int] = KeptPrompts(max_ids=10, tries=8)
    kept.keep("a", [1, 2, 3], 0)
    _, base = kept.find("a", [1, 2, 3, 4])
    kept.keep("a", [1, 2, 3, 4], 1, replacing=base)
    assert len(kept) == 1 and kept.size == 4
    kept.keep("b", [5, 6, 7], 2)
    kept.keep("c", [8, 9, 10, 11], 3)  # 11 ids: the oldest, "a", goes
    assert len(kept) == 2 and kept.size == 7 and kept.find("a", [1, 2]) == (0, None)
    kept.keep("b", [5, 6, 7, 8], 4, replacing=base)  # already gone: nothing else is dropped for it
    assert len(kept) == 2 and kept.size == 8  # "b"'s first went for the bound, not for `replacing`
    kept.keep("d", list(range(11)), 5)  # longer than the bound: not kept, and nothing dropped for it
    assert len(kept) == 2
    with pytest.raises(ValueError):
        KeptPrompts(max_ids=-1, tries=1)


def test_nothing_is_kept_at_a_bound_of_zero() -> None:
    kept: KeptPrompts[int] = KeptPrompts(max_ids=0, tries=1)
    kept.keep("k", [1], 0)
    assert len(kept) == 0 and kept.find("k", [1]) == (0, None)
