"""The retention cap on the real engine: decode never lets leases hold more than its share of KV blocks, and
a retention it declines still leaves decode's prefix cache for the next turn.

One 1P1D cluster whose engines have a KV cache of 160 blocks of 32 tokens, so the default cap
(``agentkv_max_retained_fraction`` 0.5) is 80 blocks:

- A ~2,700-token conversation (~85 blocks) is over the cap, under the 160 blocks decode has: decode declines
  to retain it and frees its blocks, which vLLM keeps cached until it needs the room. The router asks decode
  how much of the conversation it still caches and sends the next turn decode-local, where vLLM's prefix
  cache serves it, as one vLLM server with its prefix cache would. It runs first: it leaves no lease, while
  the tests after it leave decode's share full of leases (300 s) that would leave it no room.
- One ~1,450-token conversation (~46 blocks) fits under the cap while a second does not. Without the cap, or
  if a declined retention's blocks were never freed, a few more such turns would leave decode no blocks to
  schedule them and they would hang (bounded here by a timeout).
"""

from __future__ import annotations

from typing import Any

import pytest

from agentkv.server.launch._cluster import Cluster
from agentkv.server.launch._model import tiny_serving

from ._clusters import Clusters
from ._helpers import (
    RouterProc,
    assert_agrees_up_to_rounding,
    assert_same_answer,
    chat,
    held_params,
    messages_under,
    metric,
    pd_turn,
    retained_params,
    service_info,
    split_invariant,
)

P_PORT, D_PORT, SIDE_PORT = 26100, 26200, 8600
BLOCK, TOTAL_BLOCKS = 32, 160
PROMPT_TOKENS = 1450  # ~46 blocks with the answer: one fits under the 80-block cap, two do not
DECLINED_TOKENS = 2700  # ~85 blocks with the answer: over the 80-block cap, under the 160 blocks decode has
TURN_TIMEOUT_S = 120  # far above a turn here (1-2 s); a turn that cannot get blocks waits forever


@pytest.fixture(scope="module")
def capped(clusters: Clusters) -> Cluster:
    serving = tiny_serving()
    serving["extra_args"] += ["--num-gpu-blocks-override", str(TOTAL_BLOCKS)]
    return clusters.get(
        "capped",
        prefill_port=P_PORT,
        decode_port=D_PORT,
        side_channel_port=SIDE_PORT,
        lease_s=300,  # the granted lease must outlive the test: only the cap may decline anything
        max_model_len=4096,
        block_size=BLOCK,
        **serving,
    )


def _messages(prefill_url: str, seed: int) -> list[dict[str, Any]]:
    return messages_under(prefill_url, seed, PROMPT_TOKENS, words=2000, start=300)


def _declined_messages(prefill_url: str, seed: int) -> list[dict[str, Any]]:
    return messages_under(prefill_url, seed, DECLINED_TOKENS, words=4000, start=600)


def _a_declined_turn(
    router: RouterProc, decode_service: str, cid: str, history: list[dict[str, Any]], *, then: str
) -> list[dict[str, Any]]:
    """One turn of ``cid`` through ``router`` that decode declines to retain (counted once); returns the
    messages that continue the history: its answer and the user's ``then``."""
    declined0 = service_info(decode_service)["stats"]["not_retained"]
    first = chat(router.url, history, conversation_id=cid, max_tokens=8)
    assert service_info(decode_service)["stats"]["not_retained"] == declined0 + 1
    return [{"role": "assistant", "content": first.text}, {"role": "user", "content": then}]


def _sources(decode_url: str) -> tuple[float, float]:
    """Decode's prompt tokens so far by vLLM's own count: (from its prefix cache, computed itself)."""
    return (
        metric(decode_url, "vllm:prompt_tokens_by_source_total", source="local_cache_hit"),
        metric(decode_url, "vllm:prompt_tokens_by_source_total", source="local_compute"),
    )


def test_a_declined_retentions_next_turn_reuses_what_decode_caches(
    capped: Cluster, clusters: Clusters
) -> None:
    p, d = capped.prefills[0].spec, capped.decodes[0].spec
    assert p.service_url and d.service_url
    assert service_info(d.service_url)["retention_capacity_blocks"] == TOTAL_BLOCKS // 2
    router = clusters.router("auto", shared=False)
    try:
        cid = "declined-then-cached"
        history = _declined_messages(p.url, 1)
        history += _a_declined_turn(router, d.service_url, cid, history, then="and then?")
        hits0, computed0 = _sources(d.url)
        second = chat(router.url, history, conversation_id=cid, max_tokens=8, extra={"top_logprobs": 5})
        hits1, computed1 = _sources(d.url)
        assert second.headers["x-agentkv-path"] == "decode-local", second.headers
        assert second.headers["x-agentkv-reuse"] == "cached", second.headers
        # Decode's prefix cache served the conversation; decode computed only the new turn's tokens.
        assert hits1 - hits0 > DECLINED_TOKENS - 2 * BLOCK
        assert computed1 - computed0 < 4 * BLOCK
        assert int(second.headers["x-agentkv-reused-tokens"]) > DECLINED_TOKENS - 2 * BLOCK

        # Prefill alone is an ordinary single server computing the whole prompt: its answer, up to rounding.
        reference = chat(p.url, history, max_tokens=8, extra={"top_logprobs": 5})
        assert_agrees_up_to_rounding(second, reference)
    finally:
        router.stop()


