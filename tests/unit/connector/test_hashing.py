from hypothesis import given
from hypothesis import strategies as st

from agentkv.server._connector._hashing import (
    block_fingerprints,
    matching_prefix_blocks,
    prefill_computed_tokens,
    tail_fingerprint,
    verified_tokens,
)

BS = 4


def test_fingerprints_cover_full_blocks_only_and_chain() -> None:
    ids = list(range(10))
    fp = block_fingerprints(ids, BS)
    assert len(fp) == 2
    # Chained: the same block content after a different prefix fingerprints differently.
    other = [99, *ids[1:]]
    assert block_fingerprints(other, BS)[1] != fp[1]
    assert block_fingerprints(ids, BS, limit_tokens=7) == fp[:1]


def test_matching_prefix_stops_at_first_difference() -> None:
    assert matching_prefix_blocks(["a", "b", "c"], ["a", "b", "x"]) == 2
    assert matching_prefix_blocks(["a"], ["x", "a"]) == 0
    assert matching_prefix_blocks([], ["a"]) == 0


def test_verified_tokens_full_blocks_and_tail() -> None:
    decode_seq = list(range(11))  # 2 full blocks + a tail of 3
    theirs = block_fingerprints(decode_seq, BS, limit_tokens=11)
    tail = tail_fingerprint(decode_seq, BS, 11)
    assert tail is not None and tail[0] == 11
    prompt = [*decode_seq, 50, 51, 52]  # the new turn extends decode's sequence exactly
    assert verified_tokens(prompt, BS, 11, theirs, tail) == 11
    edited = decode_seq.copy()
    edited[9] = -1  # a change inside the tail: only the full blocks are provably equal
    assert verified_tokens([*edited, 50], BS, 11, theirs, tail) == 8
    early = decode_seq.copy()
    early[1] = -1  # a change in the first block: nothing may be reused
    assert verified_tokens([*early, 50], BS, 11, theirs, tail) == 0


def test_tail_absent_on_block_boundary_or_short_sequence() -> None:
    assert tail_fingerprint(list(range(8)), BS, 8) is None
    assert tail_fingerprint(list(range(5)), BS, 9) is None


def test_only_prefill_computed_kv_is_offered() -> None:
    # A finished decode request computed prompt + output - 1 tokens; decode itself recomputed the last prompt
    # token and computed every generated one, so the offer stops before the last prompt token.
    assert prefill_computed_tokens(computed=300 + 20 - 1, num_prompt_tokens=300) == 299
    assert prefill_computed_tokens(computed=150, num_prompt_tokens=300) == 150  # stopped early: all from P
    assert prefill_computed_tokens(computed=0, num_prompt_tokens=0) == 0


@given(st.lists(st.integers(0, 2**40), max_size=40), st.integers(1, 40), st.integers(0, 10))
def test_tail_from_a_given_chain_equals_the_tail_computed_alone(ids: list[int], n: int, extra: int) -> None:
    """A caller's chain (of at least the tail's full blocks) gives the same tail as computing it again; a
    chain too short for them is not used."""
    alone = tail_fingerprint(ids, BS, n)
    assert tail_fingerprint(ids, BS, n, chain=block_fingerprints(ids, BS, limit_tokens=n + extra)) == alone
    assert tail_fingerprint(ids, BS, n, chain=block_fingerprints(ids, BS, limit_tokens=n - BS)) == alone
