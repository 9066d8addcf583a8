"""The scheduler's idle wait: long while the engine only holds blocks, over the moment a request arrives."""

import queue
import threading
import time
from typing import Any

from agentkv.server.engine._connector._scheduler import _engine_input_queue, _wait_for_input


class FakeEngineCore:
    """Stands in for vLLM's EngineCoreProc: the scheduler is called from a method of it."""

    def __init__(self) -> None:
        self.input_queue: queue.Queue[Any] = queue.Queue()

    def step(self) -> object:
        return _engine_input_queue()


def test_the_input_queue_is_found_on_the_call_stack_or_reported_missing() -> None:
    engine = FakeEngineCore()
    assert engine.step() is engine.input_queue
    assert _engine_input_queue() is False


def test_a_request_ends_the_wait_at_once_and_stays_queued() -> None:
    q: queue.Queue[Any] = queue.Queue()
    threading.Timer(0.05, q.put, args=("req",)).start()
    t0 = time.monotonic()
    _wait_for_input(q, 5.0)
    assert time.monotonic() - t0 < 2.0  # woke on the put, not at the 5 s timeout
    assert q.get_nowait() == "req"  # the engine, not the wait, takes the request


def test_without_input_the_wait_lasts_its_timeout_and_a_queued_request_skips_it() -> None:
    q: queue.Queue[Any] = queue.Queue()
    t0 = time.monotonic()
    _wait_for_input(q, 0.2)
    assert time.monotonic() - t0 >= 0.19
    q.put("already here")
    t0 = time.monotonic()
    _wait_for_input(q, 5.0)
    assert time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    _wait_for_input(False, 0.05)
    assert time.monotonic() - t0 >= 0.045
