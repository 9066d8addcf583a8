"""Tokenize only what a prompt adds to a prompt tokenized before.

An agent turn's prompt is the previous turn's prompt with a few messages appended, and a vLLM API server
tokenizes all of it on every request: at 127k tokens that is 320-450 ms of CPU on the H200 host, against
~80 ms of GPU work (docs/findings.md). This cache keeps recently tokenized prompts and, for a new prompt that
starts with the same text, tokenizes only the text after the last *added token* (`<|im_start|>`,
`<|im_end|>`, ...) the two share, reusing the ids before it.

Why that equals tokenizing the whole text: a Hugging Face fast tokenizer (`tokenizers`) first splits the text
on its added tokens and then normalizes, pre-tokenizes and encodes each piece between them on its own, so the
ids up to the end of an added token do not depend on the text after it. That holds only for added tokens
matched on the raw text that absorb no whitespace after them and are not part of a longer added token, and
for tokenizers whose pieces do not depend on their position (a `Metaspace` pre-tokenizer that marks only the
first piece does). So:
* a boundary is only an added token with those properties (`_Boundaries`);
* each cached prompt's ids are checked against its text: the added tokens found in the text, in order, must
  be exactly the added-token ids in the ids, else it gets no boundaries and is never reused;
* a tokenizer must pass a probe of the splitting rule when the cache is built, else nothing is reused;
* `verify=True` tokenizes the whole prompt as well and compares (tests and evaluations run with it); a
  mismatch turns reuse off for good and returns the whole-prompt ids.

Reuse is by exact text, so an edited history reuses up to its first changed added token and no further."""

from __future__ import annotations

import array
import bisect
import collections
import dataclasses
import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from agentkv.server.engine._kept_prompts import common_prefix

__all__ = ["AddedTokenInfo", "CacheStats", "TokenizerCache"]

logger = logging.getLogger("vllm.agentkv.tokenizer_cache")

# (text, add_special_tokens) -> ids, the engine's own tokenizer call.
Encode = Callable[[str, bool], Sequence[int]]
# (result: "hit" | "miss" | "mismatch", ids reused, ids tokenized), after each prompt.
Observe = Callable[[str, int, int], None]

# Texts the splitting rule is probed with when a cache is built (heads and tails around an added token).
_PROBE_HEADS = ("a", "x y\n", " ")
_PROBE_TAILS = ("b", " b c", "\n\nd", "  e\tf", "über 数据")
_MAX_PROBED_TOKENS = 16


class AddedTokenInfo(Protocol):
    """What `tokenizers.AddedToken` says about one added token (the fields read here)."""

    content: str
    normalized: bool
    rstrip: bool
    single_word: bool


@dataclasses.dataclass
class CacheStats:
    """Counts since the cache was built; `reused_tokens` + `tokenized_tokens` is every id returned."""

    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    tokenized_tokens: int = 0
    mismatches: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Entry:
    text: str  # a tokenized prompt, cut after its last boundary
    ids: array.array[int]  # the ids of `text`
    ends: list[int]  # char offset just after each boundary in `text`, ascending
    counts: list[int]  # how many ids cover text[: ends[i]]
    special: bool  # the add_special_tokens it was tokenized with

    @property
    def size(self) -> int:
        return len(self.text) + 4 * len(self.ids)


