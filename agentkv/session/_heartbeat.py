"""Keeping decode's lease alive between turns, without pinning memory for forgotten sessions.

``HeartbeatScheduler`` is the I/O-free core: it decides *when* to beat from the lease expiry the
router reported and from the time of the last turn. ``HeartbeatThread`` (sync) and ``HeartbeatTask``
(asyncio) only wait and send. Heartbeats run between turns only: a turn in flight keeps the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from agentkv._constants import DEFAULT_LEASE_S

__all__ = ["HeartbeatScheduler", "HeartbeatTask", "HeartbeatThread"]

log = logging.getLogger("agentkv.session")

Body = dict[str, Any] | None
# Sends one heartbeat; its argument says whether a tool call just started (`tool_call_started`).
Beat = Callable[[bool], Body]
AsyncBeat = Callable[[bool], Awaitable[Body]]
# After a failed heartbeat, try again soon, but never hammer a struggling router.
_RETRY_AFTER_ERROR_S = 2.0


class HeartbeatScheduler:
    """When is the next heartbeat due? Thread-safe, no I/O, injectable clock and randomness."""

    def __init__(
        self,
        *,
        idle_limit_s: float,
        enabled: bool = True,
        jitter: float = 0.1,
        fraction: float = 1 / 3,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.idle_limit_s = idle_limit_s
        self.enabled = enabled
        self._jitter = jitter
        self._fraction = fraction
        self._rng = rng
        self._lock = threading.Lock()
        self._next_at: float | None = None  # None: nothing to do until the next turn
        self._expires_at: float | None = None
        self._last_turn_end: float | None = None
        self._in_turn = False
        self._closed = False
        self._agentkv_seen = False
        self._expired = False
        self._tool_call = False  # the next beat says a tool call started
        self.beats = 0

    # -- events -------------------------------------------------------------------------------------
    def turn_started(self) -> None:
        with self._lock:
            self._in_turn = True
            self._tool_call = False

    def turn_finished(
        self,
        now: float,
        *,
        lease_expires_in_s: float | None,
        from_agentkv: bool,
        final: bool = False,
        tool_calls: bool = False,
    ) -> None:
        """``tool_calls``: the answer called tools, which the caller runs next (`tool_call_started`)."""
        with self._lock:
            self._in_turn = False
            self._last_turn_end = now
            self._agentkv_seen = self._agentkv_seen or from_agentkv
            if final:
                # The router released the conversation after a final turn: nothing is left to keep alive
                # (a later turn, if any, plans again).
                self._next_at = None
                return
            # Streams carry no lease header; assume the router's default lease until a beat says more.
            lease = DEFAULT_LEASE_S if lease_expires_in_s is None else lease_expires_in_s
            self._plan(now, lease)
            if tool_calls:
                self._beat_for_tools(now)

    def tool_call_started(self, now: float) -> None:
        """The caller is about to run tools: beat now, saying so, so that the router may move the
        conversation's KV out of decode's HBM for the time they run (to its host tier, where it has one).
        Nothing while no lease is being kept alive (no turn yet, a final turn, a stock server)."""
        with self._lock:
            if not self._in_turn:
                self._beat_for_tools(now)

    def _beat_for_tools(self, now: float) -> None:
        # Under the lock.
        if self.enabled and not self._closed and self._next_at is not None:
            self._tool_call = True
            self._next_at = now

    def take_tool_call(self) -> bool:
        """True once per `tool_call_started`: whether the beat about to be sent carries it."""
        with self._lock:
            tool_call, self._tool_call = self._tool_call, False
            return tool_call

    def turn_failed(self) -> None:
        """The turn raised: the lease is as it was before, so keep the old plan."""
        with self._lock:
            self._in_turn = False

    def beat_succeeded(self, now: float, body: Body) -> None:
        with self._lock:
            self.beats += 1
            if body is None:
                # 404: unknown conversation. Against a server that never spoke agentkv it means
                # "no such endpoint": stop for good. Otherwise wait for the next turn to re-register.
                if not self._agentkv_seen:
                    self.enabled = False
                self._next_at = None
                return
            lease = body.get("lease") or {}
            state = lease.get("state")
            expires_in = lease.get("expires_in_s")
            if state == "expired":
                self._expired = True
                self._next_at = None
            elif state == "held" and lease.get("renewable", True) and isinstance(expires_in, int | float):
                self._plan(now, float(expires_in))
            elif state == "none":
                self._plan(now, DEFAULT_LEASE_S)  # nothing retained yet; look again later
            else:
                # fixed_ttl (stock vLLM) or not renewable: beating cannot help.
                self._expires_at = now + expires_in if isinstance(expires_in, int | float) else None
                self._next_at = None

    def beat_failed(self, now: float) -> None:
        with self._lock:
            left = None if self._expires_at is None else self._expires_at - now
            wait = _RETRY_AFTER_ERROR_S if left is None else max(0.1, min(_RETRY_AFTER_ERROR_S, left / 3))
            self._next_at = now + wait

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._next_at = None

    def take_expired(self) -> bool:
        """True once if a heartbeat saw the lease expire since the last call."""
        with self._lock:
            expired, self._expired = self._expired, False
            return expired

    # -- queries ------------------------------------------------------------------------------------
    def due_in(self, now: float) -> float | None:
        """Seconds until the next beat (0: now); None while there is nothing to do."""
        with self._lock:
            if not self.enabled or self._closed or self._in_turn or self._next_at is None:
                return None
            if self._last_turn_end is not None and now - self._last_turn_end >= self.idle_limit_s:
                # A forgotten session must not pin decode memory forever.
                self._next_at = None
                return None
            return max(0.0, self._next_at - now)

    def _plan(self, now: float, lease_s: float) -> None:
        self._expires_at = now + lease_s
        spread = 1.0 - self._jitter * self._rng()
        self._next_at = now + max(0.0, lease_s * self._fraction * spread)


def _record(scheduler: HeartbeatScheduler, clock: Callable[[], float], body: Body | BaseException) -> None:
    if isinstance(body, BaseException):
        log.debug("heartbeat failed: %s", body)
        scheduler.beat_failed(clock())
    else:
        scheduler.beat_succeeded(clock(), body)


class HeartbeatThread:
    """Sends heartbeats from a daemon thread."""

    def __init__(
        self,
        *,
        scheduler: HeartbeatScheduler,
        beat: Beat,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self._beat = beat
        self._clock = clock
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def run_once(self) -> float | None:
        """Beat if due; return the wait until the next check (None: wait for a notify)."""
        if self.scheduler.due_in(self._clock()) != 0.0:
            return self.scheduler.due_in(self._clock())
        try:
            result: Body | BaseException = self._beat(self.scheduler.take_tool_call())
        except Exception as exc:  # a heartbeat must never take the session down; retry soon instead
            result = exc
        _record(self.scheduler, self._clock, result)
        return self.scheduler.due_in(self._clock())

    def _run(self) -> None:
        while not self._stopped:
            delay = self.run_once()
            self._wake.wait(delay)
            self._wake.clear()

    def notify(self) -> None:
        """A turn started or ended: re-read the schedule; starts the thread on first use."""
        if not self.scheduler.enabled:
            return
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._run, name="agentkv-heartbeat", daemon=True)
            self._thread.start()
        self._wake.set()

    def tool_call_started(self) -> None:
        """Tools are about to run: one beat now that says so (`HeartbeatScheduler.tool_call_started`)."""
        self.scheduler.tool_call_started(self._clock())
        self.notify()

    def stop(self) -> None:
        self._stopped = True
        self.scheduler.close()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


class HeartbeatTask:
    """Sends heartbeats from an asyncio task on the session's event loop."""

    def __init__(
        self,
        *,
        scheduler: HeartbeatScheduler,
        beat: AsyncBeat,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self._beat = beat
        self._clock = clock
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    async def run_once(self) -> float | None:
        if self.scheduler.due_in(self._clock()) != 0.0:
            return self.scheduler.due_in(self._clock())
        try:
            result: Body | BaseException = await self._beat(self.scheduler.take_tool_call())
        except Exception as exc:  # a heartbeat must never take the session down; retry soon instead
            result = exc
        _record(self.scheduler, self._clock, result)
        return self.scheduler.due_in(self._clock())

    async def _run(self, wake: asyncio.Event) -> None:
        # The flag, not only cancel(): on 3.11 wait_for can swallow a cancel that races its wake-up.
        while not self._stopped:
            delay = await self.run_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), delay)
            wake.clear()

    def notify(self) -> None:
        """Must be called from the event loop (the session's turns run there)."""
        if not self.scheduler.enabled or self._stopped:
            return
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(self._wake))
        assert self._wake is not None
        self._wake.set()

    def tool_call_started(self) -> None:
        """Tools are about to run: one beat now that says so. Must be called from the event loop."""
        self.scheduler.tool_call_started(self._clock())
        self.notify()

    def cancel(self) -> None:
        """Synchronous stop, safe from a finalizer: no await needed."""
        self._stopped = True
        self.scheduler.close()
        with contextlib.suppress(RuntimeError):  # the loop may already be closed at exit
            if self._wake is not None:
                self._wake.set()
            if self._task is not None and not self._task.done():
                self._task.cancel()

    async def stop(self) -> None:
        self.cancel()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
