"""Ids, params sanitising, SSE splitting and the prefix fingerprint."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv._exceptions import APIStatusError
from agentkv._wire import (
    KV_KEY,
    MESSAGES_CUT_KEY,
    PACKED_IDS_KEY,
    PROMPT_IDS_KEY,
    cut_messages,
    decode_body,
    decode_local_body,
    pack_ids,
    prefill_body,
    prefix_cache_tokens,
    unpack_ids,
    with_prompt_ids,
)
from agentkv.server.router import _codec, _ids
from agentkv.server.router._ids import extract_conversation_id, parse_body, tenant_of
from agentkv.server.router._params import strip_client_fields, strip_kv_json
from agentkv.server.router._prefix import Prefix
from agentkv.server.router._sse import ABORTED, EventSplitter, TurnOutput, stream_error


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        ({"x-session-id": "h1", "x-conversation-id": "h2"}, {"conversation_id": "b"}, "h1"),
        ({"x-conversation-id": "h2"}, {"conversation_id": "b"}, "h2"),
        ({}, {"session_id": "s", "prompt_cache_key": "k"}, "s"),
        ({}, {"conversation_id": "c", "session_id": "s"}, "c"),
        ({}, {"prompt_cache_key": "a.b:c-d_e"}, "a.b:c-d_e"),
        ({}, {"conversation_id": None, "prompt_cache_key": "k"}, "k"),
        ({}, {}, None),
    ],
)
def test_conversation_id_first_match_wins(headers: dict, body: dict, expected: str | None) -> None:
    assert extract_conversation_id(headers, body, session_header="x-session-id") == expected


@pytest.mark.parametrize("bad", ["", "x" * 129, "a b", "a/b", "é", "ok\n", 12, ["x"]])
def test_invalid_ids_are_400(bad: object) -> None:
    with pytest.raises(APIStatusError) as info:
        extract_conversation_id({}, {"conversation_id": bad}, session_header="x-session-id")
    assert info.value.status_code == 400


def test_id_of_128_chars_is_fine_and_custom_header_is_used() -> None:
    assert (
        extract_conversation_id({"x-smg-routing-key": "k" * 128}, {}, session_header="x-smg-routing-key")
        == "k" * 128
    )


def test_tenant_of() -> None:
    assert tenant_of(None, frozenset()) == "-"
    a, b = tenant_of("Bearer ka", frozenset({"ka", "kb"})), tenant_of("bearer kb", frozenset({"ka", "kb"}))
    assert a != b and len(a) == 16
    for header in (None, "Bearer", "Basic ka", "Bearer kc"):
        with pytest.raises(APIStatusError):
            tenant_of(header, frozenset({"ka"}))


def test_parse_body_accepts_prompt_shapes() -> None:
    for prompt in ("x", ["x", "y"], [1, 2], [[1], [2, 3]]):
        assert parse_body(json.dumps({"prompt": prompt}).encode(), "completions")["prompt"] == prompt
    for prompt in (None, [], [1, "x"], [[]], {"a": 1}):
        with pytest.raises(APIStatusError):
            parse_body(json.dumps({"prompt": prompt}).encode(), "completions")


@pytest.mark.parametrize(
    "bad",
    [
        b'{"prompt": "a", "temperature": NaN}',
        b'{"prompt": "a", "x": -Infinity}',
        b'{"prompt": "a", "top_p": 1e999}',
    ],
)
def test_parse_body_refuses_numbers_json_cannot_hold(bad: bytes) -> None:
    with pytest.raises(APIStatusError) as err:
        parse_body(bad, "completions")
    assert err.value.status_code == 400


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


# Field names of bodies the router accepts: any text but the fields it type-checks, which a draw may fill with
# a value the router is right to refuse (hypothesis draws the code's own string constants, such as
# `max_tokens`). Those fields are tested by name in test_router_http / test_fuzz.
FIELD = st.text().filter(lambda name: name not in _ids.CHECKED_FIELDS)


@given(st.dictionaries(FIELD, JSON, max_size=6))
def test_hop_codec_round_trips_whatever_a_parsed_body_holds(body: dict[str, Any]) -> None:
    raw = json.dumps({**body, "prompt": "p"}).encode()
    parsed = parse_body(raw, "completions")
    assert json.loads(_codec.encode(parsed)) == parsed
    assert _codec.decode(json.dumps(parsed).encode()) == parsed


ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


def _stdlib_parse(raw: bytes) -> Any:
    """The router's reader before msgspec: the standard library, refusing non-finite numbers."""
    return json.loads(raw, parse_constant=_ids._not_json, parse_float=_ids._finite)


