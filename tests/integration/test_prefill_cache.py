"""Prefill with vLLM's prefix cache on, as `agentkv up` runs it (the suite's other clusters turn it off so
that every reused token comes from decode): a reuse turn pulls from decode only what prefill's own cache
lacks. Its own 1P1D cluster, since prefill's cache changes chunk boundaries, and so the last bits of KV, that
the other modules' bit-for-bit comparisons with a recompute rely on."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentkv.server.launch._cluster import Cluster
from agentkv.server.launch._model import tiny_serving

from ._clusters import Clusters
from ._helpers import (
    CPU_BLOCK,
    RouterProc,
    assert_agrees_up_to_rounding,
    chat,
    conversation_script,
    metric,
    new_id,
    service_info,
)

# NIXL side channels at 8900 (P) and 9000 (D): clear of every other cluster's (test_retention_cap's decode
# listens at 8600 + 100).
P_PORT, D_PORT, SIDE_PORT = 26300, 26400, 8900


@pytest.fixture(scope="module")
def cached(clusters: Clusters, model_dir: Path) -> Cluster:
    return clusters.get(
        "prefill-cache",
        prefill_port=P_PORT,
        decode_port=D_PORT,
        side_channel_port=SIDE_PORT,
        prefill_prefix_caching=True,
        **tiny_serving(),
    )


@pytest.fixture(scope="module")
def routers(clusters: Clusters, cached: Cluster) -> tuple[RouterProc, RouterProc]:
    on = clusters.router("exact", "--exact", "--path-policy", "always-pd")
    off = clusters.router("off", "--no-reuse", "--exact", "--path-policy", "always-pd")
    return on, off


def test_prefill_pulls_only_what_its_own_prefix_cache_lacks(
    cached: Cluster, routers: tuple[RouterProc, RouterProc]
) -> None:
    """Prefill computed turn 1's prompt and its prefix cache still holds the full blocks of it. Of what decode
    offers for turn 2 (exact mode: turn 1's prompt but its last token) prefill pulls only the rest, the
    prompt's last partial block, and vLLM reads just that block from decode into the blocks its own cache did
    not cover. The answer agrees with a recompute up to rounding: the recompute runs over prefill's cache too,
    with other chunk boundaries, which vLLM's prefix cache does not promise to keep bit for bit."""
    on, off = routers
    [p] = cached.prefills
    assert p.spec.service_url
    cid = new_id("pcache")
    h: list[dict[str, object]] = [
        {"role": "user", "content": " ".join(conversation_script(560, 3, letters=True))},  # several blocks
    ]
    t1 = chat(on.url, h, conversation_id=cid)
    h += [{"role": "assistant", "content": t1.text}, {"role": "user", "content": "tool result: 7 rows"}]
    before = service_info(p.spec.service_url)["stats"]
    hits0 = metric(p.spec.url, "vllm:prefix_cache_hits_total")
    t2 = chat(on.url, h, conversation_id=cid)
    after = service_info(p.spec.service_url)["stats"]
    assert t2.headers.get("x-agentkv-reuse") == "hit", t2.headers
    assert after["pulls"] - before["pulls"] == 1
    offered = after["tokens_offered"] - before["tokens_offered"]
    pulled = after["tokens_pulled"] - before["tokens_pulled"]
    assert offered >= CPU_BLOCK and pulled == offered % CPU_BLOCK > 0, (offered, pulled)
    # The router says the same to the client: of the tokens not recomputed, these came from decode.
    assert t2.headers["x-agentkv-pulled-tokens"] == str(pulled), t2.headers
    assert int(t2.headers["x-agentkv-reused-tokens"]) > pulled  # the rest from prefill's own cache
    # vLLM's own count agrees: prefill's cache served the full blocks.
    assert metric(p.spec.url, "vllm:prefix_cache_hits_total") - hits0 >= offered - pulled
    # The suite's one predicate for "up to rounding" (a first-token logprob moved by 0.08 in one CI run on
    # this tiny random-weight model; wrong KV moves it far more).
    ref = chat(off.url, h, extra={"top_logprobs": 5})
    assert_agrees_up_to_rounding(t2, ref)
