import re

import pytest
from openai.types.chat import ChatCompletionMessage
from openai.types.completion_usage import CompletionUsage

from agentkv import ConfigError, SessionClosedError
from agentkv._constants import CONVERSATION_ID_PATTERN
from agentkv.client import router_headers
from agentkv.session import new_conversation_id
from agentkv.session._core import SessionCore


def make_core(**options: object) -> SessionCore:
    defaults: dict = dict(
        model="m",
        conversation_id=None,
        system="be brief",
        session_header="x-session-id",
        heartbeat=False,
        heartbeat_idle_limit_s=600.0,
    )
    return SessionCore(**{**defaults, **options})


def test_generated_ids_are_valid_and_distinct() -> None:
    ids = {new_conversation_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(re.fullmatch(CONVERSATION_ID_PATTERN, i) for i in ids)


@pytest.mark.parametrize("bad", ["", "has space", "slash/no", "x" * 129, "newline\n"])
def test_invalid_conversation_id_is_rejected(bad: str) -> None:
    with pytest.raises(ConfigError):
        make_core(conversation_id=bad)


def test_prepare_carries_identity_and_merges_caller_extras() -> None:
    core = make_core(conversation_id="c1", session_header="x-smg-routing-key")
    turn = core.prepare(
        "hi",
        tools=None,
        stream=True,
        final=False,
        params={"extra_headers": {"x-trace": "t"}, "extra_body": {"top_k": 5}, "temperature": 0},
    )
    headers, body = turn.params["extra_headers"], turn.params["extra_body"]
    assert headers["x-smg-routing-key"] == "c1" and headers["x-trace"] == "t"
    assert headers["x-request-id"] == turn.request_id
    assert body == {"top_k": 5, "prompt_cache_key": "c1"}
    assert turn.params["stream_options"] == {"include_usage": True}
    assert turn.params["temperature"] == 0
    assert turn.params["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert "tools" not in turn.params


def test_each_turn_gets_a_new_request_id() -> None:
    core = make_core()
    first = core.prepare("a", tools=None, stream=False, final=False, params={})
    second = core.prepare("b", tools=None, stream=False, final=False, params={})
    assert first.request_id != second.request_id


def test_finish_appends_both_sides_and_reads_router_headers() -> None:
    now = [10.0]
    core = make_core(clock=lambda: now[0])
    turn = core.prepare("hi", tools=None, stream=False, final=False, params={})
    now[0] = 12.5
    stats = core.finish(
        turn,
        ChatCompletionMessage(role="assistant", content="hello"),
        headers=router_headers(
            reuse="hit", reused_tokens=96, pulled_tokens=64, path="pull", lease_expires_in_s=29.5
        ),
        usage=CompletionUsage(prompt_tokens=120, completion_tokens=3, total_tokens=123),
    )
    assert core.history[-2:] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert (stats.reused, stats.reuse, stats.reused_tokens, stats.path) == (True, "hit", 96, "pull")
    assert stats.pulled_tokens == 64  # the other 32 came from prefill's own prefix cache
    assert stats.total_s == 2.5 and stats.ttft_s is None and stats.since_previous_s is None
    assert stats.lease_expires_in_s == 29.5 and stats.prompt_tokens == 120
    now[0] = 20.0
    later = core.prepare("again", tools=None, stream=False, final=False, params={})
    second = core.finish(later, ChatCompletionMessage(role="assistant", content="x"), headers={}, usage=None)
    assert second.since_previous_s == 7.5 and second.pulled_tokens is None
    assert (second.reused, second.reuse, second.path) == (False, "unknown", None)


def test_expired_reuse_header_marks_the_lease_expired() -> None:
    core = make_core()
    turn = core.prepare("hi", tools=None, stream=False, final=False, params={})
    stats = core.finish(
        turn,
        ChatCompletionMessage(role="assistant", content="x"),
        headers=router_headers(reuse="expired", path="recompute"),
        usage=None,
    )
    assert stats.lease_expired and not stats.reused


def test_failed_turn_leaves_history_untouched() -> None:
    core = make_core()
    before = list(core.history)
    core.prepare("hi", tools=None, stream=False, final=False, params={})
    core.fail()
    assert core.history == before


def test_closed_core_refuses_turns() -> None:
    core = make_core()
    core.closed = True
    with pytest.raises(SessionClosedError):
        core.prepare("hi", tools=None, stream=False, final=False, params={})


def test_summary_lists_every_turn() -> None:
    core = make_core(conversation_id="c-summary")
    for reuse in ("miss", "hit"):
        turn = core.prepare("q", tools=None, stream=False, final=False, params={})
        core.finish(
            turn,
            ChatCompletionMessage(role="assistant", content="a"),
            headers=router_headers(reuse=reuse),
            usage=None,
        )
    text = core.summary()
    assert "c-summary" in text and "miss" in text and "hit" in text
