"""One exception tree for the whole project.

AgentKVError
├── ConfigError                 bad configuration (flags, env, file)
├── EngineError                 starting / stopping vLLM servers
│   ├── EngineNotInstalledError vllm (or nixl) missing; names the extra to install
│   ├── PortInUseError
│   ├── EngineStartError        a server died or did not become healthy; carries the log tail
│   ├── ModelNotFoundError
│   ├── EngineVersionError      an unsupported vLLM, or prefill and decode on different ones
│   └── WarmUpError             a warm-up hop through a prefill/decode pair failed
├── TransportError              talking HTTP to the router / an OpenAI-compatible server
│   ├── ConnectError            nothing answered (retried before the first byte)
│   ├── TimeoutError_           a deadline passed
│   ├── APIStatusError          a non-2xx answer; carries status, OpenAI error type and message
│   │   └── RateLimitError      429
│   └── StreamInterruptedError  a stream broke after it started; carries the partial output
├── SessionClosedError          a closed Session was used again
└── ToolError                   a tool could not be described or run (not raised by tool bodies)
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "APIStatusError",
    "AgentKVError",
    "ConfigError",
    "ConnectError",
    "EngineError",
    "EngineNotInstalledError",
    "EngineStartError",
    "EngineVersionError",
    "ModelNotFoundError",
    "PortInUseError",
    "RateLimitError",
    "SessionClosedError",
    "StreamInterruptedError",
    "TimeoutError_",
    "ToolError",
    "TransportError",
    "WarmUpError",
]


class AgentKVError(Exception):
    """Root of every error agentkv raises on purpose."""


class ConfigError(AgentKVError):
    pass


class EngineError(AgentKVError):
    pass


class EngineNotInstalledError(EngineError):
    pass


class PortInUseError(EngineError):
    pass


class EngineStartError(EngineError):
    def __init__(self, message: str, *, log_tail: str = "") -> None:
        super().__init__(message + (f"\n--- log tail ---\n{log_tail}" if log_tail else ""))
        self.log_tail = log_tail


class ModelNotFoundError(EngineError):
    pass


class EngineVersionError(EngineError):
    """An engine runs a vLLM release outside the supported range, or prefill and decode run different
    releases (vLLM >= 0.34 refuses such a NIXL handshake; older ones may read KV of another layout), or a
    part of agentkv's vLLM plugin finds vLLM's code elsewhere than where it wraps it."""

    @classmethod
    def plugin_part(cls, env: str, what: str, exc: Exception) -> EngineVersionError:
        """The part switched on by `env` cannot wrap `what` in this vLLM (`exc` says why)."""
        return cls(
            f"{env}: this vLLM's {what} is not where agentkv's plugin wraps it ({exc}); "
            f"set {env}=off to leave it as shipped"
        )


class WarmUpError(EngineError):
    """A warm-up hop through a prefill/decode pair failed: the pair cannot serve P/D turns."""


class TransportError(AgentKVError):
    pass


class ConnectError(TransportError):
    pass


class TimeoutError_(TransportError):  # trailing underscore: the builtin keeps its name
    pass


class APIStatusError(TransportError):
    def __init__(
        self, message: str, *, status_code: int, error_type: str | None = None, body: Any = None
    ) -> None:
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code
        self.error_type = error_type
        self.body = body


class RateLimitError(APIStatusError):
    pass


class StreamInterruptedError(TransportError):
    def __init__(self, message: str, *, partial: Any = None) -> None:
        super().__init__(message)
        self.partial = partial


class SessionClosedError(AgentKVError):
    pass


class ToolError(AgentKVError):
    pass
