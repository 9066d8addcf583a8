"""A prompt that starts with only some of decode's whole blocks reuses exactly those, on the real engine.

mini-swe-agent's format-error turn drops the model's last answer and appends a user message; agents also
cut or summarise a history's tail and regenerate a turn. Each such prompt starts with some whole blocks of
what decode holds and then differs: the router offers prefill those blocks (the rest is computed) where it
used to answer `mismatch` and recompute everything. Prefill's connector checks each offered block against
its own fingerprints; this suite's prefill caches nothing and pulls every verified offer, so every token it
did not compute came from decode, and the pulled count is exactly the matching whole blocks.

Exact mode: the answers equal reuse OFF bit for bit (token ids and logprobs). The default mode (decode also
offers KV it decoded) is compared up to rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from agentkv._wire import cut_offer
from agentkv.server.launch._cluster import Cluster

from ._clusters import Clusters
from ._helpers import (
    CPU_BLOCK,
    MODEL,
    RouterProc,
    Turn,
    assert_agrees_up_to_rounding,
    assert_same_answer,
    chat,
    conversation_script,
    conversation_state,
    held_params,
    new_id,
    pd_turn,
    retained_params,
    service_call,
    service_info,
    wait_until,
)

Messages = list[dict[str, Any]]


def _render(p_url: str, messages: Messages) -> list[int]:
    """The prompt's token ids as prefill renders them (the router's token path renders the same body)."""
    r = httpx.post(
        f"{p_url}/v1/chat/completions/render", json={"model": MODEL, "messages": messages}, timeout=60
    )
    assert r.status_code == 200, r.text
    return list(r.json()["token_ids"])


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _whole_matching(held: list[int], new: list[int]) -> int:
    """The tokens of the whole blocks of `held` that `new` starts with, leaving it two tokens to compute, and
    a block where fewer than 16 would be left (`agentkv._wire.pullable_tokens`)."""
    n = min(_common(held, new), len(held), len(new) - 2) // CPU_BLOCK * CPU_BLOCK
    return n - CPU_BLOCK if n > 0 and len(new) - n < 16 else n


# Each later prompt from a two-turn history [u0, a1, u1] (answered a2): what an agent sends next.
def _dropped(h: Messages, a2: str) -> Messages:  # format error: the answer dropped, a user message added
    return [*h, {"role": "user", "content": "Format error: reply with exactly one bash code block."}]


def _rewritten(h: Messages, a2: str) -> Messages:
    """The client rewrote the last answer: the router holds the previous prompt's ids only (decode's own
    answer is not known as ids), so this prompt extends them and is offered all decode holds of them."""
    return [*h, {"role": "assistant", "content": "THOUGHT: " + a2[::-1]}, {"role": "user", "content": "ok"}]


def _tail_cut(h: Messages, a2: str) -> Messages:  # the last exchange cut, another question asked
    return [*h[:2], {"role": "user", "content": "Summarise the files you found so far."}]


def _regenerated(h: Messages, a2: str) -> Messages:  # the same request again
    return list(h)


EDITS: list[Callable[[Messages, str], Messages]] = [_dropped, _rewritten, _tail_cut, _regenerated]


@pytest.fixture(scope="module")
def router_default(clusters: Clusters, cluster: Cluster) -> RouterProc:
    """Reuse ON in the default mode with the router's guard on, P/D path always: the router's partial match
    decides what prefill is offered."""
    return clusters.router("default-pd", "--no-exact", "--path-policy", "always-pd")


def _edited_turn(
    url: str,
    p_url: str,
    edit: Callable[[Messages, str], Messages],
    seed: int,
    *,
    exact: bool,
    extra: dict[str, Any] | None = None,
) -> tuple[Turn, Messages, int]:
    """Two turns of a conversation, then the edited one. Returns the edited turn, its messages and the
    tokens it must have pulled: all decode holds of the previous prompt where the new one extends it (in
    exact mode: the whole previous prompt, see `TokenPrefix.must_exceed`), else the matching whole blocks."""
    cid = new_id("partial")
    script = conversation_script(seed, 2, letters=True)
    history: Messages = [{"role": "user", "content": script[0]}]
    first = chat(url, history, conversation_id=cid, extra=extra)
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": script[1]}]
    second = chat(url, history, conversation_id=cid, extra=extra)
    assert second.headers["x-agentkv-reuse"] == "hit", second.headers
    held_tokens = int(conversation_state(url, cid)["retained_tokens"])
    previous = _render(p_url, history)
    held = previous[:held_tokens]
    messages = edit(history, second.text)
    new = _render(p_url, messages)
    third = chat(url, messages, conversation_id=cid, extra=extra)
    extends = new[: len(held)] == held and len(new) > (len(previous) if exact else len(held))
    return third, messages, len(held) if extends else _whole_matching(held, new)


@pytest.mark.parametrize("edit", EDITS, ids=lambda e: e.__name__.strip("_"))
def test_exact_mode_reuses_every_matching_whole_block_bit_for_bit(
    edit: Callable[[Messages, str], Messages],
    cluster: Cluster,
    router: RouterProc,
    router_off: RouterProc,
    bit_exact: bool,
    report: Callable[[str], None],
) -> None:
    p_url = cluster.prefills[0].spec.url
    turn, messages, want = _edited_turn(router.url, p_url, edit, 700 + EDITS.index(edit), exact=True)
    off = chat(router_off.url, messages)
    assert want >= CPU_BLOCK, "the edit must leave whole blocks to reuse"
    assert turn.headers["x-agentkv-reuse"] == "hit", turn.headers
    assert int(turn.headers["x-agentkv-pulled-tokens"]) == want, (want, turn.headers)
    assert_same_answer(turn, off, bit_exact=bit_exact)
    same = "==" if bit_exact else "up to rounding (this host's kernels are not split-invariant) =="
    report(f"exact {edit.__name__}: pulled {want} tokens as computed from the ids, answer {same} OFF")


@pytest.mark.parametrize("edit", [_dropped, _tail_cut, _regenerated], ids=lambda e: e.__name__.strip("_"))
def test_default_mode_reuses_every_matching_whole_block(
    edit: Callable[[Messages, str], Messages],
    cluster: Cluster,
    router_default: RouterProc,
    router_off_inexact: RouterProc,
    report: Callable[[str], None],
) -> None:
    p_url = cluster.prefills[0].spec.url
    top = {"top_logprobs": 5}
    turn, messages, want = _edited_turn(
        router_default.url, p_url, edit, 720 + EDITS.index(edit), exact=False, extra=top
    )
    off = chat(router_off_inexact.url, messages, extra=top)
    assert want >= CPU_BLOCK, "the edit must leave whole blocks to reuse"
    assert turn.headers["x-agentkv-reuse"] == "hit", turn.headers
    assert int(turn.headers["x-agentkv-pulled-tokens"]) == want, (want, turn.headers)
    assert_agrees_up_to_rounding(turn, off)
    report(f"default {edit.__name__}: pulled {want} tokens as computed from the ids")


def test_a_partial_offer_released_before_prefill_reads_it_is_never_read(cluster: Cluster) -> None:
    """Decode lets go of the blocks between the offer and prefill's read (the router offered the whole
    blocks a dropped answer leaves): prefill reads none of them and computes the turn, as a recompute."""
    p, d = cluster.prefills[0].spec.url, cluster.decodes[0].spec.url
    ps, ds = cluster.prefills[0].spec.service_url, cluster.decodes[0].spec.service_url
    assert ps and ds
    script = conversation_script(740, 1, letters=True)
    history: Messages = [{"role": "user", "content": script[0]}]
    _, rid = pd_turn(p, d, history)
    held = held_params(ds, rid)
    messages = _dropped(history, "")
    want = _whole_matching(_render(p, history)[: held["remote_num_tokens"]], _render(p, messages))
    assert want >= CPU_BLOCK
    offer = cut_offer(held, want, CPU_BLOCK)
    assert service_call("DELETE", f"{ds}/agentkv/v1/leases/{rid}").status_code == 200
    wait_until(lambda: retained_params(ds, rid) is None, timeout_s=60, what=lambda: "decode still holds them")
    before = service_info(ps)["stats"]
    late, _ = pd_turn(p, d, messages, retained=offer)
    after = service_info(ps)["stats"]
    recompute, _ = pd_turn(p, d, messages)
    assert after["tokens_pulled"] == before["tokens_pulled"], "prefill read blocks decode had released"
    assert after["refused_released"] == before["refused_released"] + 1
    assert (late.ids, late.logprobs) == (recompute.ids, recompute.logprobs)