@given(
    st.dictionaries(FIELD, ANY_JSON, max_size=6),
    st.booleans(),
    st.sampled_from([b"", b"\xef\xbb\xbf", b" \n"]),
)
def test_parse_body_reads_what_the_standard_library_reads(
    body: dict[str, Any], ascii_only: bool, lead: bytes
) -> None:
    # Non-finite numbers, any text (lone surrogates included, escaped where ascii_only), a byte-order mark.
    raw = lead + json.dumps({**body, "prompt": "p"}, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    try:
        expected = _stdlib_parse(raw)
    except (ValueError, UnicodeDecodeError):
        with pytest.raises(APIStatusError) as err:
            parse_body(raw, "completions")
        assert err.value.status_code == 400
        return
    parsed = parse_body(raw, "completions")
    assert json.dumps(parsed, sort_keys=True) == json.dumps(expected, sort_keys=True)


def test_strip_client_fields() -> None:
    body = {
        "model": "m",
        "conversation_id": "c",
        "session_id": "s",
        "prompt_cache_key": "k",
        "kv_transfer_params": {},
    }
    clean, dropped = strip_client_fields(body)
    assert clean == {"model": "m"} and dropped
    assert strip_client_fields({"model": "m"}) == ({"model": "m"}, False)


def test_prefill_body_without_max_completion_tokens_does_not_add_it() -> None:
    out = prefill_body({"messages": [], "max_tokens": 99, "min_tokens": 5, "stream": True}, None)
    assert out["max_tokens"] == 1 and "max_completion_tokens" not in out and "min_tokens" not in out


def test_strip_kv_json_leaves_other_documents_byte_identical() -> None:
    plain = b'{"choices": [{"delta": {"content": "say kv_transfer_params"}}]}'
    assert strip_kv_json(plain)[0] == plain  # the words in content are not the key
    assert strip_kv_json(b'{"a": 1}') == (b'{"a": 1}', None, None)
    out, params, _obj = strip_kv_json(b'{"a": 1, "kv_transfer_params": {"remote_host": "h"}}')
    assert json.loads(out) == {"a": 1} and params == {"remote_host": "h"}


def test_event_splitter_reassembles_and_strips() -> None:
    output = TurnOutput()
    splitter = EventSplitter(output=output)
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    kv = b'data: {"choices":[],"kv_transfer_params":{"remote_block_ids":[[1]]}}\r\n\r\n'
    stream = chunk + b": keepalive\n\n" + kv + b"data: [DONE]\n\n"
    out = b"".join(e for i in range(0, len(stream), 5) for e in splitter.feed(stream[i : i + 5]))
    out += b"".join(splitter.flush())
    assert out.startswith(chunk + b": keepalive\n\n")  # untouched bytes
    assert b"kv_transfer_params" not in out and out.endswith(b"data: [DONE]\n\n")
    assert splitter.done and output.content == "hi" and output.kv_params == {"remote_block_ids": [[1]]}


def test_turn_output_assembles_tool_call_deltas() -> None:
    output = TurnOutput()
    for delta in (
        {
            "tool_calls": [
                {"index": 0, "id": "c1", "type": "function", "function": {"name": "ls", "arguments": ""}}
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"p":'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"."}'}}]},
    ):
        output.add_chunk({"choices": [{"index": 0, "delta": delta}]})
    output.add_chunk(
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}], "usage": {"prompt_tokens": 3}}
    )
    msg = output.assistant_message()
    assert msg["tool_calls"] == [
        {"type": "function", "function": {"name": "ls", "arguments": '{"p":"."}'}, "id": "c1"}
    ]
    assert output.finish_reason == "tool_calls" and output.usage == {"prompt_tokens": 3}


