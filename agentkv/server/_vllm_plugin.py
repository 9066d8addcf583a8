"""A vLLM general plugin (entry point `vllm.general_plugins`): the tokenizer cache in vLLM's API server.

vLLM loads every installed general plugin in each of its processes; this one does nothing unless
`AGENTKV_TOKENIZER_CACHE` is `on` or `verify` (the launcher sets it for the engines it starts). It then wraps
`BaseRenderer._tokenize_prompt`, the one place vLLM 0.26-0.32 tokenizes a rendered prompt (chat, completions,
messages, responses, and the render routes), so that a prompt extending one tokenized before costs only its
new text (`_tokenizer_cache`). Prompts it cannot serve exactly as vLLM would go to vLLM's own code unchanged:
offsets requested, truncation that would cut, tokenizers that are not Hugging Face fast ones or fail the
cache's probe.

Counters on the API server's `/metrics`: `agentkv_tokenizer_cache_prompts_total{result}` (hit, miss,
mismatch: only `verify` finds mismatches), `agentkv_tokenizer_cache_tokens_total{kind}` (reused,
tokenized)."""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any, Literal

from agentkv.server._tokenizer_cache import TokenizerCache

__all__ = ["ENV_MAX_MB", "ENV_MODE", "TokenizerCacheMode", "register"]

logger = logging.getLogger("vllm.agentkv.tokenizer_cache")

ENV_MODE = "AGENTKV_TOKENIZER_CACHE"
TokenizerCacheMode = Literal["on", "off", "verify"]  # unset means off
ENV_MAX_MB = "AGENTKV_TOKENIZER_CACHE_MB"
_DEFAULT_MAX_MB = 256  # ~1 MiB per 127k-token conversation (its text and ids)

_ATTR = "_agentkv_tokenizer_cache"
_build_lock = threading.Lock()


def _mode() -> str | None:
    mode = os.environ.get(ENV_MODE, "off").strip().lower()
    if mode in ("", "0", "off", "false", "no"):
        return None
    if mode not in ("on", "1", "true", "yes", "verify"):
        logger.warning("%s=%r is not off, on or verify: the tokenizer cache stays off", ENV_MODE, mode)
        return None
    return "verify" if mode == "verify" else "on"


class _Counters:
    def __init__(self) -> None:
        from prometheus_client import Counter

        self.prompts = Counter(
            "agentkv_tokenizer_cache_prompts", "Prompts tokenized through the prefix cache", ["result"]
        )
        self.tokens = Counter("agentkv_tokenizer_cache_tokens", "Prompt ids reused or tokenized", ["kind"])

    def __call__(self, result: str, reused: int, tokenized: int) -> None:
        self.prompts.labels(result=result).inc()
        self.tokens.labels(kind="reused").inc(reused)
        self.tokens.labels(kind="tokenized").inc(tokenized)


@functools.cache
def _counters() -> _Counters | None:
    try:
        return _Counters()
    except Exception:  # metrics are a convenience; a name clash must not stop tokenizing
        logger.warning("tokenizer cache: counters not registered", exc_info=True)
        return None


def _build(tokenizer: Any, *, verify: bool) -> TokenizerCache | None:
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if not getattr(tokenizer, "is_fast", False) or not isinstance(added, dict) or not added:
        return None

    def encode(text: str, special: bool) -> list[int]:
        return list(tokenizer(text, add_special_tokens=special)["input_ids"])

    try:
        max_bytes = int(float(os.environ.get(ENV_MAX_MB, _DEFAULT_MAX_MB)) * 2**20)
    except ValueError:
        max_bytes = _DEFAULT_MAX_MB * 2**20
    unknown_id = getattr(tokenizer, "unk_token_id", None)
    cache = TokenizerCache(
        encode=encode,
        added=added,
        max_bytes=max_bytes,
        unknown_id=unknown_id if isinstance(unknown_id, int) else None,
        verify=verify,
        observe=_counters(),
    )
    return cache if cache.reusing else None


def _cache_for(renderer: Any, *, verify: bool) -> TokenizerCache | None:
    if _ATTR in renderer.__dict__:
        cache: TokenizerCache | None = renderer.__dict__[_ATTR]
        return cache
    with _build_lock:
        if _ATTR not in renderer.__dict__:
            try:
                built = _build(renderer.get_tokenizer(), verify=verify)
            except Exception:  # an unknown tokenizer shape: vLLM's own path serves it
                logger.warning("tokenizer cache off for this model", exc_info=True)
                built = None
            on = built is not None
            logger.info("tokenizer cache %s", "off" if not on else "on (verify)" if verify else "on")
            renderer.__dict__[_ATTR] = built
    cache = renderer.__dict__[_ATTR]
    return cache


def _wrap(original: Any, *, verify: bool) -> Any:
    @functools.wraps(original)
    def _tokenize_prompt(self: Any, prompt: Any, params: Any) -> Any:
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        if not isinstance(text, str) or self._wants_offsets(prompt, params):
            return original(self, prompt, params)
        kwargs = params.get_encode_kwargs()
        if set(kwargs) - {"add_special_tokens", "truncation", "max_length"}:
            return original(self, prompt, params)
        cache = _cache_for(self, verify=verify)
        if cache is None or not cache.reusing:
            return original(self, prompt, params)
        ids = cache.encode(text, add_special_tokens=bool(kwargs.get("add_special_tokens", True)))
        max_length = kwargs.get("max_length") if kwargs.get("truncation") else None
        if max_length is not None and len(ids) > max_length:
            return original(self, prompt, params)  # vLLM's truncation (and its error for a prompt too long)
        return self._build_tokens_prompt(ids, prompt)

    _tokenize_prompt.agentkv_wrapped = True  # type: ignore[attr-defined]
    return _tokenize_prompt


def register() -> None:
    """vLLM's plugin hook; runs in every vLLM process, before any renderer exists."""
    mode = _mode()
    if mode is None:
        return
    try:
        from vllm.renderers.base import BaseRenderer
    except ImportError:
        logger.warning(
            "%s: this vLLM has no vllm.renderers.base.BaseRenderer; the tokenizer cache stays off", ENV_MODE
        )
        return
    original = getattr(BaseRenderer, "_tokenize_prompt", None)
    if original is None or not hasattr(BaseRenderer, "_build_tokens_prompt"):
        logger.warning("%s: this vLLM tokenizes elsewhere; the tokenizer cache stays off", ENV_MODE)
        return
    if getattr(original, "agentkv_wrapped", False):
        return
    BaseRenderer._tokenize_prompt = _wrap(original, verify=mode == "verify")  # type: ignore[method-assign]
