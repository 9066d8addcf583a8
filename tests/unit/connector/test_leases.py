from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv.server.engine._connector._leases import LeaseTable


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def table(clock: Clock) -> LeaseTable:
    return LeaseTable(lease_s=10, max_lease_s=60, clock=clock)


def test_lookup_matches_vllm_internal_ids_and_reports_expiry(clock: Clock) -> None:
    t = table(clock)
    t.add("chatcmpl-agentkv-abc-1234", {"remote_block_ids": [[1, 2]]}, 256)
    found = t.lookup("agentkv-abc")
    assert found is not None
    assert found["request_id"] == "chatcmpl-agentkv-abc-1234"
    assert found["expires_in_s"] == 10
    assert found["kv_transfer_params"]["remote_blocks_expiry_time"] == 1010
    assert t.lookup("agentkv-other") is None


def test_renew_only_extends_and_is_bounded(clock: Clock) -> None:
    t = table(clock)
    t.add("r1", {}, 1)
    clock.t += 5
    assert t.renew("r1", 1.0)["expires_in_s"] == 5  # shorter than what is left: unchanged
    assert t.renew("r1", 1000)["expires_in_s"] == 60  # capped at max_lease_s
    changes = t.drain()
    assert changes == {"r1": clock.t + 60}


def test_release_hands_the_worker_a_deadline_of_now(clock: Clock) -> None:
    t = table(clock)
    t.add("r1", {}, 1)
    assert t.release("r1") is True
    assert t.lookup("r1") is None  # never advertise released blocks
    assert t.renew("r1", 30) is None
    assert t.drain() == {"r1": clock.t}
    assert len(t) == 0
    assert t.release("r1") is False


def test_expired_entries_disappear_and_forget_drops(clock: Clock) -> None:
    t = table(clock)
    t.add("r1", {}, 1)
    t.add("r2", {}, 1)
    t.forget("r2")
    clock.t += 11
    assert t.lookup("r1") is None
    t.drain()
    assert len(t) == 0


def test_bad_bounds_rejected(clock: Clock) -> None:
    with pytest.raises(ValueError):
        LeaseTable(lease_s=10, max_lease_s=5, clock=clock)


def test_a_retention_over_capacity_is_declined_and_granted_leases_are_kept(clock: Clock) -> None:
    t = LeaseTable(lease_s=10, max_lease_s=60, clock=clock, capacity_blocks=10)
    assert t.add("a", {}, 96, block_ids=range(6)) == pytest.approx(1010.0)
    assert t.add("b", {}, 96, block_ids=range(1000, 1006)) == 0.0  # 12 > 10: declined, nothing recorded
    assert t.lookup("b") is None and t.lookup("a") is not None
    assert t.blocks_in_use() == 6
    assert t.add("c", {}, 64, block_ids=range(2000, 2004)) > 0  # exactly full is allowed
    assert t.blocks_in_use() == 10


def test_released_and_expired_leases_free_their_room_at_once(clock: Clock) -> None:
    t = LeaseTable(lease_s=10, max_lease_s=60, clock=clock, capacity_blocks=10)
    t.add("a", {}, 96, block_ids=range(3000, 3006))
    t.release("a")  # queued for the scheduler's next drain, but already no longer holding room
    assert t.add("b", {}, 96, block_ids=range(4000, 4006)) > 0
    clock.t += 11  # b ran out
    assert t.blocks_in_use() == 0
    assert t.add("c", {}, 160, block_ids=range(5000, 5010)) > 0


def test_blocks_two_leases_share_are_charged_once(clock: Clock) -> None:
    # A conversation's next turn, served decode-local, reuses its previous turn's leased blocks (the same
    # ids from vLLM's prefix cache) and adds its own; the router releases the older lease only afterwards.
    t = LeaseTable(lease_s=10, max_lease_s=60, clock=clock, capacity_blocks=10)
    assert t.add("turn1", {}, 96, block_ids=range(6)) > 0
    assert t.add("turn2", {}, 144, block_ids=range(9)) > 0  # 3 new blocks: 9 held, not 15
    assert t.blocks_in_use() == 9
    assert t.add("other", {}, 32, block_ids=[100, 101]) == 0.0  # 11 distinct > 10
    t.release("turn1")
    assert t.blocks_in_use() == 9  # turn2 still holds every block turn1 shared with it
    t.release("turn2")
    assert t.blocks_in_use() == 0


def test_a_renewed_lease_keeps_its_room(clock: Clock) -> None:
    t = LeaseTable(lease_s=10, max_lease_s=60, clock=clock, capacity_blocks=10)
    t.add("a", {}, 96, block_ids=range(6000, 6006))
    clock.t += 8
    t.renew("a", 30)  # pending until the scheduler drains, and it already counts
    clock.t += 5  # past a's original deadline, inside the renewal
    assert t.add("b", {}, 96, block_ids=range(7000, 7006)) == 0.0
    assert t.blocks_in_use() == 6


def test_without_capacity_nothing_is_declined(clock: Clock) -> None:
    t = table(clock)
    for i in range(100):
        assert t.add(f"r{i}", {}, 10_000, block_ids=range(i * 1000, (i + 1) * 1000)) > 0
    assert t.blocks_in_use() == 100_000


def test_a_lease_that_ran_out_is_not_renewed(clock: Clock) -> None:
    # The workers free it at their next step whatever the table queues: a renewal must not promise it.
    t = table(clock)
    t.add("a", {}, 96, block_ids=range(6))
    clock.t += 11
    assert t.renew("a", 30) is None


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 5), st.frozensets(st.integers(0, 11), max_size=6)),
        st.tuples(st.sampled_from(["release", "renew", "forget"]), st.integers(0, 5), st.none()),
        st.tuples(st.just("tick"), st.integers(1, 8), st.none()),
        st.tuples(st.just("drain"), st.just(0), st.none()),
    ),
    max_size=40,
)


@given(ops=_OPS)
def test_the_room_held_is_the_distinct_blocks_of_the_live_leases(ops: list[tuple[str, int, Any]]) -> None:
    clock = Clock()
    t = LeaseTable(lease_s=10, max_lease_s=20, clock=clock, capacity_blocks=8)
    model: dict[str, tuple[frozenset[int], float]] = {}  # request -> (blocks, deadline): the brute force
    released: set[str] = set()
    for op, n, blocks in ops:
        rid = f"r{n}"
        if op == "add" and rid not in model:
            live = [b for r, (b, d) in model.items() if r not in released and d > clock.t]
            held = frozenset().union(*live)
            granted = t.add(rid, {}, 32 * len(blocks), block_ids=blocks) > 0
            assert granted == (len(held | blocks) <= 8)
            if granted:
                model[rid] = (blocks, clock.t + 10)
        elif op == "release" and rid in model:
            t.release(rid)
            released.add(rid)
        elif op == "renew" and rid in model:
            blocks_, deadline = model[rid]
            if t.renew(rid, 15) is not None:
                model[rid] = (blocks_, max(deadline, clock.t + 15))
        elif op == "forget" and rid in model:
            t.forget(rid)
            del model[rid]
        elif op == "tick":
            clock.t += n
        elif op == "drain":
            t.drain()
        live = [b for r, (b, d) in model.items() if r not in released and d > clock.t]
        assert t.blocks_in_use() == len(frozenset().union(*live))
