import pytest

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
    assert t.add("a", {}, 96, num_blocks=6) == pytest.approx(1010.0)
    assert t.add("b", {}, 96, num_blocks=6) == 0.0  # 12 > 10: declined, nothing recorded
    assert t.lookup("b") is None and t.lookup("a") is not None
    assert t.blocks_in_use() == 6
    assert t.add("c", {}, 64, num_blocks=4) > 0  # exactly full is allowed
    assert t.blocks_in_use() == 10


def test_released_and_expired_leases_free_their_room_at_once(clock: Clock) -> None:
    t = LeaseTable(lease_s=10, max_lease_s=60, clock=clock, capacity_blocks=10)
    t.add("a", {}, 96, num_blocks=6)
    t.release("a")  # queued for the scheduler's next drain, but already no longer holding room
    assert t.add("b", {}, 96, num_blocks=6) > 0
    clock.t += 11  # b ran out
    assert t.blocks_in_use() == 0
    assert t.add("c", {}, 160, num_blocks=10) > 0


def test_a_renewed_lease_keeps_its_room(clock: Clock) -> None:
    t = LeaseTable(lease_s=10, max_lease_s=60, clock=clock, capacity_blocks=10)
    t.add("a", {}, 96, num_blocks=6)
    clock.t += 8
    t.renew("a", 30)  # pending until the scheduler drains, and it already counts
    clock.t += 5  # past a's original deadline, inside the renewal
    assert t.add("b", {}, 96, num_blocks=6) == 0.0
    assert t.blocks_in_use() == 6


def test_without_capacity_nothing_is_declined(clock: Clock) -> None:
    t = table(clock)
    for i in range(100):
        assert t.add(f"r{i}", {}, 10_000, num_blocks=1000) > 0
    assert t.blocks_in_use() == 100_000
