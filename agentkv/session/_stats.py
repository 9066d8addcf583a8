"""Per-turn statistics, read from the router's response headers (docs/protocol.md section 1)."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict
from rich.console import Console
from rich.table import Table

from agentkv._constants import (
    H_LEASE_EXPIRES_IN,
    H_PATH,
    H_PREFILL_MS,
    H_PULLED_TOKENS,
    H_REUSE,
    H_REUSED_TOKENS,
    H_TIER,
)

__all__ = ["RouterHeaders", "TurnStats", "render_summary"]

# `local`: decode served the turn from KV it already held under the lease, `cached`: from what its prefix
# cache or host KV tier still held after the lease ended; both are reuse too.
_REUSED = frozenset({"hit", "local", "cached"})
UNKNOWN = "unknown"


class RouterHeaders(BaseModel):
    """The agentkv headers of one response; all absent against a plain OpenAI-compatible server."""

    model_config = ConfigDict(frozen=True)

    reuse: str | None = None
    reused_tokens: int | None = None
    # Of reused_tokens, what prefill read from decode (the rest: prefill's own prefix cache); None when the
    # prefill does not say (stock vLLM) or nothing was offered.
    pulled_tokens: int | None = None
    path: str | None = None
    prefill_ms: float | None = None
    lease_expires_in_s: float | None = None
    # On a `cached` turn, where decode found the KV: "hbm" (its KV cache) or "host" (restored from its tier).
    tier: str | None = None

    @classmethod
    def parse(cls, headers: Mapping[str, str]) -> RouterHeaders:
        # A malformed number from a proxy must not fail a turn that otherwise succeeded.
        return cls(
            reuse=headers.get(H_REUSE),
            reused_tokens=_int(headers.get(H_REUSED_TOKENS)),
            pulled_tokens=_int(headers.get(H_PULLED_TOKENS)),
            path=headers.get(H_PATH),
            prefill_ms=_float(headers.get(H_PREFILL_MS)),
            lease_expires_in_s=_float(headers.get(H_LEASE_EXPIRES_IN)),
            tier=headers.get(H_TIER),
        )

    @property
    def from_agentkv(self) -> bool:
        return self.reuse is not None or self.path is not None


def _float(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        return None


def _int(raw: str | None) -> int | None:
    value = _float(raw)
    return None if value is None else int(value)


class TurnStats(BaseModel):
    """What one turn cost and whether it reused the KV cache that decode kept."""

    model_config = ConfigDict(frozen=True)

    index: int
    request_id: str
    streamed: bool
    ttft_s: float | None  # None for non-streaming turns: the first token is not observable
    total_s: float
    prompt_tokens: int | None
    completion_tokens: int | None
    reused: bool
    reused_tokens: int | None
    pulled_tokens: int | None  # of reused_tokens, read from decode (None: the prefill does not say)
    reuse: str  # the x-agentkv-reuse header, "unknown" when the server sent none
    path: str | None
    tier: str | None  # a `cached` turn's: "hbm" or "host" (decode restored the KV from its host tier)
    prefill_ms: float | None
    since_previous_s: float | None  # gap since the previous turn ended (tool time, user think time)
    lease_expires_in_s: float | None
    lease_expired: bool

    @classmethod
    def build(
        cls,
        *,
        router: RouterHeaders,
        lease_expired_before: bool,
        **fields: object,
    ) -> TurnStats:
        reuse = router.reuse or UNKNOWN
        return cls.model_validate(
            {
                **fields,
                "reused": reuse in _REUSED,
                "reused_tokens": router.reused_tokens,
                "pulled_tokens": router.pulled_tokens,
                "reuse": reuse,
                "path": router.path,
                "tier": router.tier,
                "prefill_ms": router.prefill_ms,
                "lease_expires_in_s": router.lease_expires_in_s,
                "lease_expired": lease_expired_before or reuse == "expired",
            }
        )


def _fmt(value: float | int | None, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def render_summary(turns: Sequence[TurnStats], *, title: str = "", width: int = 120) -> str:
    table = Table(title=title or None)
    for name in (
        "turn",
        "reuse",
        "path",
        "reused tok",
        "prompt tok",
        "out tok",
        "ttft s",
        "total s",
        "gap s",
    ):
        table.add_column(name, justify="left" if name in ("reuse", "path") else "right")
    for t in turns:
        table.add_row(
            str(t.index),
            t.reuse + (" (lease expired)" if t.lease_expired and t.reuse != "expired" else ""),
            t.path or "-",
            _fmt(t.reused_tokens),
            _fmt(t.prompt_tokens),
            _fmt(t.completion_tokens),
            _fmt(t.ttft_s, ".3f"),
            _fmt(t.total_s, ".3f"),
            _fmt(t.since_previous_s, ".2f"),
        )
    buffer = io.StringIO()
    Console(file=buffer, width=width, force_terminal=False, color_system=None).print(table)
    return buffer.getvalue()
