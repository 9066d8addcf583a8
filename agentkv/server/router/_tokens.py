"""Token ids between the router and the engines.

A turn is rendered and tokenized once, by the prefill engine's own renderer (vLLM's
`/v1/chat/completions/render`, `/v1/completions/render`), so the ids can never disagree with what the engine
would compute from the text. Prefill then gets the ids (`/inference/v1/generate`; an id prompt on
`/v1/completions` before vLLM 0.32), decode gets them forwarded in `kv_transfer_params["prompt_token_ids"]`
(vLLM >= 0.32 skips its own rendering then), and the router checks reuse on them: the new prompt must start
with exactly the token ids decode holds. That check sees everything a chat template renders (tools,
`chat_template_kwargs`, a system prompt it injects), which a check on messages cannot.

Only ids an engine rendered for this very request are ever forwarded: vLLM trusts forwarded ids."""

from __future__ import annotations

import array
import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

__all__ = ["TokenPrefix"]


def _digest(ids: Sequence[int], n: int) -> str:
    """sha256 of the first `n` ids as native uint32s: a digest of the ids themselves, not of some text that
    could spell them two ways. An `array("I")` (the turn's ids) is hashed in place."""
    if isinstance(ids, array.array) and ids.typecode == "I":
        return hashlib.sha256(memoryview(ids)[:n]).hexdigest()
    return hashlib.sha256(array.array("I", ids[:n]).tobytes()).hexdigest()


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenPrefix:
    """The token ids decode holds for a conversation, as a fingerprint: their count and a digest.

    `must_exceed` is how long the next prompt must be to extend the previous turn: the previous prompt's
    length in exact mode (a repeated request is not reused there, see `Prefix.prompt_only`), else `held`."""

    held: int
    must_exceed: int
    digest: str

    @classmethod
    def of(cls, prompt_ids: Sequence[int], *, offered: int, exact: bool) -> TokenPrefix | None:
        """What the next turn must start with, given the prompt's ids and the tokens decode offers. Decode's
        generated tokens are not known as ids here, so an offer beyond the prompt is covered only up to the
        prompt (the offer is cut to match by the caller, or verified on prefill by our connector)."""
        held = min(offered, len(prompt_ids))
        if held <= 0:
            return None
        try:
            digest = _digest(prompt_ids, held)
        except OverflowError:  # an id beyond 32 bits: no vocabulary has one; never reuse on a guess
            return None
        return cls(held=held, must_exceed=len(prompt_ids) if exact else held, digest=digest)

    def extended_by(self, ids: Sequence[int]) -> bool:
        """Whether a prompt of these ids starts with exactly the held ids and adds at least one token."""
        if len(ids) <= self.must_exceed or len(ids) < self.held:
            return False
        try:
            return _digest(ids, self.held) == self.digest
        except OverflowError:
            return False

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> TokenPrefix | None:
        if not isinstance(data, dict):
            return None
        return cls(held=int(data["held"]), must_exceed=int(data["must_exceed"]), digest=str(data["digest"]))
