"""The router's per-block digests of what decode holds (`TokenPrefix.chain`): a prompt that starts with only
some of decode's whole blocks reuses those blocks, and no others.

The router chains its own digests (16-byte BLAKE2b over uint32 ids), not vLLM's block hashes, which depend
on the engine's hash seed and algorithm: so the tests compare its matching with a naive comparison of the
ids, block by block."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from array import array
from typing import Any

import httpx
from hypothesis import given
from hypothesis import strategies as st

from agentkv._constants import FINGERPRINTS_KEY
from agentkv.server.router import _codec
from agentkv.server.router._policy import assess_reuse, partial_offer
from agentkv.server.router._store import ConversationRecord
from agentkv.server.router._tokens import MAX_CHECKPOINTS, TokenPrefix, block_chain

from .conftest import FakeEngines, render_ids, store_of
from .test_policy import pool

ids_st = st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=120)


def naive_chain(ids: list[int], block_size: int) -> list[bytes]:
    out, prev = [], b""
    for at in range(0, len(ids) - block_size + 1, block_size):
        prev = hashlib.blake2b(
            prev + array("I", ids[at : at + block_size]).tobytes(), digest_size=16
        ).digest()
        out.append(prev)
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def whole_matching_blocks(held: list[int], new: list[int], block_size: int) -> int:
    """The naive answer: tokens in the whole blocks of `held` that `new` repeats, leaving `new` at least two
    tokens to compute, and a block where fewer than 16 would be left."""
    n = min(common_prefix(held, new), len(held), len(new) - 2) // block_size * block_size
    while n > 0 and len(new) - n < min(16, block_size):
        n -= block_size
    return max(n, 0)


@st.composite
def edited(draw: st.DrawFn, ids: list[int]) -> list[int]:
    """A later prompt: a prefix of `ids` (any length) with other ids after it, as a dropped or rewritten
    answer, a cut tail or a regenerated turn leaves it."""
    keep = draw(st.integers(0, len(ids)))
    return ids[:keep] + draw(st.lists(st.integers(0, 2**32 - 1), max_size=40))


@given(ids_st, st.integers(1, 16))
def test_the_chain_is_each_blocks_digest_over_the_previous_one(ids: list[int], block_size: int) -> None:
    assert block_chain(ids, block_size, len(ids) // block_size) == naive_chain(ids, block_size)
    assert block_chain(array("I", ids), block_size, len(ids) // block_size) == naive_chain(ids, block_size)


@given(ids_st, st.integers(1, 8), st.integers(1, 200), st.booleans(), st.data())
def test_a_prompt_reuses_exactly_the_whole_blocks_that_match(
    ids: list[int], block_size: int, offered: int, exact: bool, data: st.DataObject
) -> None:
    held = TokenPrefix.of(ids, offered=offered, exact=exact, block_size=block_size)
    assert held is not None
    new = data.draw(edited(ids))
    match = held.match(new)
    assert match.extends == held.extended_by(new)
    if not match.extends:
        # Every block is a checkpoint below MAX_CHECKPOINTS blocks: the router's count is exact.
        want = whole_matching_blocks(ids[: held.held], new, block_size)
        assert match.verified == match.bound == want
    assert held.match(array("I", new)) == match


@given(st.integers(1, 4), st.integers(0, 4000), st.data())
def test_beyond_the_checkpoint_bound_the_true_match_lies_within_one_stride(
    block_size: int, seed: int, data: st.DataObject
) -> None:
    blocks = data.draw(st.integers(MAX_CHECKPOINTS + 1, 5 * MAX_CHECKPOINTS))
    ids = [(seed + 7919 * i) % 2**32 for i in range(blocks * block_size)]
    held = TokenPrefix.of(ids, offered=len(ids), exact=False, block_size=block_size)
    assert held is not None and held.stride > 1
    assert len(base64.b64decode(held.chain)) <= MAX_CHECKPOINTS * 16
    cut = data.draw(st.integers(0, len(ids) - 1))
    new = [*ids[:cut], 2**32 - 1 - ids[cut], 5, 6]
    match = held.match(new)
    want = whole_matching_blocks(ids, new, block_size)
    assert match.verified <= want <= match.bound
    assert match.bound - match.verified < held.stride * block_size
    assert match.verified % (held.stride * block_size) == 0 or match.verified == want


@given(ids_st, ids_st, st.integers(1, 8), st.booleans())
def test_a_resumed_chain_equals_one_hashed_from_scratch(
    first: list[int], more: list[int], block_size: int, exact: bool
) -> None:
    previous = TokenPrefix.of(first, offered=len(first), exact=exact, block_size=block_size)
    ids = first + more
    resumed = TokenPrefix.of(ids, offered=len(ids), exact=exact, block_size=block_size, previous=previous)
    assert resumed == TokenPrefix.of(ids, offered=len(ids), exact=exact, block_size=block_size)


def test_a_long_conversation_keeps_at_most_max_checkpoints_as_it_grows() -> None:
    turn, previous = 3000, None
    ids: list[int] = []
    for n in range(1, 9):
        ids += [(n * 31 + i) % 50_000 for i in range(turn * n)]
        held = TokenPrefix.of(ids, offered=len(ids), exact=False, block_size=16, previous=previous)
        assert held is not None and held.blocks == len(ids) // 16
        assert len(base64.b64decode(held.chain)) == held.blocks // held.stride * 16 <= MAX_CHECKPOINTS * 16
        assert held == TokenPrefix.of(ids, offered=len(ids), exact=False, block_size=16)
        previous = held
    assert previous is not None and previous.stride == 16  # 108k tokens: 6750 blocks


@given(ids_st, st.integers(1, 8), st.integers(1, 200))
def test_records_keep_the_chain_through_both_stores_encodings(
    ids: list[int], block_size: int, offered: int
) -> None:
    held = TokenPrefix.of(ids, offered=offered, exact=False, block_size=block_size)
    record = ConversationRecord(decode="d0", request_id="r", tokens=held)
    assert ConversationRecord.from_json(_codec.decode(_codec.encode(record.to_json()))) == record


def test_records_without_or_with_garbled_digests_match_only_a_whole_prefix() -> None:
    ids = list(range(1, 41))
    held = TokenPrefix.of(ids, offered=40, exact=False, block_size=4)
    # 20 ids shared, 3 added: 16 reused, so that a block (of 4) is left, not 3 tokens.
    assert held is not None and held.match([*ids[:20], 9, 9, 9]).verified == 16
    old = {"held": 40, "must_exceed": 40, "digest": held.digest}  # a record written before the chain
    garbled: list[dict[str, Any]] = [
        {**held.to_json(), "chain": held.chain[:-4]},
        {**held.to_json(), "chain": "!not base64!"},
        {**held.to_json(), "last": None},
        {**held.to_json(), "stride": 0},
        {**held.to_json(), "block_size": 8},
    ]
    for data in (old, *garbled):
        loaded = TokenPrefix.from_json(data)
        assert loaded is not None and loaded.block_size == 0, data
        assert not loaded.match([*ids[:20], 9, 9, 9]).verified
        assert loaded.match([*ids, 9]).extends


RETAINED = {"remote_block_ids": [list(range(10))], "remote_engine_id": "E", "remote_num_tokens": 40}


def verdict(held: TokenPrefix, new: list[int], retained: dict[str, Any] = RETAINED, **kw: Any) -> str:
    decode = next(iter(pool("decode", [0])))
    return assess_reuse(
        retained=retained,
        expires_at=1e12,
        prefix=None,
        body={},
        decode=decode,
        now=0.0,
        margin_s=1.0,
        tokens=held,
        prompt_ids=new,
        **kw,
    )


def test_the_verdict_is_partial_where_some_whole_blocks_match() -> None:
    ids = list(range(1, 41))
    held = TokenPrefix.of(ids, offered=40, exact=False, block_size=4)
    assert held is not None
    assert verdict(held, [*ids, 1]) == "ok"
    assert verdict(held, [*ids[:22], 7, 7]) == "partial"
    assert verdict(held, ids) == "partial"  # a regenerate: the blocks leaving it two tokens
    assert partial_offer(held.match(ids), RETAINED) == 36
    assert verdict(held, [0, *ids]) == "mismatch"  # differs in the first block
    assert verdict(held, ids[:5]) == "mismatch"  # too short to reuse a block and compute two tokens
    # Exact mode: prefill-computed KV only (decode's offer is fingerprinted by our connector).
    exact = TokenPrefix.of(ids, offered=38, exact=True, block_size=4)
    assert exact is not None
    fingerprinted = {**RETAINED, FINGERPRINTS_KEY: "00"}
    assert verdict(exact, ids, fingerprinted, exact=True) == "partial"
    assert verdict(exact, [*ids[:22], 7, 7], RETAINED, exact=True) == "miss"


def test_a_stock_decodes_offer_gets_only_blocks_the_router_proved() -> None:
    blocks = MAX_CHECKPOINTS * 2  # stride 2: every other block is a checkpoint
    ids = list(range(1, blocks + 1))
    held = TokenPrefix.of(ids, offered=len(ids), exact=False, block_size=1)
    assert held is not None and held.stride == 2
    new = [*ids[:11], 0, 0, 0]  # blocks 0..10 match; checkpoints at 1, 3, .., 9 do, 11 does not
    match = held.match(new)
    assert (match.verified, match.bound) == (10, 11)
    assert partial_offer(match, RETAINED) == 10
    assert partial_offer(match, {**RETAINED, FINGERPRINTS_KEY: "00"}) == 11  # prefill's connector checks


CHAT = "/v1/chat/completions"
USER1 = [{"role": "user", "content": "list the files in this directory please"}]
GENERATE = "/inference/v1/generate"


async def turn(client: httpx.AsyncClient, messages: list[dict[str, Any]], **body: Any) -> httpx.Response:
    r = await client.post(
        CHAT,
        json={"model": "tiny", "messages": messages, "max_tokens": 8, **body},
        headers={"x-session-id": "c1"},
    )
    assert r.status_code == 200, r.text
    return r


async def test_a_dropped_answer_pulls_the_whole_blocks_that_still_match(
    engines: FakeEngines, make_client
) -> None:
    """mini-swe-agent's format-error turn: every earlier message again, the model's answer dropped, a user
    message appended. Prefill is offered decode's blocks up to the last whole one the prompts share."""
    engines.renders = True
    async with make_client(tokens=True, path_policy="always-pd") as client:
        await turn(client, USER1)
        retry = [*USER1, {"role": "user", "content": "format error: answer with one command"}]
        r2 = await turn(client, retry)
        record = await store_of(client).get("-/c1")
        metrics = (await client.get("/metrics")).text
    first, second = (render_ids(b) for b, _ in engines.requests("p", "/v1/chat/completions/render"))
    prefills = [b for b, _ in engines.requests("p", GENERATE)]
    offer = prefills[1]["kv_transfer_params"]
    want = whole_matching_blocks(first, second, 4)
    assert 0 < want < len(first)
    assert r2.headers["x-agentkv-reuse"] == "hit"
    assert offer["remote_num_tokens"] == want
    assert [len(g) for g in offer["remote_block_ids"]] == [want // 4]
    assert "agentkv_partial_reuse_total 1.0" in metrics
    assert record.tokens is not None and record.tokens.held == len(second)


async def test_a_repeated_request_reuses_the_whole_blocks_leaving_two_tokens(
    engines: FakeEngines, make_client
) -> None:
    engines.renders = True
    async with make_client(tokens=True, path_policy="always-pd") as client:
        await turn(client, USER1)
        again = await turn(client, USER1)
    ids = render_ids({"model": "tiny", "messages": USER1, "max_tokens": 8})
    offer = [b for b, _ in engines.requests("p", GENERATE)][1]["kv_transfer_params"]
    assert again.headers["x-agentkv-reuse"] == "hit"
    assert offer["remote_num_tokens"] == (len(ids) - 4) // 4 * 4  # a regenerate: a block (of 4) left


async def test_a_prompt_that_shares_no_whole_block_recomputes(engines: FakeEngines, make_client) -> None:
    engines.renders = True
    async with make_client(tokens=True, path_policy="always-pd") as client:
        await turn(client, USER1)
        # Tools render first: the prompt differs from decode's in its first block.
        other = await turn(client, USER1, tools=[{"type": "function", "function": {"name": "ls"}}])
    assert other.headers["x-agentkv-reuse"] == "mismatch"
    assert [b for b, _ in engines.requests("p", GENERATE)][1]["kv_transfer_params"][
        "remote_block_ids"
    ] is None


def test_match_is_pure() -> None:
    held = TokenPrefix.of(list(range(1, 41)), offered=40, exact=False, block_size=4)
    assert held is not None
    before = dataclasses.asdict(held)
    held.match([1, 2, 3, 4, 5, 6, 7])
    assert dataclasses.asdict(held) == before
