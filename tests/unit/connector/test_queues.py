"""Queue-reader tuning: the spin window is set and every wait is bounded, on vLLM's own reader class."""

from typing import Any

import pytest

from agentkv.server.engine._connector._queues import tune_queue_readers

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")


def _reader(is_reader: bool) -> Any:
    obj = object.__new__(shm_broadcast.SpinCondition)  # no sockets: only the attributes we touch
    obj.is_reader = is_reader
    obj.busy_loop_s = 1.0
    obj.seen = []
    obj.wait = lambda timeout_ms=None: obj.seen.append(timeout_ms)
    return obj


def test_readers_get_the_spin_window_and_bounded_waits_writers_are_left_alone() -> None:
    reader, writer = _reader(True), _reader(False)
    original_writer_wait = writer.wait
    assert tune_queue_readers(busy_loop_s=0.1, max_wait_ms=50) >= 1
    assert reader.busy_loop_s == 0.1 and writer.busy_loop_s == 1.0
    reader.wait(timeout_ms=None)  # vLLM's "wait for the notification however long it takes"
    reader.wait(timeout_ms=60_000)
    reader.wait(timeout_ms=10)
    assert reader.seen == [50, 50, 10]
    assert writer.wait is original_writer_wait
    # Tuning again (a second connector in the process) does not stack wrappers.
    tune_queue_readers(busy_loop_s=None, max_wait_ms=50)
    reader.wait(timeout_ms=None)
    assert reader.seen[-1] == 50 and reader.busy_loop_s == 0.1


def test_nothing_to_do_changes_nothing() -> None:
    reader = _reader(True)
    assert tune_queue_readers(busy_loop_s=None, max_wait_ms=None) == 0
    assert reader.busy_loop_s == 1.0


def test_readers_of_a_subclass_are_found_too() -> None:
    class Sub(shm_broadcast.SpinCondition):  # type: ignore[name-defined,misc]
        pass

    reader = object.__new__(Sub)
    reader.is_reader, reader.busy_loop_s = True, 1.0
    reader.wait = lambda timeout_ms=None: None
    tune_queue_readers(busy_loop_s=0.2, max_wait_ms=None)
    assert reader.busy_loop_s == 0.2
