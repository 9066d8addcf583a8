"""The fuzz checks can fail: each kind of bad answer is reported, good answers are not."""

from __future__ import annotations

import json

from bench._http_cases import answer_problems
from bench.fuzz import _sentinel_changes

OPENAI_ERROR = json.dumps({"error": {"message": "m", "type": "t", "param": None, "code": 400}})


def test_good_answers_have_no_problems() -> None:
    assert answer_problems(400, "application/json", OPENAI_ERROR, b"{}") == []
    assert answer_problems(200, "text/event-stream", "data: {}\n\ndata: [DONE]\n\n", b"{}") == []
    sent = b'{"kv_transfer_params": {}}'
    assert answer_problems(200, "application/json", '{"kv_transfer_params": {}}', sent) == []


def test_each_bad_answer_is_named() -> None:
    assert answer_problems(500, "application/json", OPENAI_ERROR, b"{}") == ["status 500"]
    assert answer_problems(502, "application/json", OPENAI_ERROR, b"{}") == ["status 502"]
    [shape] = answer_problems(400, "text/plain", "Internal Server Error", b"{}")
    assert shape.startswith("error body is not OpenAI-shaped")
    assert answer_problems(404, "application/json", '{"error": "not found"}', b"{}")
    assert answer_problems(200, "text/event-stream", "data: {}\n\n", b"{}") == [
        "stream does not end with data: [DONE]"
    ]
    leak = answer_problems(200, "application/json", '{"kv_transfer_params": {}}', b"{}")
    assert leak == ["kv_transfer_params leaked"]


def test_the_sentinel_may_only_count_down() -> None:
    view = {"decode": "d0", "retained_tokens": 80, "lease": {"state": "held", "expires_in_s": 100.0}}
    later = {**view, "lease": {"state": "held", "expires_in_s": 99.0}}
    assert _sentinel_changes(view, later) is None
    extended = {**view, "lease": {"state": "held", "expires_in_s": 120.0}}
    assert "extended" in (_sentinel_changes(view, extended) or "")
    assert _sentinel_changes(view, {**view, "retained_tokens": 0})
    assert _sentinel_changes(view, {**view, "lease": {"state": "released", "expires_in_s": 0.0}})