def test_decode_declines_what_does_not_fit_frees_it_and_keeps_the_granted_lease(capped: Cluster) -> None:
    p, d = capped.prefills[0].spec, capped.decodes[0].spec
    assert p.service_url and d.service_url
    info = service_info(d.service_url)
    assert info["retention_capacity_blocks"] == TOTAL_BLOCKS // 2  # the default share, from vLLM's count
    base = info["retained_blocks"]  # the warm-up's last turn (a few tokens) may still be leased

    first = _messages(p.url, 1)
    turn_a, rid_a = pd_turn(p.url, d.url, first, max_tokens=8, timeout_s=TURN_TIMEOUT_S)
    held_a = held_params(d.service_url, rid_a)
    assert held_a["remote_num_tokens"] > 1000
    blocks_a = service_info(d.service_url)["retained_blocks"] - base
    assert 40 <= blocks_a <= TOTAL_BLOCKS // 2 - base

    # A second conversation of the same size does not fit: declined, nothing offered, counted.
    declined0 = service_info(d.service_url)["stats"]["not_retained"]
    turn_b, rid_b = pd_turn(p.url, d.url, _messages(p.url, 2), max_tokens=8, timeout_s=TURN_TIMEOUT_S)
    assert retained_params(d.service_url, rid_b) is None
    offer_b = turn_b.kv_transfer_params or {}
    assert offer_b.get("remote_num_tokens") == 0 and not any(offer_b.get("remote_block_ids") or [])
    assert service_info(d.service_url)["stats"]["not_retained"] == declined0 + 1
    assert service_info(d.service_url)["retained_blocks"] == base + blocks_a

    # Declined blocks are freed: four more such turns need 4 x ~46 blocks on a 160-block decode that still
    # holds conversation 1's ~46. Leaked blocks would leave them unschedulable (a timeout, not a pass).
    for seed in range(3, 7):
        pd_turn(p.url, d.url, _messages(p.url, seed), max_tokens=8, timeout_s=TURN_TIMEOUT_S)
    assert service_info(d.service_url)["stats"]["not_retained"] == declined0 + 5

    # The granted lease survived all of that: the next turn of conversation 1 pulls it, and answers what a
    # recompute of the same history answers, bit for bit.
    second = [*first, {"role": "assistant", "content": turn_a.text}, {"role": "user", "content": "and then?"}]
    pulled0 = service_info(p.service_url)["stats"]["tokens_pulled"]
    reuse, _ = pd_turn(p.url, d.url, second, retained=held_a, max_tokens=8, timeout_s=TURN_TIMEOUT_S)
    assert service_info(p.service_url)["stats"]["tokens_pulled"] - pulled0 > 1000
    recompute, _ = pd_turn(p.url, d.url, second, max_tokens=8, timeout_s=TURN_TIMEOUT_S)
    assert_same_answer(reuse, recompute, bit_exact=split_invariant(d.url))


def test_the_router_offers_nothing_from_a_turn_decode_declined_to_retain(
    capped: Cluster, clusters: Clusters
) -> None:
    """A declined retention leaves the router no record to offer: the next turn is a plain miss (prefill is
    offered nothing), not an empty offer that prefill would have to refuse."""
    p, d = capped.prefills[0].spec, capped.decodes[0].spec
    assert p.service_url and d.service_url
    # Fill decode's retention share with direct turns until one more conversation cannot fit.
    for seed in range(20, 24):
        if service_info(d.service_url)["retained_blocks"] + 46 > TOTAL_BLOCKS // 2:
            break
        pd_turn(p.url, d.url, _messages(p.url, seed), max_tokens=8, timeout_s=TURN_TIMEOUT_S)
    else:
        pytest.fail("decode kept retaining past its cap")
    router = clusters.router("on", "--path-policy", "always-pd", shared=False)
    try:
        cid = "capped-declined"
        history = _messages(p.url, 30)
        history += _a_declined_turn(router, d.service_url, cid, history, then="next")
        offered0 = service_info(p.service_url)["stats"]["tokens_offered"]
        second = chat(router.url, history, conversation_id=cid, max_tokens=8)
        assert second.headers["x-agentkv-reuse"] == "miss", second.headers
        assert service_info(p.service_url)["stats"]["tokens_offered"] == offered0
    finally:
        router.stop()
