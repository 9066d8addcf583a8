"""The goodput benchmark's pure parts (plans, step summary, knee, engine metrics, limits, targets) and its
open-loop driver against a fake streaming server."""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

import httpx
import pytest

from bench._agentload import (
    SLO,
    StepRun,
    TurnRecord,
    generate_plans,
    knee,
    run_step,
    summarize_step,
    trace_plans,
)
from bench._engine_metrics import CONNECTOR, VLLM, Sample, digest, parse, series
from bench._plugin_args import kv_config_item
from bench._trace import Conversation, Request
from bench.goodput import groups, limits, merge, router_paths, router_settings, targets

VLLM_TEXT = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 4.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.2
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="64",engine="0",num_gpu_blocks="1000"} 1.0
"""


def test_parse_reads_vllm_names_and_the_engine_block_count() -> None:
    got = parse(VLLM_TEXT, VLLM)
    assert got == {
        "kv_usage": 0.75,
        "preemptions": 3.0,
        "queue_n": 4.0,
        "queue_s": 0.2,
        "num_gpu_blocks": 1000.0,
    }


def test_parse_reads_the_connector_service_exposition() -> None:
    from agentkv.server.engine._connector._service import render_metrics

    text = render_metrics({"role": "decode", "stats": {"not_retained": 2, "pulls": 5}}, 3, 250)
    got = parse(text, CONNECTOR)
    assert got["retained_blocks"] == 250 and got["retained_requests"] == 3
    assert got["not_retained"] == 2 and got["pulls"] == 5


def _sample(t: float, **decode: float) -> Sample:
    return Sample(t_s=t, values={"decode": dict(decode)})


def test_digest_takes_peaks_means_and_counter_increases() -> None:
    samples = [
        _sample(
            0, kv_usage=0.2, retained_blocks=100, num_gpu_blocks=1000, preemptions=1, queue_s=1.0, queue_n=10
        ),
        _sample(
            1, kv_usage=0.9, retained_blocks=500, num_gpu_blocks=1000, preemptions=4, queue_s=1.5, queue_n=20
        ),
    ]
    d = digest(samples)["decode"]
    assert d["kv_usage_max"] == 0.9 and d["kv_usage_mean"] == 0.55
    assert d["retained_share_max"] == 0.5 and d["retained_share_mean"] == 0.3
    assert d["preemptions_delta"] == 3
    assert d["queue_ms_mean"] == 50.0  # 0.5 s over 10 requests
    assert series(samples, "decode")["retained_share"] == [0.1, 0.5]


def _rec(turn: int, ttft: float | None, tpot: float | None = 0.02, **kw: Any) -> TurnRecord:
    return TurnRecord(conversation=0, turn=turn, sent_s=0.0, ttft_s=ttft, tpot_s=tpot, **kw)


def test_step_summary_counts_goodput_hits_and_slo() -> None:
    records = [
        _rec(0, 0.5),
        _rec(1, 0.2, reuse="hit"),
        _rec(2, 0.3, reuse="local"),
        _rec(3, 2.0, reuse="miss"),  # too slow: not good, and not a hit
        _rec(1, 0.4, tpot=0.09, reuse="expired"),  # TPOT over the bound
    ]
    s = summarize_step(StepRun(records=records, wall_s=2.0, peak_active=2), slo=SLO())
    assert s["turns_ok"] == 5 and s["turns_good"] == 3
    assert s["goodput_turns_s"] == 1.5 and s["turns_s"] == 2.5
    assert s["eligible_turns"] == 4 and s["hit_rate"] == 0.5
    assert s["reuse_counts"] == {"hit": 1, "local": 1, "miss": 1, "expired": 1}
    assert s["slo_ok"] is False  # TTFT p90 is past 1 s
    fast = [_rec(0, 0.1), _rec(1, 0.2, reuse="hit")]
    assert summarize_step(StepRun(records=fast, wall_s=1.0, peak_active=1), slo=SLO())["slo_ok"] is True


def test_a_cut_or_failed_turn_fails_the_step_and_a_plain_server_hits_on_cached_tokens() -> None:
    records = [
        _rec(0, 0.1, prompt_tokens=100),
        _rec(1, 0.1, prompt_tokens=200, cached_tokens=96),
        _rec(1, None, cut=True),
    ]
    s = summarize_step(StepRun(records=records, wall_s=1.0, peak_active=1), slo=SLO())
    assert s["cut"] == 1 and s["slo_ok"] is False
    assert s["hit_rate"] == 1.0 and s["cached_token_share"] == 0.48
    assert s["pulled_token_share"] is None  # no prefill said what it read from decode
    pulled = [_rec(1, 0.1, prompt_tokens=200, reuse="hit", pulled_tokens=50), _rec(2, 0.1, prompt_tokens=200)]
    assert (
        summarize_step(StepRun(records=pulled, wall_s=1.0, peak_active=1), slo=SLO())["pulled_token_share"]
        == 0.125
    )
    failed = [_rec(0, 0.1), _rec(1, None, error="http 503")]
    assert summarize_step(StepRun(records=failed, wall_s=1.0, peak_active=1), slo=SLO())["errors"] == {
        "http 503": 1
    }


def test_knee_is_the_highest_rate_that_met_the_slo() -> None:
    def step(rate: float, ok: bool, goodput: float) -> dict[str, Any]:
        return {"rate": rate, "summary": {"slo_ok": ok, "goodput_turns_s": goodput, "hit_rate": 0.95}}

    assert knee([step(0.5, True, 2.0), step(1, True, 3.9), step(2, False, 4.5)]) == {
        "rate": 1,
        "goodput_turns_s": 3.9,
        "hit_rate": 0.95,
        "reached": True,
    }
    assert knee([step(0.5, False, 1.0), {"rate": 1, "skipped": "budget"}])["goodput_turns_s"] == 0.0
    # A step that drew no arrival (its summary counts 0 turns, so it "missed" the SLO) is no evidence.
    empty = {"rate": 2, "summary": {"slo_ok": False, "turns": 0, "goodput_turns_s": 0.0, "hit_rate": None}}
    assert knee([step(0.5, True, 2.0), empty])["reached"] is False
    assert knee([empty])["reached"] is False and knee([empty])["rate"] is None
    # Every rate that ran met the SLO: the knee lies beyond the sweep.
    assert (
        knee([step(0.5, True, 2.0), step(1, True, 3.9), {"rate": 2, "skipped": "budget"}])["reached"] is False
    )


def test_generated_plans_are_seeded_poisson_with_capped_lognormal_gaps() -> None:
    kw: dict[str, Any] = dict(
        rate=2.0,
        window_s=100.0,
        contexts=[1000, 2000],
        turns=3,
        suffix=64,
        output_tokens=8,
        gap_median_s=2.0,
        gap_sigma=1.0,
        max_gap_s=5.0,
    )
    plans = generate_plans(seed=1, **kw)
    assert plans == generate_plans(seed=1, **kw) != generate_plans(seed=2, **kw)
    assert len(plans) == 200  # 2/s over 100 s, exactly: the load a step offers is its label
    arrivals = [p.arrival_s for p in plans]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0 and arrivals[-1] < 100
    # Poisson times given the count: gaps between arrivals look exponential (mean 0.5 s, sd about the same).
    gaps_between = [b - a for a, b in itertools.pairwise(arrivals)]
    mean = sum(gaps_between) / len(gaps_between)
    sd = (sum((g - mean) ** 2 for g in gaps_between) / len(gaps_between)) ** 0.5
    assert 0.4 < mean < 0.6 and 0.3 < sd < 0.7, (mean, sd)
    # Every rate label offers what it says, also over a short window (a free Poisson count did not).
    for r in (0.5, 0.75, 1.0, 1.5, 2.0, 4.0):
        assert len(generate_plans(seed=2, **{**kw, "rate": r, "window_s": 12.0})) == round(r * 12)
    assert all(p.turns[0].new_tokens in (1000, 2000) and p.turns[0].gap_s == 0 for p in plans)
    gaps = [t.gap_s for p in plans for t in p.turns[1:]]
    assert max(gaps) == 5.0 and 1.0 < sorted(gaps)[len(gaps) // 2] < 3.0


def test_trace_plans_grow_conversations_and_time_scale_arrivals() -> None:
    def req(i: int, t: float, n: int, out: int = 10) -> Request:
        return Request(index=i, timestamp_s=t, input_length=n, output_length=out, hash_ids=())

    convs = [
        Conversation(index=0, requests=[req(0, 0.0, 1000), req(2, 4.0, 1500), req(3, 9.0, 9000)]),
        Conversation(index=1, requests=[req(1, 10.0, 600, out=500)]),
    ]
    plans = trace_plans(
        convs, rate=1.0, window_s=60, max_tokens=4096, max_output=32, gap_scale=0.5, max_gap_s=60
    )
    # The trace's arrivals are 10 s apart; at 1 conversation/s they are 1 s apart.
    assert [p.arrival_s for p in plans] == [0.0, 1.0]
    first = plans[0].turns
    assert [(t.new_tokens, t.output_tokens, t.gap_s) for t in first] == [(1000, 10, 0.0), (490, 10, 2.0)]
    assert plans[1].turns[0].output_tokens == 32  # capped; the 9000-token request was cut


def test_groups_share_engines_between_on_and_exact() -> None:
    assert groups(["off", "on", "exact", "agg"]) == [
        ("off", ["off"]),
        ("reuse", ["on", "exact"]),
        ("agg", ["agg"]),
    ]
    with pytest.raises(ValueError, match="unknown leg"):
        groups(["of"])


def test_limits_name_what_ran_out() -> None:
    summary = {"reuse_counts": {"expired": 2}, "tpot_ms": {"p90": 80.0}, "start_delay_ms_max": 0}
    engines = {
        "decode": {
            "kv_usage_max": 0.97,
            "retained_share_max": 0.6,
            "not_retained_delta": 4,
            "queue_ms_mean": 5,
        },
        "prefill": {"preemptions_delta": 0, "queue_ms_mean": 400.0},
    }
    assert limits(summary, engines, SLO()) == [
        "decode KV full (peak 97%, retained up to 60%)",
        "retention cap declined 4 finished turns",
        "leases expired before 2 turns",
        "prefill queue (mean 400 ms per request)",
        "decode step time (TPOT p90 80 ms)",
    ]
    assert limits({"tpot_ms": {"p90": 10.0}}, {"decode": {"kv_usage_max": 0.5}}, SLO()) == []


def test_targets_compare_knees_and_count_errors() -> None:
    def leg(goodput: float, hit: float | None, errors: int = 0) -> dict[str, Any]:
        steps = [{"summary": {"errors": {"http 503": errors} if errors else {}}}]
        return {"knee": {"goodput_turns_s": goodput, "hit_rate": hit}, "steps": steps}

    t = targets({"off": leg(1.0, None), "on": leg(2.5, 0.93), "agg": leg(3.0, 0.99, errors=1)})
    assert t["on_vs_off_goodput"] == 2.5 and t["on_vs_off_met"] is True
    assert t["on_vs_agg_goodput"] == 0.833 and t["on_vs_agg_met"] is False
    assert t["errors"] == 1 and t["errors_met"] is False
    assert t["on_hit_rate_met"] is True
    assert t["knees_reached"] == {"off": False, "on": False, "agg": False}
    assert "exact_vs_off_goodput" in t and t["exact_vs_off_goodput"] is None


def test_targets_compare_equal_loads_where_a_leg_has_no_knee() -> None:
    """OFF meeting the SLO at no load tried has knee goodput 0: the knee ratio is left out (JSON has no
    infinity) while ON's knee above 0 still meets the target; the steps both legs ran at the same offered
    load are compared turn for turn."""

    def leg(knee: float, steps: dict[int, float]) -> dict[str, Any]:
        return {
            "knee": {"goodput_turns_s": knee, "hit_rate": 0.95},
            "steps": [
                {"conversations": n, "summary": {"errors": {}, "goodput_turns_s": g}}
                for n, g in steps.items()
            ]
            + [{"conversations": 99}],  # a step cut before it ran has no summary
        }

    t = targets({"off": leg(0.0, {6: 0.7, 12: 0.5}), "on": leg(1.5, {12: 1.5, 18: 2.0})})
    assert t["on_vs_off_goodput"] is None and t["on_vs_off_met"] is True
    assert t["on_vs_off_at_equal_loads"] == [{"conversations": 12, "on": 1.5, "off": 0.5, "ratio": 3.0}]
    assert t["on_vs_off_at_equal_loads_met"] is True
    assert "on_vs_agg_at_equal_loads" not in t and "on_vs_agg_at_equal_loads_met" not in t
    json.dumps(t, allow_nan=False)
    lost = targets({"off": leg(0.0, {6: 0.7}), "on": leg(0.0, {6: 0.0})})
    assert lost["on_vs_off_met"] is False
    assert lost["on_vs_off_at_equal_loads"] == [{"conversations": 6, "on": 0.0, "off": 0.7, "ratio": 0.0}]
    assert lost["on_vs_off_at_equal_loads_met"] is False


def test_targets_at_equal_loads_where_no_leg_meets_the_slo_at_p90() -> None:
    """Issue 46's load: no leg's p90 is within the SLO (the first turns recompute), so no leg has a knee, and
    the verdicts come from the one load all legs ran: tiered served turns within the SLO where HBM-only ON
    served none (2x of nothing: met), more than the single server, and reused on every later turn."""

    def leg(goodput: float, hit: float | None) -> dict[str, Any]:
        summary = {"errors": {}, "goodput_turns_s": goodput, "hit_rate": hit}
        return {
            "knee": {"goodput_turns_s": 0.0, "hit_rate": None},
            "steps": [{"conversations": 7, "summary": summary}],
        }

    t = targets({"tiered": leg(0.18, 1.0), "on": leg(0.0, 0.667), "agg": leg(0.116, 0.857)})
    assert t["tiered_vs_on_met"] is False and t["tiered_vs_on_at_equal_loads_met"] is True
    assert t["tiered_vs_on_at_equal_loads"] == [
        {"conversations": 7, "tiered": 0.18, "on": 0.0, "ratio": None}
    ]
    assert t["tiered_vs_agg_at_equal_loads_met"] is True
    assert t["on_vs_agg_at_equal_loads_met"] is False
    assert t["tiered_hit_rate_met"] is None and t["tiered_hit_rate_by_load_met"] is True
    assert t["tiered_hit_rate_by_load"] == [{"conversations": 7, "hit_rate": 1.0}]
    assert t["on_hit_rate_by_load_met"] is False
    # Neither leg served a turn within the SLO: not met; a load whose hit rate is unknown: no verdict.
    none = targets({"tiered": leg(0.0, None), "on": leg(0.0, 0.5)})
    assert none["tiered_vs_on_at_equal_loads_met"] is False and none["tiered_hit_rate_by_load_met"] is None


def test_merge_computes_targets_over_the_merged_legs() -> None:
    """A run whose legs came from two calls: the merged targets compare legs of different files (each file's
    own targets saw only its legs), and the knees are the steps' by the current rule."""

    def doc(command: str, legs: dict[str, list[tuple[int, float, bool]]]) -> dict[str, Any]:
        data = {
            leg: {
                "knee": {"stale": True},
                "steps": [
                    {
                        "rate": n / 12,
                        "conversations": n,
                        "summary": {"errors": {}, "goodput_turns_s": g, "slo_ok": ok, "hit_rate": 0.97},
                    }
                    for n, g, ok in steps
                ],
            }
            for leg, steps in legs.items()
        }
        stale = targets(
            {leg: {**r, "knee": {"goodput_turns_s": 0.0, "hit_rate": None}} for leg, r in data.items()}
        )
        return {"command": command, "data": {"legs": data, "targets": stale, "wall_s": 10.0}}

    first = doc("agg run", {"agg": [(12, 1.737, True), (18, 2.012, False)]})
    second = doc("off run", {"off": [(6, 0.728, False), (12, 0.635, False)]})
    third = doc("on run", {"on": [(12, 1.736, True), (18, 2.088, False)]})
    merged = merge([first, second, third])
    t = merged["targets"]
    assert set(merged["legs"]) == {"agg", "off", "on"}
    assert merged["legs"]["on"]["knee"] == {
        "rate": 1.0,
        "goodput_turns_s": 1.736,
        "hit_rate": 0.97,
        "reached": True,
    }
    assert t["on_vs_off_met"] is True and t["on_vs_off_goodput"] is None  # OFF has no knee
    assert t["on_vs_off_at_equal_loads"] == [{"conversations": 12, "on": 1.736, "off": 0.635, "ratio": 2.734}]
    assert t["on_vs_agg_goodput"] == 0.999 and t["on_vs_agg_met"] is False
    assert t["on_hit_rate_met"] is True
    assert merged["merged_from"] == ["agg run", "off run", "on run"] and merged["wall_s"] == 30.0
    assert first["data"]["legs"]["agg"]["knee"] == {"stale": True}  # the inputs are left as they were