class _Boundaries:
    """Finds the added tokens of a text and pairs those that can end a reusable prefix with id counts."""

    def __init__(self, added: dict[int, AddedTokenInfo], unknown_id: int | None) -> None:
        # The unknown token's id also stands for text the model cannot encode, so it is not looked for.
        contents = {tid: tok.content for tid, tok in added.items() if tok.content and tid != unknown_id}
        self._content_of = contents
        # Leftmost-longest, as the tokenizer matches added tokens: longer alternatives first.
        pattern = "|".join(re.escape(c) for c in sorted(set(contents.values()), key=len, reverse=True))
        self._pattern = re.compile(pattern) if pattern else None
        self.eligible = frozenset(
            tok.content
            for tok in added.values()
            if tok.content
            and not tok.normalized
            and not tok.rstrip
            and not tok.single_word
            and tok.content in contents.values()
            and not any(tok.content in other and tok.content != other for other in contents.values())
        )

    def find(
        self, text: str, ids: Sequence[int], *, char_base: int = 0, id_base: int = 0
    ) -> tuple[list[int], list[int]] | None:
        """(ends, counts) of the eligible added tokens in `text` tokenized as `ids`, offset by the bases; None
        when the added tokens in the text and the added-token ids in the ids disagree."""
        if self._pattern is None:
            return [], []
        matches = [(m.group(), m.end()) for m in self._pattern.finditer(text)]
        content_of = self._content_of
        positions = [j for j, tid in enumerate(ids) if tid in content_of]
        if len(matches) != len(positions):
            return None
        ends: list[int] = []
        counts: list[int] = []
        for (content, end), j in zip(matches, positions, strict=True):
            if content_of[ids[j]] != content:
                return None
            if content in self.eligible:
                ends.append(char_base + end)
                counts.append(id_base + j + 1)
        return ends, counts


