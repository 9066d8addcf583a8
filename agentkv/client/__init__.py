"""Low-level HTTP to an agentkv router (or any OpenAI-compatible server)."""

from agentkv.client._retry import Deadline, RetryPolicy
from agentkv.client._scripted import ScriptedReply, ScriptedRouter, router_headers
from agentkv.client._transport import (
    AsyncControlClient,
    AsyncTransport,
    ControlClient,
    Reply,
    Timeouts,
    Transport,
    first_model,
    messages_as_is,
    new_request_id,
    turn_headers,
)

__all__ = [
    "AsyncControlClient",
    "AsyncTransport",
    "ControlClient",
    "Deadline",
    "Reply",
    "RetryPolicy",
    "ScriptedReply",
    "ScriptedRouter",
    "Timeouts",
    "Transport",
    "first_model",
    "messages_as_is",
    "new_request_id",
    "router_headers",
    "turn_headers",
]
