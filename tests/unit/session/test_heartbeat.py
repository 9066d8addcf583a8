import asyncio
import threading
import time

import pytest

from agentkv import ConnectError
from agentkv.session._heartbeat import HeartbeatScheduler, HeartbeatTask, HeartbeatThread

HELD = {"lease": {"state": "held", "expires_in_s": 30.0, "renewable": True}}


def scheduler(**options: object) -> HeartbeatScheduler:
    return HeartbeatScheduler(**{"idle_limit_s": 600.0, "rng": lambda: 0.0, **options})  # type: ignore[arg-type]


def test_nothing_is_due_before_the_first_turn() -> None:
    assert scheduler().due_in(0.0) is None


def test_first_beat_at_a_third_of_the_reported_lease() -> None:
    s = scheduler()
    s.turn_finished(100.0, lease_expires_in_s=30.0, from_agentkv=True)
    assert s.due_in(100.0) == pytest.approx(10.0)
    assert s.due_in(110.0) == 0.0


def test_jitter_only_ever_brings_the_beat_earlier() -> None:
    s = scheduler(rng=lambda: 1.0, jitter=0.1)
    s.turn_finished(0.0, lease_expires_in_s=30.0, from_agentkv=True)
    assert s.due_in(0.0) == pytest.approx(9.0)


def test_stream_turn_without_lease_header_assumes_default_lease() -> None:
    s = scheduler()
    s.turn_finished(0.0, lease_expires_in_s=None, from_agentkv=True)
    assert s.due_in(0.0) == pytest.approx(10.0)  # DEFAULT_LEASE_S / 3


def test_successful_beat_renews_before_expiry() -> None:
    s = scheduler()
    s.turn_finished(0.0, lease_expires_in_s=30.0, from_agentkv=True)
    s.beat_succeeded(10.0, {"lease": {"state": "held", "expires_in_s": 60.0, "renewable": True}})
    assert s.due_in(10.0) == pytest.approx(20.0)


def test_no_beats_during_a_turn() -> None:
    s = scheduler()
    s.turn_finished(0.0, lease_expires_in_s=30.0, from_agentkv=True)
    s.turn_started()
    assert s.due_in(50.0) is None
    s.turn_failed()
    assert s.due_in(50.0) == 0.0


def test_close_stops_beats() -> None:
    s = scheduler()
    s.turn_finished(0.0, lease_expires_in_s=30.0, from_agentkv=True)
    s.close()
    assert s.due_in(10.0) is None


def test_idle_limit_stops_beats_until_the_next_turn() -> None:
    s = scheduler(idle_limit_s=60.0)
    s.turn_finished(0.0, lease_expires_in_s=30.0, from_agentkv=True)
    now, beats = 0.0, []
    while (delay := s.due_in(now)) is not None:
        now += delay
        if s.due_in(now) == 0.0:
            beats.append(now)
            s.beat_succeeded(now, HELD)
    assert beats and beats[-1] < 60.0 <= now  # beats until the limit, none after it
    assert s.due_in(now + 1000.0) is None
    s.turn_finished(2000.0, lease_expires_in_s=30.0, from_agentkv=True)
    assert s.due_in(2000.0) is not None


def test_expired_lease_is_reported_once_and_stops_beats() -> None:
    s = scheduler()
    s.turn_finished(0.0, lease_expires_in_s=30.0, from_agentkv=True)
    s.beat_succeeded(10.0, {"lease": {"state": "expired", "expires_in_s": 0.0, "renewable": False}})
    assert s.due_in(10.0) is None
    assert s.take_expired() is True
    assert s.take_expired() is False


def test_fixed_ttl_lease_is_not_beaten() -> None:
    s = scheduler()
    s.turn_finished(0.0, lease_expires_in_s=480.0, from_agentkv=True)
    s.beat_succeeded(160.0, {"lease": {"state": "fixed_ttl", "expires_in_s": 320.0, "renewable": False}})
    assert s.due_in(160.0) is None


def test_404_from_a_plain_server_disables_heartbeats() -> None:
    s = scheduler()
    s.turn_finished(0.0, lease_expires_in_s=None, from_agentkv=False)
    s.beat_succeeded(10.0, None)
    assert not s.enabled
    s.turn_finished(20.0, lease_expires_in_s=None, from_agentkv=False)
    assert s.due_in(40.0) is None


