"""Routing decisions, pure and I/O-free: which P, which D, whether to reuse, and which path a turn takes.

Paths: `pull` (P pulls decode's retained blocks, prefills the suffix, D pulls from P), `recompute` (P
prefills everything), `decode-local` (D prefills the turn itself, no P hop: the suffix over its own prefix
cache, or the whole prompt when every prefill is saturated).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Literal

from agentkv._constants import FINGERPRINTS_KEY

from ._backend import BackendState, Registration
from ._prefix import Prefix
from ._tokens import TokenPrefix

__all__ = [
    "CostModel",
    "Line",
    "Path",
    "PathDecision",
    "assess_reuse",
    "choose_decode",
    "choose_path",
    "choose_prefill",
]

Path = Literal["pull", "recompute", "decode-local"]
ReuseVerdict = Literal["ok", "miss", "expired", "mismatch"]


def choose_prefill(
    states: Iterable[BackendState], *, exclude: frozenset[str] = frozenset(), prefer: str | None = None
) -> BackendState | None:
    """The healthy P with the fewest outstanding requests. Ties go to `prefer`, the P that computed the
    conversation's last prompt: vLLM's prefix cache there may still hold it, so a pull reads from decode only
    what that cache lacks, and its tokenizer cache holds the prompt. Then to the P used least so far."""
    candidates = [s for s in states if s.healthy and s.name not in exclude]
    chosen = min(candidates, key=lambda s: (s.outstanding, s.name != prefer, s.placed), default=None)
    if chosen is not None:
        chosen.placed += 1
    return chosen


def choose_decode(
    states: Iterable[BackendState],
    *,
    sticky: str | None,
    load_cap: int,
    exclude: frozenset[str] = frozenset(),
) -> BackendState | None:
    """The decode holding this conversation's retained blocks, unless it is unhealthy or over the load
    cap (pure stickiness loses to load balance under load); else the least-loaded healthy decode."""
    candidates = [s for s in states if s.healthy and s.name not in exclude]
    for s in candidates:
        if s.name == sticky and s.outstanding < load_cap:
            return s
    chosen = min(candidates, key=lambda s: (s.outstanding, s.placed), default=None)
    if chosen is not None:
        chosen.placed += 1
    return chosen


def assess_reuse(
    *,
    retained: dict[str, object] | None,
    expires_at: float | None,
    prefix: Prefix | None,
    body: dict[str, object],
    decode: BackendState,
    now: float,
    margin_s: float,
    check_prefix: bool = True,
    exact: bool = False,
    tokens: TokenPrefix | None = None,
    prompt_ids: Sequence[int] | None = None,
) -> ReuseVerdict:
    """Whether decode's retained blocks may be offered to P for this request.

    With the new prompt's token ids and the held ids' fingerprint the check is on token ids (it sees tools,
    template kwargs and anything else the chat template renders); otherwise on messages (`prefix`).
    ``check_prefix=False`` leaves the (token-exact) check to our connector on prefill; it exists to test that
    check through the whole stack and for engines whose chat template rewrites history."""
    if not retained or (prefix is None and tokens is None):
        return "miss"
    if exact and FINGERPRINTS_KEY not in retained:
        # Only our connector offers prefill-computed KV alone; a stock decode's offer ends with the tokens it
        # computed itself, which a recompute would not reproduce bit for bit.
        return "miss"
    if expires_at is None or now + margin_s >= expires_at:
        return "expired"
    # A decode restart (or re-registration) frees every block; its old params would make P read garbage.
    if decode.registration is not None and not decode.registration.matches(Registration.of_params(retained)):
        return "expired"
    if check_prefix:
        if tokens is not None and prompt_ids is not None:
            if not tokens.extended_by(prompt_ids):
                return "mismatch"
        elif prefix is None or not prefix.matches(body):
            return "mismatch"
    return "ok"


class Line:
    """Exponentially weighted least squares fit of `ms = fixed + rate * tokens`.

    Fixed costs (an extra HTTP hop, a NIXL handshake) and per-token prefill cost both matter: the
    break-even suffix length is where the lines cross, so both terms are learned, not assumed."""

    def __init__(self, *, alpha: float = 0.2) -> None:
        self._alpha = alpha
        self._n = 0
        self._x = self._y = self._xx = self._xy = 0.0

    @property
    def samples(self) -> int:
        return self._n

    def observe(self, tokens: float, ms: float) -> None:
        if tokens < 0 or ms < 0 or not math.isfinite(ms):
            return
        a = self._alpha if self._n else 1.0
        self._n += 1
        self._x += a * (tokens - self._x)
        self._y += a * (ms - self._y)
        self._xx += a * (tokens * tokens - self._xx)
        self._xy += a * (tokens * ms - self._xy)

    def predict(self, tokens: float) -> float | None:
        if self._n == 0:
            return None
        var = self._xx - self._x * self._x
        if var <= 1e-9 * max(self._xx, 1.0):
            # All samples at one size: attribute everything to the per-token rate (no fixed cost seen).
            rate = self._y / self._x if self._x > 0 else 0.0
            return rate * tokens if self._x > 0 else self._y
        rate = max((self._xy - self._x * self._y) / var, 0.0)
        fixed = max(self._y - rate * self._x, 0.0)
        return fixed + rate * tokens


@dataclasses.dataclass(kw_only=True)
class CostModel:
    """Measured time-to-first-token per path, and chars per token to estimate a suffix's length."""

    pd: Line = dataclasses.field(default_factory=Line)
    local: Line = dataclasses.field(default_factory=Line)
    chars_per_token: float = 4.0  # a prior only; replaced by measurements from usage after one turn
    _cpt_samples: int = 0

    def observe_chars(self, chars: int, tokens: int | None) -> None:
        if not tokens or tokens <= 0 or chars <= 0:
            return
        sample = chars / tokens
        a = 0.2 if self._cpt_samples else 1.0
        self._cpt_samples += 1
        self.chars_per_token += a * (sample - self.chars_per_token)

    def estimate_tokens(self, chars: int) -> int:
        return math.ceil(chars / max(self.chars_per_token, 0.1))

    def observe_turn(self, *, path: Path, computed_tokens: int, reused_tokens: int, ttft_ms: float) -> None:
        """Learn from a streamed turn's first token, on the line of the path it took.

        A turn that reused nothing (a recompute, a declined pull, a cold turn prefilled on a busy decode)
        teaches neither line. It computes the whole prompt, so with such turns on it the P/D line runs
        through seconds at long prompts and prices a short pull at the slope of computing it, blind to what
        a pull costs beyond compute at that context (the P hop's per-request work over every id and the read
        of decode's KV): on the H200 at 127k tokens it priced a 512-token pull below decode-local, and the
        pull took 331 ms where decode-local took 212."""
        if reused_tokens <= 0:
            return
        if path == "decode-local":
            self.local.observe(computed_tokens, ttft_ms)
        elif path == "pull":
            self.pd.observe(computed_tokens, ttft_ms)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PathDecision:
    path: Path
    reason: str
    # Decode-local because every prefill was at `prefill_queue_cap` P hops (counted apart in the metrics).
    prefill_busy: bool = False


