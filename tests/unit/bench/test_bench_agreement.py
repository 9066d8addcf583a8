"""bench.agreement's comparison with the single server: Fisher's exact test on textbook tables."""

from __future__ import annotations

import argparse
import json

import pytest
import respx

from bench._plugin_args import kv_config_item
from bench.agreement import _against_single, _from_prefill_first_token, fisher_p


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


def _completion(tokens: list[str], finish: str, kv: dict[str, object] | None = None) -> dict[str, object]:
    choice = {"logprobs": {"tokens": tokens}, "finish_reason": finish}
    return {"choices": [choice], "kv_transfer_params": kv}


@respx.mock
def test_decode_starts_from_the_token_prefill_sampled() -> None:
    respx.post("http://p/tokenize").respond(json={"tokens": [5, 6, 7]})
    prefill = respx.post("http://p/v1/completions").respond(
        json=_completion(["token_id:42"], "length", {"remote_block_ids": [3]})
    )
    decode = respx.post("http://d/v1/completions").respond(
        json=_completion(["token_id:8", "token_id:9"], "length")
    )
    answer = _from_prefill_first_token("http://p", "http://d", "m")
    assert answer([{"role": "user", "content": "hi"}]) == ["token_id:42", "token_id:8", "token_id:9"]
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
    assert _from_prefill_first_token("http://p", "http://d", "m")([]) == ["token_id:0"]
    assert not decode.called


@respx.mock
def test_a_failed_hop_is_none_not_an_answer() -> None:
    respx.post("http://p/tokenize").respond(json={"tokens": [5]})
    respx.post("http://p/v1/completions").respond(json=_completion(["token_id:1"], "length", {}))
    respx.post("http://d/v1/completions").respond(status_code=500)
    assert _from_prefill_first_token("http://p", "http://d", "m")([]) is None
