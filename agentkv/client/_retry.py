"""Retry policy: retry only before the first response byte, never replay a started stream.

Retryable: connect errors (incl. connect timeouts), pool timeouts, and 429/502/503/504 answers, with
``Retry-After`` honoured up to a cap. Everything else is raised at once, mapped into the agentkv
exception tree. A read timeout is *not* retried: the server may already be working on the turn.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import openai
from tenacity import AsyncRetrying, RetryCallState, Retrying, retry_if_exception, stop_after_attempt, stop_any
from tenacity.stop import stop_base

from agentkv._exceptions import (
    APIStatusError,
    ConnectError,
    RateLimitError,
    TimeoutError_,
    TransportError,
)
from agentkv.client._compat import exception_classes

__all__ = ["Deadline", "RetryPolicy", "call_with_retry", "call_with_retry_async", "classify", "retry_after"]

T = TypeVar("T")
RETRYABLE_STATUS = frozenset({429, 502, 503, 504})


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how long to retry a request that never got a first byte."""

    max_attempts: int = 3
    backoff_s: float = 0.25
    max_backoff_s: float = 4.0
    # A hostile or confused server must not park a client for minutes.
    max_retry_after_s: float = 30.0


class Deadline:
    """A total budget for one turn; httpx's own timeouts are per read, not per response."""

    def __init__(self, total_s: float | None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._end = None if total_s is None else clock() + total_s

    def remaining(self) -> float | None:
        return None if self._end is None else max(0.0, self._end - self._clock())

    def check(self) -> None:
        if self._end is not None and self._clock() >= self._end:
            raise TimeoutError_("the total deadline for this turn passed")


class _Retryable(Exception):
    def __init__(self, error: TransportError, retry_after_s: float | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.retry_after_s = retry_after_s


class _Fatal(_Retryable):
    """Carries a mapped error that must not be retried."""


def retry_after(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """Seconds to wait from ``retry-after-ms`` / ``retry-after`` (seconds or an HTTP date)."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms is not None:
        try:
            return max(0.0, float(raw_ms) / 1000.0)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _error_body(body: Any) -> tuple[str | None, str | None]:
    if isinstance(body, Mapping):
        inner = body.get("error", body)
        if isinstance(inner, Mapping):
            message, kind = inner.get("message"), inner.get("type")
            return (str(message) if message else None, str(kind) if kind else None)
    return None, None


def status_error(status: int, body: Any, headers: Mapping[str, str], fallback: str) -> _Retryable:
    message, kind = _error_body(body)
    cls = RateLimitError if status == 429 else APIStatusError
    error = cls(message or fallback, status_code=status, error_type=kind, body=body)
    return _Retryable(error, retry_after(headers)) if status in RETRYABLE_STATUS else _Fatal(error)


def classify(exc: BaseException) -> _Retryable:
    """Map an openai / httpx exception to agentkv; ``_Fatal`` means do not retry."""
    if isinstance(exc, openai.APIStatusError):
        return status_error(exc.status_code, exc.body, exc.response.headers, exc.message)
    cause = exc.__cause__ if isinstance(exc, openai.APIConnectionError) else exc
    # ConnectTimeout is a TimeoutException too: test it before the timeout family.
    if isinstance(cause, exception_classes("ConnectError") + exception_classes("ConnectTimeout")):
        return _Retryable(_chain(ConnectError(f"could not connect: {cause}"), exc), None)
    if isinstance(cause, exception_classes("PoolTimeout")):
        return _Retryable(_chain(TimeoutError_("no free connection in the pool"), exc), None)
    if isinstance(exc, openai.APITimeoutError) or isinstance(cause, exception_classes("TimeoutException")):
        return _Fatal(_chain(TimeoutError_(f"timed out: {cause or exc}"), exc))
    if isinstance(exc, openai.APIError):
        message, _ = _error_body(exc.body)
        return _Fatal(_chain(TransportError(message or exc.message), exc))
    return _Fatal(_chain(TransportError(f"{type(exc).__name__}: {exc}"), exc))


def _catchable() -> tuple[type[BaseException], ...]:
    return (openai.OpenAIError, *exception_classes("HTTPError"))


def _chain(error: TransportError, cause: BaseException) -> TransportError:
    error.__cause__ = cause
    return error


def _wait(policy: RetryPolicy) -> Callable[[RetryCallState], float]:
    def wait(state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        hinted = exc.retry_after_s if isinstance(exc, _Retryable) else None
        if hinted is not None:
            return min(hinted, policy.max_retry_after_s)
        ceiling = min(policy.max_backoff_s, policy.backoff_s * 2 ** (state.attempt_number - 1))
        return ceiling * random.uniform(0.5, 1.0)  # jitter keeps a crowd of clients from syncing up

    return wait


class _StopAtDeadline(stop_base):
    def __init__(self, deadline: Deadline) -> None:
        self._deadline = deadline

    def __call__(self, retry_state: RetryCallState) -> bool:
        left = self._deadline.remaining()
        # tenacity>=8.3 computes the sleep before asking stop; a retry that cannot finish in time is waste.
        return left is not None and getattr(retry_state, "upcoming_sleep", 0.0) >= left


def _options(policy: RetryPolicy, deadline: Deadline) -> dict[str, Any]:
    return {
        "stop": stop_any(stop_after_attempt(policy.max_attempts), _StopAtDeadline(deadline)),
        "wait": _wait(policy),
        "retry": retry_if_exception(lambda e: isinstance(e, _Retryable) and not isinstance(e, _Fatal)),
        "reraise": True,
    }


def call_with_retry(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    deadline: Deadline,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    def attempt() -> T:
        deadline.check()
        try:
            return fn()
        except _catchable() as exc:
            raise classify(exc) from exc

    try:
        return Retrying(sleep=sleep, **_options(policy, deadline))(attempt)
    except _Retryable as exc:
        raise exc.error from exc.error.__cause__


async def call_with_retry_async(
    fn: Callable[[], Awaitable[T]],
    *,
    policy: RetryPolicy,
    deadline: Deadline,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> T:
    async def attempt() -> T:
        deadline.check()
        try:
            return await fn()
        except _catchable() as exc:
            raise classify(exc) from exc

    try:
        return await AsyncRetrying(sleep=sleep, **_options(policy, deadline))(attempt)
    except _Retryable as exc:
        raise exc.error from exc.error.__cause__
