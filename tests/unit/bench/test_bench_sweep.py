"""The multi-turn sweep's pure parts: per-turn phase split and the OFF / ON / floor summary."""

from __future__ import annotations

import json
import math

import httpx

from bench.multiturn_sweep import PHASES, Words, measure_call_tokens, phase_split, summarize, turn_messages


def _row(leg: str, ttft: float, prefill: float, label: str = "turn2") -> dict[str, object]:
    return {
        "leg": leg,
        "label": label,
        "target_tokens": 8192,
        "ttft_ms": ttft,
        "prefill_ms": prefill,
        "transfer_ms": 2.0 if leg == "on" else 0.0,
        "compute_ms": prefill - (2.0 if leg == "on" else 0.0),
        "input_num_tokens": 8166,
        "reused_tokens": 2116 if leg == "on" else 0,
        "path": "pull" if leg == "on" else "recompute",
    }


def test_phase_split_takes_the_engine_time_out_of_the_router_hop() -> None:
    # e2e left at 0: vLLM 0.26 records none for a request that ends holding KV for a remote decode.
    p = dict.fromkeys(PHASES, 0.0) | {"queue_s": 0.030, "engine_prefill_s": 0.200}
    # vLLM's TTFT on decode (70 ms) counts from before its API server rendered: not the engine's part.
    d = dict.fromkeys(PHASES, 0.0) | {"queue_s": 0.015, "engine_prefill_s": 0.050, "ttft_s": 0.070}
    split = phase_split(p, d, prefill_ms=260.0, ttft_ms=400.0, render_ms=40.0)
    assert split == {
        "p_queue_ms": 30.0,
        "p_engine_prefill_ms": 200.0,
        "p_api_ms": 30.0,
        "d_hop_ms": 100.0,  # 400 - 40 rendering - 260 prefill
        "d_queue_ms": 15.0,
        "d_engine_prefill_ms": 50.0,
        "d_vllm_ttft_ms": 70.0,
        "d_api_ms": 35.0,
    }
    nan = float("nan")
    assert math.isnan(phase_split(p, d, prefill_ms=nan, ttft_ms=400.0, render_ms=nan)["p_api_ms"])
    # The text path renders inside the P hop: no render phase of its own.
    assert phase_split(p, d, prefill_ms=260.0, ttft_ms=400.0, render_ms=nan)["d_hop_ms"] == 140.0


def test_summary_reports_ratios_against_off_and_against_the_floor() -> None:
    rows = [_row("off", 400, 260), _row("off", 420, 262), _row("on", 200, 150), _row("floor", 190, 120)]
    [entry] = summarize(rows, "published")
    assert entry["ttft_ms_off"] == 410 and entry["ttft_ms_on"] == 200
    assert entry["ttft_ratio_on_off"] == round(200 / 410, 3)
    assert entry["prefill_ratio_on_floor"] == round(150 / 120, 3)
    assert entry["paths_on"] == ["pull"] and entry["paths_floor"] == ["recompute"]


def test_summary_recomputes_the_api_share_of_older_rows() -> None:
    """Rows written before api_ms carried the whole hop as p_api_ms; the summary corrects them."""
    old = _row("on", 200, 150) | {"p_queue_ms": 10.0, "p_engine_prefill_ms": 100.0, "p_api_ms": 150.0}
    [entry] = summarize([old], "published")
    assert entry["p_api_ms_on"] == 40.0


def test_agentic_summary_keeps_only_the_suffix_turns() -> None:
    rows = [_row("off", 400, 260, "context"), _row("off", 100, 60, "suffix"), _row("on", 30, 0, "suffix")]
    assert [e["label"] for e in summarize(rows, "agentic")] == ["suffix"]


def test_one_leg_alone_plots_and_prints(tmp_path: object) -> None:
    """The repro trio writes one leg per run: plotting it must not need the other legs' columns."""
    import pathlib

    from bench.multiturn_sweep import plot

    out = pathlib.Path(str(tmp_path))
    rows = [_row("off", 400, 260)]
    doc = {"data": {"device": "cpu", "shape": "published", "summary": summarize(rows, "published")}}
    paths = plot(doc, out)
    assert [p.name for p in paths] == ["ttft_vs_length_published.png", "prefill_split_published.png"]
    assert all(p.stat().st_size > 0 for p in paths)


