"""Prompt ids as the Python lists vLLM takes, built without making the ints a kept prompt already has.

vLLM's API server takes a prompt as a `list[int]`. Where agentkv's plugin holds the ids as machine integers
(decode's packed forwarded ids: `_forwarded_ids`), `array.tolist()` makes one Python int per id: 2.5-3.2 ms
at 127k ids on one CPU core, on every turn, for a prompt that is the previous turn's plus a few hundred new
ids. `IdLists` keeps the lists of recent prompts and builds the next one from the longest prefix a kept
prompt shares with it (pointer copies of the same, immutable, int objects) plus the new ids' ints.

Which prefix is shared is found by comparing the machine integers (in C, stopping at the first difference),
never assumed, so the list equals `ids.tolist()` whatever was kept. vLLM gets a list of its own each time:
a kept list is never handed out, so nothing vLLM does to its prompt list can change a later prompt.
"""

from __future__ import annotations

import collections
import itertools
from array import array

__all__ = ["IdLists"]

# Kept prompts are grouped by their first ids; conversations under one long system prompt share a group, and
# the comparison tells them apart.
_KEY_IDS = 64
# Kept prompts of a group compared per request, newest first (the likeliest to be extended); the search stops
# at the first one the new prompt extends whole, an agent's previous turn.
_CANDIDATES = 16


class IdLists:
    """Lists of recent prompts' ids, at most `max_ids` ids in all (0: keep none, every list built whole).
    Not thread-safe: vLLM's API server runs the chat wrapper that uses it on its event loop."""

    def __init__(self, *, max_ids: int) -> None:
        if max_ids < 0:
            raise ValueError(f"max_ids must be >= 0, not {max_ids}")
        self._max_ids = max_ids
        # serial -> (the ids, their list); oldest first.
        self._kept: collections.OrderedDict[int, tuple[array[int], list[int]]] = collections.OrderedDict()
        self._by_start: dict[bytes, list[int]] = {}
        self._size = 0
        self._serials = itertools.count()

    def to_list(self, ids: array[int]) -> tuple[list[int], int]:
        """`ids.tolist()` (a new list), its longest prefix shared with a kept prompt taken from that
        prompt's list, and how many ids that prefix holds; the result is kept for the prompts that extend
        it, and so is `ids`, which the caller must not change afterwards."""
        if self._max_ids == 0 or not _KEY_IDS <= len(ids) <= self._max_ids:
            return ids.tolist(), 0  # a prompt shorter than its key is cheap to make whole
        start = ids[:_KEY_IDS].tobytes()
        shared, source = 0, None
        for serial in reversed(self._by_start.get(start, [])[-_CANDIDATES:]):
            kept_ids, _ = self._kept[serial]
            n = _common_prefix(kept_ids, ids)
            if n > shared:
                shared, source = n, serial
                if n == len(kept_ids):
                    break
        if source is None:
            out = ids.tolist()
        else:
            kept_ids, kept_list = self._kept[source]
            out = kept_list[:shared]
            out.extend(ids[shared:].tolist())
            if shared == len(kept_ids):
                # Every prompt that shares a prefix with the kept one shares as much with this one.
                self._drop(source)
        self._keep(start, ids, out[:])
        return out, shared

    def _keep(self, start: bytes, ids: array[int], ints: list[int]) -> None:
        serial = next(self._serials)
        self._kept[serial] = (ids, ints)
        self._by_start.setdefault(start, []).append(serial)
        self._size += len(ids)
        while self._size > self._max_ids:
            self._drop(next(iter(self._kept)))

    def _drop(self, serial: int) -> None:
        ids, _ = self._kept.pop(serial)
        self._size -= len(ids)
        start = ids[:_KEY_IDS].tobytes()
        serials = self._by_start[start]
        serials.remove(serial)
        if not serials:
            del self._by_start[start]

    def __len__(self) -> int:
        return len(self._kept)


def _common_prefix(a: array[int], b: array[int]) -> int:
    """How many leading ids two arrays of one type share. Memoryviews compare in C without copying and stop
    at the first difference, so another conversation parts after what it shares, a whole shared prefix costs
    one pass (~0.1 ms at 131k ids) and a partial one a binary search of passes over halving spans."""
    n = min(len(a), len(b))
    va, vb = memoryview(a)[:n], memoryview(b)[:n]
    if va == vb:
        return n
    lo, hi = 0, n  # va[:lo] == vb[:lo]; va[:hi] != vb[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if va[lo:mid] == vb[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