class TokenizerCache:
    """Prefix reuse for one tokenizer; thread-safe (vLLM tokenizes in a thread pool).

    A tokenizer the splitting rule does not hold for fails the probe the constructor runs: `reusing` is then
    False and `encode` tokenizes every prompt whole. `added` is the tokenizer's added tokens by id,
    `unknown_id` its unknown token's id (the model emits it for text it cannot encode, so it is not an added
    token there), `max_bytes` bounds the cached texts and ids (least recently used go first), `observe` is
    called after each prompt (for metrics)."""

    def __init__(
        self,
        *,
        encode: Encode,
        added: dict[int, AddedTokenInfo],
        max_bytes: int,
        unknown_id: int | None = None,
        verify: bool = False,
        observe: Observe | None = None,
    ) -> None:
        self._encode = encode
        self._observe = observe
        self._boundaries = _Boundaries(added, unknown_id)
        self._max_bytes = max_bytes
        self._verify = verify
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._bytes = 0
        self._next_key = 0
        self._lock = threading.Lock()
        # How many ids add_special_tokens puts before a text's own (a BOS); None: it also appends some (an
        # EOS), so such prompts are not cached.
        self._lead: int | None = 0
        self.stats = CacheStats()
        self._reuse = self._probe()

    def _probe(self) -> bool:
        """Whether this tokenizer splits on its eligible added tokens as the module says, on sample texts."""
        eligible = sorted(self._boundaries.eligible)[:_MAX_PROBED_TOKENS]
        if not eligible:
            return False
        leads = set()
        for text in _PROBE_TAILS:
            with_, without = list(self._encode(text, True)), list(self._encode(text, False))
            n = len(with_) - len(without)
            leads.add(tuple(with_[:n]) if n >= 0 and with_[n:] == without else None)
        lead = leads.pop() if len(leads) == 1 else None
        self._lead = None if lead is None else len(lead)
        for special in (True, False) if self._lead is not None else (False,):
            for token in eligible:
                for head in _PROBE_HEADS:
                    for tail in _PROBE_TAILS:
                        whole = list(self._encode(head + token + tail, special))
                        parts = list(self._encode(head + token, special)) + list(self._encode(tail, False))
                        if whole != parts:
                            logger.info(
                                "tokenizer cache off: %r splits differently around %r",
                                head + token + tail,
                                token,
                            )
                            return False
        return True

    @property
    def reusing(self) -> bool:
        """Whether prompts are reused: the probe passed and verify found no mismatch."""
        return self._reuse

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        cacheable = self._reuse and (self._lead is not None or not add_special_tokens)
        found = self._lookup(text, add_special_tokens) if cacheable else None
        if found is None:
            ids = list(self._encode(text, add_special_tokens))
            if cacheable:
                self._store(text, ids, add_special_tokens, None)
            with self._lock:
                self.stats.misses += 1
                self.stats.tokenized_tokens += len(ids)
            self._report("miss", 0, len(ids))
            return ids
        entry, end, count = found
        tail = list(self._encode(text[end:], False))
        ids = entry.ids[:count].tolist() + tail
        if self._verify:
            whole = list(self._encode(text, add_special_tokens))
            if whole != ids:
                self._disable(text, end)
                self._report("mismatch", 0, len(whole))
                return whole
        self._store(text, ids, add_special_tokens, (entry, end, count))
        with self._lock:
            self.stats.hits += 1
            self.stats.reused_tokens += count
            self.stats.tokenized_tokens += len(tail)
        self._report("hit", count, len(tail))
        return ids

    def _report(self, result: str, reused: int, tokenized: int) -> None:
        if self._observe is not None:
            self._observe(result, reused, tokenized)

    def _disable(self, text: str, end: int) -> None:
        logger.error(
            "tokenizer cache: reused ids differ from tokenizing the whole prompt (cut at char %d of %d); "
            "reuse is off from now on",
            end,
            len(text),
        )
        with self._lock:
            self._reuse = False
            self.stats.mismatches += 1
            self._entries.clear()
            self._bytes = 0

    def _lookup(self, text: str, special: bool) -> tuple[_Entry, int, int] | None:
        """The cached prompt sharing most ids with `text`, and where to cut: (entry, char end, id count)."""
        best: tuple[_Entry, int, int] | None = None
        with self._lock:
            entries = list(self._entries.values())
        for entry in reversed(entries):  # most recent first
            if entry.special != special or not entry.ends or entry.text[:1] != text[:1]:
                continue
            # The usual agent turn extends a cached prompt: one memcmp, no copy.
            shared = len(entry.text) if text.startswith(entry.text) else common_prefix(entry.text, text)
            i = bisect.bisect_right(entry.ends, shared) - 1
            if i < 0:
                continue
            if best is None or entry.counts[i] > best[2]:
                best = (entry, entry.ends[i], entry.counts[i])
            if shared == len(entry.text):
                break  # the newest prompt this one extends
        return best

    def _store(self, text: str, ids: list[int], special: bool, base: tuple[_Entry, int, int] | None) -> None:
        # The ids kept are the base entry's (an array slice: a copy of machine ints) and the new ones only;
        # converting the whole list again cost more than tokenizing the turn at 130k tokens.
        known = 0
        try:
            if base is None:
                lead = (self._lead or 0) if special else 0
                found = self._boundaries.find(text, ids[lead:], id_base=lead)
                if found is None or not found[0]:
                    return
                ends, counts = found
                kept = array.array("i")
            else:
                entry, end, known = base
                i = bisect.bisect_right(entry.ends, end)
                found = self._boundaries.find(text[end:], ids[known:], char_base=end, id_base=known)
                if found is None:
                    return
                ends, counts = entry.ends[:i] + found[0], entry.counts[:i] + found[1]
                kept = entry.ids[:known]
            kept.extend(ids[known : counts[-1]])
        except OverflowError:  # an id beyond 31 bits: no vocabulary has one
            return
        new = _Entry(text=text[: ends[-1]], ids=kept, ends=ends, counts=counts, special=special)
        if new.size > self._max_bytes:
            return
        with self._lock:
            # A prompt this one extends is of no further use.
            for key, old in list(self._entries.items()):
                if (
                    old.special == special
                    and len(old.text) <= len(new.text)
                    and new.text.startswith(old.text)
                ):
                    self._drop(key)
            key, self._next_key = self._next_key, self._next_key + 1
            self._entries[key] = new
            self._bytes += new.size
            while self._bytes > self._max_bytes and self._entries:
                self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> None:
        self._bytes -= self._entries.pop(key).size

    def __len__(self) -> int:
        return len(self._entries)
