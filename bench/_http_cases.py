"""What the router's HTTP fuzz sends and what every answer must satisfy, shared by the unit test (300 cases
in process) and ``bench/fuzz.py`` (tens of thousands over real sockets).

Requests mix well-formed and malformed OpenAI bodies, conversation ids of every printable shape, random bytes
and bodies around the 4096-byte limit the fuzzed router is configured with, on every route and a wrong method.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from agentkv._constants import BODY_ID_FIELDS

__all__ = ["MAX_BODY_BYTES", "SENTINEL", "answer_problems", "requests", "touches_sentinel"]

MAX_BODY_BYTES = 4096
SENTINEL = "sentinel"  # a conversation no fuzzed request may touch

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**40) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
ids = st.one_of(
    st.text(alphabet="abc.:_-XYZ019", min_size=1, max_size=10),
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=140),
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool", "system"]) | json_values},
        optional={"content": json_values, "tool_calls": json_values, "name": json_values},
    ),
    max_size=3,
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["tiny", "nope"]) | json_values,
        "messages": messages | json_values,
        "prompt": st.text(max_size=20) | json_values,
        "stream": st.booleans() | json_values,
        "max_tokens": st.integers(-2, 5) | json_values,
        "conversation_id": ids | json_values,
        "session_id": ids,
        "prompt_cache_key": ids,
        "kv_transfer_params": json_values,
        "stream_options": json_values,
        # The Responses API's fields, the stateful ones the router refuses among them.
        "input": st.text(max_size=20) | json_values,
        "max_output_tokens": st.integers(-2, 5) | json_values,
        "previous_response_id": ids | json_values,
        "background": st.booleans() | json_values,
        "tools": json_values,
    },
)
# Well-formed chats with fuzzed extras: without them almost every completion is a 400, and the paths that
# reach the engines (reuse, streaming, the store) would be fuzzed a few dozen times in ten thousand.
chats = st.fixed_dictionaries(
    {
        "model": st.just("tiny"),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "assistant", "system"]), "content": st.text(max_size=40)}
            ),
            min_size=1,
            max_size=4,
        ),
    },
    optional={
        "stream": st.booleans(),
        "max_tokens": st.integers(1, 8),
        "conversation_id": ids,
        "kv_transfer_params": json_values,
        "stream_options": json_values,
        "prompt": st.text(max_size=20),
    },
)
# (method, path with "{id}"), body bytes, headers, conversation id for the path.
requests = st.tuples(
    st.sampled_from(
        [
            ("POST", "/v1/chat/completions"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/messages"),
            ("POST", "/v1/responses"),
            ("GET", "/v1/conversations/{id}"),
            ("POST", "/v1/conversations/{id}/heartbeat"),
            ("DELETE", "/v1/conversations/{id}"),
            ("GET", "/v1/models"),
            ("PUT", "/v1/chat/completions"),
        ]
    ),
    st.one_of(
        bodies.map(lambda b: json.dumps(b).encode()),
        chats.map(lambda b: json.dumps(b).encode()),
        st.binary(max_size=64),
        st.binary(min_size=MAX_BODY_BYTES - 96, max_size=MAX_BODY_BYTES + 1904),  # 413 or a parse error
    ),
    st.dictionaries(st.sampled_from(["x-session-id", "x-conversation-id", "authorization"]), ids, max_size=2),
    ids,
)


def touches_sentinel(content: bytes, headers: dict[str, str], conversation_id: str) -> bool:
    """Whether a generated request names the sentinel conversation (the runner skips those): in the path, a
    header, or any body field the router takes a conversation id from (hypothesis draws the code's own
    string constants, `SENTINEL` among them, for any of them)."""
    if conversation_id == SENTINEL or SENTINEL in headers.values():
        return True
    try:
        body = json.loads(content)
    except ValueError:
        return False
    return isinstance(body, dict) and any(body.get(field) == SENTINEL for field in BODY_ID_FIELDS)


def answer_problems(status: int, content_type: str, text: str, sent: bytes) -> list[str]:
    """What is wrong with one answer: a server error, an error body that is not OpenAI's shape, a stream
    without its end, or ``kv_transfer_params`` (internal to P/D) shown to a client that did not send them."""
    problems = []
    if status >= 500:
        problems.append(f"status {status}")
    if status >= 400:
        try:
            body: Any = json.loads(text)
        except ValueError:
            body = None
        if not (
            isinstance(body, dict)
            and set(body) == {"error"}
            and isinstance(body["error"], dict)
            and set(body["error"]) == {"message", "type", "param", "code"}
        ):
            problems.append(f"error body is not OpenAI-shaped: {text[:200]!r}")
    elif content_type.startswith("text/event-stream") and not text.rstrip().endswith("data: [DONE]"):
        problems.append("stream does not end with data: [DONE]")
    if "kv_transfer_params" in text and "kv_transfer_params" not in sent.decode(errors="replace"):
        problems.append("kv_transfer_params leaked")
    return problems
