"""bench.agreement: its senders, the sides' pairing, Fisher's and McNemar's tests, the first-token runs."""

from __future__ import annotations

import argparse
import json

import pytest
import respx

from bench._plugin_args import env_item, kv_config_item
from bench.agreement import (
    TurnFailed,
    _against_single,
    _block_size,
    _first_token_side,
    _from_prefill_first_token,
    _paired_with_single,
    _sender,
    fisher_p,
    paired_p,
    run_side,
    single_server_sides,
)


def test_fisher_p_on_textbook_tables() -> None:
    # Fisher's tea tasting (3 of 4 against 1 of 4): 17/35; Wikipedia's 1 of 10 against 11 of 14.
    assert fisher_p(3, 4, 1, 4) == pytest.approx(17 / 35)
    assert fisher_p(1, 10, 11, 14) == pytest.approx(0.0027594561852)
    assert fisher_p(5, 10, 5, 10) == pytest.approx(1.0)
    assert fisher_p(1, 10, 11, 14) == pytest.approx(fisher_p(11, 14, 1, 10))


def test_each_pd_side_is_compared_with_the_single_servers_agreement() -> None:
    summary = {
        "P/D default": {"turns": 192, "same_tokens": 163, "same_as_reference": 162},
        "single server": {"turns": 192, "same_tokens": 179, "same_as_reference": None},
    }
    _against_single(summary)
    side = summary["P/D default"]
    assert side["p_vs_single"] == round(fisher_p(163, 192, 179, 192), 4)
    assert side["p_vs_single_reference"] == round(fisher_p(162, 192, 179, 192), 4)
    assert 0 < side["p_vs_single_reference"] < side["p_vs_single"] < 0.05
    assert "p_vs_single" not in summary["single server"]


def test_connector_keys_from_the_command_line() -> None:
    items = ["agentkv_decode_tail_tokens=2", "agentkv_prefix_check=false", "mode=fast"]
    assert dict(map(kv_config_item, items)) == {
        "agentkv_decode_tail_tokens": 2,
        "agentkv_prefix_check": False,
        "mode": "fast",
    }
    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        kv_config_item("agentkv_decode_tail_tokens")


def test_engine_environment_from_the_command_line() -> None:
    # Values stay text (an environment holds strings), '=' after the first belongs to the value.
    assert dict(map(env_item, ["VLLM_KV_CACHE_LAYOUT=HND", "X=a=b", "EMPTY="])) == {
        "VLLM_KV_CACHE_LAYOUT": "HND",
        "X": "a=b",
        "EMPTY": "",
    }
    for bad in ("VLLM_KV_CACHE_LAYOUT", "=HND"):
        with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
            env_item(bad)


def test_a_single_server_reuses_under_the_conversations_salt_and_recomputes_under_a_fresh_one() -> None:
    keys: list[str | None] = []

    def send(messages: list[dict[str, str]], key: str | None) -> dict[str, object]:
        keys.append(key)
        return {"tokens": []}

    reuse, recompute = single_server_sides(send)
    history = [{"role": "user", "content": "hi"}]
    reuse(history, "conv-1")
    reuse(history, "conv-1")
    recompute(history)
    recompute(history)
    assert keys[:2] == ["conv-1", "conv-1"]
    fresh = keys[2:]
    assert len(set(fresh)) == 2 and "conv-1" not in fresh and None not in fresh


@respx.mock
def test_a_conversations_key_is_its_id_and_its_salt_and_no_key_sends_neither() -> None:
    answer = {
        "choices": [
            {
                "message": {"content": "ok"},
                "logprobs": {"content": [{"token": "token_id:7", "logprob": -0.5}]},
            }
        ],
        "usage": {"prompt_tokens_details": {"cached_tokens": 3}},
    }
    route = respx.post("http://r/v1/chat/completions").respond(json=answer)
    send = _sender("http://r", "m")
    turn = send([{"role": "user", "content": "hi"}], "conv-1")
    assert turn["tokens"] == ["token_id:7"] and turn["cached_tokens"] == 3
    sent = route.calls[0].request
    assert json.loads(sent.content)["cache_salt"] == "conv-1" and sent.headers["x-session-id"] == "conv-1"
    send([{"role": "user", "content": "hi"}], None)
    sent = route.calls[1].request
    assert "cache_salt" not in json.loads(sent.content) and "x-session-id" not in sent.headers


def test_every_side_starts_from_the_seeds_words() -> None:
    firsts: list[str] = []

    def reuse(messages: list[dict[str, str]], key: str | None) -> dict[str, object]:
        if len(messages) == 1:
            firsts.append(messages[0]["content"])
        return {"text": "a", "tokens": ["t"], "first_logprob": 0.0, "reuse": None, "cached_tokens": None}

    for side in ("one side", "another"):
        run_side(side, range(5, 7), reuse=reuse, recompute=lambda m: reuse(m, None), wordlevel=False)
    assert firsts[:2] == firsts[2:] and firsts[0] != firsts[1]