def test_404_from_agentkv_pauses_until_the_next_turn() -> None:
    s = scheduler()
    s.turn_finished(0.0, lease_expires_in_s=30.0, from_agentkv=True)
    s.beat_succeeded(10.0, None)
    assert s.enabled and s.due_in(10.0) is None
    s.turn_finished(20.0, lease_expires_in_s=30.0, from_agentkv=True)
    assert s.due_in(20.0) == pytest.approx(10.0)


def test_failed_beat_is_retried_soon_within_the_lease() -> None:
    s = scheduler()
    s.turn_finished(0.0, lease_expires_in_s=30.0, from_agentkv=True)
    s.beat_failed(10.0)
    assert 0.0 < (s.due_in(10.0) or 0.0) <= 20.0 / 3


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_thread_driver_beats_only_when_due() -> None:
    clock, beats = FakeClock(), []
    s = scheduler()
    driver = HeartbeatThread(scheduler=s, beat=lambda tool_call: beats.append(clock.now) or HELD, clock=clock)
    s.turn_finished(0.0, lease_expires_in_s=30.0, from_agentkv=True)
    assert driver.run_once() == pytest.approx(10.0) and beats == []
    clock.now = 10.0
    assert driver.run_once() == pytest.approx(10.0)
    assert beats == [10.0]


def test_thread_driver_survives_a_failing_beat() -> None:
    clock = FakeClock()
    s = scheduler()

    def beat(tool_call: bool) -> None:
        raise ConnectError("router down")

    driver = HeartbeatThread(scheduler=s, beat=beat, clock=clock)
    s.turn_finished(0.0, lease_expires_in_s=30.0, from_agentkv=True)
    clock.now = 10.0
    assert driver.run_once() is not None  # rescheduled, not crashed


def test_thread_stops_on_stop() -> None:
    beaten = threading.Event()
    s = scheduler()
    driver = HeartbeatThread(scheduler=s, beat=lambda tool_call: beaten.set() or HELD)
    s.turn_finished(time.monotonic(), lease_expires_in_s=0.0, from_agentkv=True)  # due at once
    driver.notify()
    assert beaten.wait(5.0)
    driver.stop()
    assert driver._thread is not None and not driver._thread.is_alive()


def test_disabled_scheduler_starts_no_thread() -> None:
    driver = HeartbeatThread(scheduler=scheduler(enabled=False), beat=lambda tool_call: HELD)
    driver.notify()
    assert driver._thread is None


async def test_task_driver_beats_and_stops() -> None:
    beaten = asyncio.Event()
    s = scheduler()

    async def beat(tool_call: bool) -> dict:
        beaten.set()
        return HELD

    driver = HeartbeatTask(scheduler=s, beat=beat)
    s.turn_finished(time.monotonic(), lease_expires_in_s=0.0, from_agentkv=True)
    driver.notify()
    await asyncio.wait_for(beaten.wait(), 5.0)
    await driver.stop()
    assert driver._task is not None and driver._task.done()
    assert s.beats >= 1


def test_a_final_turn_leaves_nothing_to_beat_for_until_the_next_turn() -> None:
    s = scheduler()
    s.turn_finished(0.0, lease_expires_in_s=30.0, from_agentkv=True)
    s.turn_started()
    s.turn_finished(5.0, lease_expires_in_s=None, from_agentkv=True, final=True)
    assert s.due_in(100.0) is None
    s.turn_started()  # the agent went on after all: its next turn plans beats again
    s.turn_finished(200.0, lease_expires_in_s=30.0, from_agentkv=True)
    assert s.due_in(200.0) == pytest.approx(10.0)


def test_a_tool_call_makes_one_beat_due_now_that_says_so() -> None:
    clock, sent = FakeClock(), []
    s = scheduler()
    driver = HeartbeatThread(scheduler=s, beat=lambda tool_call: sent.append(tool_call) or HELD, clock=clock)
    s.turn_finished(0.0, lease_expires_in_s=30.0, from_agentkv=True)
    clock.now = 1.0
    s.tool_call_started(clock.now)
    assert s.due_in(clock.now) == 0.0  # not at the planned 10 s
    driver.run_once()
    clock.now = 11.0
    driver.run_once()
    assert sent == [True, False]  # the flag rides on one beat only


def test_a_tool_call_with_no_lease_to_keep_sends_nothing() -> None:
    s = scheduler()
    s.tool_call_started(0.0)  # no turn yet
    assert s.due_in(0.0) is None and not s.take_tool_call()
    s.turn_finished(0.0, lease_expires_in_s=30.0, from_agentkv=True)
    s.tool_call_started(1.0)
    s.turn_started()  # a turn began before the beat went out: the turn keeps the lease, no tool beat
    assert not s.take_tool_call()
