"""`IdLists`: the list vLLM gets always equals `array.tolist()`, whatever was kept, and a prompt that extends
a kept one gets that prompt's int objects for the shared prefix."""

from __future__ import annotations

import random
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.server.engine.plugin._id_lists import IdLists


def ids(values: list[int]) -> array[int]:
    return array("I", values)


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 200_000) for _ in range(n)]  # above CPython's cached small ints


def test_an_agents_next_turn_shares_the_previous_prompts_ints() -> None:
    rng = random.Random(0)
    lists = IdLists(max_ids=1 << 20)
    first = words(rng, 5000)
    out1, reused1 = lists.to_list(ids(first))
    assert (out1, reused1) == (first, 0)
    second = first + words(rng, 300)
    out2, reused2 = lists.to_list(ids(second))
    assert out2 == second and reused2 == len(first)
    # The same objects, not equal ones made again: what saves the work.
    assert all(a is b for a, b in zip(out1, out2, strict=False))
    assert out2 is not out1 and len(lists) == 1  # the first prompt is held whole by the second


def test_an_edited_history_shares_what_precedes_the_edit() -> None:
    rng = random.Random(1)
    lists = IdLists(max_ids=1 << 20)
    first = words(rng, 4000)
    lists.to_list(ids(first))
    edited = [*first[:2500], 7, *first[2501:], *words(rng, 50)]
    out, reused = lists.to_list(ids(edited))
    assert out == edited and reused == 2500
    assert len(lists) == 2  # the first is kept too: a prompt may still extend it


def test_agents_under_one_system_prompt_each_extend_their_own_previous_turn() -> None:
    rng = random.Random(4)
    lists = IdLists(max_ids=1 << 20)
    system = words(rng, 300)
    prompts = [[*system, *words(rng, 200)] for _ in range(10)]
    for p in prompts:
        lists.to_list(ids(p))
    for _ in range(3):  # turns interleaved across the agents, as a server sees them
        for i, p in enumerate(prompts):
            prompts[i] = [*p, *words(rng, 40)]
            out, reused = lists.to_list(ids(prompts[i]))
            assert out == prompts[i] and reused == len(p)  # its own turn, not another agent's system prompt
    assert len(lists) == 10


def test_what_vllm_does_to_its_list_never_reaches_a_later_prompt() -> None:
    rng = random.Random(2)
    lists = IdLists(max_ids=1 << 20)
    first = words(rng, 1000)
    out, _ = lists.to_list(ids(first))
    out[:10] = [1] * 10  # vLLM owns the list it was given
    del out[500:]
    later = first + words(rng, 10)
    assert lists.to_list(ids(later))[0] == later


def test_other_conversations_and_over_long_prompts_are_made_whole() -> None:
    rng = random.Random(3)
    lists = IdLists(max_ids=3000)
    a, b = words(rng, 1000), words(rng, 1000)
    lists.to_list(ids(a))
    assert lists.to_list(ids(b)) == (b, 0)
    too_long = a + words(rng, 3000)
    assert lists.to_list(ids(too_long)) == (too_long, 0)
    assert IdLists(max_ids=0).to_list(ids(a)) == (a, 0)
    with pytest.raises(ValueError):
        IdLists(max_ids=-1)


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["new", "extend", "edit", "cut", "same"]), st.integers(0, 10**6)),
        min_size=1,
        max_size=25,
    ),
    max_ids=st.sampled_from([0, 50, 300, 5000]),
)
def test_every_list_equals_its_ids_and_the_kept_ids_stay_bounded(
    steps: list[tuple[str, int]], max_ids: int
) -> None:
    rng = random.Random(len(steps) * 7919 + max_ids)
    lists = IdLists(max_ids=max_ids)
    seen: list[list[int]] = []
    for op, seed in steps:
        r = random.Random(seed)
        base = seen[seed % len(seen)] if seen else []
        if op == "new" or not base:
            # A shared start (a system prompt) for most, so that candidates collide on their key.
            prompt = ([5000] * 64 if r.random() < 0.7 else []) + words(rng, r.randrange(1, 200))
        elif op == "extend":
            prompt = base + words(rng, r.randrange(1, 50))
        elif op == "edit":
            at = r.randrange(len(base))
            prompt = [*base[:at], r.randrange(1000, 2000), *base[at + 1 :]]
        elif op == "cut":
            prompt = base[: r.randrange(1, len(base) + 1)]
        else:
            prompt = list(base)
        out, reused = lists.to_list(ids(prompt))
        assert out == prompt and 0 <= reused <= len(prompt)
        out.append(1)  # vLLM's to change
        seen.append(prompt)
        assert lists._kept.size <= max_ids
