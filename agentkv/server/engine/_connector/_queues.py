"""vLLM's shared-memory message queues between the engine core and its worker, made safe to leave idle.

Each process reads its queue through a ``SpinCondition``: it spins ``sched_yield`` for ``busy_loop_s``
(1 s) after every message, then sleeps in a zmq poll until the writer's notification. Two things go wrong
on a small CPU host:

* while an engine only holds retained blocks it steps every few ms, so its worker spins all the time and
  the cores that other engines need for their NIXL handshakes are gone (handshakes took minutes);
* a reader sleeping in the poll waits for the writer's notification up to vLLM's 60 s warning interval, so
  a notification that never arrives stalls the request that was sent for that long.

We change two attributes of the reader objects that exist when our connector is built (its own RPCs arrive
through them): a shorter spin window, and a bound on each poll, after which the reader looks at the buffer
again. A lost notification then costs at most ``max_wait_ms``; an idle reader wakes that often (~µs each).
(The stall once seen with 4 engines on 2 cores came from two engines pinned to one core, not from the queue;
see docs/architecture.md, "CPU placement".)
"""

from __future__ import annotations

import gc
import logging
from typing import Any

__all__ = ["tune_queue_readers"]

logger = logging.getLogger("agentkv.connector")


def tune_queue_readers(*, busy_loop_s: float | None, max_wait_ms: int | None) -> int:
    """Apply to every queue reader in this process; returns how many were changed (0 on other vLLMs)."""
    if busy_loop_s is None and not max_wait_ms:
        return 0
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return 0
    found = 0
    for obj in _instances(SpinCondition):
        if not getattr(obj, "is_reader", False):
            continue
        if busy_loop_s is not None:
            obj.busy_loop_s = busy_loop_s
        if max_wait_ms and not getattr(obj.wait, "agentkv_bounded", False):
            obj.wait = _bounded(obj.wait, max_wait_ms)  # type: ignore[method-assign]
        found += 1
    logger.info(
        "agentkv queue readers: spin window %s, longest wait %s ms (%d reader(s))",
        "vLLM's" if busy_loop_s is None else f"{busy_loop_s:.3f}s",
        max_wait_ms or "unbounded",
        found,
    )
    return found


def _instances(cls: type) -> list[Any]:
    """The live instances of ``cls`` and its subclasses. Each instance of a Python class refers to its class
    for the collector, so asking for the class's referrers finds them in C: a twentieth of the time of a
    Python loop over ``gc.get_objects()`` (~700k objects once vLLM is imported; ~1 s per engine process)."""
    classes: list[type] = [cls]
    found: list[Any] = []
    while classes:
        klass = classes.pop()
        classes.extend(klass.__subclasses__())
        found.extend(obj for obj in gc.get_referrers(klass) if type(obj) is klass)
    return found


def _bounded(wait: Any, max_wait_ms: int) -> Any:
    def bounded_wait(timeout_ms: int | None = None) -> None:
        # The caller (MessageQueue.acquire_read) re-checks the buffer and its own deadline after each wait.
        wait(timeout_ms=max_wait_ms if timeout_ms is None else min(timeout_ms, max_wait_ms))

    bounded_wait.agentkv_bounded = True  # type: ignore[attr-defined]
    return bounded_wait
