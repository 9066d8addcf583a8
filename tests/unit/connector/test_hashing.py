import hashlib

from hypothesis import given
from hypothesis import strategies as st

from agentkv.server.engine._connector._hashing import (
    DIGEST,
    ChainCache,
    block_fingerprints,
    chain_digests,
    decode_loaded_tokens,
    matching_prefix_blocks,
    parse_chain,
    prefill_computed_tokens,
    tail_fingerprint,
    verified_tokens,
)

BS = 4


def _blocks(chain: bytes) -> list[bytes]:
    return [chain[i : i + DIGEST] for i in range(0, len(chain), DIGEST)]


def vllm_like_keys(ids: list[int], block_size: int = BS) -> list[bytes]:
    """A stand-in for vLLM's ``Request.block_hashes``: a hash per full block, chained over the prefix."""
    keys: list[bytes] = []
    prev = b"seed"
    for start in range(0, len(ids) - block_size + 1, block_size):
        prev = hashlib.sha256(prev + repr(ids[start : start + block_size]).encode()).digest()
        keys.append(prev)
    return keys


def test_fingerprints_cover_full_blocks_only_and_chain() -> None:
    ids = list(range(10))
    fp = block_fingerprints(ids, BS)
    assert len(fp) == 2 * DIGEST
    # Chained: the same block content after a different prefix fingerprints differently.
    other = [99, *ids[1:]]
    assert _blocks(block_fingerprints(other, BS))[1] != _blocks(fp)[1]
    assert block_fingerprints(ids, BS, limit_tokens=7) == fp[:DIGEST]


def test_matching_prefix_stops_at_first_difference() -> None:
    a, b, c, x = (bytes([i]) * DIGEST for i in range(4))
    assert matching_prefix_blocks(a + b + c, a + b + x) == 2
    assert matching_prefix_blocks(a, x + a) == 0
    assert matching_prefix_blocks(b"", a) == 0
    assert matching_prefix_blocks(a + b, a + b + c) == 2


@given(st.integers(0, 30), st.integers(0, 30), st.integers(0, 30))
def test_matching_prefix_finds_the_first_difference(common: int, ours_extra: int, theirs_extra: int) -> None:
    ours = b"".join(bytes([i % 251]) * DIGEST for i in range(common + ours_extra))
    theirs = b"".join(bytes([i % 251]) * DIGEST for i in range(common)) + b"\xff" * DIGEST * theirs_extra
    assert matching_prefix_blocks(ours, theirs) == common


def test_wire_form_is_one_hex_string_and_the_per_block_list_is_read_too() -> None:
    chain = block_fingerprints(list(range(12)), BS)
    assert parse_chain(chain.hex()) == chain
    assert parse_chain([block.hex() for block in _blocks(chain)]) == chain
    for bad in ("xyz", chain.hex()[:-2], ["ab"], [1, 2], 7, None):
        assert parse_chain(bad) is None


def test_verified_tokens_full_blocks_and_tail() -> None:
    decode_seq = list(range(11))  # 2 full blocks + a tail of 3
    theirs = block_fingerprints(decode_seq, BS, limit_tokens=11)
    tail = tail_fingerprint(decode_seq, BS, 11)
    assert tail is not None and tail[0] == 11
    prompt = [*decode_seq, 50, 51, 52]  # the new turn extends decode's sequence exactly
    assert verified_tokens(prompt, BS, 11, theirs, tail) == 11
    assert verified_tokens(prompt, BS, 11, theirs, tail, ours=block_fingerprints(prompt, BS)) == 11
    edited = decode_seq.copy()
    edited[9] = -1  # a change inside the tail: only the full blocks are provably equal
    assert verified_tokens([*edited, 50], BS, 11, theirs, tail) == 8
    early = decode_seq.copy()
    early[1] = -1  # a change in the first block: nothing may be reused
    assert verified_tokens([*early, 50], BS, 11, theirs, tail) == 0
    assert verified_tokens(prompt, BS, 11, theirs, ["11", tail[1]]) == 8  # a tail must name an int


def test_tail_absent_on_block_boundary_or_short_sequence() -> None:
    assert tail_fingerprint(list(range(8)), BS, 8) is None
    assert tail_fingerprint(list(range(5)), BS, 9) is None


def test_only_prefill_computed_kv_is_offered() -> None:
    # A finished decode request computed prompt + output - 1 tokens; decode itself recomputed the last prompt
    # token and computed every generated one, so the offer stops before the last prompt token.
    assert prefill_computed_tokens(computed=300 + 20 - 1, num_prompt_tokens=300) == 299
    assert prefill_computed_tokens(computed=150, num_prompt_tokens=300) == 150  # stopped early: all from P
    assert prefill_computed_tokens(computed=0, num_prompt_tokens=0) == 0
    # Where decode may have computed the prompt's last two tokens, neither is offered.
    assert prefill_computed_tokens(computed=300 + 20 - 1, num_prompt_tokens=300, tail=2) == 298
    assert prefill_computed_tokens(computed=150, num_prompt_tokens=300, tail=2) == 150


def _load(n: int, computed: int = 0, *, bs: int = 16, tail: int = 2) -> int:
    return decode_loaded_tokens(
        num_prompt_tokens=n, num_computed=computed, count=n - computed, block_size=bs, tail=tail
    )


def test_decode_leaves_the_prompts_last_tokens_where_its_blocks_stay_the_same() -> None:
    assert _load(100) == 98  # blocks 0-6 either way: decode computes tokens 98 and 99
    assert _load(100, computed=32) == 66  # its own prefix-cache hit stays; the load shrinks
    assert _load(96) == 94  # a full last block: still 6 blocks
    assert _load(100, tail=1) == 100  # vLLM's own: load all, re-run the last token alone