def test_prefix_fingerprint() -> None:
    first = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": "q"},
    ]
    prefix = Prefix.of_turn({"messages": first}, {"role": "assistant", "content": "a", "tool_calls": []})
    assert prefix is not None
    same = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "refusal": None},
        {"role": "user", "content": "next"},
    ]
    assert prefix.matches({"messages": same})
    assert not prefix.matches({"messages": [*same[:2], {"role": "assistant", "content": "a!"}, same[3]]})
    assert not prefix.matches({"prompt": "q"})
    assert prefix.new_chars({"messages": same}) > 0
    assert Prefix.from_json(prefix.to_json()) == prefix
    assert Prefix.of_turn({"prompt": [1, 2]}, {"content": "x"}) is None


def test_prompt_only_prefix_lets_the_last_answer_change() -> None:
    # An exact router offers only the previous prompt's KV, so only the prompt must be extended: a client that
    # strips reasoning from the answer still reuses it. The same request again (a regenerate) does not.
    first = [{"role": "user", "content": "q"}]
    prefix = Prefix.of_turn(
        {"messages": first}, {"role": "assistant", "content": "long answer"}, prompt_only=True
    )
    assert prefix is not None and prefix.prompt_only
    stripped = [*first, {"role": "assistant", "content": "answer"}, {"role": "user", "content": "next"}]
    assert prefix.matches({"messages": stripped})
    assert not prefix.matches({"messages": first})  # a regenerate: prefill would compute one token alone
    assert not prefix.matches({"messages": [{"role": "user", "content": "q!"}, *stripped[1:]]})
    assert Prefix.from_json(prefix.to_json()) == prefix
    assert Prefix.from_json({"items": 1, "chars": 2, "digest": "d"}) == Prefix(items=1, chars=2, digest="d")
    text = Prefix.of_turn({"prompt": "abc"}, {"content": "xyz"}, prompt_only=True)
    assert text is not None and text.matches({"prompt": "abc, then"})
    assert not text.matches({"prompt": "abc"}) and not text.matches({"prompt": "ab"})


@pytest.mark.parametrize("calls", [3437696, "x", {"function": {}}, True])
def test_malformed_tool_calls_are_compared_as_sent_not_a_crash(calls: object) -> None:
    """/v1/completions does not validate ``messages`` (the engine ignores them there), so the prompt-size
    estimate and the history guard meet any JSON value; ``python -m bench.fuzz`` found an int here."""
    from agentkv.server.router._prefix import canonical_message, prompt_chars

    message = {"role": "assistant", "tool_calls": calls}
    assert canonical_message(message)["tool_calls"] == calls
    assert prompt_chars({"prompt": "p", "messages": [message]}) > 0


def _anthropic_stream(stop_reason: str | None) -> bytes:
    """A Messages API stream as vLLM 0.32 sends it: `event:` + `data:` pairs, no [DONE]."""
    events = [
        (
            "message_start",
            {"type": "message_start", "message": {"usage": {"input_tokens": 9, "output_tokens": 0}}},
        ),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}},
        ),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 1,
                "content_block": {"type": "tool_use", "id": "t1", "name": "ls"},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": '{"p":'},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": '"."}'},
            },
        ),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason},
                "usage": {
                    "input_tokens": 2,
                    "output_tokens": 5,
                    "cache_read_input_tokens": 7,
                    "cache_creation_input_tokens": 0,
                },
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


