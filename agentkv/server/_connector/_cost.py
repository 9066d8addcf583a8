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


class PullCostModel:
    def __init__(self, *, static_threshold: int, enabled: bool = True, alpha: float = 0.2) -> None:
        self.static_threshold = static_threshold
        self.enabled = enabled
        self.bytes_per_token: float | None = None
        self._post_s = _Ewma(alpha)  # fixed part: posting descriptors, notification
        self._bytes_per_s = _Ewma(alpha)
        self._prefill_s_per_token = _Ewma(alpha)
        self.last_estimate: dict[str, float] | None = None

    # --- learning ----------------------------------------------------------------------------------------
    def observe_transfer(self, data: Mapping[str, Sequence[Any]]) -> None:
        durations = data.get("transfer_duration") or ()
        posts = data.get("post_duration") or ()
        sizes = data.get("bytes_transferred") or ()
        for duration, post, size in zip(durations, posts, sizes, strict=False):
            self._post_s.add(float(post))
            moving = float(duration) - float(post)
            if moving > 0 and size:
                self._bytes_per_s.add(float(size) / moving)

    def observe_step(self, *, tokens: int, seconds: float) -> None:
        if tokens >= _MIN_STEP_TOKENS and seconds > 0:
            self._prefill_s_per_token.add(seconds / tokens)

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
        assert self._bytes_per_s.value and self._post_s.value is not None and self.bytes_per_token
        assert self._prefill_s_per_token.value is not None
        pull_s = self._post_s.value + pull_tokens * self.bytes_per_token / self._bytes_per_s.value
        recompute_s = pull_tokens * self._prefill_s_per_token.value
        return {"pull_ms": round(pull_s * 1e3, 3), "recompute_ms": round(recompute_s * 1e3, 3)}

    def should_pull(self, *, pull_tokens: int, new_tokens: int, context: int) -> bool:
        """``new_tokens``/``context`` are kept for logging and future context-aware rates."""
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
            "post_ms": None if self._post_s.value is None else round(self._post_s.value * 1e3, 3),
            "gb_per_s": None if self._bytes_per_s.value is None else round(self._bytes_per_s.value / 1e9, 3),
            "prefill_us_per_token": None
            if self._prefill_s_per_token.value is None
            else round(self._prefill_s_per_token.value * 1e6, 3),
            "observations": {"transfers": self._post_s.count, "steps": self._prefill_s_per_token.count},
        }
