"""A retention declined at the cap still leaves decode's prefix cache: the next turn reuses it there.

A 1P1D cluster of its own whose engines have a KV cache of 160 blocks of 32 tokens, less than twice one
~2,700-token conversation (~85 blocks), so decode declines to retain it (the default cap
``agentkv_max_retained_fraction`` 0.5 is 80 blocks) and frees its blocks, which vLLM keeps cached until it
needs the room. The router asks decode how much of the conversation it still caches and sends the next turn
decode-local, where vLLM's prefix cache serves it, as one vLLM server with its prefix cache would. Nothing
else runs on this cluster during the test, so decode's counters move for these turns alone.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentkv.server.launch._cluster import Cluster
from agentkv.server.launch._model import tiny_serving

from ._clusters import Clusters
from ._helpers import assert_agrees_up_to_rounding, chat, messages_under, metric, service_info

P_PORT, D_PORT, SIDE_PORT = 26500, 26600, 9100
BLOCK, TOTAL_BLOCKS = 32, 160
PROMPT_TOKENS = 2700  # ~85 blocks with the answer: over the 80-block cap, under the 160 blocks decode has


@pytest.fixture(scope="module")
def small_decode(clusters: Clusters) -> Cluster:
    serving = tiny_serving()
    serving["extra_args"] += ["--num-gpu-blocks-override", str(TOTAL_BLOCKS)]
    return clusters.get(
        "declined",
        prefill_port=P_PORT,
        decode_port=D_PORT,
        side_channel_port=SIDE_PORT,
        max_model_len=4096,
        block_size=BLOCK,
        **serving,
    )


def _messages(prefill_url: str, seed: int) -> list[dict[str, Any]]:
    return messages_under(prefill_url, seed, PROMPT_TOKENS, words=4000, start=600)


def _sources(decode_url: str) -> tuple[float, float]:
    """Decode's prompt tokens so far by vLLM's own count: (from its prefix cache, computed itself)."""
    return (
        metric(decode_url, "vllm:prompt_tokens_by_source_total", source="local_cache_hit"),
        metric(decode_url, "vllm:prompt_tokens_by_source_total", source="local_compute"),
    )


def test_a_declined_retentions_next_turn_reuses_what_decode_caches(
    small_decode: Cluster, clusters: Clusters
) -> None:
    p, d = small_decode.prefills[0].spec, small_decode.decodes[0].spec
    assert p.service_url and d.service_url
    assert service_info(d.service_url)["retention_capacity_blocks"] == TOTAL_BLOCKS // 2
    router = clusters.router("auto", shared=False)
    try:
        cid = "declined-then-cached"
        history = _messages(p.url, 1)
        declined0 = service_info(d.service_url)["stats"]["not_retained"]
        first = chat(router.url, history, conversation_id=cid, max_tokens=8)
        assert service_info(d.service_url)["stats"]["not_retained"] == declined0 + 1

        history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and then?"}]
        hits0, computed0 = _sources(d.url)
        second = chat(router.url, history, conversation_id=cid, max_tokens=8, extra={"top_logprobs": 5})
        hits1, computed1 = _sources(d.url)
        assert second.headers["x-agentkv-path"] == "decode-local", second.headers
        assert second.headers["x-agentkv-reuse"] == "cached", second.headers
        # Decode's prefix cache served the conversation; decode computed only the new turn's tokens.
        assert hits1 - hits0 > PROMPT_TOKENS - 2 * BLOCK
        assert computed1 - computed0 < 4 * BLOCK
        assert int(second.headers["x-agentkv-reused-tokens"]) > PROMPT_TOKENS - 2 * BLOCK

        # Prefill alone is an ordinary single server computing the whole prompt: its answer, up to rounding.
        reference = chat(p.url, history, max_tokens=8, extra={"top_logprobs": 5})
        assert_agrees_up_to_rounding(second, reference)
    finally:
        router.stop()
