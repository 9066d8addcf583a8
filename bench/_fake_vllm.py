"""I/O-free core of the stub backend: what a vLLM 0.32/0.33 P or D server with NixlConnector answers.

Shapes follow vLLM's source: the ``kv_transfer_params`` dict is the one ``NixlConnectorScheduler.
request_finished`` builds in ``kv_connector/v1/nixl/pull_scheduler.py`` (0.32), the internal request id is
``chatcmpl-<X-Request-Id>-<8 random chars>`` (``InputProcessor.assign_request_id``), and the response id
is ``chatcmpl-<X-Request-Id>``. Tokens are not real: one token is ``chars_per_token`` characters of prompt
text, which is enough for the router's token arithmetic and block bookkeeping.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from agentkv._constants import DEFAULT_LEASE_S, DEFAULT_MAX_LEASE_S, VLLM_FIXED_TTL_S

__all__ = [
    "DECLINE_MARGIN_S",
    "Completion",
    "Retained",
    "Scripted",
    "StubConfig",
    "StubState",
    "count_prompt_tokens",
    "error_body",
]

# vLLM's P worker declines a pull that would land within this many seconds of D's expiry.
DECLINE_MARGIN_S = 5.0
Role = Literal["prefill", "decode"]


@dataclass(kw_only=True)
class StubConfig:
    role: Role
    model: str = "stub-model"
    output_tokens: int = 16
    # Delay before the first byte (P: the whole answer, D: the first token) and between streamed tokens.
    prefill_ms: float = 0.0
    token_ms: float = 0.0
    block_size: int = 16
    chars_per_token: int = 4
    max_model_len: int = 131072
    # Stock vLLM pins D's finished blocks for a fixed TTL; with a retention service D uses a lease instead.
    ttl_s: float = VLLM_FIXED_TTL_S
    lease: bool = False
    lease_s: float = DEFAULT_LEASE_S
    max_lease_s: float = DEFAULT_MAX_LEASE_S
    # vLLM >= 0.33 puts D's kv_transfer_params on the last streamed chunk; 0.32 only on non-streaming.
    stream_kv_params: bool = True
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5600
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))


@dataclass(kw_only=True)
class Retained:
    """Blocks a decode keeps after a finished request, waiting for prefill to read them."""

    request_id: str
    kv_transfer_params: dict[str, Any]
    expires_at: float  # time.perf_counter() of this process, like vLLM's remote_blocks_expiry_time
    num_tokens: int

    def view(self, now: float) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "kv_transfer_params": self.kv_transfer_params,
            "expires_in_s": max(0.0, self.expires_at - now),
            "num_tokens": self.num_tokens,
        }


@dataclass(kw_only=True)
class Scripted:
    """An answer chosen by a test instead of the stub's own (`` t0 t1 ...``, or a call to the first tool)."""

    text: str | None
    tool_call: dict[str, Any] | None = None
    finish_reason: str = "stop"
    # Tokens decode holds beyond the prompt; a test sets it apart from the text, since an answer sent back
    # as text may re-tokenize to other tokens than the ones decode generated.
    held_beyond_prompt: int = 3


