"""agentkv: KV-cache reuse for multi-turn, tool-calling agents on P/D-disaggregated vLLM.

The SDK names are imported lazily: the router and the decode-side connector import
``agentkv._constants`` inside vLLM processes and should not pay for openai / rich on the way.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from agentkv._exceptions import (
    AgentKVError,
    APIStatusError,
    ConfigError,
    ConnectError,
    EngineError,
    EngineNotInstalledError,
    EngineStartError,
    EngineVersionError,
    ModelNotFoundError,
    PortInUseError,
    RateLimitError,
    SessionClosedError,
    StreamInterruptedError,
    TimeoutError_,
    ToolError,
    TransportError,
    WarmUpError,
)

if TYPE_CHECKING:
    from agentkv.client import RetryPolicy, Timeouts
    from agentkv.session import (
        AsyncSession,
        Delta,
        RunResult,
        Session,
        Tool,
        ToolCallDelta,
        TurnStats,
        new_conversation_id,
    )

__version__ = "0.1.0"

_LAZY = {
    "AsyncSession": "agentkv.session",
    "Delta": "agentkv.session",
    "RetryPolicy": "agentkv.client",
    "RunResult": "agentkv.session",
    "Session": "agentkv.session",
    "Timeouts": "agentkv.client",
    "Tool": "agentkv.session",
    "ToolCallDelta": "agentkv.session",
    "TurnStats": "agentkv.session",
    "new_conversation_id": "agentkv.session",
}

__all__ = [
    "APIStatusError",
    "AgentKVError",
    "AsyncSession",
    "ConfigError",
    "ConnectError",
    "Delta",
    "EngineError",
    "EngineNotInstalledError",
    "EngineStartError",
    "EngineVersionError",
    "ModelNotFoundError",
    "PortInUseError",
    "RateLimitError",
    "RetryPolicy",
    "RunResult",
    "Session",
    "SessionClosedError",
    "StreamInterruptedError",
    "TimeoutError_",
    "Timeouts",
    "Tool",
    "ToolCallDelta",
    "ToolError",
    "TransportError",
    "TurnStats",
    "WarmUpError",
    "__version__",
    "new_conversation_id",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agentkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