def _short_plans(**kw: Any) -> list[Any]:
    """Short plans for the driver tests: tiny contexts, gaps of tens of milliseconds unless asked."""
    return generate_plans(**{"contexts": [100], "suffix": 10, "gap_sigma": 0.1, "max_gap_s": 0.1, **kw})


async def _drive(plans: list[Any], transport: httpx.AsyncBaseTransport, **kw: Any) -> StepRun:
    return await run_step(
        plans, url="http://r.test", model="m", text=lambda c, n: "w " * n, tag="t", transport=transport, **kw
    )


def _sse(tokens: int, reuse: str) -> httpx.Response:
    chunks = [{"choices": [{"delta": {"content": f"t{i} "}}]} for i in range(tokens)]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": tokens}})
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(
        200, text=body, headers={"x-agentkv-reuse": reuse, "content-type": "text/event-stream"}
    )


async def test_run_step_drives_turns_heartbeats_and_closes_conversations() -> None:
    seen: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path))
        if request.url.path == "/v1/chat/completions":
            body = json.loads(request.content)
            return _sse(body["max_tokens"], "miss" if len(body["messages"]) == 1 else "hit")
        return httpx.Response(200, json={})

    # Tool gaps of a second against beats every 10 ms: a gap sees a beat unless its process stalls for
    # about the whole second. The drain is a bound only: the step ends when its conversations do.
    plans = _short_plans(
        rate=20.0, window_s=0.2, turns=3, output_tokens=4, gap_median_s=1.0, max_gap_s=2.0, seed=3
    )
    run = await _drive(plans, httpx.MockTransport(handler), router=True, heartbeat_s=0.01, drain_s=120)
    assert len(run.records) == 3 * len(plans) and all(r.ok for r in run.records)
    assert all(r.output_tokens == 4 and r.tpot_s is not None for r in run.records)
    assert {r.reuse for r in run.records if r.turn > 0} == {"hit"}
    assert sum(1 for m, p in seen if m == "DELETE") == len(plans)
    assert any(p.endswith("/heartbeat") for _, p in seen)


