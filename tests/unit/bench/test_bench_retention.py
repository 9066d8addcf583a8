"""The retention replay: the lease (real LeaseTable) vs the fixed TTL on hand-built scripts."""

from __future__ import annotations

import pytest

from bench._retention_sim import Scenario, ScriptedConversation, ScriptedTurn, replay

pytest.importorskip("agentkv.server.engine._connector._leases")

# Service time zero so block-seconds are exact: tokens 16*10+1 -> 160 computed -> 10 blocks.
SCENARIO = Scenario(lease_s=30, ttl_s=480, block_size=16, prefill_us_per_token=0, itl_ms=0)


def turn(gap: float) -> ScriptedTurn:
    return ScriptedTurn(input_length=160, output_length=1, gap_s=gap)


def run(scripts: list[ScriptedConversation], policy: str, scenario: Scenario = SCENARIO) -> dict:
    return replay(scripts, scenario, policy)


def test_closed_single_turn_is_pinned_480s_by_vllm_and_released_at_once_by_the_lease() -> None:
    scripts = [ScriptedConversation(turns=[turn(0)], vanishes=False)]
    assert run(scripts, "fixed")["block_seconds"] == pytest.approx(10 * 480)
    lease = run(scripts, "lease")
    assert lease["block_seconds"] == pytest.approx(0)
    assert lease["released"] == 1


def test_a_vanished_agent_holds_the_lease_once_then_expires() -> None:
    scripts = [ScriptedConversation(turns=[turn(0)], vanishes=True)]
    lease = run(scripts, "lease")
    assert lease["block_seconds"] == pytest.approx(10 * 30)
    assert lease["expired"] == 1 and lease["heartbeats"] == 0


def test_heartbeats_keep_a_long_tool_gap_alive_that_the_fixed_ttl_loses() -> None:
    scripts = [ScriptedConversation(turns=[turn(0), turn(600)], vanishes=False)]
    fixed, lease = run(scripts, "fixed"), run(scripts, "lease")
    assert fixed["hit_rate"] == 0.0
    assert lease["hit_rate"] == 1.0
    assert lease["heartbeats"] >= 600 // 10 - 1
    # The lease held turn 1 for the whole gap, then released turn 2 on close.
    assert lease["block_seconds"] == pytest.approx(10 * 600)


def test_a_short_gap_hits_under_both_and_the_read_frees_the_blocks() -> None:
    scripts = [ScriptedConversation(turns=[turn(0), turn(20)], vanishes=False)]
    fixed, lease = run(scripts, "fixed"), run(scripts, "lease")
    assert fixed["hit_rate"] == lease["hit_rate"] == 1.0
    assert fixed["read"] == lease["read"] == 1
    assert fixed["block_seconds"] == pytest.approx(10 * 20 + 10 * 480)  # turn 2 pinned after close
    assert lease["block_seconds"] == pytest.approx(10 * 20)


def test_a_full_decode_refuses_to_retain() -> None:
    capped = Scenario(**{**SCENARIO.__dict__, "capacity_blocks": 15})
    scripts = [ScriptedConversation(turns=[turn(0)], vanishes=True) for _ in range(2)]
    for policy in ("fixed", "lease"):  # the lease's cap is the real LeaseTable's
        result = run(scripts, policy, capped)
        assert result["refused"] == 1
        assert result["peak_blocks"] == 10


def test_the_sdk_idle_limit_ends_heartbeats_and_the_lease_runs_out() -> None:
    """An agent idle past heartbeat_idle_limit_s stops renewing: a gap longer than limit + lease misses."""
    limited = Scenario(**{**SCENARIO.__dict__, "heartbeat_idle_limit_s": 100})
    scripts = [ScriptedConversation(turns=[turn(0), turn(600)], vanishes=False)]
    lease = run(scripts, "lease", limited)
    assert lease["hit_rate"] == 0.0 and lease["expired"] == 1
    # Held from the finish of turn 1 until the last renewal before 100 s idle plus one lease (<= 130 s).
    assert 10 * 100 < lease["block_seconds"] <= 10 * 130
    short_gap = [ScriptedConversation(turns=[turn(0), turn(90)], vanishes=False)]
    assert run(short_gap, "lease", limited)["hit_rate"] == 1.0


def test_bounds_hold_each_gap_up_to_the_fixed_window_and_hindsight_only_the_hits() -> None:
    from bench._retention_sim import bounds

    # Gaps 20 s (hit), 600 s (past the 475 s window: a miss), then the last turn (nothing after it).
    scripts = [ScriptedConversation(turns=[turn(0), turn(20), turn(600)], vanishes=True)]
    result = bounds(scripts, SCENARIO)
    assert result["ideal window"]["block_seconds"] == pytest.approx(10 * 20 + 10 * 475)
    assert result["hindsight"]["block_seconds"] == pytest.approx(10 * 20)
    assert result["ideal window"]["hit_rate"] == result["hindsight"]["hit_rate"] == 0.5
    assert run(scripts, "fixed")["hit_rate"] == 0.5


def test_on_the_trace_the_bounds_hit_what_the_fixed_pin_hits_for_fewer_block_seconds() -> None:

    from bench._retention_sim import bounds, script_scenario
    from bench._trace import DEFAULT_TRACE, group_conversations, load_trace

    conversations = group_conversations(load_trace(DEFAULT_TRACE, limit=1200))
    scenario = Scenario(seed=1)
    scripts = script_scenario(conversations, scenario)
    fixed = replay(scripts, scenario, "fixed")
    result = bounds(scripts, scenario)
    # Computed from the scripts, the bounds must find exactly the turns the replayed fixed pin hits.
    assert result["ideal window"]["hit_rate"] == pytest.approx(fixed["hit_rate"])
    ideal, hindsight = result["ideal window"]["block_seconds"], result["hindsight"]["block_seconds"]
    assert 0 < hindsight < ideal < fixed["block_seconds"]


def test_the_cap_declines_the_newcomer_where_eviction_would_drop_the_oldest() -> None:
    capped = Scenario(**{**SCENARIO.__dict__, "capacity_blocks": 15})
    # Conversation 0 retains 10 blocks at t=0 and comes back at t=100; conversation 1 needs 10 at t=50.
    scripts = [
        ScriptedConversation(turns=[turn(0), turn(100)], vanishes=False),
        ScriptedConversation(turns=[turn(50)], vanishes=True),
    ]
    kept = run(scripts, "lease", capped)
    assert kept["refused"] == 1 and kept["evicted"] == 0 and kept["hit_rate"] == 1.0
    evicting = run(scripts, "lease-evict", capped)
    assert evicting["evicted"] == 1 and evicting["refused"] == 0 and evicting["hit_rate"] == 0.0