def test_anthropic_stream_is_relayed_untouched_and_assembled() -> None:
    output = TurnOutput(dialect="anthropic")
    splitter = EventSplitter(output=output)
    stream = _anthropic_stream("tool_use")
    out = b"".join(e for i in range(0, len(stream), 7) for e in splitter.feed(stream[i : i + 7]))
    out += b"".join(splitter.flush())
    assert out == stream and b"[DONE]" not in out
    assert splitter.done and not splitter.aborted
    assert output.content == "hi" and output.finish_reason == "tool_use"
    assert output.tool_calls == {
        1: {"type": "function", "id": "t1", "function": {"name": "ls", "arguments": '{"p":"."}'}}
    }
    # OpenAI's names: the prompt counts the tokens read from the prefix cache too.
    assert output.usage == {
        "prompt_tokens": 9,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 7},
    }


def test_anthropic_stream_with_a_null_stop_reason_is_an_abort() -> None:
    output = TurnOutput(dialect="anthropic")
    splitter = EventSplitter(output=output)
    out = b"".join(splitter.feed(_anthropic_stream(None)))
    assert splitter.aborted and not splitter.done
    assert b"message_delta" not in out and b"message_stop" not in out  # nothing after the abort


def test_anthropic_stream_without_message_stop_is_not_done() -> None:
    splitter = EventSplitter(output=TurnOutput(dialect="anthropic"))
    stream = _anthropic_stream("end_turn")
    list(splitter.feed(stream[: stream.index(b"event: message_stop")]))
    assert not splitter.done


def test_anthropic_message_is_assembled() -> None:
    output = TurnOutput(dialect="anthropic")
    message = {
        "type": "message",
        "content": [
            {"type": "text", "text": "a"},
            {"type": "tool_use", "id": "t", "name": "f", "input": {"x": 1}},
        ],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 4, "output_tokens": 2},
    }
    output.add_response(message)
    assert output.content == "a" and output.finish_reason == "tool_use"
    assert output.tool_calls[1]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert output.usage == {"prompt_tokens": 4, "completion_tokens": 2}
    aborted = TurnOutput(dialect="anthropic")
    aborted.add_response({**message, "stop_reason": None})
    assert aborted.finish_reason == ABORTED


def test_stream_errors_speak_the_stream_dialect() -> None:
    body = {"error": {"message": "decode engine connection lost", "type": "server_error"}}
    openai = stream_error(body, TurnOutput())
    assert openai.startswith(b"data: {") and openai.endswith(b"data: [DONE]\n\n")
    anthropic = stream_error(body, TurnOutput(dialect="anthropic"))
    name, data = anthropic.decode().strip().split("\n")
    assert name == "event: error" and b"[DONE]" not in anthropic
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error",
        "error": {"type": "api_error", "message": "decode engine connection lost"},
    }


def test_parse_body_messages_needs_max_tokens() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    with pytest.raises(APIStatusError) as info:
        parse_body(json.dumps(body).encode(), "messages")
    assert info.value.status_code == 400 and "max_tokens" in str(info.value)
    assert parse_body(json.dumps({**body, "max_tokens": 4}).encode(), "messages")["max_tokens"] == 4
    with pytest.raises(APIStatusError):
        parse_body(json.dumps({**body, "max_tokens": 4, "messages": []}).encode(), "messages")


