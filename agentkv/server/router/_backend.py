"""Backends: the immutable `Backend` value object and the mutable state the router tracks for each."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from typing import Any, Literal

__all__ = ["Backend", "BackendPool", "BackendState", "Registration", "block_size_of"]

Role = Literal["prefill", "decode"]
# vLLM exports its cache config as the labels of one gauge: vllm:cache_config_info{block_size="16",...} 1.0
_BLOCK_SIZE = re.compile(r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', re.MULTILINE)


def block_size_of(metrics_text: str) -> int | None:
    """The KV block size a vLLM server reports on `/metrics`, or None."""
    m = _BLOCK_SIZE.search(metrics_text)
    return int(m.group(1)) if m and int(m.group(1)) > 0 else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backend:
    """One vLLM server. `control_url` is the decode retention service (decode only)."""

    name: str
    role: Role
    url: str
    control_url: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Registration:
    """Which incarnation of a decode engine holds blocks; blocks from another one are gone."""

    engine_id: str | None
    generation: Any = None

    @classmethod
    def of_params(cls, params: dict[str, Any]) -> Registration:
        return cls(
            engine_id=params.get("remote_engine_id"), generation=params.get("remote_registration_generation")
        )

    def matches(self, other: Registration) -> bool:
        """Whether blocks ``other`` (a record's params) names are still there, ``self`` being the newest
        registration seen for the decode."""
        if self.engine_id is not None and other.engine_id is not None and self.engine_id != other.engine_id:
            return False
        # Generations are only comparable when both sides report one (vLLM < 0.33 reports none).
        if self.generation is None or other.generation is None:
            return True
        if _ordered(self.generation, other.generation):
            # vLLM >= 0.33 counts re-registrations (a wake from sleep): blocks named by an older generation
            # are gone; a newer one only means the router has not seen the re-registration yet.
            return bool(other.generation >= self.generation)
        return bool(self.generation == other.generation)

    def supersedes(self, other: Registration) -> bool:
        """Whether this registration may replace ``other`` as a decode's newest: another engine, or the same
        engine at the same or a higher generation (a late answer of an older generation never wins)."""
        if self.engine_id != other.engine_id or not _ordered(self.generation, other.generation):
            return True
        return bool(self.generation >= other.generation)


def _ordered(a: Any, b: Any) -> bool:
    return isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and not isinstance(b, bool)


@dataclasses.dataclass(kw_only=True)
class BackendState:
    backend: Backend
    healthy: bool = True
    # Gone from discovery's view: no new turn is routed here (it stays out of `healthy`) while the turns
    # already on it finish; health checks leave it alone until discovery removes it or sees it again.
    draining: bool = False
    outstanding: int = 0
    # Of those, P hops (prompts being computed), not renders: what conditional disaggregation reads.
    prefilling: int = 0
    # Turns placed here without stickiness: breaks ties between idle backends, so conversations that
    # arrive one at a time spread out instead of all landing on the first configured decode.
    placed: int = 0
    # None until probed: whether decode runs our retention service (leases) or stock vLLM (fixed TTL).
    retention: bool | None = None
    lease_s: float | None = None
    # Decode's retention service says its API server takes forwarded prompt ids on a vLLM older than 0.32
    # (agentkv's plugin, `AGENTKV_FORWARDED_IDS`); learned with `retention`.
    forwarded_ids: bool = False
    # ... and reads them packed (`agentkv._wire.pack_ids`): agentkv's plugin runs its own wrapper there.
    packed_ids: bool = False
    # ... and takes a chat body cut to its last message beside them (`agentkv._wire.cut_messages`).
    messages_cut: bool = False
    registration: Registration | None = None
    # Bytes of KV per token on this decode (its retention service's info): prices a host-tier restore.
    kv_bytes_per_token: float | None = None
    # Decode's KV block size, from vLLM's `vllm:cache_config_info`, learned when the router first cuts a stock
    # decode's offer itself; None until then, and again after the backend went down.
    block_size: int | None = None
    # Per render route (chat, completions, messages, responses): whether this prefill serves it and the
    # tokens-in routes; absent until a turn tried it. Per route: vLLM 0.26 renders chat but not messages.
    renders: dict[str, bool] = dataclasses.field(default_factory=dict)
    # The engine's vLLM (major, minor) from its `/version`: which routes and fields it honours (decode takes
    # forwarded prompt ids and prefill's generate route keeps kv_transfer_params from 0.32 on); None until
    # learned, and again after the backend went down.
    release: tuple[int, int] | None = None
    # False once this prefill's generate route refused the token path's request or dropped its
    # kv_transfer_params: id prompts on /v1/completions from then on (until it goes down and comes back).
    generates: bool | None = None

    @property
    def name(self) -> str:
        return self.backend.name

    def inflight(self) -> contextlib.AbstractContextManager[None]:
        """One request counted in `outstanding` (what the choosers balance on) for as long as it runs."""
        return _InFlight(self, "outstanding")

    def computing(self) -> contextlib.AbstractContextManager[None]:
        """One P hop counted in `prefilling` while it runs."""
        return _InFlight(self, "prefilling")

    def saw_registration(self, registration: Registration) -> None:
        if registration.engine_id is not None and (
            self.registration is None or registration.supersedes(self.registration)
        ):
            self.registration = registration


class _InFlight:
    # A class, not a generator: a generator's context would also end when garbage-collected, and an answer
    # whose end was never seen must show up as a leaked count, not vanish silently.
    def __init__(self, state: BackendState, counter: Literal["outstanding", "prefilling"]) -> None:
        self._state, self._counter = state, counter

    def __enter__(self) -> None:
        setattr(self._state, self._counter, getattr(self._state, self._counter) + 1)

    def __exit__(self, *exc: object) -> None:
        setattr(self._state, self._counter, getattr(self._state, self._counter) - 1)


class BackendPool:
    """All backends of one role, by name, in configuration order (discovered ones after them, in the order
    they joined)."""

    def __init__(self, *, backends: list[Backend]) -> None:
        self._states = {b.name: BackendState(backend=b) for b in backends}

    def __iter__(self) -> Iterator[BackendState]:
        # A snapshot: discovery adds and removes backends between the awaits of whoever iterates.
        return iter(tuple(self._states.values()))

    def __len__(self) -> int:
        return len(self._states)

    def get(self, name: str | None) -> BackendState | None:
        return self._states.get(name) if name is not None else None

    def healthy(self) -> list[BackendState]:
        return [s for s in self._states.values() if s.healthy]

    def add(self, backend: Backend) -> BackendState:
        """A backend found at run time: out of rotation until its first health check passes."""
        if backend.name in self._states:
            raise ValueError(f"backend {backend.name!r} is already in the pool")
        state = self._states[backend.name] = BackendState(backend=backend, healthy=False)
        return state

    def remove(self, name: str) -> BackendState | None:
        """Forget a backend; turns still running on it keep their state and finish."""
        return self._states.pop(name, None)
