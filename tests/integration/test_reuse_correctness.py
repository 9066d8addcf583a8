"""Reuse never reads KV of other tokens, on the real engine, in both modes.

Exact mode: greedy token ids and their logprobs bit for bit, reuse ON == reuse OFF. The OFF router is exact
too, so decode recomputes nothing it held: an independent recompute, not one that shares decode's prefix
cache with the reuse turn. Two exact ON routers: one with the router's token check plus our prefill
connector's, one with the router's check off, so the connector's alone must catch every edited history.

Default mode (vLLM's prefix-cache semantics): decode also offers the KV it decoded, so reuse of the same
tokens may round differently from a recompute; KV of other tokens would be far off. Compared by each turn's
first-token logprob, with the connector's check alone in charge.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from agentkv.server.launch._cluster import Cluster

from ._cases import CASES, assert_same_records, run_case
from ._helpers import CPU_BLOCK, RouterProc, chat, conversation_script, metric, new_id, service_info

# Histories that stop extending what decode holds: without the router's guard, prefill's token-exact check
# must catch each of them (a trimmed offer), or the unguarded run would compute with wrong KV.
DIVERGING = {
    "edited_earlier_user_message",
    "conversation_id_reused",
    "history_truncated_from_front",
}
# A history whose change lies in the previous answer only: decode offers just the previous prompt's KV (the
# only KV a prefill computed), so it diverges from nothing offered and reuses every turn, guarded or not.
ANSWER_ONLY = {"assistant_text_shortened"}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_reuse_on_equals_off(
    case: Callable[..., None],
    cluster: Cluster,
    router: RouterProc,
    router_unguarded: RouterProc,
    router_off: RouterProc,
    bit_exact: bool,
    report: Callable[[str], None],
) -> None:
    ps = cluster.prefills[0].spec.service_url
    assert ps
    script = conversation_script(100 + CASES.index(case), 3)
    off, _ = run_case(case, router_off.url, script)
    on, on_reuse = run_case(case, router.url, script)
    before = service_info(ps)["stats"]
    trimmed0 = metric(ps, "agentkv_connector_tokens_trimmed_total")
    bare, bare_reuse = run_case(case, router_unguarded.url, script)
    after = service_info(ps)["stats"]
    trimmed = metric(ps, "agentkv_connector_tokens_trimmed_total") - trimmed0
    assert_same_records(on, off, bit_exact=bit_exact)
    assert_same_records(bare, off, bit_exact=bit_exact)
    # The suite must exercise reuse, not just recompute everywhere.
    assert "hit" in on_reuse or case.__name__ == "conversation_id_reused"
    assert "hit" in bare_reuse
    # The connector's Prometheus counter and its JSON stats are one number.
    assert trimmed == after["tokens_trimmed"] - before["tokens_trimmed"]
    if case.__name__ in DIVERGING:
        assert after["refused_mismatch"] > before["refused_mismatch"] and trimmed > 0
    if case.__name__ in ANSWER_ONLY:
        assert on_reuse[1:] == ["hit"] * (len(on_reuse) - 1) and trimmed == 0, (on_reuse, trimmed)
    report(
        f"{case.__name__}: guarded {on_reuse}, unguarded {bare_reuse}, unguarded pulled "
        f"{after['tokens_pulled'] - before['tokens_pulled']} tokens, trimmed {trimmed:.0f}"
    )


def test_short_tool_result_goes_decode_local_and_long_document_goes_to_prefill(
    router_auto: RouterProc, router_off_inexact: RouterProc, report: Callable[[str], None]
) -> None:
    """The non-exact router's path choice. Decode-local is not bit-exact by construction (decode computes the
    last prompt token inside its prefill chunk; a P/D turn computes it alone on decode, with other kernels),
    so its answers are compared by the first token's logprob: equal up to bf16 rounding over the right KV,
    far off over wrong KV. Whether all token ids agreed is reported."""
    router_off = router_off_inexact
    script = conversation_script(200, 1)
    long_doc = " ".join(conversation_script(201, 1)[0].split() * 3)  # ~1000+ tokens of new text
    cid = new_id("path")
    h: list[dict[str, object]] = [{"role": "user", "content": script[0]}]
    paths, turns = [], []
    steps = [{"role": "user", "content": "tool result: 7 rows"}, {"role": "user", "content": long_doc}]
    for step in [None, *steps]:
        if step is not None:
            h.append(step)
        on = chat(router_auto.url, h, conversation_id=cid)
        off = chat(router_off.url, h)
        paths.append(on.headers.get("x-agentkv-path"))
        turns.append((on, off))
        h.append({"role": "assistant", "content": on.text})
    assert paths[1] == "decode-local", paths
    assert paths[2] in ("pull", "recompute"), paths
    assert turns[0][0].ids == turns[0][1].ids  # nothing reused yet
    for on, off in turns[1:]:
        assert abs(on.logprobs[0] - off.logprobs[0]) < 0.05, (on.logprobs[:3], off.logprobs[:3])
    assert metric(router_auto.url, "agentkv_path_decisions_total", path="decode-local") >= 1
    same = [on.ids == off.ids for on, off in turns]
    report(f"path choice (not exact): {paths}, token ids equal to OFF: {same}")


def test_a_cold_turn_prefilled_on_decode_is_retained_and_reused_there(
    cluster: Cluster, router_local: RouterProc, router_off_inexact: RouterProc, report: Callable[[str], None]
) -> None:
    """The path conditional disaggregation sends turns down when prefill is saturated, on the real engines:
    the cold turn's whole prompt is computed by decode (prefill's engine computes nothing), decode retains
    it, and the next turn reuses it there. Answers compared with the non-exact OFF router by first-token
    logprob (decode's prefill chunk and prefill's own prefill round differently)."""
    p, d = cluster.prefills[0].spec.url, cluster.decodes[0].spec.url

    def computed() -> tuple[float, float]:
        name = "vllm:prompt_tokens_by_source_total"
        return metric(p, name, source="local_compute"), metric(d, name, source="local_compute")

    script = conversation_script(210, 1)
    cid = new_id("cold-local")
    h: list[dict[str, object]] = [{"role": "user", "content": script[0]}]
    turns = []
    for step in (None, {"role": "user", "content": "tool result: 7 rows"}):
        if step is not None:
            h.append(step)
        p0, d0 = computed()
        on = chat(router_local.url, h, conversation_id=cid)
        p1, d1 = computed()
        off = chat(router_off_inexact.url, h)
        turns.append((on, off, p1 - p0, d1 - d0))
        h.append({"role": "assistant", "content": on.text})
    (cold, _, cold_p, cold_d), (warm, _, warm_p, warm_d) = turns
    assert (cold.headers["x-agentkv-path"], cold.headers["x-agentkv-reuse"]) == ("decode-local", "miss")
    assert cold.headers.get("x-agentkv-lease-expires-in"), cold.headers  # decode retained what it computed
    assert cold_p == 0 and cold_d > 100, (cold_p, cold_d)
    assert (warm.headers["x-agentkv-path"], warm.headers["x-agentkv-reuse"]) == ("decode-local", "local")
    assert warm_p == 0 and 0 < warm_d < cold_d / 2, (warm_p, warm_d, cold_d)
    for on, off, *_ in turns:
        assert abs(on.logprobs[0] - off.logprobs[0]) < 0.05, (on.logprobs[:3], off.logprobs[:3])
    report(
        f"cold turn on decode: decode computed {cold_d:.0f} tokens, prefill 0; next turn {warm_d:.0f}; "
        f"token ids equal to OFF: {[on.ids == off.ids for on, off, *_ in turns]}"
    )


def _chain_share(before: dict[str, int], after: dict[str, int]) -> str:
    """Blocks fingerprinted from an earlier turn's chain, of all blocks fingerprinted, between two stats."""
    reused = after["fingerprint_blocks_reused"] - before["fingerprint_blocks_reused"]
    hashed = after["fingerprint_blocks_hashed"] - before["fingerprint_blocks_hashed"]
    return f"{reused}/{reused + hashed}"


