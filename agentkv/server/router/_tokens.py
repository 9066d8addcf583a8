"""Token ids between the router and the engines.

A turn is rendered and tokenized once, by the prefill engine's own renderer (vLLM's
`/v1/chat/completions/render`, `/v1/completions/render`), so the ids can never disagree with what the engine
would compute from the text. Prefill then gets the ids (`/inference/v1/generate`; an id prompt on
`/v1/completions` before vLLM 0.32), decode gets them forwarded in `kv_transfer_params["prompt_token_ids"]`
(vLLM >= 0.32 skips its own rendering then), and the router checks reuse on them: a prompt that starts with
exactly the token ids decode holds reuses decode's whole offer; one that starts with only some of decode's
whole blocks (a dropped or rewritten last answer, a cut or summarised tail, a regenerated turn) reuses
those blocks, as vLLM's prefix cache would. That check sees everything a chat template renders (tools,
`chat_template_kwargs`, a system prompt it injects), which a check on messages cannot.

Only ids an engine rendered for this very request are ever forwarded: vLLM trusts forwarded ids."""

from __future__ import annotations

import array
import base64
import binascii
import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

from agentkv._wire import pullable_tokens

__all__ = ["MAX_CHECKPOINTS", "TokenMatch", "TokenPrefix", "block_chain"]

# Block digests kept per conversation: at most this many, 16 bytes each (8 KiB, whatever the conversation's
# length). Up to this many whole blocks every block is one (an exact partial match); beyond, every
# `stride`-th block, the stride doubling as the conversation grows.
MAX_CHECKPOINTS = 512
_DIGEST = 16


def _digest(ids: Sequence[int], n: int) -> str:
    """sha256 of the first `n` ids as native uint32s: a digest of the ids themselves, not of some text that
    could spell them two ways. An `array("I")` (the turn's ids) is hashed in place."""
    if isinstance(ids, array.array) and ids.typecode == "I":
        return hashlib.sha256(memoryview(ids)[:n]).hexdigest()
    return hashlib.sha256(array.array("I", ids[:n]).tobytes()).hexdigest()


def _id_bytes(ids: Sequence[int], n: int) -> bytes | memoryview:
    """The first `n` ids as native uint32 bytes (raises OverflowError for an id beyond 32 bits)."""
    if isinstance(ids, array.array) and ids.typecode == "I":
        return memoryview(ids)[:n].cast("B")
    return array.array("I", ids[:n]).tobytes()


def block_chain(ids: Sequence[int], block_size: int, num_blocks: int) -> list[bytes]:
    """The chained digest of each of the first `num_blocks` whole blocks, as vLLM chains its block hashes:
    block i's digest covers block i - 1's digest and block i's ids (16-byte BLAKE2b of the ids as uint32s),
    so equal digests at block i mean equal ids up to the end of block i."""
    return _extend(_id_bytes(ids, num_blocks * block_size), block_size, 0, num_blocks, b"", keep=1)[0]


def _extend(
    buf: bytes | memoryview, block_size: int, start: int, stop: int, prev: bytes, *, keep: int = 0
) -> tuple[list[bytes], bytes]:
    """Chain blocks `start .. stop - 1` of `buf` (the ids' bytes from block 0) after `prev` (block
    `start - 1`'s digest): the digests of the blocks `i` with `(i + 1) % keep == 0` (none for 0), and the
    last one (`prev` if none)."""
    step = block_size * 4
    blake2b = hashlib.blake2b
    kept: list[bytes] = []
    for i in range(start, stop):
        h = blake2b(prev, digest_size=_DIGEST)
        h.update(buf[i * step : (i + 1) * step])
        prev = h.digest()
        if keep and (i + 1) % keep == 0:
            kept.append(prev)
    return kept, prev


