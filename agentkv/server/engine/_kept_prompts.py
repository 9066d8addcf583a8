"""Recent prompts' ids, for a new prompt to find the kept one it shares the longest prefix with.

An agent's turn is its previous turn's prompt plus a few hundred ids, and vLLM does some of its per-request
work over the whole prompt again on every turn. Two parts of agentkv keep what that work made for the next
turn to take: decode's API server keeps the Python ints of vLLM's prompt list (`_id_lists`), each engine
core vLLM's block hashes (`_connector._block_hashes`). Both find the kept prompt here.

What a new prompt shares with a kept one is found by comparing the ids (in C, stopping at the first
difference), never assumed, so a caller takes from a kept prompt only what belongs to the same ids.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Kept", "KeptPrompts", "common_prefix"]

T = TypeVar("T")
V = TypeVar("V")

# Ids compared first, four times as many in each next slice: a kept prompt of another conversation under the
# same key parts within the first slices and costs microseconds; the one a new prompt extends costs one pass.
_FIRST_SLICE = 2048


@dataclass(eq=False)  # identity: two kept prompts with equal ids are still two entries
class Kept(Generic[V]):
    """A kept prompt: the key it is filed under, its ids and what the caller keeps with them."""

    key: Hashable
    ids: Sequence[int]
    value: V


class KeptPrompts(Generic[V]):
    """Prompts filed under a key the caller derives from their first ids (and whatever else must match),
    at most `max_ids` ids in all, the least recently kept dropped first. Thread-safe."""

    def __init__(self, *, max_ids: int, tries: int) -> None:
        if max_ids < 0 or tries < 1:
            raise ValueError(f"max_ids must be >= 0 and tries >= 1, not {max_ids} and {tries}")
        self.max_ids = max_ids
        self._tries = tries
        self._order: OrderedDict[Kept[V], None] = OrderedDict()  # oldest first
        self._by_key: dict[Hashable, list[Kept[V]]] = {}
        self._size = 0
        self._lock = threading.Lock()

    def find(self, key: Hashable, ids: Sequence[int]) -> tuple[int, Kept[V] | None]:
        """The kept prompt under `key` sharing the longest prefix with `ids`, and how many ids that prefix
        holds; (0, None) where none shares any. The `tries` newest are compared, newest first, and the
        search stops at the first one `ids` extends whole: the likeliest, an agent's previous turn (a
        shared system prompt files many conversations under one key)."""
        with self._lock:
            shared, found = 0, None
            for kept in reversed(self._by_key.get(key, [])[-self._tries :]):
                n = common_prefix(kept.ids, ids)
                if n > shared:
                    shared, found = n, kept
                    if n == len(kept.ids):
                        break
            return shared, found

    def keep(self, key: Hashable, ids: Sequence[int], value: V, *, replacing: Kept[V] | None = None) -> None:
        """Keep `ids` (which the caller must not change afterwards) and `value` under `key`. `replacing`: a
        kept prompt `ids` extends whole, dropped, since every prompt that shares a prefix with it shares
        as much with this one. A prompt of more than `max_ids` ids is not kept."""
        with self._lock:
            if replacing is not None and replacing in self._order:
                self._drop(replacing)
            if len(ids) > self.max_ids:
                return
            kept = Kept(key=key, ids=ids, value=value)
            self._order[kept] = None
            self._by_key.setdefault(key, []).append(kept)
            self._size += len(ids)
            while self._size > self.max_ids:
                self._drop(next(iter(self._order)))

    def _drop(self, kept: Kept[V]) -> None:
        del self._order[kept]
        self._size -= len(kept.ids)
        filed = self._by_key[kept.key]
        filed.remove(kept)
        if not filed:
            del self._by_key[kept.key]

    @property
    def size(self) -> int:
        """Ids kept, in all."""
        return self._size

    def __len__(self) -> int:
        return len(self._order)


def common_prefix(a: Sequence[T], b: Sequence[T]) -> int:
    """How many leading items `a` and `b` share: two lists, two texts, or two arrays of one type, which
    compare as memoryviews (no copies); an array and a list never compare equal, so they share none. Slices
    of growing size find where the two part, a binary search over that slice the first differing item: a
    whole shared prefix costs one pass (~0.1 ms at 131k ids as arrays), and a prompt that parts early from a
    long one (many share a system prompt and little else) a few small slices."""
    n = min(len(a), len(b))
    x: Sequence[T] | memoryview = a
    y: Sequence[T] | memoryview = b
    if isinstance(a, array) and isinstance(b, array) and a.typecode == b.typecode:
        x, y = memoryview(a), memoryview(b)
    at, step = 0, _FIRST_SLICE
    while at < n:
        stop = min(at + step, n)
        if x[at:stop] != y[at:stop]:
            lo, hi = at, stop  # x[:lo] == y[:lo]; x[:hi] != y[:hi]
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if x[lo:mid] == y[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            return lo
        at, step = stop, step * 4
    return n