def test_mcnemars_exact_p() -> None:
    # 1 of 9 discordant pairs against 8: 2 * (1 + 9) / 512.
    assert paired_p(1, 8) == pytest.approx(20 / 512)
    assert paired_p(8, 1) == paired_p(1, 8)
    assert paired_p(3, 3) == 1.0 and paired_p(0, 0) == 1.0


def test_reuse_turns_pair_with_the_single_servers_on_the_same_history() -> None:
    def row(
        side: str, seed: int, same: bool, history: str = "h", *, tokens: str = "a", recompute: str = "a"
    ) -> dict[str, object]:
        return {
            "side": side,
            "seed": seed,
            "turn": 2,
            "same_tokens": same,
            "history": [history],
            "tokens": [tokens],
            "recompute_tokens": [recompute],
        }

    rows = [
        row("P/D default", 1, False, recompute="b"),  # its reuse answer is the single server's, its OFF not
        row("P/D default", 2, False, recompute="d"),
        row("P/D default", 3, True, tokens="c", recompute="c"),
        row("P/D default", 4, False, history="parted"),  # another history: not a pair
        row("single server", 1, True),
        row("single server", 2, False, recompute="d"),
        row("single server", 3, False),
        row("single server", 4, True),
    ]
    summary: dict[str, dict[str, object]] = {"P/D default": {}, "single server": {}}
    _paired_with_single(rows, summary)
    side = summary["P/D default"]
    assert (side["paired_turns"], side["paired_only_side_departs"], side["paired_only_single_departs"]) == (
        3,
        1,
        1,
    )
    assert side["p_paired_vs_single"] == 1.0
    assert (side["paired_same_reuse_answer"], side["paired_same_recompute_answer"]) == (2, 1)
    assert "paired_turns" not in summary["single server"]


def _completion(
    tokens: list[str],
    finish: str,
    kv: dict[str, object] | None = None,
    *,
    logprobs: list[float] | None = None,
) -> dict[str, object]:
    choice = {"logprobs": {"tokens": tokens, "token_logprobs": logprobs}, "finish_reason": finish}
    return {
        "choices": [choice],
        "kv_transfer_params": kv,
        "usage": {"prompt_tokens_details": {"cached_tokens": 2}},
    }


def _recompute_tokens(messages: list[dict[str, str]], *, block_size: int = 16) -> list[str] | None:
    """The first-token recompute's token ids (None where a hop failed), on the fake engines p and d."""
    answer = _from_prefill_first_token("http://p", "http://d", "m", block_size=block_size)(messages)
    return None if answer is None else answer["tokens"]


@respx.mock
def test_the_block_size_is_read_from_vllms_metrics() -> None:
    respx.get("http://p/metrics").respond(text='vllm:cache_config_info{block_size="16"} 1.0\n')
    assert _block_size("http://p") == 16
    respx.get("http://q/metrics").respond(text="vllm:num_requests_running 0.0\n")
    with pytest.raises(RuntimeError, match="no block size"):
        _block_size("http://q")


@respx.mock
def test_decode_starts_from_the_token_prefill_sampled() -> None:
    respx.post("http://p/tokenize").respond(json={"tokens": [5, 6, 7]})
    prefill = respx.post("http://p/v1/completions").respond(
        json=_completion(["token_id:42"], "length", {"remote_block_ids": [3]})
    )
    decode = respx.post("http://d/v1/completions").respond(
        json=_completion(["token_id:8", "token_id:9"], "length")
    )
    assert _recompute_tokens([{"role": "user", "content": "hi"}]) == [
        "token_id:42",
        "token_id:8",
        "token_id:9",
    ]
    p, d = json.loads(prefill.calls.last.request.content), json.loads(decode.calls.last.request.content)
    assert (p["prompt"], p["max_tokens"], p["kv_transfer_params"]["do_remote_decode"]) == ([5, 6, 7], 1, True)
    # Decode gets the prompt plus prefill's token, prefill's params as they came, one token fewer to write.
    assert (d["prompt"], d["max_tokens"], d["kv_transfer_params"]) == (
        [5, 6, 7, 42],
        23,
        {"remote_block_ids": [3]},
    )
    # A salt no other request had, so that decode loads the prompt instead of hitting KV it cached.
    assert d["cache_salt"] and d["cache_salt"] == p["cache_salt"]


@respx.mock
def test_an_answer_that_ends_at_prefills_token_has_no_decode_hop() -> None:
    respx.post("http://p/tokenize").respond(json={"tokens": [5]})
    respx.post("http://p/v1/completions").respond(json=_completion(["token_id:0"], "stop"))
    decode = respx.post("http://d/v1/completions")
    assert _recompute_tokens([]) == ["token_id:0"]
    assert not decode.called


@respx.mock
def test_a_failed_hop_is_none_not_an_answer() -> None:
    respx.post("http://p/tokenize").respond(json={"tokens": [5]})
    respx.post("http://p/v1/completions").respond(json=_completion(["token_id:1"], "length", {}))
    respx.post("http://d/v1/completions").respond(status_code=500)
    assert _recompute_tokens([]) is None