async def test_a_step_without_arrivals_is_empty_not_an_error() -> None:
    run = await _drive([], httpx.MockTransport(lambda r: httpx.Response(500)), router=True, drain_s=1)
    assert run.records == [] and run.peak_active == 0
    assert summarize_step(run, slo=SLO())["turns"] == 0


async def test_run_step_cuts_what_is_still_running_at_the_drain_deadline() -> None:
    import asyncio

    class Slow(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.path == "/v1/chat/completions":
                await asyncio.sleep(600)  # only the cut ends these turns
            return httpx.Response(200, json={})

    plans = _short_plans(rate=50.0, window_s=0.05, turns=2, output_tokens=2, gap_median_s=0.01, seed=1)
    run = await _drive(plans, Slow(), router=False, drain_s=0.2)
    assert run.records and all(r.cut and r.error is None for r in run.records)
    assert run.wall_s < 300  # a bound, not a speed: a step that waited for its turns took 600 s


def test_router_settings_per_leg() -> None:
    assert router_settings("off", "auto", []) == {
        "reuse": False,
        "exact": False,
        "path_policy": "auto",
        "log_level": "info",
    }
    assert router_settings("floor", "auto", [])["reuse"] is False
    assert router_settings("on", "auto", []) == {
        "reuse": True,
        "exact": False,
        "path_policy": "auto",
        "log_level": "info",
    }
    assert router_settings("exact", "always-pd", ["decode_load_cap=256", "log_level=warning"]) == {
        "reuse": True,
        "exact": True,
        "path_policy": "always-pd",
        "log_level": "warning",  # a KEY=VALUE wins
        "decode_load_cap": "256",
    }
    with pytest.raises(ValueError):
        router_settings("agg", "auto", [])


def test_kv_config_items_read_json_values_and_refuse_a_missing_key() -> None:
    assert kv_config_item("agentkv_max_retained_fraction=0.3") == ("agentkv_max_retained_fraction", 0.3)
    assert kv_config_item("agentkv_offer_decoded=true") == ("agentkv_offer_decoded", True)
    assert kv_config_item("agentkv_service_host=10.0.0.1") == ("agentkv_service_host", "10.0.0.1")
    for bad in ("no_equals", "=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            kv_config_item(bad)


def test_router_paths_reads_the_routers_own_metric_names() -> None:
    """Read from the exposition the router itself renders, so a renamed metric fails here."""
    import respx

    from agentkv.server.router._metrics import RouterMetrics

    metrics = RouterMetrics()
    metrics.path_decisions_by_path["decode-local"].inc(3)
    metrics.path_decisions_by_path["pull"].inc()
    metrics.prefill_busy.inc(2)
    with respx.mock:
        respx.get("http://router.test/metrics").mock(
            return_value=httpx.Response(200, content=metrics.render())
        )
        got = router_paths("http://router.test")
    assert got == {"pull": 1.0, "recompute": 0.0, "decode-local": 3.0, "prefill_busy": 2.0}
