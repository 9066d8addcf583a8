"""Prompt ids as the Python lists vLLM takes, built without making the ints a kept prompt already has.

vLLM's API server takes a prompt as a `list[int]`. Where agentkv's plugin holds the ids as machine integers
(decode's packed forwarded ids: `_forwarded_ids`), `array.tolist()` makes one Python int per id: 2.5-3.2 ms
at 127k ids on one CPU core, on every turn, for a prompt that is the previous turn's plus a few hundred new
ids. `IdLists` keeps the lists of recent prompts and builds the next one from the longest prefix a kept
prompt shares with it (pointer copies of the same, immutable, int objects) plus the new ids' ints.

Which prefix is shared is found by comparing the machine integers (`KeptPrompts`), never assumed, so the list
equals `ids.tolist()` whatever was kept. vLLM gets a list of its own each time: a kept list is never handed
out, so nothing vLLM does to its prompt list can change a later prompt.
"""

from __future__ import annotations

from array import array

from agentkv.server.engine._kept_prompts import KeptPrompts

__all__ = ["IdLists"]

# Kept prompts are filed under their first ids; conversations under one long system prompt share a key, and
# the comparison tells them apart.
_KEY_IDS = 64
# Kept prompts of a key compared per request, newest first (the likeliest to be extended).
_CANDIDATES = 16


class IdLists:
    """Lists of recent prompts' ids, at most `max_ids` ids in all (0: keep none, every list built whole)."""

    def __init__(self, *, max_ids: int) -> None:
        if max_ids < 0:
            raise ValueError(f"max_ids must be >= 0, not {max_ids}")
        self._kept: KeptPrompts[list[int]] = KeptPrompts(max_ids=max_ids, tries=_CANDIDATES)

    def to_list(self, ids: array[int]) -> tuple[list[int], int]:
        """`ids.tolist()` (a new list), its longest prefix shared with a kept prompt taken from that
        prompt's list, and how many ids that prefix holds; the result is kept for the prompts that extend
        it, and so is `ids`, which the caller must not change afterwards."""
        if not _KEY_IDS <= len(ids) <= self._kept.max_ids:
            return ids.tolist(), 0  # a prompt shorter than its key is cheap to make whole
        key = ids[:_KEY_IDS].tobytes()
        shared, kept = self._kept.find(key, ids)
        if kept is None:
            out = ids.tolist()
        else:
            out = kept.value[:shared]
            out.extend(ids[shared:].tolist())
        whole = kept is not None and shared == len(kept.ids)
        self._kept.keep(key, ids, out[:], replacing=kept if whole else None)
        return out, shared

    def __len__(self) -> int:
        return len(self._kept)
