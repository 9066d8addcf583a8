"""A vLLM general plugin (entry point `vllm.general_plugins`): work in vLLM's API server that grows with the
whole conversation on every turn, removed. vLLM loads every installed general plugin in each of its
processes; each part here does nothing unless its environment variable is set (the launcher sets them for
the engines it starts).

**The tokenizer cache** (`AGENTKV_TOKENIZER_CACHE` = `on` or `verify`). It wraps
`BaseRenderer._tokenize_prompt`, the one place vLLM 0.26-0.34 tokenizes a rendered prompt (chat, completions,
messages, responses, and the render routes), so that a prompt extending one tokenized before costs only its
new text (`_tokenizer_cache`). Prompts it cannot serve exactly as vLLM would go to vLLM's own code unchanged:
offsets requested, truncation that would cut, tokenizers that are not Hugging Face fast ones or fail the
cache's probe.

Counters on the API server's `/metrics`: `agentkv_tokenizer_cache_prompts_total{result}` (hit, miss,
mismatch: only `verify` finds mismatches), `agentkv_tokenizer_cache_tokens_total{kind}` (reused,
tokenized), `agentkv_detokenizer_tail_primes_total`.

**The detokenizer's prompt tail** (`AGENTKV_DETOKENIZER_PRIME_TOKENS`, a number of ids). vLLM primes each
request's incremental detokenizer (`FastIncrementalDetokenizer`, a `tokenizers.DecodeStream`) with the whole
prompt, and the first output token then decodes all of it: ~130 ms at 127k tokens on the H200 host, on every
hop. Decoding the next token needs only a short left context (a byte-level run spans at most a few ids), so
the stream is primed with the prompt's last N ids instead; upstream proposes the same (vllm-project/vllm#51281
with 32, #57330 with 128).

**Forwarded prompt ids on decode** (`AGENTKV_FORWARDED_IDS` = `always`, agentkv's launcher's default, or `on`
to leave vLLM 0.32+'s own code in place): decode runs the prompt ids the router forwards in
`kv_transfer_params` instead of rendering and tokenizing the messages again, as vLLM 0.32+ does itself
(`_forwarded_ids`); agentkv's wrapper also takes them packed and a body cut to its last message.
Decode's retention service reports the setting (`forwarded_ids` in `/agentkv/v1/info`, and `packed_ids`
where agentkv's wrapper runs and also reads them packed) so that the router sends the ids only where they
are taken, in the cheaper form where it can. Packed ids become vLLM's list with the ints of the longest prefix
a recent prompt shares taken from that prompt's list (`_id_lists`, `AGENTKV_KEPT_PROMPT_IDS` ids kept, 0:
none): an agent's next turn makes ints only for what it adds. On vLLM 0.32+ the list the wrapper checked (or
it and prefill's token) skips vLLM's second vocabulary check (`agentkv_vllm_id_checks_total{result}`).

**Decode starts from prefill's token** (`AGENTKV_PREFILL_TOKEN` = `on`): where the router forwards the
token prefill sampled, decode takes it as its prompt's last id instead of computing that token again, and
puts it back at the answer's front (`_prefill_token`), so that a P/D answer computes what one server
computes. Counted by `agentkv_prefill_tokens_total{result}` (used, or why not).

**JSON through msgspec** (`AGENTKV_FAST_JSON` = `on`): starlette's `Request.json`, which parses every
request body in vLLM's API server, uses msgspec where it can and `json.loads` where msgspec refuses, and
`JSONResponse.render` encodes with msgspec where that gives the standard library's values (`_fast_json`):
half the time for the token path's bodies of 100k+ ids, a twentieth for the render answer that carries
them."""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Container, Sequence
from typing import Any, Literal, get_args

from agentkv.server._tokenizer_cache import TokenizerCache

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


class _Counters:
    def __init__(self) -> None:
        from prometheus_client import Counter

        self.prompts = Counter(
            "agentkv_tokenizer_cache_prompts", "Prompts tokenized through the prefix cache", ["result"]
        )
        self.tokens = Counter("agentkv_tokenizer_cache_tokens", "Prompt ids reused or tokenized", ["kind"])
        self.tail_primes = Counter(
            "agentkv_detokenizer_tail_primes", "Detokenizers primed with the prompt's tail, not all of it"
        )
        self.forwarded_ids = Counter(
            "agentkv_forwarded_ids_prompts",
            "Chat prompts run from the router's forwarded ids (`_forwarded_ids`), by form: list or packed",
            ["form"],
        )
        self.cut_conversations = Counter(
            "agentkv_cut_conversations",
            "Of those, chat requests the router cut to their last message (`agentkv._wire.cut_messages`)",
        )
        self.id_ints = Counter(
            "agentkv_forwarded_id_ints",
            "Packed forwarded ids made into the list vLLM takes, by kind: reused (the int of a kept prompt's "
            "shared prefix) or made",
            ["kind"],
        )
        self.id_checks = Counter(
            "agentkv_vllm_id_checks",
            "vLLM's vocabulary checks of a prompt's ids (0.32+), by result: skipped (a list agentkv's "
            "wrapper checked) or run",
            ["result"],
        )
        self.prefill_tokens = Counter(
            "agentkv_prefill_tokens",
            "Requests that came with prefill's token (`_prefill_token`): used, or why vLLM's own path ran",
            ["result"],
        )

    def __call__(self, result: str, reused: int, tokenized: int) -> None:
        self.prompts.labels(result=result).inc()
        self.tokens.labels(kind="reused").inc(reused)
        self.tokens.labels(kind="tokenized").inc(tokenized)


@functools.cache
def _counters() -> _Counters | None:
    try:
        return _Counters()
    except Exception:  # metrics are a convenience; a name clash must not stop serving
        logger.warning("agentkv plugin: counters not registered", exc_info=True)
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
        from agentkv.server import _fast_json

        _fast_json.install()
    if (forwarded := forwarded_ids_mode()) is not None:
        from agentkv.server import _forwarded_ids

        _forwarded_ids.install(
            always=forwarded == "always",
            kept_ids=_ids_setting(ENV_KEPT_IDS, DEFAULT_KEPT_IDS, unknown="none kept"),
        )
    if _switch(ENV_PREFILL_TOKEN, unknown="decode computes the prompt's last token again") is not None:
        from agentkv.server import _prefill_token

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
