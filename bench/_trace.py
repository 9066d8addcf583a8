"""Mooncake trace loading and conversation grouping for the retention replay.

The trace has no conversation ids: each request lists ``hash_ids``, one id per 512-token prefix block,
chained (an id never appears at two positions, so an equal id means an equal prefix up to that block).
A request continues an earlier request ``q`` when it shares all of ``q``'s blocks, or all but ``q``'s last
(partial, hence unhashed-equal) block: bench/data/README.md's "extend fully" and "all but its last" cases.
Requests that share less (a common system prompt) start a new conversation. Among several candidates the
longest shared prefix wins, then the most recent request.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DEFAULT_TRACE", "Conversation", "Request", "group_conversations", "load_trace", "turn_histogram"]

# Mooncake's FAST'25 synthetic trace (Apache-2.0), shipped gzipped beside the benches: bench/data/README.md.
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl.gz"


@dataclass(frozen=True, kw_only=True)
class Request:
    index: int
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(kw_only=True)
class Conversation:
    index: int
    requests: list[Request] = field(default_factory=list)

    @property
    def turns(self) -> int:
        return len(self.requests)


def load_trace(path: Path = DEFAULT_TRACE, *, limit: int | None = None) -> list[Request]:
    requests = []
    with gzip.open(path, "rt") if path.suffix == ".gz" else path.open() as lines:
        for index, line in enumerate(lines):
            if limit is not None and index >= limit:
                break
            row = json.loads(line)
            requests.append(
                Request(
                    index=index,
                    timestamp_s=row["timestamp"] / 1000.0,
                    input_length=int(row["input_length"]),
                    output_length=int(row["output_length"]),
                    hash_ids=tuple(row["hash_ids"]),
                )
            )
    return requests


def _parent(request: Request, ends: dict[int, int], ends_but_last: dict[int, int]) -> int | None:
    # Walk from the longest possible shared prefix down; the first hit is the longest match.
    for block in reversed(request.hash_ids):
        if block in ends:
            return ends[block]
        if block in ends_but_last:
            return ends_but_last[block]
    return None


def group_conversations(requests: Iterable[Request]) -> list[Conversation]:
    """Conversations in order of their first request; each request belongs to exactly one."""
    ends: dict[int, int] = {}  # last block id of request q -> q
    ends_but_last: dict[int, int] = {}  # second-to-last block id of q -> q
    conversation_of: dict[int, int] = {}
    conversations: list[Conversation] = []
    for request in sorted(requests, key=lambda r: (r.timestamp_s, r.index)):
        parent = _parent(request, ends, ends_but_last) if request.hash_ids else None
        if parent is None:
            conversation = Conversation(index=len(conversations))
            conversations.append(conversation)
        else:
            conversation = conversations[conversation_of[parent]]
        conversation.requests.append(request)
        conversation_of[request.index] = conversation.index
        # Later requests overwrite earlier ones: the most recent turn is the one to continue.
        if request.hash_ids:
            ends[request.hash_ids[-1]] = request.index
        if len(request.hash_ids) >= 2:
            ends_but_last[request.hash_ids[-2]] = request.index
    return conversations


def turn_histogram(conversations: Sequence[Conversation]) -> dict[int, int]:
    histogram: dict[int, int] = {}
    for conversation in conversations:
        histogram[conversation.turns] = histogram.get(conversation.turns, 0) + 1
    return dict(sorted(histogram.items()))
