"""The state of one turn: the validated request and what the router learns while it runs it (for the
response headers, the log line and the bookkeeping afterwards). Pure data; nothing here does I/O."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from array import array
from collections.abc import Sequence
from typing import Any

from agentkv._constants import (
    H_CONVERSATION_ID,
    H_PATH,
    H_PREFILL_MS,
    H_PULLED_TOKENS,
    H_RENDER_MS,
    H_REUSE,
    H_REUSED_TOKENS,
    H_TIER,
)
from agentkv._wire import MESSAGES_PATH, RESPONSES_PATH, render_path

from ._backend import BackendState
from ._policy import Path
from ._sse import Dialect

__all__ = ["Turn"]

_DIALECTS: dict[str, Dialect] = {MESSAGES_PATH: "anthropic", RESPONSES_PATH: "responses"}


@dataclasses.dataclass(kw_only=True)
class Turn:
    """One validated client request, ids already stripped from `body`."""

    api_path: str  # /v1/chat/completions, /v1/completions, /v1/messages or /v1/responses
    body: dict[str, Any]
    conversation_id: str | None
    key: str | None  # conversation_key(tenant, conversation_id)
    request_id: str
    # x-agentkv-final-turn: the conversation ends with this turn, so decode retains nothing for it.
    final: bool = False
    started: float = dataclasses.field(default_factory=time.perf_counter)
    # Filled in as the turn runs, for headers, the log line and the bookkeeping afterwards.
    prefill: str = "-"
    decode: str = "-"
    path: Path = "recompute"
    reuse: str = "none"
    reused_tokens: int = 0
    # Of a "cached" turn's reused tokens, those decode restores from its host KV tier (0: all in its HBM).
    host_tokens: int = 0
    # What decode said it still had of this prompt when asked (tokens cached, of them in its host tier),
    # whichever path the turn then took; None: not asked. The log line's `decode_had`.
    decode_had: tuple[int, int] | None = None
    # Of those, what prefill read from decode, as our connector on prefill reports it (None: not reported).
    pulled_tokens: int | None = None
    prompt_tokens: int | None = None
    prefill_ms: float = 0.0
    ttft_ms: float | None = None
    used_retained: bool = False
    # Where the prompt starts with only some of decode's whole blocks (a "partial" reuse verdict): the
    # leading tokens of decode's offer this turn may read; None: the whole offer.
    offer_tokens: int | None = None
    decode_started: float = 0.0
    # The token path: prefill's render of this body (a vLLM `GenerateRequest`), its ids as uint32s (what the
    # reuse check hashes and decode's packed form carries) and which prefill made it.
    rendered: dict[str, Any] | None = None
    prompt_ids: array[int] | None = None
    render_prefill: BackendState | None = None
    render_ms: float | None = None
    # Whether decode gets the prompt's ids forwarded (it renders nothing then), packed, and with the chat
    # messages cut to the last one (`agentkv._wire.cut_messages`).
    forward_ids: bool = False
    pack_ids: bool = False
    cut_messages: bool = False
    # Decode's in-flight count for this turn (see `BackendState.inflight`): held from the decode hop's start
    # to the answer's last byte, closed by whoever sees that byte.
    inflight: contextlib.ExitStack[bool | None] = dataclasses.field(default_factory=contextlib.ExitStack)

    def forwarded_ids(self) -> Sequence[int] | None:
        """The ids decode's params carry: packed from the array, or the render's own list (no copy)."""
        if not self.forward_ids or self.rendered is None:
            return None
        return self.prompt_ids if self.pack_ids else self.rendered["token_ids"]

    @property
    def dialect(self) -> Dialect:
        """The answer and stream format: OpenAI's completions, Anthropic's Messages or OpenAI's Responses.
        Only the completions are also checked on messages; the other two on token ids alone."""
        return _DIALECTS.get(self.api_path, "openai")

    @property
    def render_path(self) -> str | None:
        """vLLM's render route for this turn's route (what `BackendState.renders` is keyed by), or None."""
        return render_path(self.api_path)

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def headers(self) -> dict[str, str]:
        headers = {
            H_REUSE: self.reuse,
            H_REUSED_TOKENS: str(self.reused_tokens),
            H_PATH: self.path,
            H_PREFILL_MS: f"{self.prefill_ms:.1f}",
        }
        if self.render_ms is not None:
            headers[H_RENDER_MS] = f"{self.render_ms:.1f}"
        if self.pulled_tokens is not None:
            headers[H_PULLED_TOKENS] = str(self.pulled_tokens)
        if self.conversation_id:
            headers[H_CONVERSATION_ID] = self.conversation_id
        if self.reuse == "cached":
            headers[H_TIER] = "host" if self.host_tokens else "hbm"
        return headers