def _responses_stream(final: str = "response.completed", status: str = "completed") -> bytes:
    """A Responses API stream as vLLM 0.32 sends it: the response object (with its kv params) embedded in
    the first and last events."""
    response = {"status": "in_progress", "kv_transfer_params": None, "usage": None, "output": []}
    done = {
        **response,
        "status": status,
        "kv_transfer_params": {"remote_block_ids": [[3]]},
        "usage": {"input_tokens": 30, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 16}},
        "output": [
            {"type": "message", "content": [{"type": "output_text", "text": "ab"}]},
            {"type": "function_call", "name": "ls", "call_id": "c1", "arguments": "{}"},
        ],
    }
    events = [
        {"type": "response.created", "sequence_number": 0, "response": response},
        {"type": "response.output_text.delta", "sequence_number": 1, "delta": "a"},
        {"type": "response.output_text.delta", "sequence_number": 2, "delta": "b"},
        {"type": final, "sequence_number": 3, "response": done},
    ]
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def test_responses_stream_is_assembled_and_its_nested_kv_params_stripped() -> None:
    output = TurnOutput(dialect="responses")
    splitter = EventSplitter(output=output)
    stream = _responses_stream()
    out = b"".join(e for i in range(0, len(stream), 11) for e in splitter.feed(stream[i : i + 11]))
    out += b"".join(splitter.flush())
    assert b"kv_transfer_params" not in out and b"[DONE]" not in out
    assert out.count(b"event: response.") == 4
    assert splitter.done and output.kv_params == {"remote_block_ids": [[3]]}
    assert output.content == "ab" and output.finish_reason == "completed" and output.sequence == 3
    assert output.usage == {
        "prompt_tokens": 30,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 16},
    }
    assert output.tool_calls[0] == {
        "type": "function",
        "id": "c1",
        "function": {"name": "ls", "arguments": "{}"},
    }
    error = json.loads(stream_error({"error": {"message": "m", "code": "c"}}, output).split(b"data: ")[1])
    assert error == {"type": "error", "code": "c", "message": "m", "param": None, "sequence_number": 4}


def test_responses_stream_ends_with_incomplete_or_fails() -> None:
    splitter = EventSplitter(output=TurnOutput(dialect="responses"))
    list(splitter.feed(_responses_stream("response.incomplete", "incomplete")))
    assert splitter.done  # vLLM >= 0.33's final event when max_output_tokens cut the answer
    failed = EventSplitter(output=TurnOutput(dialect="responses"))
    out = b"".join(failed.feed(_responses_stream("response.failed", "failed")))
    assert failed.aborted and not failed.done and b"response.failed" not in out


def test_responses_json_is_assembled() -> None:
    output = TurnOutput(dialect="responses")
    body = json.loads(_responses_stream().split(b"data: ")[-1])["response"]
    output.add_response(body)
    assert output.content == "ab" and output.finish_reason == "completed"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search_preview"}]}, "tools"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_parse_body_refuses_stateful_responses(extra: dict, param: str) -> None:
    body = {"model": "m", "input": "hi", **extra}
    with pytest.raises(APIStatusError) as info:
        parse_body(json.dumps(body).encode(), "responses")
    assert info.value.status_code == 400 and info.value.body["error"]["param"] == param


def test_prefill_body_limits_the_responses_api_by_its_own_field() -> None:
    out = prefill_body({"input": "hi", "max_output_tokens": 99, "stream": True}, None, responses=True)
    assert out["max_output_tokens"] == 1 and "max_tokens" not in out and out["stream"] is False


def test_prefix_ignores_what_is_not_a_message() -> None:
    """Found by bench.fuzz: a text completion whose body also carries a `messages` array of non-objects (the
    engine ignores the field) crashed the router's check of the next turn (a 500)."""
    first = {"messages": [{"role": "user", "content": "a"}, 7]}
    prefix = Prefix.of_turn(first, {"role": "assistant", "content": "b"})
    assert prefix is not None
    assert not prefix.matches({"messages": [1023963988, True, None]})
    assert prefix.matches(
        {
            "messages": [
                {"role": "user", "content": "a"},
                None,
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"},
            ]
        }
    )


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300))
def test_packed_ids_unpack_to_the_same_ids(ids: list[int]) -> None:
    packed = pack_ids(ids)
    assert isinstance(packed, str) and unpack_ids(packed).tolist() == ids