def test_decode_loads_everything_where_leaving_the_tail_would_drop_a_block() -> None:
    # 97 or 98 tokens: loading 95 or 96 would fill 6 blocks of the 7 prefill sent, and NIXL pairs a shorter
    # list with the remote's last blocks (every block read one place off): vLLM's own count instead.
    assert _load(97) == 97
    assert _load(98) == 98
    assert _load(99) == 97
    assert _load(3, bs=16) == 1
    assert _load(2, bs=16) == 2  # nothing left to load: vLLM's
    # A longer tail stays inside the last block: 100 tokens hold 4 there, so 3 at most (tokens 97-99).
    assert _load(100, tail=16) == 97
    assert _load(96, tail=16) == 81  # a full last block: up to 15 of its 16 (tokens 81-95)
    assert _load(98, tail=16) == 98  # 2 in the last block would leave one: vLLM's
    # An offer that is not the whole prompt (a hybrid model's N-1, a partial hit) is not touched.
    assert decode_loaded_tokens(num_prompt_tokens=100, num_computed=0, count=99, block_size=16, tail=2) == 99


@given(st.integers(1, 5000), st.integers(0, 300), st.sampled_from([1, 4, 16, 64]), st.integers(1, 4))
def test_a_decode_load_never_changes_its_block_count_or_exceeds_the_offer(
    n: int, hit_blocks: int, bs: int, tail: int
) -> None:
    computed = min(hit_blocks * bs, ((n - 1) // bs) * bs)
    count = n - computed
    loaded = decode_loaded_tokens(
        num_prompt_tokens=n, num_computed=computed, count=count, block_size=bs, tail=tail
    )
    assert 1 <= loaded <= count
    assert -(-(computed + loaded) // bs) == -(-n // bs)
    assert loaded == count or 2 <= n - (computed + loaded) <= tail


@given(st.lists(st.integers(0, 2**40), max_size=40), st.integers(1, 40), st.integers(0, 10))
def test_tail_from_a_given_chain_equals_the_tail_computed_alone(ids: list[int], n: int, extra: int) -> None:
    """A caller's chain (of at least the tail's full blocks) gives the same tail as computing it again; a
    chain too short for them is not used."""
    alone = tail_fingerprint(ids, BS, n)
    assert tail_fingerprint(ids, BS, n, chain=block_fingerprints(ids, BS, limit_tokens=n + extra)) == alone
    assert tail_fingerprint(ids, BS, n, chain=block_fingerprints(ids, BS, limit_tokens=n - BS)) == alone


def test_chain_digests_resume_where_a_chain_stopped() -> None:
    ids = list(range(40))
    whole = chain_digests(ids, BS, 10)
    rest = chain_digests(ids, BS, 10, start=4, prev=whole[3 * DIGEST : 4 * DIGEST])
    assert whole[: 4 * DIGEST] + rest == whole


def test_cache_hashes_only_the_blocks_a_turn_added() -> None:
    cache = ChainCache()
    turn1 = list(range(100))  # 25 blocks
    assert cache.chain(turn1, BS, 25, vllm_like_keys(turn1)) == block_fingerprints(turn1, BS)
    assert (cache.hashed_blocks, cache.reused_blocks) == (25, 0)
    turn2 = [*turn1, *range(500, 510)]  # 27 full blocks
    assert cache.chain(turn2, BS, 27, vllm_like_keys(turn2)) == block_fingerprints(turn2, BS)
    assert (cache.hashed_blocks, cache.reused_blocks) == (27, 25)
    # No keys (vLLM hashes at another granularity): the whole chain, right all the same.
    assert cache.chain(turn2, BS, 27, None) == block_fingerprints(turn2, BS)
    assert cache.hashed_blocks == 54


def test_cache_is_bounded_least_recently_used_first() -> None:
    cache = ChainCache(max_bytes=3 * 10 * DIGEST)
    convs = [[c * 1000 + i for i in range(40)] for c in range(4)]  # 10 blocks each
    for ids in convs[:3]:
        cache.chain(ids, BS, 10, vllm_like_keys(ids))
    cache.chain(convs[0], BS, 10, vllm_like_keys(convs[0]))  # touched: now the most recent
    cache.chain(convs[3], BS, 10, vllm_like_keys(convs[3]))  # evicts conversation 1
    assert len(cache) == 3
    before = cache.hashed_blocks
    cache.chain(convs[1], BS, 10, vllm_like_keys(convs[1]))
    assert cache.hashed_blocks == before + 10
    cache.chain(convs[0], BS, 10, vllm_like_keys(convs[0]))
    assert cache.hashed_blocks == before + 10


@given(
    st.lists(st.lists(st.integers(0, 7), min_size=0, max_size=12), min_size=1, max_size=6),
    st.lists(st.integers(0, 12), min_size=6, max_size=6),
)
def test_cached_chains_equal_a_full_hash_for_any_history(turns: list[list[int]], cuts: list[int]) -> None:
    """Conversations that grow, get cut back (an edit or a regenerate) and grow again: every chain the cache
    gives equals hashing the whole prefix, whichever earlier chain it started from."""
    cache = ChainCache()
    ids: list[int] = []
    for added, cut in zip(turns, cuts, strict=False):
        ids = ids[: max(0, len(ids) - cut)] + added
        blocks = len(ids) // BS
        assert cache.chain(ids, BS, blocks, vllm_like_keys(ids)) == block_fingerprints(ids, BS)
