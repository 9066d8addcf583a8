"""Pull vs recompute on prefill, from measured numbers instead of a fixed token threshold.

vLLM pulls whenever at least ``kv_recompute_threshold`` (64) tokens are offered. What a pull really costs
depends on the link and on how many NIXL descriptors it posts (on the GPU machine most of a pull was posting
~20k descriptors, not moving bytes), and what recompute costs depends on the model and the context. Both are
learned online: transfers from the engine's own NIXL stats, prefill throughput from the scheduler's steps.
The static threshold stays a floor; with too few observations the model defers to vLLM's rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["PullCostModel"]

_MIN_OBSERVATIONS = 3
_MIN_STEP_TOKENS = 32  # shorter steps are dominated by per-step overhead, not per-token compute


class _Ewma:
    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.value: float | None = None
        self.count = 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value
        self.count += 1


class _DecayedLine:
    """``y = fixed + slope * x`` by exponentially weighted least squares (old points fade with ``decay``).

    Two uses: a pull's post time vs its NIXL descriptors (a fixed part for notification and bookkeeping plus
    a part per descriptor; pulls of different sizes separate the two), and prefill seconds per token vs the
    position the tokens sit at. With all points at one x the slope is unknown (0) and the fit is their mean.
    """

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.count = 0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self._w = d * self._w + 1
        self._x = d * self._x + x
        self._y = d * self._y + y
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * y
        self.count += 1

    def fit(self) -> tuple[float, float] | None:
        if not self.count:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        slope = (self._xy / self._w - mx * my) / var if var > 1e-9 * max(1.0, mx * mx) else 0.0
        slope = max(0.0, slope)  # more descriptors never post faster; noise must not say so
        return max(0.0, my - slope * mx), slope


class PullCostModel:
    def __init__(self, *, static_threshold: int, enabled: bool = True, alpha: float = 0.2) -> None:
        self.static_threshold = static_threshold
        self.enabled = enabled
        self.bytes_per_token: float | None = None
        self._post_s = _DecayedLine(decay=1 - alpha)  # post seconds vs descriptors
        self._descriptors_per_byte = _Ewma(alpha)  # block size and layout (cross-layer blocks or not)
        self._bytes_per_s = _Ewma(alpha)
        # Prefill seconds per token as a line in the context the tokens attend over: attention makes a token
        # at position 20k dearer than one at 2k, so recomputing the first n tokens costs the rate at n/2.
        self._prefill_s_per_token = _DecayedLine(decay=1 - alpha)
        self.last_estimate: dict[str, float] | None = None

    # --- learning ----------------------------------------------------------------------------------------
    def observe_transfer(self, data: Mapping[str, Sequence[Any]]) -> None:
        durations = data.get("transfer_duration") or ()
        posts = data.get("post_duration") or ()
        sizes = data.get("bytes_transferred") or ()
        descriptors = data.get("num_descriptors") or ()
        for i, (duration, post, size) in enumerate(zip(durations, posts, sizes, strict=False)):
            n_desc = float(descriptors[i]) if i < len(descriptors) else 0.0
            self._post_s.add(n_desc, float(post))
            if size and n_desc:
                self._descriptors_per_byte.add(n_desc / float(size))
            moving = float(duration) - float(post)
            if moving > 0 and size:
                self._bytes_per_s.add(float(size) / moving)

    def observe_step(self, *, tokens: int, seconds: float, context: float = 0.0) -> None:
        """One engine step: ``tokens`` computed in ``seconds``, at mean position ``context``."""
        if tokens >= _MIN_STEP_TOKENS and seconds > 0:
            self._prefill_s_per_token.add(context, seconds / tokens)

    def prefill_s_per_token(self, context: float) -> float | None:
        line = self._prefill_s_per_token.fit()
        return None if line is None else line[0] + line[1] * context

    # --- deciding ----------------------------------------------------------------------------------------
    def estimate(self, pull_tokens: int) -> dict[str, float] | None:
        ready = (
            self.bytes_per_token
            and self._post_s.count >= _MIN_OBSERVATIONS
            and self._prefill_s_per_token.count >= _MIN_OBSERVATIONS
            and self._bytes_per_s.value
        )
        if not ready:
            return None
        line = self._post_s.fit()
        rate = self.prefill_s_per_token(pull_tokens / 2)  # the pulled tokens are positions 0..pull_tokens
        assert self._bytes_per_s.value and line is not None and self.bytes_per_token and rate is not None
        fixed_s, per_descriptor_s = line
        pull_bytes = pull_tokens * self.bytes_per_token
        descriptors = pull_bytes * (self._descriptors_per_byte.value or 0.0)
        post_s = fixed_s + per_descriptor_s * descriptors
        pull_s = post_s + pull_bytes / self._bytes_per_s.value
        recompute_s = pull_tokens * rate
        return {
            "pull_ms": round(pull_s * 1e3, 3),
            "post_ms": round(post_s * 1e3, 3),
            "descriptors": round(descriptors),
            "recompute_ms": round(recompute_s * 1e3, 3),
        }

    def should_pull(self, *, pull_tokens: int, new_tokens: int, context: int) -> bool:
        """Pull the first ``pull_tokens`` of a ``context``-token prompt with ``new_tokens`` left to compute?

        The new tokens are computed either way, so only the pulled span's costs are compared.
        """
        self.last_estimate = None
        if self.static_threshold > 0 and pull_tokens < self.static_threshold:
            return False
        if not self.enabled:
            return True
        est = self.estimate(pull_tokens)
        if est is None:
            return True
        self.last_estimate = est
        return est["pull_ms"] < est["recompute_ms"]

    def snapshot(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "post_fixed_ms": None if (line := self._post_s.fit()) is None else round(line[0] * 1e3, 3),
            "post_us_per_descriptor": None if line is None else round(line[1] * 1e6, 4),
            "gb_per_s": None if self._bytes_per_s.value is None else round(self._bytes_per_s.value / 1e9, 3),
            "prefill_us_per_token": None
            if (rate := self._prefill_s_per_token.fit()) is None
            else round(rate[0] * 1e6, 3),
            "prefill_us_per_token_per_1k_context": None if rate is None else round(rate[1] * 1e9, 4),
            "observations": {"transfers": self._post_s.count, "steps": self._prefill_s_per_token.count},
        }