@pytest.mark.parametrize("ids", [[-1], [2**32], [1, 2**40]])
def test_ids_outside_uint32_are_not_packed(ids: list[int]) -> None:
    assert pack_ids(ids) is None
    assert with_prompt_ids({}, ids, pack=True) == {PROMPT_IDS_KEY: ids}  # the plain list instead


@pytest.mark.parametrize("bad", ["", "AAA", "AQAAAA", "AQAAAA==x", "AAAA=", "!!!!", None, [1, 2]])
def test_malformed_packed_ids_are_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        unpack_ids(bad)


_HISTORY = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


@pytest.mark.parametrize("local", [True, False])
def test_a_decode_hop_with_packed_ids_is_cut_to_its_last_message(local: bool) -> None:
    body = {"model": "m", "messages": _HISTORY, "max_tokens": 3}
    if local:
        out = cut_messages(decode_local_body(body, prompt_ids=[1, 2, 3], pack=True))
    else:
        out = cut_messages(decode_body(body, {"remote_engine_id": "P"}, prompt_ids=[1, 2, 3], pack=True))
    assert out["messages"] == _HISTORY[-1:] and out["max_tokens"] == 3
    assert out[KV_KEY][MESSAGES_CUT_KEY] is True and unpack_ids(out[KV_KEY][PACKED_IDS_KEY]).tolist() == [
        1,
        2,
        3,
    ]
    assert body["messages"] == _HISTORY and KV_KEY not in body  # the client's body is not touched


@pytest.mark.parametrize(
    ("extra", "pack", "messages"),
    [
        ({}, False, _HISTORY),  # the ids as a list: a decode that reads only packed ids renders them
        ({"echo": True}, True, _HISTORY),  # an echo is rendered
        ({}, True, [*_HISTORY[:1], {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        ({}, True, _HISTORY[:1]),  # one message: nothing to cut
    ],
)
def test_a_decode_hop_that_would_render_keeps_its_messages(
    extra: dict[str, Any], pack: bool, messages: list[dict[str, Any]]
) -> None:
    body = {"model": "m", "messages": messages, **extra}
    out = cut_messages(decode_local_body(body, prompt_ids=[1, 2], pack=pack))
    assert out["messages"] == messages and MESSAGES_CUT_KEY not in out[KV_KEY]
    assert cut_messages({"model": "m", "prompt": "x"}) == {"model": "m", "prompt": "x"}


def test_the_default_offer_is_what_vllms_prefix_cache_would_reuse() -> None:
    # Whole blocks only: the partial last block (decode's newest tokens) is left for prefill to compute.
    assert prefix_cache_tokens(300 + 20 - 1, 16) == 304
    assert prefix_cache_tokens(320, 16) == 320
    assert prefix_cache_tokens(15, 16) == 0
    assert prefix_cache_tokens(0, 128) == 0


@given(
    st.integers(min_value=0, max_value=5000),
    st.integers(min_value=0, max_value=5000),
    st.sampled_from([4, 16, 64, 128]),
    st.booleans(),
)
def test_a_reused_prompt_never_leaves_a_handful_of_tokens_to_compute(
    num_prompt: int, available: int, block_size: int, whole: bool
) -> None:
    from agentkv._wire import pullable_tokens

    n = pullable_tokens(num_prompt, available, block_size, whole=whole)
    assert 0 <= n <= available and (n == 0 or num_prompt - n >= 2)
    if whole:
        assert n % block_size == 0
    left = num_prompt - n
    # Fewer than 16 left only where a whole block is: the step is then at least a block (never 2 tokens).
    assert n == 0 or left >= 16 or (n % block_size == 0 and left >= block_size)
    # And it gives up no more than that rule needs: the 16 tokens, a block, and the cut to a whole block.
    assert n >= min(available, num_prompt - 2) - 2 * block_size - 16
