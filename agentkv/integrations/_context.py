"""For frameworks that forward nothing: a context variable plus an httpx request hook.

``with use_conversation(session): ...`` marks every request that an httpx client made with
``event_hooks=httpx_event_hooks()`` sends inside the block. Context variables follow asyncio
tasks, so concurrent async turns of different conversations do not mix.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from agentkv._constants import DEFAULT_SESSION_HEADER
from agentkv.client import new_request_id
from agentkv.client._transport import REQUEST_ID_HEADER

__all__ = ["current_conversation", "httpx_event_hooks", "use_conversation"]

_current: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "agentkv_conversation", default=None
)


@contextlib.contextmanager
def use_conversation(session_or_id: Any, *, session_header: str | None = None) -> Iterator[str]:
    """Tag requests in this context with a conversation (a ``Session`` or an id)."""
    conversation_id = getattr(session_or_id, "conversation_id", session_or_id)
    header = session_header or getattr(session_or_id, "session_header", None) or DEFAULT_SESSION_HEADER
    token = _current.set((str(conversation_id), header))
    try:
        yield str(conversation_id)
    finally:
        _current.reset(token)


def current_conversation() -> str | None:
    value = _current.get()
    return None if value is None else value[0]


def _tag(request: Any) -> None:
    value = _current.get()
    if value is None:
        return
    conversation_id, header = value
    request.headers[header] = conversation_id
    if REQUEST_ID_HEADER not in request.headers:
        request.headers[REQUEST_ID_HEADER] = new_request_id()


async def _atag(request: Any) -> None:
    _tag(request)


def httpx_event_hooks(*, asynchronous: bool = False) -> dict[str, list[Callable[[Any], Any]]]:
    """``event_hooks=`` for ``httpx.Client`` (or ``AsyncClient`` with ``asynchronous=True``)."""
    hook: Callable[[Any], Awaitable[None] | None] = _atag if asynchronous else _tag
    return {"request": [hook]}
