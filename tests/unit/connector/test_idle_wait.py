"""The scheduler's idle wait: long while the engine only holds blocks, over the moment a request arrives."""

import queue
import threading
import time
from typing import Any

from agentkv.server.engine._connector._scheduler import _engine_input_queue, _wait_for_input

# Far longer than any test here may take: a wait that ends before it was ended by a request, not by its
# timeout, whatever the machine's speed.
LONG_S = 600.0


class FakeEngineCore:
    """Stands in for vLLM's EngineCoreProc: the scheduler is called from a method of it."""

    def __init__(self) -> None:
        self.input_queue: queue.Queue[Any] = queue.Queue()

    def step(self) -> object:
        return _engine_input_queue()


class SeenCondition(threading.Condition):
    """The queue's `not_empty` condition, telling when a thread waits on it."""

    def __init__(self, lock: Any, *, may_wait: bool = True) -> None:
        super().__init__(lock)
        self.waiting = threading.Event()
        self._may_wait = may_wait

    def wait(self, timeout: float | None = None) -> bool:
        assert self._may_wait, "waited although a request was queued"
        self.waiting.set()  # the lock is still held: a put can only come once the wait has begun
        return super().wait(timeout)


def watched_queue(*, may_wait: bool = True) -> "queue.Queue[Any]":
    q: queue.Queue[Any] = queue.Queue()
    q.not_empty = SeenCondition(q.mutex, may_wait=may_wait)
    return q


def test_the_input_queue_is_found_on_the_call_stack_or_reported_missing() -> None:
    engine = FakeEngineCore()
    assert engine.step() is engine.input_queue
    assert _engine_input_queue() is False


def test_a_request_ends_the_wait_at_once_and_stays_queued() -> None:
    q = watched_queue()
    waiter = threading.Thread(target=_wait_for_input, args=(q, LONG_S), daemon=True)
    waiter.start()
    assert q.not_empty.waiting.wait(60)  # type: ignore[attr-defined]
    q.put("req")
    waiter.join(60)  # an upper bound only: the wait's own timeout is ten times longer
    assert not waiter.is_alive(), "the wait did not end on the request"
    assert q.get_nowait() == "req"  # the engine, not the wait, takes the request


def test_without_input_the_wait_lasts_its_timeout_and_a_queued_request_skips_it() -> None:
    q = watched_queue()
    t0 = time.monotonic()
    _wait_for_input(q, 0.2)
    assert time.monotonic() - t0 >= 0.19
    skip = watched_queue(may_wait=False)
    skip.put("already here")
    _wait_for_input(skip, LONG_S)  # returns without waiting (a wait fails the test at once)
    assert skip.get_nowait() == "already here"
    t0 = time.monotonic()
    _wait_for_input(False, 0.05)
    assert time.monotonic() - t0 >= 0.045
