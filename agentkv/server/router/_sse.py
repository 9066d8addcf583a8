"""Server-sent events from decode: split into events, strip kv params, and assemble what decode said.

Three dialects: OpenAI's completions (`data:` chunks ending with `data: [DONE]`), Anthropic's Messages API
(`event:` + `data:` pairs ending with `message_stop`) and OpenAI's Responses API (`event:` + `data:` pairs
ending with `response.completed` or `response.incomplete`); the last two send no `[DONE]`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any, Literal

from ._params import strip_kv_json

__all__ = ["ABORTED", "DONE", "Dialect", "EventSplitter", "TurnOutput", "error_event", "stream_error"]

DONE = b"data: [DONE]\n\n"
ABORTED = "abort"  # vLLM's finish_reason for a request it dropped before the end


def error_event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


Dialect = Literal["openai", "anthropic", "responses"]


def stream_error(body: dict[str, Any], output: TurnOutput) -> bytes:
    """What ends a stream that broke after its first byte, in the stream's own dialect: an OpenAI error
    chunk and `[DONE]`, or an `error` event (which the Messages and Responses APIs send instead of their
    final event)."""
    if output.dialect == "openai":
        return error_event(body) + DONE
    error = body.get("error")
    error = error if isinstance(error, dict) else {}
    message = error.get("message") or ""
    payload: dict[str, Any]
    if output.dialect == "anthropic":
        payload = {"type": "error", "error": {"type": "api_error", "message": message}}
    else:
        payload = {
            "type": "error",
            "code": error.get("code"),
            "message": message,
            "param": None,
            "sequence_number": output.sequence + 1,
        }
    return b"event: error\ndata: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


@dataclasses.dataclass(kw_only=True)
class TurnOutput:
    """Decode's answer for choice 0, assembled from one JSON response or from stream chunks."""

    content: str = ""
    tool_calls: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    kv_params: dict[str, Any] | None = None
    # Anthropic's Messages API and OpenAI's Responses API have their own answers and events; usage is kept
    # in the completions' field names.
    dialect: Dialect = "openai"
    # Their streams end with a final event (the completions' `[DONE]`).
    stopped: bool = False
    sequence: int = -1  # the Responses stream's last `sequence_number`

    def assistant_message(self) -> dict[str, Any]:
        calls = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return {"role": "assistant", "content": self.content, "tool_calls": calls}

    def add_response(self, obj: Any) -> None:
        """A whole non-streaming chat or text completion, Anthropic message or Responses API response."""
        if not isinstance(obj, dict):
            return
        if self.dialect == "anthropic":
            self._message(obj)
            return
        if self.dialect == "responses":
            self._response(obj)
            return
        self._usage(obj)
        choice = _choice0(obj)
        if choice is None:
            return
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        message = choice.get("message")
        if isinstance(message, dict):
            self.content += message.get("content") or ""
            for i, call in enumerate(message.get("tool_calls") or []):
                if isinstance(call, dict):
                    self.tool_calls[i] = _call(call)
        elif isinstance(choice.get("text"), str):
            self.content += choice["text"]

    def add_chunk(self, obj: Any) -> None:
        """One streamed chunk: content and tool-call arguments arrive as deltas to concatenate."""
        if not isinstance(obj, dict):
            return
        if self.dialect == "anthropic":
            self._message_event(obj)
            return
        if self.dialect == "responses":
            self._response_event(obj)
            return
        self._usage(obj)
        choice = _choice0(obj)
        if choice is None:
            return
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        delta = choice.get("delta")
        if isinstance(delta, dict):
            self.content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                if isinstance(call, dict):
                    self._merge_call(call)
        elif isinstance(choice.get("text"), str):
            self.content += choice["text"]

    def _merge_call(self, part: dict[str, Any]) -> None:
        index = part.get("index", len(self.tool_calls))
        index = index if isinstance(index, int) else len(self.tool_calls)
        call = self.tool_calls.setdefault(
            index, {"type": "function", "function": {"name": "", "arguments": ""}}
        )
        if part.get("id"):
            call["id"] = part["id"]
        fn = part.get("function")
        if isinstance(fn, dict):
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""

    def _usage(self, obj: dict[str, Any]) -> None:
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]

    def _message(self, obj: dict[str, Any]) -> None:
        """A whole Anthropic message. vLLM leaves `stop_reason` out (null) for a request it aborted."""
        self._anthropic_usage(obj.get("usage"))
        self.finish_reason = obj.get("stop_reason") or ABORTED
        for i, block in enumerate(obj.get("content") or []):
            if not isinstance(block, dict):
                continue
            if block.get("type") == "text":
                self.content += block.get("text") or ""
            elif block.get("type") == "tool_use":
                self.tool_calls[i] = _function_call(block, json.dumps(block.get("input") or {}))

    def _message_event(self, obj: dict[str, Any]) -> None:
        """One Anthropic stream event (its `data:` payload)."""
        kind = obj.get("type")
        if kind == "message_start" and isinstance(obj.get("message"), dict):
            self._anthropic_usage(obj["message"].get("usage"))
        elif kind == "content_block_start" and isinstance(obj.get("content_block"), dict):
            block = obj["content_block"]
            if block.get("type") == "tool_use" and isinstance(obj.get("index"), int):
                self.tool_calls[obj["index"]] = _function_call(block, "")
        elif kind == "content_block_delta" and isinstance(obj.get("delta"), dict):
            delta = obj["delta"]
            if delta.get("type") == "text_delta":
                self.content += delta.get("text") or ""
            elif delta.get("type") == "input_json_delta" and obj.get("index") in self.tool_calls:
                self.tool_calls[obj["index"]]["function"]["arguments"] += delta.get("partial_json") or ""
        elif kind == "message_delta":
            delta = obj.get("delta")
            stop = delta.get("stop_reason") if isinstance(delta, dict) else None
            # The final event: a null stop_reason is how the Messages API reports vLLM's "abort".
            self.finish_reason = stop or ABORTED
            self._anthropic_usage(obj.get("usage"))
        elif kind == "message_stop":
            self.stopped = True

    def _response(self, obj: dict[str, Any]) -> None:
        """A whole Responses API response. vLLM reports a request it aborted as `completed` (text models),
        so an abort cannot be told apart here; `failed` and `cancelled` can."""
        status = obj.get("status")
        self.finish_reason = status if status in ("completed", "incomplete") else ABORTED
        usage = obj.get("usage")
        if isinstance(usage, dict):
            out: dict[str, Any] = {}
            for theirs, ours in (("input_tokens", "prompt_tokens"), ("output_tokens", "completion_tokens")):
                if isinstance(usage.get(theirs), int):
                    out[ours] = usage[theirs]
            details = usage.get("input_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                out["prompt_tokens_details"] = {"cached_tokens": details["cached_tokens"]}
            self.usage = out
        for item in obj.get("output") or []:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "message":
                for part in item.get("content") or []:
                    if isinstance(part, dict) and part.get("type") == "output_text":
                        self.content += part.get("text") or ""
            elif item.get("type") == "function_call":
                call = {"name": item.get("name"), "id": item.get("call_id")}
                self.tool_calls[len(self.tool_calls)] = _function_call(call, item.get("arguments") or "")

    def _response_event(self, obj: dict[str, Any]) -> None:
        """One Responses API stream event. The final event embeds the whole response (text, calls, usage,
        status), so the deltas before it need no assembling; `response.failed` is an error, not an answer."""
        if isinstance(obj.get("sequence_number"), int):
            self.sequence = obj["sequence_number"]
        kind = obj.get("type")
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            response = obj.get("response")
            self._response(response if isinstance(response, dict) else {})
            self.stopped = kind != "response.failed"

    def _anthropic_usage(self, usage: Any) -> None:
        """Anthropic usage in OpenAI's names: its `input_tokens` leaves out the tokens read from or written
        to the prefix cache, which are the prompt's too."""
        if not isinstance(usage, dict):
            return
        counts = [
            usage.get(k) for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        ]
        out: dict[str, Any] = {"prompt_tokens": sum(c for c in counts if isinstance(c, int))}
        if isinstance(usage.get("output_tokens"), int):
            out["completion_tokens"] = usage["output_tokens"]
        if isinstance(usage.get("cache_read_input_tokens"), int):
            out["prompt_tokens_details"] = {"cached_tokens": usage["cache_read_input_tokens"]}
        self.usage = out


def _choice0(obj: dict[str, Any]) -> dict[str, Any] | None:
    for choice in obj.get("choices") or []:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return None


def _function_call(block: dict[str, Any], arguments: str) -> dict[str, Any]:
    """An Anthropic `tool_use` block or a Responses `function_call` (its `call_id` as `id`) as an OpenAI
    tool call."""
    out = {"type": "function", "function": {"name": block.get("name") or "", "arguments": arguments}}
    if block.get("id"):
        out["id"] = block["id"]
    return out


def _call(call: dict[str, Any]) -> dict[str, Any]:
    fn: dict[str, Any] = call["function"] if isinstance(call.get("function"), dict) else {}
    out = {
        "type": call.get("type") or "function",
        "function": {"name": fn.get("name") or "", "arguments": fn.get("arguments") or ""},
    }
    if call.get("id"):
        out["id"] = call["id"]
    return out


class EventSplitter:
    """Cuts a byte stream into whole SSE events, so each can be inspected and forwarded as it completes.

    Events are forwarded unchanged unless they carry `kv_transfer_params`; every `data:` payload is also
    decoded once to assemble the assistant message the prefix guard needs."""

    def __init__(self, *, output: TurnOutput) -> None:
        self._buf = b""
        self._output = output
        self.done = False
        # vLLM ends its streams with finish_reason "abort" when it shuts down (SIGTERM) or drops a request:
        # the answer is cut short, and passed on as finished an agent would act on half a tool call.
        self.aborted = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        self._buf += data.replace(b"\r\n", b"\n")
        while True:
            end = self._buf.find(b"\n\n")
            if end < 0:
                return
            event, self._buf = self._buf[: end + 2], self._buf[end + 2 :]
            yield self._event(event)

    def flush(self) -> Iterator[bytes]:
        if self._buf.strip():
            yield self._event(self._buf.rstrip(b"\n") + b"\n\n")
        self._buf = b""

    def _event(self, event: bytes) -> bytes:
        if self.aborted:
            return b""  # nothing after an abort reaches the client; the relay ends with an error event
        head = b""
        if self._output.dialect != "openai" and event.startswith(b"event:") and event.count(b"\n") == 3:
            # The Messages and Responses APIs' `event: <type>` line, then its one `data:` line.
            cut = event.index(b"\n") + 1
            head, event = event[:cut], event[cut:]
        if not event.startswith(b"data:") or b"\n" in event[:-2]:
            # Comments and multi-line events carry no chunk we need; pass them through untouched.
            return head + event
        payload = event[5:-2].strip()
        if payload == b"[DONE]":
            self.done = True
            return event
        out, params, obj = strip_kv_json(payload)
        if params is not None:
            self._output.kv_params = params
        if out is not payload:
            # vLLM >= 0.33 puts the key in every chunk (null until the finishing one): none reaches a client.
            event = b"data: " + out + b"\n\n"
        if obj is None:
            try:
                obj = json.loads(payload)
            except ValueError:
                return head + event
        self._output.add_chunk(obj)
        if self._output.finish_reason == ABORTED:
            self.aborted = True
            return b""
        self.done = self.done or self._output.stopped
        return head + event
