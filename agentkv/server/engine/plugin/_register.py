"""The plugin's entry point (`register`), its settings read from the environment, and the tokenizer cache's
and detokenizer prime's wraps of vLLM; `agentkv.server.engine.plugin` says what each part does."""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Container, Sequence
from typing import Any, Literal, get_args

from agentkv.server.engine.plugin._counters import _counters
from agentkv.server.engine.plugin._tokenizer_cache import TokenizerCache

__all__ = [
    "DEFAULT_KEPT_IDS",
    "DEFAULT_PRIME_TOKENS",
    "ENV_FAST_JSON",
    "ENV_FORWARDED_IDS",
    "ENV_KEPT_IDS",
    "ENV_MAX_MB",
    "ENV_MODE",
    "ENV_PREFILL_TOKEN",
    "ENV_PRIME",
    "FORWARDED_IDS_MODES",
    "TOKENIZER_CACHE_MODES",
    "ForwardedIdsMode",
    "TokenizerCacheMode",
    "forwarded_ids_mode",
    "prompt_tail",
    "register",
]

logger = logging.getLogger("vllm.agentkv.tokenizer_cache")

ENV_MODE = "AGENTKV_TOKENIZER_CACHE"
ENV_PRIME = "AGENTKV_DETOKENIZER_PRIME_TOKENS"
ENV_FORWARDED_IDS = "AGENTKV_FORWARDED_IDS"
ENV_FAST_JSON = "AGENTKV_FAST_JSON"
ENV_PREFILL_TOKEN = "AGENTKV_PREFILL_TOKEN"
ENV_KEPT_IDS = "AGENTKV_KEPT_PROMPT_IDS"
# ~40 bytes a kept id (its int, shared with the prompts that extend it, a list slot and a 4-byte copy).
DEFAULT_KEPT_IDS = 1 << 20
ForwardedIdsMode = Literal["on", "off", "always"]  # unset means off
FORWARDED_IDS_MODES: tuple[str, ...] = get_args(ForwardedIdsMode)
DEFAULT_PRIME_TOKENS = 128
TokenizerCacheMode = Literal["on", "off", "verify"]  # unset means off
TOKENIZER_CACHE_MODES: tuple[str, ...] = get_args(TokenizerCacheMode)
ENV_MAX_MB = "AGENTKV_TOKENIZER_CACHE_MB"
_DEFAULT_MAX_MB = 256  # ~1 MiB per 127k-token conversation (its text and ids)

_ATTR = "_agentkv_tokenizer_cache"
_build_lock = threading.Lock()


def _switch(env: str, other: str | None = None, *, unknown: str) -> str | None:
    """A plugin switch from the environment: None (unset or off), "on", or its `other` mode if it has one;
    anything else is logged (`unknown` says what then happens) and counts as off."""
    mode = os.environ.get(env, "off").strip().lower()
    if mode in ("", "0", "off", "false", "no"):
        return None
    if mode in ("on", "1", "true", "yes"):
        return "on"
    if other is not None and mode == other:
        return other
    logger.warning("%s=%r is not off or on%s: %s", env, mode, f" or {other}" if other else "", unknown)
    return None


def _mode() -> str | None:
    return _switch(ENV_MODE, "verify", unknown="the tokenizer cache stays off")


def forwarded_ids_mode() -> str | None:
    """`AGENTKV_FORWARDED_IDS` (a `ForwardedIdsMode`): None (unset, off, or not a mode: logged), "on" or
    "always"."""
    return _switch(ENV_FORWARDED_IDS, "always", unknown="decode renders the messages")


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


def _ids_setting(env: str, default: int, *, unknown: str) -> int:
    """A number of ids from the environment (`default` where unset); 0, logged with `unknown`, where it is
    not a number."""
    try:
        return max(0, int(os.environ.get(env, default)))
    except ValueError:
        logger.warning("%s=%r is not a number of ids: %s", env, os.environ[env], unknown)
        return 0