@dataclasses.dataclass(frozen=True)
class TokenMatch:
    """How a new prompt's ids compare with the ids decode holds.

    `extends`: it starts with all of them and adds enough (decode's whole offer is reused). Else `verified`
    leading tokens (whole blocks) are proven equal by the router's digests and at most `bound` may be: the
    true match lies between (equal where every block is a checkpoint). Both leave the prompt tokens to
    compute as `agentkv._wire.pullable_tokens` says."""

    extends: bool
    verified: int
    bound: int

    def offer(self, *, prefill_verifies: bool) -> int:
        """Tokens of decode's offer a partial match may hand prefill: up to `bound` where prefill's connector
        checks every offered block against its own fingerprints (and pulls only the equal ones), else only
        what the router proved."""
        return self.bound if prefill_verifies else self.verified


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenPrefix:
    """The token ids decode holds for a conversation, as a fingerprint: their count, a digest of them all,
    and chained digests of their whole blocks at decode's block size (`block_size`; 0: unknown, so only the
    whole-prefix rule applies, as for records written before these fields existed).

    `must_exceed` is how long the next prompt must be to extend the previous turn: the previous prompt's
    length in exact mode (a repeated request is not reused there, see `Prefix.prompt_only`), else `held`.
    `chain` holds the digest of every `stride`-th whole block (block `(j + 1) * stride - 1` at `j`), at
    most `MAX_CHECKPOINTS`; `last` the digest of the last whole block, which resumes the chain next turn.
    Both are base64, as the stores keep them (JSON)."""

    held: int
    must_exceed: int
    digest: str
    block_size: int = 0
    stride: int = 1
    chain: str = ""
    last: str = ""

    @classmethod
    def of(
        cls,
        prompt_ids: Sequence[int],
        *,
        offered: int,
        exact: bool,
        block_size: int = 0,
        previous: TokenPrefix | None = None,
    ) -> TokenPrefix | None:
        """What the next turn must start with, given the prompt's ids and the tokens decode offers. Decode's
        generated tokens are not known as ids here, so an offer beyond the prompt is covered only up to the
        prompt (the offer is cut to match by the caller, or verified on prefill by our connector).

        `previous`: the conversation's record before this turn; where this prompt starts with all the ids
        it held, its block chain is resumed instead of hashing the whole conversation again."""
        held = min(offered, len(prompt_ids))
        if held <= 0:
            return None
        try:
            digest = _digest(prompt_ids, held)
            if block_size <= 0 or held < block_size:
                return cls(held=held, must_exceed=len(prompt_ids) if exact else held, digest=digest)
            stride, chain, last = _chain_of(prompt_ids, held, block_size, previous)
        except OverflowError:  # an id beyond 32 bits: no vocabulary has one; never reuse on a guess
            return None
        return cls(
            held=held,
            must_exceed=len(prompt_ids) if exact else held,
            digest=digest,
            block_size=block_size,
            stride=stride,
            chain=base64.b64encode(chain).decode(),
            last=base64.b64encode(last).decode(),
        )

    @property
    def blocks(self) -> int:
        """Whole blocks of the held ids (0 without a block size)."""
        return self.held // self.block_size if self.block_size > 0 else 0

    def extended_by(self, ids: Sequence[int]) -> bool:
        """Whether a prompt of these ids starts with exactly the held ids and adds at least one token."""
        if len(ids) <= self.must_exceed or len(ids) < self.held:
            return False
        try:
            return _digest(ids, self.held) == self.digest
        except OverflowError:
            return False

    def match(self, ids: Sequence[int]) -> TokenMatch:
        """How much of what decode holds a prompt of these ids may reuse: all of it where it extends the held
        ids (`extended_by`), else its leading whole blocks whose chain matches decode's."""
        if self.extended_by(ids):
            return TokenMatch(extends=True, verified=self.held, bound=self.held)
        size = self.block_size
        # As prefill's connector cuts its pull (`pullable_tokens`), so this count is what is pulled.
        limit = pullable_tokens(len(ids), self.blocks * size, size, whole=True) // size if size > 0 else 0
        if limit <= 0 or not self.last:
            return TokenMatch(extends=False, verified=0, bound=0)
        try:
            buf = _id_bytes(ids, limit * size)
        except OverflowError:
            return TokenMatch(extends=False, verified=0, bound=0)
        stride, chain, blocks = self.stride, base64.b64decode(self.chain), self.blocks
        verified = 0
        prev = b""
        # Checkpoint by checkpoint: the first that differs ends the search (chaining makes it final).
        for j in range(min(limit // stride, len(chain) // _DIGEST)):
            prev = _extend(buf, size, j * stride, (j + 1) * stride, prev)[1]
            if prev != chain[j * _DIGEST : (j + 1) * _DIGEST]:
                return self._matched(verified, j * stride + stride - 1)
            verified = (j + 1) * stride
        if limit == blocks and verified < blocks:  # the last whole block is a checkpoint of its own
            if _extend(buf, size, verified, blocks, prev)[1] != base64.b64decode(self.last):
                return self._matched(verified, blocks - 1)
            verified = blocks
        return self._matched(verified, limit)

    def _matched(self, verified: int, bound: int) -> TokenMatch:
        return TokenMatch(extends=False, verified=verified * self.block_size, bound=bound * self.block_size)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"held": self.held, "must_exceed": self.must_exceed, "digest": self.digest}
        if self.block_size > 0:
            data.update(
                block_size=self.block_size,
                stride=self.stride,
                chain=self.chain,
                last=self.last,
            )
        return data

    @classmethod
    def from_json(cls, data: Any) -> TokenPrefix | None:
        if not isinstance(data, dict):
            return None
        prefix = cls(held=int(data["held"]), must_exceed=int(data["must_exceed"]), digest=str(data["digest"]))
        # Block digests that do not read back whole (a record written before they existed, or garbled) leave
        # the whole-prefix rule alone: never a partial match on a guess.
        wire_chain, wire_last = data.get("chain", ""), data.get("last", "")
        if not isinstance(wire_chain, str) or not isinstance(wire_last, str):
            return prefix
        try:
            block_size, stride = int(data.get("block_size", 0)), int(data.get("stride", 1))
            chain = base64.b64decode(wire_chain, validate=True)
            last = base64.b64decode(wire_last, validate=True)
        except (TypeError, ValueError, binascii.Error):
            return prefix
        blocks = prefix.held // block_size if block_size > 0 else 0
        checkpoints = blocks // stride if stride >= 1 else -1
        if blocks == 0 or not 0 <= checkpoints <= MAX_CHECKPOINTS or len(chain) != checkpoints * _DIGEST:
            return prefix
        if len(last) != _DIGEST:
            return prefix
        return dataclasses.replace(
            prefix, block_size=block_size, stride=stride, chain=wire_chain, last=wire_last
        )


def _stride_for(blocks: int, at_least: int) -> int:
    stride = at_least
    while blocks // stride > MAX_CHECKPOINTS:
        stride *= 2
    return stride


def _chain_of(
    ids: Sequence[int], held: int, block_size: int, previous: TokenPrefix | None
) -> tuple[int, bytes, bytes]:
    """(stride, checkpoints, last digest) of the whole blocks among the first `held` ids."""
    blocks = held // block_size
    if blocks == 0:
        return 1, b"", b""
    start, stride, chain, prev = 0, 1, b"", b""
    if (
        previous is not None
        and previous.block_size == block_size
        and previous.last
        and 0 < previous.blocks <= blocks
        and len(ids) >= previous.held
        and _digest(ids, previous.held) == previous.digest
    ):
        # These ids start with all the previous ones: their whole blocks' chain is the previous chain.
        start, stride = previous.blocks, previous.stride
        chain, prev = base64.b64decode(previous.chain), base64.b64decode(previous.last)
    new_stride = _stride_for(blocks, stride)
    if new_stride != stride:  # thin: keep the checkpoints that are also ones at the wider stride
        ratio = new_stride // stride
        chain = b"".join(
            chain[j * _DIGEST : (j + 1) * _DIGEST] for j in range(ratio - 1, len(chain) // _DIGEST, ratio)
        )
        stride = new_stride
    kept, last = _extend(_id_bytes(ids, blocks * block_size), block_size, start, blocks, prev, keep=stride)
    return stride, chain + b"".join(kept), last
