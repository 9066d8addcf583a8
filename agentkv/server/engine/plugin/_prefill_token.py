"""Decode starts from the token prefill sampled, as one server would (part of agentkv's vLLM plugin,
`agentkv.server.engine.plugin`, switched on by `AGENTKV_PREFILL_TOKEN`).

In vLLM's P/D, prefill computes the whole prompt and samples token 1, which is thrown away; decode loads all
of the prompt's KV but its last token's, computes that token again in a decode step (a batch of one-token
rows, not the prompt's prefill) and samples token 1 itself. One server computes the last prompt token inside
the prefill and samples token 1 there. Those two computations round differently, and greedy answers then
part in about one turn in ten (bench/README.md, "agreement: decode starting from prefill's token"). Here
decode takes prefill's token 1 (the router forwards it in `kv_transfer_params`, `PREFILL_TOKEN_KEY`) as
the last id of its prompt: it loads exactly the KV prefill computed and computes token 1's KV in its first
step, as one server computes its first decode step.

How: `AsyncLLM.generate` (0.26-0.34), below vLLM's serving layer, appends token 1 to the engine prompt,
asks for one token fewer, and puts token 1 back at the front of the answer (its id and its text, decoded
against the prompt's tail) with the prompt's ids as they came. The serving layer above sees an ordinary
answer: tool and reasoning parsers, `usage` and the chat chunks need nothing.

Where one server's token 1 would not be prefill's, or the answer's start is read by something this cannot
put back, decode runs as vLLM ships (`refusal` names each case): sampling that is not greedy (prefill
samples greedily), penalties, prompt logprobs, stop strings, structured output, several choices, a token 1
that is a stop token or part of a character, and a prompt of whole blocks (decode would need one block more
than prefill hands on, and vLLM's NIXL worker stops the engine on that). Logprobs of the answer are kept:
token 1's come from prefill, which computed them as one server would (`agentkv._wire.prefill_logprobs`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from agentkv._exceptions import EngineVersionError
from agentkv._wire import KV_KEY, take_prefill_token
from agentkv.server.engine.plugin._counters import _counters
from agentkv.server.engine.plugin._forwarded_ids import extended

__all__ = ["install", "refusal"]

logger = logging.getLogger("vllm.agentkv.prefill_token")

_GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature under it samples greedily
_TAIL = 8  # the prompt ids token 1's text is decoded against (a byte-level run spans a few ids)


def refusal(
    params: Any,
    token: int,
    prompt_ids: Sequence[int],
    *,
    block_size: int | None,
    logprobs: dict[str, Any] | None = None,
) -> str | None:
    """Why decode must run this request as vLLM ships instead of from prefill's `token` (a short reason
    for the counter), or None where it may. `params` is the request's `SamplingParams`; `logprobs` what
    came beside the token (`agentkv._wire.prefill_logprobs`): the token's logprobs as prefill computed them,
    which a request asking for logprobs needs, with as many top logprobs as it asks."""
    if getattr(params, "n", 1) != 1:
        return "choices"
    if getattr(params, "temperature", 1.0) >= _GREEDY_BELOW:
        return "sampling"
    if (
        getattr(params, "presence_penalty", 0.0)
        or getattr(params, "frequency_penalty", 0.0)
        or getattr(params, "repetition_penalty", 1.0) != 1.0
    ):
        return "penalties"
    asked = getattr(params, "logprobs", None)
    if getattr(params, "prompt_logprobs", None) is not None or (
        asked is not None and not _logprobs_of(logprobs, token, asked)
    ):
        return "logprobs"
    if getattr(params, "stop", None):
        return "stop strings"
    # Prefill chose token 1 without any of these.
    for name in (
        "structured_outputs",
        "guided_decoding",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "logits_processors",
        "thinking_token_budget",
    ):
        if getattr(params, name, None):
            return "constraints"
    if token in (getattr(params, "stop_token_ids", None) or ()):
        return "stop token"
    max_tokens = getattr(params, "max_tokens", None)
    if max_tokens is not None and max_tokens < 2:
        return "one token"
    if block_size is None or not prompt_ids or len(prompt_ids) % block_size == 0:
        return "whole blocks"
    return None


def _logprobs_of(logprobs: dict[str, Any] | None, token: int, asked: int) -> bool:
    """Whether prefill's `logprobs` are `token`'s, with the `asked` top logprobs (vLLM's order: the sampled
    token first, then at most `asked` more)."""
    if not isinstance(logprobs, dict) or logprobs.get("k") != asked or asked < 0:
        return False
    top = logprobs.get("top")
    return (
        isinstance(top, list)
        and 0 < len(top) <= asked + 1
        and all(
            isinstance(e, list) and len(e) == 3 and type(e[0]) is int and type(e[1]) is float for e in top
        )
        and top[0][0] == token
    )


def _token_text(tokenizer: Any, tail: Sequence[int], token: int, params: Any) -> str | None:
    """Token 1's text as vLLM's detokenizer gives the first output token: the text of the prompt's tail with
    it, less the text without it. None where that is not a clean extension (part of a character) or there
    is no tokenizer to decode with."""
    if not getattr(params, "detokenize", True):
        return ""
    if tokenizer is None:
        return None
    skip = bool(getattr(params, "skip_special_tokens", True))
    before = tokenizer.decode(list(tail), skip_special_tokens=skip)
    after = tokenizer.decode([*tail, token], skip_special_tokens=skip)
    if not after.startswith(before) or after.endswith("\ufffd"):
        return None
    return str(after[len(before) :])


def _take_token(params: Any) -> tuple[int | None, Any]:
    """Prefill's token and its logprobs, taken off the request's `kv_transfer_params`
    (`agentkv._wire.take_prefill_token`); (None, None) where the request has none."""
    extra = getattr(params, "extra_args", None)
    kv = extra.get(KV_KEY) if isinstance(extra, dict) else None
    return take_prefill_token(kv) if isinstance(kv, dict) else (None, None)


def _count(result: str) -> None:
    if (counters := _counters()) is not None:
        counters.prefill_tokens.labels(result=result).inc()


def _block_size(engine: Any) -> int | None:
    size = getattr(getattr(getattr(engine, "vllm_config", None), "cache_config", None), "block_size", None)
    return size if isinstance(size, int) and size > 0 else None


class _VLLM:
    """What the wrapper takes from vLLM, imported once by `install`."""

    def __init__(self, *, kinds: Any, logprob: Any, to_tokens: Any) -> None:
        self.kinds = kinds  # RequestOutputKind: DELTA and FINAL_ONLY are the serving layer's
        self.logprob = logprob  # vllm.logprobs.Logprob
        self.to_tokens = to_tokens  # how vLLM's output processor names each logprob's token


def _position(vllm: _VLLM, tokenizer: Any, top: list[list[Any]]) -> dict[int, Any] | None:
    """Token 1's logprobs as vLLM's output processor builds a position's (id -> `Logprob`, the sampled token
    first), or None where a token's name would need vLLM's correction of a partial character."""
    if tokenizer is None:
        return None
    names = vllm.to_tokens(tokenizer, [i for i, _, _ in top])
    if any(name.endswith("\ufffd") for name in names):
        return None
    return {
        i: vllm.logprob(logprob=lp, rank=rank if type(rank) is int else n, decoded_token=name)
        for n, ((i, lp, rank), name) in enumerate(zip(top, names, strict=True), start=1)
    }


def _wrap_generate(original: Any, vllm: _VLLM) -> Any:
    # A plain function returning vLLM's own generator wherever decode does not start from prefill's token,
    # so those requests run vLLM's code with no layer between it and the serving layer.
    @functools.wraps(original)
    def generate(
        self: Any, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any
    ) -> Any:
        token, logprobs = _take_token(sampling_params)
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if token is None or not isinstance(ids, list):
            return original(self, prompt, sampling_params, request_id, *args, **kwargs)
        kind = getattr(sampling_params, "output_kind", None)
        reason = refusal(sampling_params, token, ids, block_size=_block_size(self), logprobs=logprobs)
        if reason is None and kind not in (vllm.kinds.DELTA, vllm.kinds.FINAL_ONLY):
            reason = "output kind"  # a cumulative answer object may be handed out again: not rewritten
        tokenizer = getattr(self, "tokenizer", None)
        text = position = None
        if reason is None:
            text = _token_text(tokenizer, ids[-_TAIL:], token, sampling_params)
            if text is None:
                reason = "text"
        if reason is None and getattr(sampling_params, "logprobs", None) is not None:
            position = _position(vllm, tokenizer, logprobs["top"])
            if position is None:
                reason = "logprobs"
        _count(reason or "used")
        if reason is not None or text is None:
            return original(self, prompt, sampling_params, request_id, *args, **kwargs)
        # The serving layer keeps its own (`clone`: vLLM's copy, which shares logits processors).
        params = sampling_params.clone() if hasattr(sampling_params, "clone") else copy.copy(sampling_params)
        if params.max_tokens is not None:
            params.max_tokens -= 1
        if getattr(params, "min_tokens", 0):
            params.min_tokens -= 1
        answers = original(
            self, {**prompt, "prompt_token_ids": extended(ids, token)}, params, request_id, *args, **kwargs
        )
        return _with_token(answers, ids, token, text, position, delta=kind == vllm.kinds.DELTA)

    generate.agentkv_wrapped = True  # type: ignore[attr-defined]
    return generate


async def _with_token(
    answers: Any, ids: list[int], token: int, text: str, position: dict[int, Any] | None, *, delta: bool
) -> AsyncGenerator[Any, None]:
    """vLLM's outputs with token 1 back at the front (its id, text and, where asked, logprobs): a delta
    answer carries it once, a final one holds it; the prompt's ids as they came. Closing this closes vLLM's
    generator at once (which aborts the request in the engine), as the serving layer does when a client goes
    away."""
    first = True
    async with contextlib.aclosing(answers):
        async for out in answers:
            out.prompt_token_ids = ids
            if first or not delta:
                for choice in out.outputs:
                    choice.token_ids = [token, *choice.token_ids]
                    choice.text = text + choice.text
                    if position is not None and choice.logprobs is not None:
                        positions = type(choice.logprobs)()  # a list, or vLLM's FlatLogprobs
                        for each in (position, *choice.logprobs):
                            positions.append(each)
                        choice.logprobs = positions
                        if choice.cumulative_logprob is not None:
                            choice.cumulative_logprob += position[token].logprob
            first = False
            yield out


def install() -> bool:
    """Wrap `AsyncLLM.generate` (0.26-0.34); True when in place. Where it is not there the engine serves as
    vLLM ships, which is safe (decode ignores the router's token and computes the prompt's last token
    again), so this logs why instead of stopping vLLM's start."""
    try:
        from vllm.logprobs import Logprob
        from vllm.sampling_params import RequestOutputKind
        from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
        from vllm.v1.engine.async_llm import AsyncLLM

        original = AsyncLLM.generate
        vllm = _VLLM(kinds=RequestOutputKind, logprob=Logprob, to_tokens=convert_ids_list_to_tokens)
    except (ImportError, AttributeError) as exc:
        logger.warning("%s", EngineVersionError.plugin_part("AGENTKV_PREFILL_TOKEN", "engine client", exc))
        return False
    if not getattr(original, "agentkv_wrapped", False):
        AsyncLLM.generate = _wrap_generate(original, vllm)  # type: ignore[method-assign]
    return True
