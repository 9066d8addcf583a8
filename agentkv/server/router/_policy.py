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
from ._tokens import TokenMatch, TokenPrefix

__all__ = [
    "CostModel",
    "Line",
    "Path",
    "PathDecision",
    "assess_reuse",
    "choose_decode",
    "choose_path",
    "choose_prefill",
    "partial_offer",
]

Path = Literal["pull", "recompute", "decode-local"]
# "partial": the prompt does not extend what decode holds but starts with some of its whole blocks, which
# the turn reuses (decode's offer cut to them); the rest is computed.
ReuseVerdict = Literal["ok", "partial", "miss", "expired", "mismatch"]


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
    match: TokenMatch | None = None,
) -> ReuseVerdict:
    """Whether decode's retained blocks may be offered to P for this request.

    With the new prompt's token ids and the held ids' fingerprint the check is on token ids (it sees tools,
    template kwargs and anything else the chat template renders); otherwise on messages (`prefix`). On ids
    a prompt that does not extend the held ids but starts with some of their whole blocks is "partial":
    those blocks are reused, as vLLM's prefix cache reuses every whole block that matches. `match`: the
    prompt's `TokenPrefix.match`, where the caller has it (it needs the matched count too).
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
            match = match or tokens.match(prompt_ids)
            if not match.extends:
                return "partial" if partial_offer(match, retained) > 0 else "mismatch"
        elif prefix is None or not prefix.matches(body):
            return "mismatch"
    return "ok"


def partial_offer(match: TokenMatch, retained: dict[str, object]) -> int:
    """The tokens of decode's offer a prompt that only partly matches may read: the whole blocks the
    router proved equal, or up to the first that differs where our connector on prefill checks each
    offered block against its own fingerprints (decode's offer carries them) and pulls only equal ones."""
    return match.offer(prefill_verifies=FINGERPRINTS_KEY in retained)


# Slope columns of a fit: 0 is the tokens the turn computes, 1 the context it reuses.
_TOKENS, _CONTEXT = 0, 1
# Relative size under which a quantity is rounding: a feature's weighted variance against its mean square
# (the feature is constant), a pivot of the unit-diagonal normal equations (collinear features), two fits'
# difference in residual against the data's spread (the smaller model is as good).
_FLAT = 1e-9


def _solve(gram: list[list[float]], rhs: list[float]) -> list[float] | None:
    """The solution of ``gram @ w = rhs`` for a small symmetric positive semi-definite `gram` (a normal
    equations matrix), or None when it is singular: the features are (near-)collinear, so the data cannot
    tell their rates apart.

    Scaled to a unit diagonal first so the singularity test reads as a correlation (1 - r^2) whatever the
    features' units (tokens and 100k-token contexts); elimination needs no pivoting on a positive definite
    matrix."""
    n = len(rhs)
    scale = [math.sqrt(gram[i][i]) for i in range(n)]
    if not all(s > 0 and math.isfinite(s) for s in scale):
        return None
    a = [[gram[i][j] / (scale[i] * scale[j]) for j in range(n)] for i in range(n)]
    b = [rhs[i] / scale[i] for i in range(n)]
    for k in range(n):
        if a[k][k] <= _FLAT:
            return None
        for i in range(k + 1, n):
            f = a[i][k] / a[k][k]
            for j in range(k, n):
                a[i][j] -= f * a[k][j]
            b[i] -= f * b[k]
    w = [0.0] * n
    for k in reversed(range(n)):
        w[k] = (b[k] - sum(a[k][j] * w[j] for j in range(k + 1, n))) / a[k][k]
    return [w[k] / scale[k] for k in range(n)]


class Line:
    """Exponentially weighted least squares fit of `ms = fixed + rate * tokens + context_rate * context`.

    `tokens` is what the turn computes, `context` what it reuses from cache. Fixed costs (an extra HTTP hop,
    a NIXL handshake) and per-token prefill cost both matter: the break-even suffix length is where the lines
    cross, so both terms are learned, not assumed. The context term is learned because both paths slow down
    with it at a fixed suffix (per-request work over every id, attention over the prefix, a pull's read of
    decode's KV): agents run at 30k-200k tokens at once, and a line blind to context prices every turn at
    the mix's average context.

    Moments are kept centered (an exponentially weighted mean and covariance, updated in place), so the
    normal equations' intercept row is eliminated exactly and the slopes come from a small, well conditioned
    system, not from differences of 1e10-sized raw moments. A feature without variance in the weighted
    samples is left out of the fit: the line then predicts as the one-feature fit does, independent of it."""

    def __init__(self, *, alpha: float = 0.2) -> None:
        self._alpha = alpha
        self._n = 0
        self._mean = [0.0, 0.0]  # tokens, context
        self._mean_y = 0.0
        self._cov = [[0.0, 0.0], [0.0, 0.0]]
        self._cov_y = [0.0, 0.0]
        self._var_y = 0.0
        self._coefficients: tuple[float, float, float] | None = None

    @property
    def samples(self) -> int:
        return self._n

    def observe(self, tokens: float, ms: float, *, context: float = 0.0) -> None:
        """Learn one turn: `ms` to its first token, computing `tokens` over `context` cached ones."""
        if not all(math.isfinite(v) and v >= 0 for v in (tokens, ms, context)):
            return
        a = self._alpha if self._n else 1.0
        self._n += 1
        self._coefficients = None
        d = (tokens - self._mean[0], context - self._mean[1])
        dy = ms - self._mean_y
        # West's update: the exact exponentially weighted covariance, without raw second moments.
        for i in range(2):
            for j in range(2):
                self._cov[i][j] = (1 - a) * (self._cov[i][j] + a * d[i] * d[j])
            self._cov_y[i] = (1 - a) * (self._cov_y[i] + a * d[i] * dy)
            self._mean[i] += a * d[i]
        self._var_y = (1 - a) * (self._var_y + a * dy * dy)
        self._mean_y += a * dy

    def predict(self, tokens: float, *, context: float = 0.0) -> float | None:
        """Milliseconds to the first token for a turn computing `tokens` over `context` cached ones."""
        if self._n == 0:
            return None
        if self._coefficients is None:  # solved once per sample, not on every routing decision
            self._coefficients = self._fit()
        fixed, rate, context_rate = self._coefficients
        return max(fixed + rate * tokens + context_rate * context, 0.0)

    def _varies(self, i: int) -> bool:
        var = self._cov[i][i]
        return var > _FLAT * max(var + self._mean[i] ** 2, 1.0)

    def _fit(self) -> tuple[float, float, float]:
        tokens_vary = self._varies(_TOKENS)
        if self._varies(_CONTEXT):
            if tokens_vary:
                return self._best((_TOKENS, _CONTEXT), intercept=True)
            if self._mean[_TOKENS] > 0:
                # All samples at one size: the fixed cost and that size's cost are one constant to this data.
                # It goes to the per-token rate, as below without context variance, so how a line scales
                # with the suffix does not flip when its turns start to differ in context.
                return self._best((_TOKENS, _CONTEXT), intercept=False)
            return self._best((_CONTEXT,), intercept=True)
        if tokens_vary:
            return self._best((_TOKENS,), intercept=True)
        if self._mean[_TOKENS] > 0:
            # All samples at one size: attribute everything to the per-token rate (no fixed cost seen).
            return self._best((_TOKENS,), intercept=False)
        return (max(self._mean_y, 0.0), 0.0, 0.0)

    def _best(self, columns: tuple[int, ...], *, intercept: bool) -> tuple[float, float, float]:
        """The least squares fit on `columns` (and a fixed cost if `intercept`) with every rate >= 0.

        A negative rate is noise (more context or tokens never make a turn faster): the fits that leave
        out features are tried too, and the best one whose rates are all non-negative wins. With at most two
        features that is every subset, so this is the exact non-negative least squares solution; a fit
        within rounding of a larger one loses to it, so collinear features fall back to the tokens alone."""
        subsets = [columns] if len(columns) == 1 else [columns, columns[:1], columns[1:]]
        fits = [f for s in (*subsets, ()) if (f := self._least_squares(s, intercept=intercept)) is not None]
        least = min(sse for sse, _ in fits)  # the empty fit is always there
        tolerance = _FLAT * max(least, self._total(intercept=intercept))
        return next(coefficients for sse, coefficients in fits if sse <= least + tolerance)

    def _total(self, *, intercept: bool) -> float:
        """The weighted sum of squares the empty fit leaves, the scale against which fits are compared."""
        return self._var_y if intercept else self._var_y + self._mean_y**2

    def _least_squares(
        self, subset: tuple[int, ...], *, intercept: bool
    ) -> tuple[float, tuple[float, float, float]] | None:
        """(weighted residual sum of squares, (fixed, rate, context_rate)) of the unconstrained fit on
        `subset`; None if it is singular or a rate comes out negative."""
        if intercept:
            gram = [[self._cov[i][j] for j in subset] for i in subset]
            rhs = [self._cov_y[i] for i in subset]
        else:
            gram = [[self._cov[i][j] + self._mean[i] * self._mean[j] for j in subset] for i in subset]
            rhs = [self._cov_y[i] + self._mean[i] * self._mean_y for i in subset]
        w = _solve(gram, rhs) if subset else []
        if w is None or any(r < 0 for r in w):
            return None
        rates = [0.0, 0.0]
        for i, r in zip(subset, w, strict=True):
            rates[i] = r
        sse = self._total(intercept=intercept) - sum(r * b for r, b in zip(w, rhs, strict=True))
        fixed = self._mean_y - rates[0] * self._mean[0] - rates[1] * self._mean[1] if intercept else 0.0
        return sse, (max(fixed, 0.0), rates[0], rates[1])


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
        pull took 331 ms where decode-local took 212.

        The reused tokens are the turn's context: both paths' cost grows with it at a fixed suffix, so the
        lines learn it as a second feature."""
        if reused_tokens <= 0:
            return
        if path == "decode-local":
            self.local.observe(computed_tokens, ttft_ms, context=reused_tokens)
        elif path == "pull":
            self.pd.observe(computed_tokens, ttft_ms, context=reused_tokens)


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
    context_tokens: int = 0,
    cached_tokens: int = 0,
    restore_ms: float = 0.0,
) -> PathDecision:
    """Pick the cheapest path to the first token for this turn.

    Decode-local prefill stalls every stream running on that decode for the suffix's duration, so its
    cost is scaled by the decode's load, and suffixes over `local_max_tokens` never go local. ``exact``:
    never local at all, since decode would serve the prefix from KV it computed itself.

    ``context_tokens``: the tokens decode holds for the conversation, the prefix the turn reuses. Both paths
    cost more at a longer context (a pull reads it from decode, both do per-request work over every id and
    attend over it), so both lines are priced at this turn's context, not at the average of those they saw.

    Conditional disaggregation: once the least busy prefill computes `prefill_queue_cap` prompts at once
    (P hops in flight, renders not counted; 0: never), any turn, a cold one included, is prefilled on its
    decode as an aggregated server would: a turn queued behind other prompts on prefill waits longer than
    decode's chunked prefill delays the streams it runs. ``new_tokens`` is then the whole prompt for a turn
    without reusable blocks.

    ``cached_tokens``: where decode retains nothing this turn may reuse (its retention cap declined the last
    turn, the lease ran out, or the conversation was demoted), the tokens of the prompt its prefix cache or
    host tier still holds; ``new_tokens`` is then the rest. ``restore_ms``: what copying the host tier's part
    back costs (bytes over the link). See `_cached_path`."""
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
        if cached_tokens > 0 and not exact and policy != "always-pd":
            return _cached_path(
                new_tokens=new_tokens,
                cached_tokens=cached_tokens,
                decode_outstanding=decode_outstanding,
                local_max_tokens=local_max_tokens,
                model=model,
                restore_ms=restore_ms,
            )
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
    local_ms = (model.local.predict(new_tokens, context=context_tokens) or 0.0) * (1 + decode_outstanding)
    pd_ms = model.pd.predict(new_tokens, context=context_tokens) or 0.0
    if local_ms <= pd_ms:
        return PathDecision(path="decode-local", reason=f"local ~{local_ms:.1f} ms <= pd ~{pd_ms:.1f} ms")
    return PathDecision(path="pull", reason=f"pd ~{pd_ms:.1f} ms < local ~{local_ms:.1f} ms")


# Until the lines are measured: a cached prefix at least this many times the suffix goes decode-local even on
# a busy decode. Recomputing it on prefill costs that many suffixes' compute (and its KV's move to decode),
# where decode-local delays decode's other streams by one suffix's compute (plus a restore over a link that
# moves KV ~30x faster than a GPU computes it).
_CACHED_LOCAL_RATIO = 8


def _cached_path(
    *,
    new_tokens: int,
    cached_tokens: int,
    decode_outstanding: int,
    local_max_tokens: int,
    model: CostModel,
    restore_ms: float = 0.0,
) -> PathDecision:
    """Decode-local over what decode's prefix cache (or host tier) still holds, or a recompute on prefill.

    Decode-local is then what one vLLM server with its prefix cache (and offloading) does with the turn: it
    computes only the `new_tokens` it lacks, after copying back what its host tier holds (`restore_ms`). A
    recompute computes the whole prompt on prefill (less what prefill's own cache holds) and moves all of its
    KV to decode: at long contexts seconds against milliseconds. So decode-local, unless the suffix is over
    `local_max_tokens`, or the measured lines say otherwise: the local line at this context, scaled by
    decode's load as for a hit, plus the restore, against the P/D line for the whole prompt computed (no
    context reused). Until the lines are measured, decode-local on an idle decode, or where the cached prefix
    is `_CACHED_LOCAL_RATIO` times the suffix or more (such a prefix also lifts `local_max_tokens`)."""
    long_prefix = cached_tokens >= _CACHED_LOCAL_RATIO * max(new_tokens, 1)
    if new_tokens > local_max_tokens and not long_prefix:
        # A suffix over the cap still goes local over a prefix many times its length: the alternative is
        # not a short pull but computing the whole prompt (a 512-token tool result plus the last answer and
        # the blocks decode's tier never stored is just over the cap at any context).
        return PathDecision(
            path="recompute", reason=f"decode caches ~{cached_tokens}; suffix ~{new_tokens} > local cap"
        )
    if model.local.samples < _MIN_SAMPLES or model.pd.samples < _MIN_SAMPLES:
        if decode_outstanding == 0:
            return PathDecision(path="decode-local", reason=f"decode caches ~{cached_tokens}; decode idle")
        if long_prefix:
            return PathDecision(
                path="decode-local", reason=f"decode caches ~{cached_tokens} >> suffix ~{new_tokens}"
            )
        return PathDecision(path="recompute", reason=f"decode caches ~{cached_tokens}; learning, decode busy")
    local_ms = (model.local.predict(new_tokens, context=cached_tokens) or 0.0) * (
        1 + decode_outstanding
    ) + restore_ms
    recompute_ms = model.pd.predict(new_tokens + cached_tokens) or 0.0
    costs = f"local ~{local_ms:.1f} ms (restore ~{restore_ms:.1f}), recompute ~{recompute_ms:.1f} ms"
    if local_ms <= recompute_ms:
        return PathDecision(path="decode-local", reason=f"decode caches ~{cached_tokens}: {costs}")
    return PathDecision(path="recompute", reason=f"decode caches ~{cached_tokens}: {costs}")
