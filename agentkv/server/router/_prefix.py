"""The router-side prefix guard: a new turn may reuse decode's blocks only if it extends the last turn.

Stored per conversation is a fingerprint (hash + length) of the previous prompt, followed by what decode
generated unless the router is exact (decode then offers only the prompt's KV, so only the prompt must be
extended: a client that strips or rewrites the last answer still reuses it), never the text itself, so 100k
conversations stay small. A regenerate (the same request again) extends nothing and is not reused."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from typing import Any

__all__ = ["Prefix", "canonical_message", "prompt_chars"]


def canonical_message(msg: dict[str, Any]) -> dict[str, Any]:
    """The parts of a message that shape the prompt tokens, in one spelling.

    Clients round-trip assistant messages differently (content None vs "", arguments re-serialised,
    extra SDK fields), which must not count as an edit."""
    out: dict[str, Any] = {"role": msg.get("role"), "content": _content(msg.get("content"))}
    calls = msg.get("tool_calls")
    if isinstance(calls, list) and calls:
        out["tool_calls"] = [_canonical_call(c) for c in calls if isinstance(c, dict)]
    elif calls:  # malformed (an engine rejects it on chat, ignores it on completions): compared as sent
        out["tool_calls"] = calls
    for key in ("name", "tool_call_id"):
        if msg.get(key) is not None:
            out[key] = msg[key]
    return out


def _content(content: Any) -> Any:
    if content is None:
        return ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return content


def _canonical_call(call: dict[str, Any]) -> dict[str, Any]:
    fn: dict[str, Any] = call["function"] if isinstance(call.get("function"), dict) else {}
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(ValueError):
            args = json.loads(args)
    # Tool-call ids are left out: engines mint them and several SDKs rewrite them.
    return {"type": call.get("type") or "function", "name": fn.get("name"), "arguments": args}


def _encode(msg: dict[str, Any]) -> bytes:
    return json.dumps(canonical_message(msg), sort_keys=True, separators=(",", ":"), default=str).encode()


def prompt_chars(body: dict[str, Any]) -> int:
    """Size of a request's prompt in canonical characters; with token counts it yields chars per token."""
    if isinstance(body.get("messages"), list):
        return sum(len(_encode(m)) for m in body["messages"] if isinstance(m, dict))
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, str) else 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prefix:
    """A fingerprint of "previous prompt + decode's output": count of items, chars, and a digest."""

    items: int
    chars: int
    digest: str
    # The previous prompt alone (what an exact router stores). A request that merely repeats it (a regenerate)
    # still does not match: prefill would compute its one remaining token alone, on the decode-path kernels,
    # and with its prefix cache on could cache that KV for later turns.
    prompt_only: bool = False

    @classmethod
    def of_turn(
        cls, body: dict[str, Any], generated: dict[str, Any], *, prompt_only: bool = False
    ) -> Prefix | None:
        """The prefix the next turn must start with. `generated` is decode's assistant message, left out
        with `prompt_only` (what an exact router stores: decode offers no KV of the answer)."""
        if isinstance(body.get("messages"), list):
            messages = [m for m in body["messages"] if isinstance(m, dict)]
            return cls._of_messages(messages if prompt_only else [*messages, generated], prompt_only)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return None  # token-id prompts cannot be checked on text; such turns are not reused
        return cls._of_text(prompt if prompt_only else prompt + (generated.get("content") or ""), prompt_only)

    @classmethod
    def _of_messages(cls, messages: list[dict[str, Any]], prompt_only: bool = False) -> Prefix:
        h = hashlib.sha256()
        chars = 0
        for m in messages:
            enc = _encode(m)
            chars += len(enc)
            h.update(len(enc).to_bytes(8, "big") + enc)
        return cls(items=len(messages), chars=chars, digest=h.hexdigest(), prompt_only=prompt_only)

    @classmethod
    def _of_text(cls, text: str, prompt_only: bool = False) -> Prefix:
        digest = hashlib.sha256(text.encode()).hexdigest()
        return cls(items=-1, chars=len(text), digest=digest, prompt_only=prompt_only)

    def matches(self, body: dict[str, Any]) -> bool:
        """Whether the new request starts with exactly this prefix and adds something after it."""
        if isinstance(body.get("messages"), list):
            # As `of_turn` counted them: a completion's body may carry a junk `messages` the engine ignores.
            messages = [m for m in body["messages"] if isinstance(m, dict)]
            if self.items < 0 or len(messages) <= self.items:
                return False
            return self._of_messages(messages[: self.items]).digest == self.digest
        prompt = body.get("prompt")
        if self.items >= 0 or not isinstance(prompt, str) or len(prompt) <= self.chars:
            return False
        return self._of_text(prompt[: self.chars]).digest == self.digest

    def new_chars(self, body: dict[str, Any]) -> int:
        """Characters the new request adds beyond the prefix decode holds."""
        return max(prompt_chars(body) - self.chars, 0)

    def to_json(self) -> dict[str, Any]:
        return {
            "items": self.items,
            "chars": self.chars,
            "digest": self.digest,
            "prompt_only": self.prompt_only,
        }

    @classmethod
    def from_json(cls, data: Any) -> Prefix | None:
        if not isinstance(data, dict):
            return None
        return cls(
            items=int(data["items"]),
            chars=int(data["chars"]),
            digest=str(data["digest"]),
            prompt_only=bool(data.get("prompt_only", False)),
        )