def _nixl(bytes_: float, xfer_s: float, xfers: float) -> dict[str, float]:
    from bench.multiturn_sweep import NIXL

    return dict.fromkeys(NIXL, 0.0) | {"bytes": bytes_, "xfer_s": xfer_s, "xfers": xfers}


def test_transfer_directions_reads_each_way_from_the_engine_that_initiated_it() -> None:
    from bench.multiturn_sweep import transfer_directions

    # Prefill pulled decode's retained KV (D->P); decode pulled the prompt's KV from prefill (P->D).
    split = transfer_directions(_nixl(2.4e9, 0.004, 1), _nixl(0.3e9, 0.002, 1))
    assert split == {
        "bytes_d_to_p": 2_400_000_000,
        "xfer_ms_d_to_p": 4.0,
        "xfers_d_to_p": 1,
        "bytes_p_to_d": 300_000_000,
        "xfer_ms_p_to_d": 2.0,
        "xfers_p_to_d": 1,
    }


def test_two_node_ttft_swaps_the_measured_copies_for_the_wire() -> None:
    from bench.multiturn_sweep import transfer_directions, two_node_ttft_ms

    split = transfer_directions(_nixl(2.4e9, 0.004, 1), _nixl(0.3e9, 0.002, 1))
    # 600 ms measured, 6 ms of same-GPU copies out, 2.7 GB / 50 GB/s = 54 ms of wire in.
    assert two_node_ttft_ms(600.0, split) == 648.0
    assert two_node_ttft_ms(600.0, split, bytes_per_s=2.7e9) == 1594.0
    # A turn that moved nothing is its measured TTFT.
    assert two_node_ttft_ms(100.0, transfer_directions(_nixl(0, 0, 0), _nixl(0, 0, 0))) == 100.0


def test_summary_carries_bytes_and_the_two_node_ttft() -> None:
    rows = [_row("on", 600, 300) | {"bytes_d_to_p": 2_000, "bytes_p_to_d": 500, "ttft_two_node_ms": 640.0}]
    [entry] = summarize([*rows, _row("off", 900, 800)], "published")
    assert entry["bytes_d_to_p_on"] == 2_000 and entry["bytes_p_to_d_on"] == 500
    assert entry["ttft_two_node_ms_on"] == 640.0
    assert entry["ttft_two_node_ms_off"] is None  # rows written before the model existed


def test_a_turns_text_goes_as_one_message_or_as_an_agents_tool_calls_and_results() -> None:
    words = Words("no-such-model", seed=0)
    [one] = turn_messages(words, 100, 0)
    assert one["role"] == "user" and one["content"]
    assert len(turn_messages(words, 100, 512)) == 1  # shorter than a message
    many = turn_messages(words, 4096, 512)
    assert [m["role"] for m in many] == ["user"] + ["assistant", "tool"] * 7
    calls = [m["tool_calls"][0] for m in many if m["role"] == "assistant"]
    assert [m["tool_call_id"] for m in many if m["role"] == "tool"] == [c["id"] for c in calls]
    assert len({c["id"] for c in calls}) == 7 and json.loads(calls[0]["function"]["arguments"])["path"]
    # A later turn is the agent's next tool results: no user message, ending on a result.
    later = turn_messages(words, 512, 512, first=False)
    assert [m["role"] for m in later] == ["assistant", "tool"] and later[-1]["content"]


def test_the_tool_calls_own_tokens_are_asked_of_the_served_template() -> None:
    def tokenize(request: httpx.Request) -> httpx.Response:
        messages = json.loads(request.content)["messages"]
        return httpx.Response(200, json={"count": 3 + 7 * (len(messages) - 1)})  # 7 tokens a message

    with httpx.Client(transport=httpx.MockTransport(tokenize)) as client:
        per_call = measure_call_tokens(client, "http://p", "m")
    assert per_call == 14
    words = Words("no-such-model", seed=0)
    lean, fat = (turn_messages(words, 4096, 512, call_tokens=c) for c in (per_call, 200))
    assert len(lean) == len(fat)
    assert len(lean[-1]["content"].split()) > len(fat[-1]["content"].split())