@dataclass(kw_only=True)
class Completion:
    """One generated answer, before it is rendered as JSON or SSE."""

    response_id: str
    chat: bool
    model: str
    prompt_tokens: int
    text_tokens: list[str]
    finish_reason: str
    tool_call: dict[str, Any] | None
    kv_transfer_params: dict[str, Any] | None
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    # Prompt tokens served from cache or pulled (vLLM's prompt_tokens_details.cached_tokens); None: not
    # reported, as vLLM does without --enable-prompt-tokens-details.
    cached_tokens: int | None = None

    @property
    def usage(self) -> dict[str, Any]:
        completion = len(self.text_tokens) or (1 if self.tool_call else 0)
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    def body(self) -> dict[str, Any]:
        text = "".join(self.text_tokens)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": None if self.tool_call else text}
            if self.tool_call:
                message["tool_calls"] = [self.tool_call]
            choice: dict[str, Any] = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": self.finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason}
        return {
            "id": self.response_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage,
            "kv_transfer_params": self.kv_transfer_params,
        }

    def chunks(self) -> Iterator[dict[str, Any]]:
        """Stream chunks in vLLM's order: role, one per token, finish (with kv params), optional usage."""
        base = {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
        }
        if self.chat:
            yield {**base, "choices": [_delta({"role": "assistant", "content": ""})]}
            if self.tool_call:
                # As vLLM streams a call: its id and name first, then the arguments in pieces.
                call, args = self.tool_call, self.tool_call["function"]["arguments"]
                name = {"name": call["function"]["name"]}
                head = {"index": 0, "id": call["id"], "type": "function", "function": name}
                yield {**base, "choices": [_delta({"tool_calls": [head]})]}
                for part in (args[: len(args) // 2], args[len(args) // 2 :]):
                    piece = {"index": 0, "function": {"arguments": part}}
                    yield {**base, "choices": [_delta({"tool_calls": [piece]})]}
            for token in self.text_tokens:
                yield {**base, "choices": [_delta({"content": token})]}
            last_choice = _delta({}, finish_reason=self.finish_reason)
        else:
            for token in self.text_tokens:
                yield {
                    **base,
                    "choices": [{"index": 0, "text": token, "logprobs": None, "finish_reason": None}],
                }
            last_choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": self.finish_reason}
        last: dict[str, Any] = {**base, "choices": [last_choice]}
        if self.kv_transfer_params is not None:
            last["kv_transfer_params"] = self.kv_transfer_params
        yield last
        if self.include_usage:
            yield {**base, "choices": [], "usage": self.usage}


def _delta(delta: dict[str, Any], *, finish_reason: str | None = None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def error_body(message: str, *, status: int, error_type: str = "BadRequestError") -> dict[str, Any]:
    # vLLM's own error envelope (ErrorResponse): the router must translate it, not the stub.
    return {"error": {"message": message, "type": error_type, "param": None, "code": status}}


def _prompt_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if isinstance(messages, list):  # a stray non-list field on /v1/completions is not a chat
        parts: list[str] = []
        # Malformed messages cost nothing here: the stub stands in for an engine's speed, not its validation.
        for message in (m for m in messages if isinstance(m, dict)):
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(str(part.get("text", "")) for part in content if isinstance(part, dict))
            if message.get("tool_calls"):
                parts.append(str(message["tool_calls"]))
            parts.append(f"<|{message.get('role', 'user')}|>")  # stands in for the chat template
        return "".join(parts)
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else "".join(str(item) for item in prompt)


def count_prompt_tokens(body: dict[str, Any], *, chars_per_token: int) -> int:
    # Token ids when the request carries them: an id prompt (tokens in), or ids forwarded to decode.
    prompt = body.get("prompt")
    ids = prompt if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else None
    ids = ids or body.get("token_ids") or (body.get("kv_transfer_params") or {}).get("prompt_token_ids")
    if isinstance(ids, list) and ids:
        return len(ids)
    return max(1, math.ceil(len(_prompt_text(body)) / chars_per_token))


class StubState:
    """Everything one stub server remembers: retained blocks (decode) and counters."""

    def __init__(self, *, config: StubConfig) -> None:
        self.config = config
        self.retained: dict[str, Retained] = {}
        # X-Request-Id (and response id) -> internal id, so lookups by the router's id are O(1).
        self._aliases: dict[str, str] = {}
        self._next_block = 0
        self.counters = {
            "requests": 0,
            "pulls": 0,
            "declined": 0,
            "retained": 0,
            "renewed": 0,
            "released": 0,
            "expired": 0,
            "service_calls": 0,  # requests to the retention service (router overhead diagnostics)
        }

    # --- generation -----------------------------------------------------------------------------
    def complete(
        self, body: dict[str, Any], *, chat: bool, external_id: str, scripted: Scripted | None = None
    ) -> Completion:
        config = self.config
        self.counters["requests"] += 1
        prompt_tokens = count_prompt_tokens(body, chars_per_token=config.chars_per_token)
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or config.output_tokens
        n_tokens = max(1, min(int(limit), config.output_tokens))
        finish = "length" if n_tokens < config.output_tokens else "stop"
        tool_call = None
        messages = body.get("messages") or []
        # Answer a user turn with a call to the first tool, so tool-call pass-through is exercised.
        tools = body.get("tools") if chat and body.get("tool_choice") != "none" else None
        last = messages[-1] if messages else None
        if isinstance(tools, list) and tools and isinstance(last, dict) and last.get("role") == "user":
            tool_call = _tool_call(tools[0], external_id)
            finish = "tool_calls"
        text_tokens = [] if tool_call else [f" t{i}" for i in range(n_tokens)]
        held = n_tokens - 1 if tool_call is None else 0  # the last sampled token is never computed
        if scripted is not None:
            # One token a word, each with the space after it: joined, the scripted text itself.
            text_tokens = re.findall(r"\S+\s*|\s+", scripted.text or "")
            tool_call, finish, held = scripted.tool_call, scripted.finish_reason, scripted.held_beyond_prompt
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{external_id}"
        internal_id = f"{response_id}-{uuid.uuid4().hex[:8]}"
        params = body.get("kv_transfer_params")
        kv_out = None
        if isinstance(params, dict) and params:
            if config.role == "prefill":
                kv_out = self._prefill(params, internal_id, prompt_tokens)
            else:
                kv_out = self._retain(internal_id, response_id, external_id, prompt_tokens + held, body)
        return Completion(
            response_id=response_id,
            chat=chat,
            model=str(body.get("model") or config.model),
            prompt_tokens=prompt_tokens,
            text_tokens=text_tokens,
            finish_reason=finish,
            tool_call=tool_call,
            kv_transfer_params=kv_out,
            include_usage=bool((body.get("stream_options") or {}).get("include_usage")),
        )

    def _blocks(self, num_tokens: int) -> list[list[int]]:
        count = max(1, math.ceil(num_tokens / self.config.block_size))
        start = self._next_block
        self._next_block += count
        return [list(range(start, start + count))]

    def _params(
        self, *, is_prefill: bool, internal_id: str, num_tokens: int, expiry: float | None
    ) -> dict[str, Any]:
        config = self.config
        return {
            "do_remote_prefill": is_prefill,
            "do_remote_decode": not is_prefill,
            "remote_block_ids": self._blocks(num_tokens),
            "remote_engine_id": config.engine_id,
            "remote_request_id": internal_id,
            "remote_host": config.side_channel_host,
            "remote_port": config.side_channel_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": num_tokens,
            "remote_blocks_expiry_time": expiry,
            "transfer_mode": "pull",
        }

    def _prefill(self, params: dict[str, Any], internal_id: str, prompt_tokens: int) -> dict[str, Any] | None:
        if not params.get("do_remote_decode"):
            return None
        if params.get("remote_block_ids") and params.get("remote_engine_id"):
            # D's blocks offered for a pull. perf_counter is CLOCK_MONOTONIC, shared by local processes,
            # so the stub can apply vLLM's decline rule across P and D without a clock-offset handshake.
            expiry = params.get("remote_blocks_expiry_time")
            if expiry is not None and time.perf_counter() > float(expiry) - DECLINE_MARGIN_S:
                self.counters["declined"] += 1
            else:
                self.counters["pulls"] += 1
        return self._params(is_prefill=True, internal_id=internal_id, num_tokens=prompt_tokens, expiry=None)

    def _retain(
        self, internal_id: str, response_id: str, external_id: str, computed: int, body: dict[str, Any]
    ) -> dict[str, Any]:
        config = self.config
        now = time.perf_counter()
        expires_at = now + (config.lease_s if config.lease else config.ttl_s)
        params = self._params(
            is_prefill=False, internal_id=internal_id, num_tokens=computed, expiry=expires_at
        )
        if config.lease:
            params["agentkv_block_hashes"] = _block_hashes(
                _prompt_text(body),
                computed,
                block_size=config.block_size,
                chars_per_token=config.chars_per_token,
            )
        self.retained[internal_id] = Retained(
            request_id=internal_id, kv_transfer_params=params, expires_at=expires_at, num_tokens=computed
        )
        self._aliases[external_id] = internal_id
        self._aliases[response_id] = internal_id
        self.counters["retained"] += 1
        return params

    # --- retention service (docs/protocol.md section 2) ----------------------------------------------
    def find(self, request_id: str) -> Retained | None:
        """By internal id, response id (``chatcmpl-<id>``) or X-Request-Id: the ids vLLM's ids contain.

        O(1): the aliases cover every id the router can know, so no scan over retained entries.
        """
        internal = self._aliases.get(request_id, request_id)
        found = self.retained.get(internal)
        if found is not None and found.expires_at <= time.perf_counter():
            self._forget(internal)
            self.counters["expired"] += 1
            return None
        return found

    def renew(self, request_id: str, duration_s: float) -> Retained | None:
        found = self.find(request_id)
        if found is not None:
            duration = min(max(0.0, duration_s), self.config.max_lease_s)
            found.expires_at = time.perf_counter() + duration
            found.kv_transfer_params["remote_blocks_expiry_time"] = found.expires_at
            self.counters["renewed"] += 1
        return found

    def release(self, request_id: str) -> bool:
        found = self.find(request_id)
        if found is None:
            return False
        self._forget(found.request_id)
        self.counters["released"] += 1
        return True

    def reap(self) -> int:
        now = time.perf_counter()
        expired = [key for key, item in self.retained.items() if item.expires_at <= now]
        for key in expired:
            self._forget(key)
        self.counters["expired"] += len(expired)
        return len(expired)

    def _forget(self, internal_id: str) -> None:
        self.retained.pop(internal_id, None)
        # internal ids are "<response id>-<8 chars>", and the response id is "<prefix>-<external id>".
        response_id = internal_id.rsplit("-", 1)[0]
        for alias in (response_id, response_id.split("-", 1)[1]):
            if self._aliases.get(alias) == internal_id:
                del self._aliases[alias]

    def info(self) -> dict[str, Any]:
        self.reap()
        return {
            "engine_id": self.config.engine_id,
            "lease_s": self.config.lease_s,
            "max_lease_s": self.config.max_lease_s,
            "retained": len(self.retained),
            "vllm_version": "stub",
        }


def _tool_call(tool: Any, external_id: str) -> dict[str, Any]:
    # Whatever a client put in `tools` (the router passes it on as vLLM would receive it): a stub engine
    # answers, it does not crash on a malformed entry.
    function = tool.get("function") if isinstance(tool, dict) else None
    name = function.get("name", "tool") if isinstance(function, dict) else "tool"
    return {
        "id": f"call_{external_id[:16]}",
        "type": "function",
        "function": {"name": name, "arguments": "{}"},
    }


def _block_hashes(text: str, num_tokens: int, *, block_size: int, chars_per_token: int) -> str:
    # Chained like our connector's fingerprints: equal prefixes give equal hashes, one per full block, sent as
    # one hex string.
    hashes: list[str] = []
    previous = b""
    chars_per_block = block_size * chars_per_token
    full_blocks = min(num_tokens // block_size, len(text) // chars_per_block)
    for index in range(full_blocks):
        chunk = text[index * chars_per_block : (index + 1) * chars_per_block].encode()
        previous = hashlib.blake2b(previous + chunk, digest_size=16).digest()
        hashes.append(previous.hex())
    return "".join(hashes)