# Below this many samples a line is a guess; decide by rule until both are measured.
_MIN_SAMPLES = 3


def choose_path(
    *,
    policy: str,
    reuse_ok: bool,
    new_tokens: int,
    decode_outstanding: int,
    local_max_tokens: int,
    model: CostModel,
    exact: bool = False,
    prefill_outstanding: int = 0,
    prefill_queue_cap: int = 0,
) -> PathDecision:
    """Pick the cheapest path to the first token for this turn.

    Decode-local prefill stalls every stream running on that decode for the suffix's duration, so its
    cost is scaled by the decode's load, and suffixes over `local_max_tokens` never go local. ``exact``:
    never local at all, since decode would serve the prefix from KV it computed itself.

    Conditional disaggregation: once the least busy prefill computes `prefill_queue_cap` prompts at once
    (P hops in flight, renders not counted; 0: never), any turn, a cold one included, is prefilled on its
    decode as an aggregated server would: a turn queued behind other prompts on prefill waits longer than
    decode's chunked prefill delays the streams it runs. ``new_tokens`` is then the whole prompt for a turn
    without reusable blocks."""
    if not exact and policy != "always-pd":
        if policy == "always-local":
            return PathDecision(path="decode-local", reason="policy always-local")
        if prefill_queue_cap > 0 and prefill_outstanding >= prefill_queue_cap:
            return PathDecision(
                path="decode-local",
                reason=f"prefill busy: {prefill_outstanding} in flight >= cap {prefill_queue_cap}",
                prefill_busy=True,
            )
    if not reuse_ok:
        return PathDecision(path="recompute", reason="no reusable blocks")
    if policy == "always-pd":
        return PathDecision(path="pull", reason="policy always-pd")
    if exact:
        return PathDecision(path="pull", reason="exact: decode-local would reuse decode-computed KV")
    if new_tokens > local_max_tokens:
        return PathDecision(path="pull", reason=f"suffix ~{new_tokens} tokens > local cap {local_max_tokens}")
    if model.pd.samples < _MIN_SAMPLES or model.local.samples < _MIN_SAMPLES:
        if decode_outstanding == 0:
            return PathDecision(path="decode-local", reason="learning costs; decode idle")
        return PathDecision(path="pull", reason="learning costs; decode busy")
    local_ms = (model.local.predict(new_tokens) or 0.0) * (1 + decode_outstanding)
    pd_ms = model.pd.predict(new_tokens) or 0.0
    if local_ms <= pd_ms:
        return PathDecision(path="decode-local", reason=f"local ~{local_ms:.1f} ms <= pd ~{pd_ms:.1f} ms")
    return PathDecision(path="pull", reason=f"pd ~{pd_ms:.1f} ms < local ~{local_ms:.1f} ms")
