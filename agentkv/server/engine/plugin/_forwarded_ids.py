"""Decode takes the prompt's token ids the router forwards instead of rendering the messages again, on vLLM
releases that predate vLLM's own mechanism for it (part of agentkv's vLLM plugin,
`agentkv.server.engine.plugin`).

From vLLM 0.32 on, a chat request whose `kv_transfer_params` carry `prompt_token_ids` (what the prefill stage
rendered for the same body) skips the chat template and the tokenizer: `_reused_prompt_token_ids` in
`vllm/renderers/online_renderer.py`. vLLM 0.26-0.31 render and tokenize the whole conversation again on
decode, every turn (141 ms at 127k tokens on the H200 host before agentkv's tokenizer cache; the template,
the cache's lookup and the message handling after it). This module gives those releases the same behaviour,
with the same rules: the ids are popped from the params (they never reach the engine's sampling metadata),
ignored when the request echoes its prompt or has non-text content (both need the messages rendered), and
refused with a 400 when they are not a non-empty list of in-vocabulary ids.

How: `OnlineRenderer.preprocess_chat` (0.26-0.34) takes the ids off the request into a context variable for
the one `BaseRenderer.render_chat_async` call it makes, which then returns the ids as the engine input
instead of rendering; everything else `preprocess_chat` does (tool and reasoning parsers adjusting the
request) runs unchanged. The trust model is vLLM's: only the router, which took the ids from prefill's
render of the same body, sends them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import time
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentkv._exceptions import EngineVersionError
from agentkv._wire import (
    MESSAGES_CUT_KEY,
    PACKED_IDS_KEY,
    PROMPT_IDS_KEY,
    has_non_text_content,
    unpack_ids,
)
from agentkv.server.engine.plugin._counters import _counters
from agentkv.server.engine.plugin._id_lists import IdLists

__all__ = ["extended", "forwarded_ids", "install", "takes_cut_messages", "takes_packed_ids"]


# Set by preprocess_chat for the render_chat_async call it makes (an await in the same task sees it): the
# ids, the form they came in, and the vocabulary size they were checked against (None: not checked).
_IDS: contextvars.ContextVar[tuple[list[int], str, int | None] | None] = contextvars.ContextVar(
    "agentkv_forwarded_ids", default=None
)


# Set by `install`: the lists of recent packed prompts (`IdLists`), or None to make every list anew.
_LISTS: IdLists | None = None
# The list this request's render handed vLLM and the vocabulary size `forwarded_ids` checked it against, the
# bounds of vLLM's own `BaseRenderer.validate_token_ids` (0.32+), which then skips that very list rather than
# take the max and the min of 127k Python ints again (2.5 ms at 131k on one CPU core). Per request: each runs
# in its own task.
_CHECKED: contextvars.ContextVar[tuple[list[int], int] | None] = contextvars.ContextVar(
    "agentkv_checked_ids", default=None
)


class _Invalid(ValueError):
    """For a vLLM without `VLLMValidationError`: its API server answers a ValueError with a 400 too."""


def forwarded_ids(
    request: Any, messages: Any, vocab_size: int | None, *, lists: IdLists | None = None
) -> tuple[list[int], str] | None:
    """Pop the forwarded ids off `request`'s `kv_transfer_params` (`prompt_token_ids`, or agentkv's packed
    form, `agentkv._wire.PACKED_IDS_KEY`; the list when both came): the ids to run and the form they came in
    ("list" or "packed"), or None to render the messages (none forwarded, echo, non-text content). Raises
    vLLM's validation error for ids that are not a non-empty list of ids below `vocab_size`. Packed ids
    become a list through `lists` where given (the ints of a kept prompt's shared prefix reused)."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict):
        return None
    ids = params.pop(PROMPT_IDS_KEY, None)
    packed = params.pop(PACKED_IDS_KEY, None)
    cut = params.pop(MESSAGES_CUT_KEY, None)
    if (ids is None and packed is None) or getattr(request, "echo", False) or has_non_text_content(messages):
        if cut:
            # The messages are the conversation's last one only: rendering them would run another prompt.
            raise _error(
                f"`kv_transfer_params['{MESSAGES_CUT_KEY}']`: the messages were cut to the last one, and "
                "this request cannot run from its forwarded ids (none sent, echo, or non-text content)."
            )
        return None
    form = "list"
    if ids is None:
        try:
            unpacked = unpack_ids(packed)  # non-negative ints by construction
        except ValueError as exc:
            raise _error(f"`kv_transfer_params['{PACKED_IDS_KEY}']`: {exc}.") from None
        top = _max_id(unpacked)
        form = "packed"
        if lists is None:
            ids = unpacked.tolist()
        else:
            ids, reused = lists.to_list(unpacked)
            if (counters := _counters()) is not None:
                counters.id_ints.labels(kind="reused").inc(reused)
                counters.id_ints.labels(kind="made").inc(len(ids) - reused)
    # bool is an int subclass, hence the exact type check.
    elif not isinstance(ids, list) or not ids or set(map(type, ids)) != {int} or min(ids) < 0:
        raise _error(
            "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative integers."
        )
    else:
        top = max(ids)
    if vocab_size is not None and top >= vocab_size:
        key = PACKED_IDS_KEY if form == "packed" else PROMPT_IDS_KEY
        raise _error(f"`kv_transfer_params['{key}']` has id {top}, out of vocabulary.")
    return ids, form


def _max_id(ids: array[int]) -> int:
    """The largest of packed ids: numpy (vLLM's own dependency) reads the buffer without making 131k ints."""
    try:
        import numpy as np
    except ImportError:
        return max(ids)
    return int(np.frombuffer(ids, dtype=np.uint32).max())


def _error(message: str) -> Exception:
    """vLLM's validation error (a ValueError in 0.26, its own client-error class later; both answer 400)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return _Invalid(message)
    return VLLMValidationError(message, parameter="kv_transfer_params.prompt_token_ids")


def _vocab_size(front: Any) -> int | None:
    """The larger of the model's and the tokenizer's vocabulary (vLLM's own rule: Qwen3's model has ids its
    tokenizer lacks, some multimodal tokenizers the reverse); None when neither is known."""
    sizes: list[int] = []
    with contextlib.suppress(Exception):  # a config without a vocabulary: the engine still checks every id
        sizes.append(int(front.model_config.get_vocab_size()))
    tokenizer = getattr(getattr(front, "renderer", None), "tokenizer", None)
    max_id = getattr(tokenizer, "max_token_id", None)
    if isinstance(max_id, int):
        sizes.append(max_id + 1)
    return max(sizes) if sizes else None


def _wrap_preprocess_chat(original: Any) -> Any:
    @functools.wraps(original)
    async def preprocess_chat(self: Any, request: Any, messages: Any, *args: Any, **kwargs: Any) -> Any:
        params = getattr(request, "kv_transfer_params", None)
        cut = isinstance(params, dict) and bool(params.get(MESSAGES_CUT_KEY))
        vocab_size = _vocab_size(self)
        taken = forwarded_ids(request, messages, vocab_size, lists=_LISTS)
        if taken is None:
            return await original(self, request, messages, *args, **kwargs)
        if cut and (counters := _counters()) is not None:
            counters.cut_conversations.inc()
        token = _IDS.set((*taken, vocab_size))
        try:
            return await original(self, request, messages, *args, **kwargs)
        finally:
            _IDS.reset(token)

    preprocess_chat.agentkv_wrapped = True  # type: ignore[attr-defined]
    return preprocess_chat


def _wrap_render_chat(original: Any) -> Any:
    """Every chat request's way through the renderer (0.26-0.34): a cut body that reached it without
    `preprocess_chat` taking its ids (vLLM's GPT-OSS path renders without it) is refused before any engine
    sees the prompt rendered from the last message alone."""

    @functools.wraps(original)
    async def render_chat(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = await original(self, request, *args, **kwargs)
        params = getattr(request, "kv_transfer_params", None)
        # A tuple is a rendered prompt (an error response answers the client as it is).
        if isinstance(result, tuple) and isinstance(params, dict) and params.pop(MESSAGES_CUT_KEY, None):
            raise _error(
                f"`kv_transfer_params['{MESSAGES_CUT_KEY}']`: this model's chat route renders the messages "
                "instead of running the forwarded ids; send the whole conversation."
            )
        return result

    render_chat.agentkv_wrapped = True  # type: ignore[attr-defined]
    return render_chat


def _wrap_render_chat_async(original: Any, tokens_input: Any) -> Any:
    @functools.wraps(original)
    async def render_chat_async(
        self: Any, conversations: Sequence[Any], *args: Any, prompt_extras: Any = None, **kwargs: Any
    ) -> Any:
        taken = _IDS.get()
        if taken is None or len(conversations) != 1:
            return await original(self, conversations, *args, prompt_extras=prompt_extras, **kwargs)
        _IDS.set(None)  # this request's one render
        ids, form, vocab_size = taken
        if vocab_size is not None:
            _CHECKED.set((ids, vocab_size))
        engine_input = tokens_input(ids, cache_salt=(prompt_extras or {}).get("cache_salt"))
        engine_input["arrival_time"] = time.time()
        _count(form)
        # No conversation: vLLM uses it only to echo the prompt, and an echo is rendered.
        return [[]], [engine_input]

    render_chat_async.agentkv_wrapped = True  # type: ignore[attr-defined]
    return render_chat_async


def _wrap_validate_token_ids(original: Any) -> Any:
    @functools.wraps(original)
    def validate_token_ids(self: Any, token_ids: Any, *args: Any, **kwargs: Any) -> Any:
        checked = _CHECKED.get()
        skip = checked is not None and token_ids is checked[0]
        if (counters := _counters()) is not None:
            counters.id_checks.labels(result="skipped" if skip else "run").inc()
        if skip:
            _CHECKED.set(None)
            return None
        return original(self, token_ids, *args, **kwargs)

    validate_token_ids.agentkv_wrapped = True  # type: ignore[attr-defined]
    return validate_token_ids


def extended(ids: list[int], token: int) -> list[int]:
    """`[*ids, token]`, the prompt decode runs from prefill's token (`_prefill_token`). Where `ids` is the
    list this request's render handed vLLM, checked, and `token` is within that vocabulary, the new list
    counts as checked in its place, so vLLM's check skips it too (its ids: the checked ones and `token`)."""
    out = [*ids, token]
    checked = _CHECKED.get()
    if checked is not None and checked[0] is ids and 0 <= token < checked[1]:
        _CHECKED.set((out, checked[1]))
    return out


def _count(form: str) -> None:
    if (counters := _counters()) is not None:
        counters.forwarded_ids.labels(form=form).inc()


@functools.cache  # the info route asks on every probe; the installed vLLM does not change under a process
def _renderer_source() -> str:
    """vLLM's online renderer's source ("" without one): read, not imported, because the plugin runs in every
    vLLM process and importing the renderer costs the engine core and workers a second of start-up."""
    try:
        spec = importlib.util.find_spec("vllm.renderers.online_renderer")
        origin = getattr(spec, "origin", None)
        return "" if origin is None else Path(origin).read_text(encoding="utf-8")
    except (ImportError, OSError):  # no such module (install() says so), or no source to read
        return ""


def _has_own() -> bool:
    """Whether this vLLM takes forwarded ids itself (0.32+)."""
    return "_reused_prompt_token_ids" in _renderer_source()


def _has_render_chat() -> bool:
    """Whether this vLLM's chat requests all pass `OnlineRenderer.render_chat`, where a cut body that was not
    run from its ids is caught (0.26-0.34)."""
    return "    async def render_chat(\n" in _renderer_source()


def takes_packed_ids(mode: str | None) -> bool:
    """Whether an API server with this `AGENTKV_FORWARDED_IDS` mode runs agentkv's wrapper, which also reads
    the packed ids (read from vLLM's source, as `install` decides; no import)."""
    return mode == "always" or (mode == "on" and not _has_own())


def takes_cut_messages(mode: str | None, *, model_type: str | None) -> bool:
    """Whether that wrapper may be sent a chat body cut to its last message (`agentkv._wire.cut_messages`):
    it runs the packed ids, and `render_chat` is there to refuse a cut body that was not run from them. Not
    for GPT-OSS (`model_type` from the model's config, vLLM's own test): its chat route renders the messages
    without `preprocess_chat`, so every cut body would be refused."""
    return model_type != "gpt_oss" and takes_packed_ids(mode) and _has_render_chat()


def install(*, always: bool, kept_ids: int = 0) -> bool:
    """Wrap vLLM's chat rendering to take forwarded ids; True when in place. Only where vLLM lacks its own
    (`_reused_prompt_token_ids`, 0.32+), unless `always`. `kept_ids`: how many ids of recent packed prompts
    to keep as Python ints for the prompts that extend them (`IdLists`; 0: none). Decided as
    `takes_packed_ids` decides what decode's retention service tells the router, so the two never disagree:
    a wrapper that cannot be put in place where the router would be told to send packed ids (or a body cut to
    its last message) stops vLLM's start rather than let it render another prompt from them."""
    if not takes_packed_ids("always" if always else "on"):
        return False  # vLLM's own, and no import of the renderer in processes that never render
    try:
        from vllm.inputs.engine import tokens_input
        from vllm.renderers import base as renderers_base
        from vllm.renderers import online_renderer
        from vllm.renderers.base import BaseRenderer

        # Both present in 0.26-0.34 (the API check reads each release's source).
        preprocess = online_renderer.OnlineRenderer.preprocess_chat
        render = BaseRenderer.render_chat_async
    except (ImportError, AttributeError) as exc:
        raise EngineVersionError.plugin_part("AGENTKV_FORWARDED_IDS", "chat rendering", exc) from exc
    global _LISTS
    _LISTS = IdLists(max_ids=kept_ids) if kept_ids > 0 else None
    if not getattr(preprocess, "agentkv_wrapped", False):
        online_renderer.OnlineRenderer.preprocess_chat = _wrap_preprocess_chat(preprocess)  # type: ignore[method-assign]
    if not getattr(render, "agentkv_wrapped", False):
        BaseRenderer.render_chat_async = _wrap_render_chat_async(render, tokens_input)  # type: ignore[method-assign]
    validate = getattr(BaseRenderer, "validate_token_ids", None)  # 0.32+; 0.26 checks inline, as before
    if validate is not None and not getattr(validate, "agentkv_wrapped", False):
        renderers_base.BaseRenderer.validate_token_ids = _wrap_validate_token_ids(validate)  # type: ignore[method-assign]
    chat = getattr(online_renderer.OnlineRenderer, "render_chat", None)
    if chat is not None and not getattr(chat, "agentkv_wrapped", False):
        online_renderer.OnlineRenderer.render_chat = _wrap_render_chat(chat)  # type: ignore[method-assign]
    return True