@respx.mock
def test_the_first_token_side_starts_on_p_then_stays_on_decode() -> None:
    """A conversation's first turn runs P then D from prefill's token under the conversation's salt; its next
    turn goes to decode alone under that salt (decode-local); the recompute is P then D under a fresh salt."""
    respx.post("http://p/detokenize").respond(json={"prompt": "text"})
    respx.post("http://p/tokenize").respond(json={"tokens": [5, 6, 7]})
    prefill = respx.post("http://p/v1/completions").respond(
        json=_completion(["token_id:42"], "length", {"remote_block_ids": [3]}, logprobs=[-0.5])
    )
    decode = respx.post("http://d/v1/completions").respond(
        json=_completion(["token_id:8"], "length", logprobs=[-0.1])
    )
    reuse, recompute = _first_token_side("http://p", "http://d", "m", block_size=16)
    first = reuse([], "conv")
    assert (first["text"], first["tokens"], first["first_logprob"], first["reuse"]) == (
        "text",
        ["token_id:42", "token_id:8"],
        -0.5,
        "miss",
    )
    assert json.loads(prefill.calls.last.request.content)["cache_salt"] == "conv"
    d = json.loads(decode.calls.last.request.content)
    assert (d["prompt"], d["cache_salt"], d["kv_transfer_params"]) == (
        [5, 6, 7, 42],
        "conv",
        {"remote_block_ids": [3]},
    )

    calls = prefill.call_count
    second = reuse([], "conv")
    assert prefill.call_count == calls  # decode-local: prefill computes nothing
    d = json.loads(decode.calls.last.request.content)
    assert (d["prompt"], d["max_tokens"], d["cache_salt"]) == ([5, 6, 7], 24, "conv")
    assert "kv_transfer_params" not in d
    assert (second["tokens"], second["first_logprob"], second["reuse"], second["cached_tokens"]) == (
        ["token_id:8"],
        -0.1,
        "local",
        2,
    )

    again = recompute([])
    salt = json.loads(prefill.calls.last.request.content)["cache_salt"]
    assert salt not in ("conv", None) and json.loads(decode.calls.last.request.content)["cache_salt"] == salt
    assert again["tokens"] == ["token_id:42", "token_id:8"]


@respx.mock
def test_a_failed_hop_of_the_first_token_side_is_an_error() -> None:
    respx.post("http://p/tokenize").respond(json={"tokens": [5]})
    respx.post("http://p/v1/completions").respond(status_code=500)
    reuse, _ = _first_token_side("http://p", "http://d", "m", block_size=16)
    with pytest.raises(RuntimeError, match="failed"):
        reuse([], "conv")


@respx.mock
def test_a_prompt_of_whole_blocks_has_prefill_compute_token_one_too() -> None:
    """Decode allocates blocks for the prompt and token 1; for a prompt of whole blocks that is one more than
    the prompt fills, and vLLM's NIXL worker asserts that decode's list is not the longer: prefill then
    writes two tokens (its blocks cover token 1), and decode still gets the prompt plus token 1 only."""
    respx.post("http://p/tokenize").respond(json={"tokens": [5, 6, 7, 8]})
    prefill = respx.post("http://p/v1/completions").respond(
        json=_completion(["token_id:42", "token_id:43"], "length", {"remote_block_ids": [3, 4]})
    )
    decode = respx.post("http://d/v1/completions").respond(json=_completion(["token_id:9"], "length"))
    assert _recompute_tokens([], block_size=4) == ["token_id:42", "token_id:9"]
    assert json.loads(prefill.calls.last.request.content)["max_tokens"] == 2
    d = json.loads(decode.calls.last.request.content)
    assert (d["prompt"], d["max_tokens"]) == ([5, 6, 7, 8, 42], 23)


@respx.mock
def test_prefill_stopping_at_its_second_token_leaves_no_blocks_for_decode() -> None:
    respx.post("http://p/tokenize").respond(json={"tokens": [5, 6, 7, 8]})
    respx.post("http://p/v1/completions").respond(json=_completion(["token_id:42", "token_id:0"], "stop"))
    decode = respx.post("http://d/v1/completions")
    assert _recompute_tokens([], block_size=4) is None
    assert not decode.called


def test_a_conversation_with_a_failed_turn_is_left_out_whole() -> None:
    """The second conversation's third turn fails: its second turn is dropped too (its history leads
    nowhere), the other conversations stay."""
    keys: list[str] = []

    def reuse(messages: list[dict[str, str]], key: str) -> dict[str, object]:
        if key not in keys:
            keys.append(key)
        if keys.index(key) == 1 and len(messages) == 5:  # the second conversation's third turn
            raise TurnFailed("no answer")
        return {
            "text": "a",
            "tokens": ["token_id:1"],
            "first_logprob": -1.0,
            "reuse": "local",
            "cached_tokens": 1,
        }

    def recompute(messages: list[dict[str, str]]) -> dict[str, object]:
        return {"tokens": ["token_id:1"], "first_logprob": -1.0}

    rows = run_side("s", range(10, 13), reuse=reuse, recompute=recompute, wordlevel=False)
    assert sorted((r["seed"], r["turn"]) for r in rows) == [(10, 2), (10, 3), (12, 2), (12, 3)]
    assert len(keys) == 3