def _hash_share(before: dict[str, int], after: dict[str, int]) -> str:
    """Prompt blocks whose vLLM block hash came from an earlier prompt, of all, between two stats."""
    reused = after["block_hashes_reused"] - before["block_hashes_reused"]
    computed = after["block_hashes_computed"] - before["block_hashes_computed"]
    return f"{reused}/{reused + computed}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_default_mode_reuses_only_the_same_tokens(
    case: Callable[..., None],
    cluster: Cluster,
    router_default_unguarded: RouterProc,
    router_off: RouterProc,
    report: Callable[[str], None],
) -> None:
    """Each turn's first-token logprob equals the exact recompute's up to bf16 rounding, as long as the two
    runs saw the same history (a flipped greedy token makes the histories differ from there on); every
    edited history is caught by the connector; reuse happens (how many tokens were pulled is reported)."""
    ps, ds = cluster.prefills[0].spec.service_url, cluster.decodes[0].spec.service_url
    assert ps and ds
    script = conversation_script(100 + CASES.index(case), 3)
    off, _ = run_case(case, router_off.url, script)
    before, d_before = service_info(ps)["stats"], service_info(ds)["stats"]
    on, reuse = run_case(case, router_default_unguarded.url, script)
    after, d_after = service_info(ps)["stats"], service_info(ds)["stats"]
    compared = 0
    for (_, on_ids, on_lp, _), (_, off_ids, off_lp, _) in zip(on, off, strict=True):
        assert abs(on_lp[0] - off_lp[0]) < 0.05, (case.__name__, compared, on_lp[:3], off_lp[:3])
        compared += 1
        if on_ids != off_ids:
            break  # the next prompt differs from the baseline's: nothing left to compare it with
    assert "hit" in reuse
    # What vLLM's prefix cache would reuse, no more: decode offers whole blocks, so pulls are whole blocks.
    assert (after["tokens_pulled"] - before["tokens_pulled"]) % CPU_BLOCK == 0, case.__name__
    if case.__name__ in DIVERGING:
        assert after["refused_mismatch"] > before["refused_mismatch"]
    else:
        # Unsalted decode turns of one conversation: decode's connector starts each turn's fingerprints from
        # the chain the previous turn left (found through vLLM's block hashes), as prefill's does.
        assert d_after["fingerprint_blocks_reused"] > d_before["fingerprint_blocks_reused"]
        # vLLM's own block hashes of the turn's prompt, likewise taken from the previous turn's on both
        # engines (`_block_hashes`): the answers above are those of engines that hashed only the new blocks.
        for b, a in ((before, after), (d_before, d_after)):
            assert a["block_hashes_reused"] > b["block_hashes_reused"], case.__name__
    same = sum(a[1] == b[1] for a, b in zip(on, off, strict=True))
    cached = {"P": _chain_share(before, after), "D": _chain_share(d_before, d_after)}
    vllm_hashes = {"P": _hash_share(before, after), "D": _hash_share(d_before, d_after)}
    report(
        f"default mode {case.__name__}: {reuse}, pulled {after['tokens_pulled'] - before['tokens_pulled']} "
        f"tokens, first logprob compared on {compared} turns, token ids equal on {same}/{len(on)}, "
        f"fingerprint blocks from earlier chains {cached}, vLLM block hashes from earlier prompts "
        f"{vllm_hashes}"
    )
