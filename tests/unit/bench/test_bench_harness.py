"""bench.harness's scenario builder and summariser: each behaviour's next request is what its harness sends,
and the summary counts later turns only."""

from __future__ import annotations

from typing import Any

import pytest

from bench.harness import (
    BEHAVIOURS,
    FORMAT_ERROR,
    STOP,
    first_messages,
    next_messages,
    request_for,
    rewrite,
    summarize_rows,
    tool_result,
)

HISTORY = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
ANSWER = "the model's answer, twenty-odd characters"


def test_a_tool_loop_resends_the_history_and_the_answer_verbatim() -> None:
    out = next_messages("tool_loop", HISTORY, ANSWER, "result 1")
    assert out == [
        *HISTORY,
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "result 1"},
    ]


@pytest.mark.parametrize("behaviour", ["stop_string", "client_left", "declined"])
def test_behaviours_that_resend_what_the_client_read_extend_the_history_as_a_tool_loop(
    behaviour: str,
) -> None:
    assert next_messages(behaviour, HISTORY, ANSWER, "r") == next_messages("tool_loop", HISTORY, ANSWER, "r")


def test_a_dropped_answer_keeps_every_earlier_message_and_appends_a_user_message() -> None:
    out = next_messages("dropped_answer", HISTORY, ANSWER, "result 1")
    assert out[: len(HISTORY)] == HISTORY
    assert len(out) == len(HISTORY) + 1
    assert out[-1]["role"] == "user"
    assert out[-1]["content"].startswith(FORMAT_ERROR)
    assert all(m["role"] != "assistant" for m in out)


def test_a_rewritten_answer_keeps_its_head_and_cuts_its_tail() -> None:
    out = next_messages("rewritten_answer", HISTORY, ANSWER, "result 1")
    said = out[len(HISTORY)]
    assert said["role"] == "assistant"
    assert said["content"] == rewrite(ANSWER)
    assert said["content"] != ANSWER
    assert ANSWER.startswith(said["content"].split(" [")[0])
    assert ANSWER[len(ANSWER) // 2 :] not in said["content"]


def test_an_unknown_behaviour_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown behaviour"):
        next_messages("regenerate", HISTORY, ANSWER, "r")


def test_first_messages_are_deterministic_and_each_behaviours_own() -> None:
    firsts = {b: first_messages(b, seed=3) for b in BEHAVIOURS}
    assert firsts["tool_loop"] == first_messages("tool_loop", seed=3)
    assert firsts["tool_loop"] != first_messages("tool_loop", seed=4)
    # No behaviour's task text shares its first words with another's: no cache serves one from another.
    heads = {b: m[1]["content"][:40] for b, m in firsts.items()}
    assert len(set(heads.values())) == len(BEHAVIOURS)
    assert len(firsts["declined"][1]["content"]) > 2 * len(firsts["tool_loop"][1]["content"])
    assert tool_result("tool_loop", seed=3, turn=1) != tool_result("tool_loop", seed=3, turn=2)


def test_requests_carry_each_behaviours_options() -> None:
    stop = request_for("stop_string").body("tiny", HISTORY)
    assert stop["stop"] == STOP and "ignore_eos" not in stop
    left = request_for("client_left")
    assert left.leave_after_chunks is not None and left.leave_after_chunks < left.max_tokens
    plain = request_for("tool_loop").body("tiny", HISTORY)
    assert plain["ignore_eos"] is True and "stop" not in plain
    assert plain["stream"] is True and plain["temperature"] == 0


def _row(behaviour: str, leg: str, turn: int, prompt: int, reused: int, ttft: float) -> dict[str, Any]:
    return {
        "behaviour": behaviour,
        "leg": leg,
        "turn": turn,
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "ttft_ms": ttft,
    }


def test_the_summary_counts_later_turns_only_per_behaviour_and_leg() -> None:
    rows = [
        _row("tool_loop", "on", 0, 1000, 900, 500.0),  # a first turn's reuse is not counted
        _row("tool_loop", "on", 1, 1100, 1000, 50.0),
        _row("tool_loop", "on", 2, 1200, 0, 150.0),
        _row("tool_loop", "prefix_cache", 0, 1000, 0, 400.0),
        _row("tool_loop", "prefix_cache", 1, 1100, 550, 70.0),
        _row("dropped_answer", "on", 0, 1000, 0, 400.0),
    ]
    summary = summarize_rows(rows)
    on = summary["tool_loop"]["on"]
    assert on["turns"] == 3 and on["later_turns"] == 2 and on["later_turns_reused"] == 1
    assert on["turns_reused_share"] == pytest.approx(0.5)
    assert on["tokens_reused_share"] == pytest.approx(1000 / 2300)
    assert on["ttft_ms_later_mean"] == pytest.approx(100.0)
    assert summary["tool_loop"]["prefix_cache"]["tokens_reused_share"] == pytest.approx(0.5)
    single = summary["dropped_answer"]["on"]
    assert single["turns"] == 1
    assert single["turns_reused_share"] is None and single["tokens_reused_share"] is None
    assert single["ttft_ms_later_mean"] is None
    assert list(summary) == ["tool_loop", "dropped_answer"]  # in BEHAVIOURS' order
