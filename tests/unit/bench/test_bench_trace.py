"""Grouping trace requests into conversations by chained hash_ids prefixes."""

from __future__ import annotations

from bench._trace import DEFAULT_TRACE, Request, group_conversations, load_trace


def req(index: int, t: float, *blocks: int) -> Request:
    return Request(
        index=index, timestamp_s=t, input_length=512 * len(blocks), output_length=10, hash_ids=blocks
    )


def members(conversations) -> list[list[int]]:
    return [[r.index for r in c.requests] for c in conversations]


def test_full_extension_and_all_but_last_block_continue_a_conversation() -> None:
    requests = [
        req(0, 0.0, 1, 2, 3),
        req(1, 1.0, 1, 2, 3, 4, 5),  # extends request 0 fully
        req(2, 2.0, 1, 2, 3, 4, 9, 10),  # shares all but request 1's last (partial) block
    ]
    assert members(group_conversations(requests)) == [[0, 1, 2]]


def test_sharing_less_than_all_but_one_block_starts_a_new_conversation() -> None:
    requests = [req(0, 0.0, 1, 2, 3, 4), req(1, 1.0, 1, 2, 7, 8)]  # a common system prompt only
    assert members(group_conversations(requests)) == [[0], [1]]


def test_unrelated_requests_are_separate_and_order_is_by_timestamp() -> None:
    requests = [req(1, 5.0, 20, 21), req(0, 0.0, 10, 11), req(2, 6.0, 10, 11, 12)]
    assert members(group_conversations(requests)) == [[0, 2], [1]]


def test_the_longest_shared_prefix_wins() -> None:
    requests = [
        req(0, 0.0, 1),  # a one-block request that everything below extends
        req(1, 1.0, 1, 2, 3),  # extends 0
        req(2, 2.0, 30),  # unrelated
        req(3, 3.0, 1, 2, 3, 4),  # extends 1 (3 blocks) rather than 0 (1 block)
    ]
    conversations = group_conversations(requests)
    assert members(conversations) == [[0, 1, 3], [2]]


def test_a_branch_from_an_earlier_turn_joins_that_conversation() -> None:
    requests = [req(0, 0.0, 1, 2), req(1, 1.0, 1, 2, 3, 4), req(2, 2.0, 1, 2, 5)]  # 2 regenerates turn 2
    assert members(group_conversations(requests)) == [[0, 1, 2]]


def test_real_trace_partitions_every_request_once() -> None:
    requests = load_trace(DEFAULT_TRACE)
    assert len(requests) == 3993  # the shipped trace, all of it (bench/data/README.md)
    conversations = group_conversations(requests)
    seen = [r.index for c in conversations for r in c.requests]
    assert sorted(seen) == list(range(len(requests)))
    assert any(c.turns > 1 for c in conversations)
    for conversation in conversations:
        times = [r.timestamp_s for r in conversation.requests]
        assert times == sorted(times)