def prompt_tail(ids: Sequence[int], keep: int, added: Container[int]) -> Sequence[int] | None:
    """The prompt ids to prime a detokenizer with, or None for all of them: the last `keep`, unless those are
    all added tokens (which a decoder may skip or treat as the text's start, e.g. stripping the next word's
    leading space), where only the whole prompt gives the same text."""
    if len(ids) <= keep:
        return None
    tail = ids[-keep:]
    return tail if any(i not in added for i in tail) else None


def _prime_with_tail(original: Any, *, keep: int) -> Any:
    @functools.wraps(original)
    def __init__(self: Any, tokenizer: Any, request: Any) -> None:
        ids = request.prompt_token_ids
        backend = getattr(tokenizer, "_tokenizer", None)  # the `tokenizers.Tokenizer` vLLM steps with
        if ids is None or len(ids) <= keep or backend is None:
            original(self, tokenizer, request)
            return
        tail = prompt_tail(ids, keep, _added_ids(backend))
        # vLLM hands the whole prompt to `DecodeStream`, which copies every id into Rust (1.3 ms at 131k
        # ids on a 2-core CPU, `bench.detokenizer_prime`) though it decodes nothing before the first step;
        # the constructor reads the prompt for nothing else (tests/unit/compat checks it per release), so it
        # gets a copy of the request that holds only the tail.
        shortened = None if tail is None else _with_prompt_ids(request, list(tail))
        original(self, tokenizer, request if shortened is None else shortened)
        if shortened is not None and (counters := _counters()) is not None:
            counters.tail_primes.inc()

    __init__.agentkv_wrapped = True  # type: ignore[attr-defined]
    return __init__


def _added_ids(backend: Any) -> Container[int]:
    """The added tokens' ids, from the map vLLM keeps on its tokenizer (`added_token_ids`, id -> content),
    built as vLLM builds it where no request has needed it yet."""
    added = getattr(backend, "added_token_ids", None)
    if added is None:
        backend.added_token_ids = added = {
            tid: tok.content for tid, tok in backend.get_added_tokens_decoder().items()
        }
    return added  # type: ignore[no-any-return]


def _with_prompt_ids(request: Any, ids: list[int]) -> Any:
    """A shallow copy of vLLM's `EngineCoreRequest` (a msgspec struct in 0.26-0.34) with other prompt ids,
    or None where it is not one (vLLM then primes with the whole prompt)."""
    try:
        import msgspec

        return msgspec.structs.replace(request, prompt_token_ids=ids)
    except (ImportError, TypeError, AttributeError):
        return None


def _register_prime_tail(keep: int) -> None:
    try:
        from vllm.v1.engine import detokenizer
    except ImportError:
        logger.warning("%s: this vLLM has no vllm.v1.engine.detokenizer; priming stays as it is", ENV_PRIME)
        return
    cls = getattr(detokenizer, "FastIncrementalDetokenizer", None)
    if cls is None or getattr(cls.__init__, "agentkv_wrapped", False):
        return
    cls.__init__ = _prime_with_tail(cls.__init__, keep=keep)
    logger.debug("detokenizers primed with the prompt's last %d ids", keep)


def register() -> None:
    """vLLM's plugin hook; runs in every vLLM process, before any renderer exists."""
    keep = _ids_setting(ENV_PRIME, 0, unknown="the detokenizer is primed as vLLM does")
    if keep:
        _register_prime_tail(keep)
    if _switch(ENV_FAST_JSON, unknown="JSON stays the standard library's") is not None:
        from agentkv.server.engine.plugin import _fast_json

        _fast_json.install()
    if (forwarded := forwarded_ids_mode()) is not None:
        from agentkv.server.engine.plugin import _forwarded_ids

        _forwarded_ids.install(
            always=forwarded == "always",
            kept_ids=_ids_setting(ENV_KEPT_IDS, DEFAULT_KEPT_IDS, unknown="none kept"),
        )
    if _switch(ENV_PREFILL_TOKEN, unknown="decode computes the prompt's last token again") is not None:
        from agentkv.server.engine.plugin import _prefill_token

        _prefill_token.install()
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
