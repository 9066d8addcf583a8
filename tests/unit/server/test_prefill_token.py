"""`agentkv.server.engine.plugin._prefill_token` alone: when decode may start from prefill's token, and how
the answer is
put back together. A stand-in engine client; the real one: tests/integration/test_prefill_token.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from agentkv._wire import KV_KEY, PREFILL_LOGPROBS_KEY, PREFILL_TOKEN_KEY
from agentkv.server.engine.plugin._prefill_token import _VLLM, _token_text, _wrap_generate, refusal

DELTA, FINAL, CUMULATIVE = "delta", "final", "cumulative"


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class Kinds:
    DELTA, FINAL_ONLY = DELTA, FINAL


def _names(tokenizer: Any, ids: list[int]) -> list[str]:
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


VLLM = _VLLM(kinds=Kinds, logprob=Logprob, to_tokens=_names)


@dataclass
class Params:
    """The `SamplingParams` fields the handoff reads, at vLLM's defaults but greedy."""

    n: int = 1
    temperature: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    structured_outputs: Any = None
    logit_bias: Any = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    detokenize: bool = True
    skip_special_tokens: bool = True
    output_kind: str = DELTA
    extra_args: dict[str, Any] | None = None


PROMPT = [1, 2, 3, 4, 5]  # not whole blocks of 4


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({}, None),
        ({"n": 2}, "choices"),
        ({"temperature": 0.7}, "sampling"),
        ({"presence_penalty": 0.5}, "penalties"),
        ({"repetition_penalty": 1.1}, "penalties"),
        ({"logprobs": 0}, "logprobs"),  # and none came from prefill
        ({"prompt_logprobs": 1}, "logprobs"),
        ({"stop": ["\n"]}, "stop strings"),
        ({"structured_outputs": object()}, "constraints"),
        ({"logit_bias": {9: 1.0}}, "constraints"),
        ({"stop_token_ids": [9]}, "stop token"),
        ({"max_tokens": 1}, "one token"),
        ({"max_tokens": None}, None),  # vLLM fills in the rest of the context
    ],
)
def test_decode_starts_from_prefills_token_only_where_one_server_would_have_sampled_it(
    change: dict[str, Any], reason: str | None
) -> None:
    assert refusal(replace(Params(), **change), 9, PROMPT, block_size=4) == reason


def test_logprobs_are_kept_where_prefills_are_the_tokens_with_as_many_top_logprobs_as_asked() -> None:
    top = [[9, -0.5, 1], [3, -1.5, 2]]
    assert refusal(Params(logprobs=1), 9, PROMPT, block_size=4, logprobs={"k": 1, "top": top}) is None
    assert refusal(Params(logprobs=0), 9, PROMPT, block_size=4, logprobs={"k": 0, "top": top[:1]}) is None
    for k, lp in (
        (2, {"k": 1, "top": top}),
        (1, {"k": 1, "top": top[::-1]}),
        (1, None),
        (0, {"k": 0, "top": top}),
    ):
        assert refusal(Params(logprobs=k), 9, PROMPT, block_size=4, logprobs=lp) == "logprobs", (k, lp)


def test_a_prompt_of_whole_blocks_or_an_unknown_block_size_runs_as_vllm_ships() -> None:
    assert refusal(Params(), 9, PROMPT[:4], block_size=4) == "whole blocks"
    assert refusal(Params(), 9, PROMPT, block_size=None) == "whole blocks"
    assert refusal(Params(), 9, [], block_size=4) == "whole blocks"


class Tokenizer:
    """Ids to text as a byte-level tokenizer would: 7 is half of a character, 8 a special token."""

    pieces = {1: "a", 2: " b", 3: "c", 4: "d", 5: " e", 9: " f", 8: "<s>"}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if 7 in ids:
            return "".join(self.pieces.get(i, "") for i in ids if i != 7) + "\ufffd"
        return "".join("" if i == 8 and skip_special_tokens else self.pieces[i] for i in ids)


def test_token_one_is_decoded_against_the_prompts_tail() -> None:
    assert _token_text(Tokenizer(), [4, 5], 9, Params()) == " f"
    assert _token_text(Tokenizer(), [4, 5], 8, Params()) == ""
    assert _token_text(Tokenizer(), [4, 5], 8, Params(skip_special_tokens=False)) == "<s>"
    assert _token_text(Tokenizer(), [4, 5], 7, Params()) is None  # part of a character
    assert _token_text(None, [4, 5], 9, Params()) is None
    assert _token_text(None, [4, 5], 9, Params(detokenize=False)) == ""


@dataclass
class Choice:
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class Output:
    prompt_token_ids: list[int]
    outputs: list[Choice]


class Engine:
    """An engine client whose `generate` answers 10, 11, 12 after whatever prompt it is given (logprobs
    -1, -2, -3 where asked)."""

    tokenizer = Tokenizer()

    def __init__(self, block_size: int = 4) -> None:
        self.vllm_config = type("C", (), {"cache_config": type("B", (), {"block_size": block_size})})()
        self.seen: list[tuple[Any, Any]] = []

    async def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> Any:
        self.seen.append((prompt, params))
        answer = [10, 11, 12][: params.max_tokens]
        for n in range(1, len(answer) + 1):
            step = answer[n - 1 : n] if params.output_kind == DELTA else answer[:n]
            choice = Choice(list(step), "".join(f"<{i}>" for i in step))
            if params.logprobs is not None:
                choice.logprobs = [{i: Logprob(float(9 - i), 1, f"<{i}>")} for i in step]
                choice.cumulative_logprob = float(sum(9 - i for i in answer[:n]))
            yield Output(list(prompt["prompt_token_ids"]), [choice])


def _run(engine: Engine, params: Params, token: int | None, logprobs: Any = None) -> list[Output]:
    generate = _wrap_generate(Engine.generate, VLLM)
    params.extra_args = {KV_KEY: {"remote_block_ids": [1]}}
    if token is not None:
        params.extra_args[KV_KEY][PREFILL_TOKEN_KEY] = token
    if logprobs is not None:
        params.extra_args[KV_KEY][PREFILL_LOGPROBS_KEY] = logprobs

    async def collect() -> list[Output]:
        return [
            out async for out in generate(engine, {"type": "token", "prompt_token_ids": PROMPT}, params, "r")
        ]

    return asyncio.run(collect())


@pytest.mark.parametrize("kind", [DELTA, FINAL])
def test_the_answer_starts_with_prefills_token_and_the_prompt_is_given_back_as_it_came(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    counted: list[str] = []
    monkeypatch.setattr("agentkv.server.engine.plugin._prefill_token._count", counted.append)
    engine = Engine()
    params = Params(output_kind=kind, max_tokens=3)
    outs = _run(engine, params, 9)
    ((prompt, sent),) = engine.seen
    # The engine ran the prompt with token 1 as its last id, for one token fewer; the key never reached it.
    assert prompt["prompt_token_ids"] == [*PROMPT, 9] and sent.max_tokens == 2 and params.max_tokens == 3
    assert PREFILL_TOKEN_KEY not in sent.extra_args[KV_KEY]
    assert all(out.prompt_token_ids == PROMPT for out in outs)
    if kind == DELTA:
        assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs] == [
            ([9, 10], " f<10>"),
            ([11], "<11>"),
        ]
    else:
        assert (outs[-1].outputs[0].token_ids, outs[-1].outputs[0].text) == ([9, 10, 11], " f<10><11>")
    assert counted == ["used"]


def test_token_ones_logprobs_from_prefill_lead_the_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agentkv.server.engine.plugin._prefill_token._count", lambda result: None)
    for kind in (DELTA, FINAL):
        top = {"k": 1, "top": [[9, -0.25, 1], [3, -2.0, 2]]}
        outs = _run(Engine(), Params(output_kind=kind, logprobs=1), 9, top)
        choice = outs[0].outputs[0] if kind == DELTA else outs[-1].outputs[0]
        assert choice.logprobs is not None
        assert choice.logprobs[0] == {9: Logprob(-0.25, 1, " f"), 3: Logprob(-2.0, 2, "c")}
        assert [list(p) for p in choice.logprobs[1:]] == [[i] for i in choice.token_ids[1:]]
        # vLLM's running sum of the answer's own logprobs, with token 1's added.
        assert choice.cumulative_logprob == (-1.0 if kind == DELTA else -1.0 - 2.0 - 3.0) - 0.25


def test_a_refused_or_absent_token_leaves_the_request_as_it_came(monkeypatch: pytest.MonkeyPatch) -> None:
    counted: list[str] = []
    monkeypatch.setattr("agentkv.server.engine.plugin._prefill_token._count", counted.append)
    cases = [(Params(logprobs=1), 9), (Params(), 7), (Params(output_kind=CUMULATIVE), 9)]
    for params, token in [*cases, (Params(), None), (Params(), True)]:
        engine = Engine()
        outs = _run(engine, params, token)  # type: ignore[arg-type]
        ((prompt, sent),) = engine.seen
        assert prompt["prompt_token_ids"] == PROMPT and sent is params and sent.max_tokens == 16
        assert PREFILL_TOKEN_KEY not in sent.extra_args[KV_KEY]
        assert outs[-1].outputs[0].token_ids == ([12] if params.output_kind == DELTA else [10, 11, 12])
    assert counted == ["logprobs", "text", "output kind"]  # neither an absent token nor a non-id is counted


def test_a_client_going_away_closes_vllms_generator_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The serving layer closes the answer's generator when its client disconnects; vLLM aborts the request
    in its generator's cleanup, which must run then, not whenever the garbage collector gets to it."""
    monkeypatch.setattr("agentkv.server.engine.plugin._prefill_token._count", lambda result: None)
    closed: list[bool] = []

    class Aborting(Engine):
        async def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> Any:
            try:
                async for out in super().generate(prompt, params, request_id, **kwargs):
                    yield out
            finally:
                closed.append(True)

    engine = Aborting()
    generate = _wrap_generate(Aborting.generate, VLLM)
    params = Params(extra_args={KV_KEY: {PREFILL_TOKEN_KEY: 9}})

    async def first_then_leave() -> None:
        answers = generate(engine, {"type": "token", "prompt_token_ids": PROMPT}, params, "r")
        assert (await anext(answers)).outputs[0].token_ids == [9, 10]
        await answers.aclose()
        assert closed == [True]

    asyncio.run(first_then_leave())


def test_a_vllm_without_the_engine_client_it_wraps_serves_as_shipped_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Unlike a cut body, a token decode cannot start from is safe to ignore (decode computes the prompt's
    last token as vLLM ships): the start goes on, with a warning that names the switch."""
    import sys

    from agentkv.server.engine.plugin import _prefill_token

    monkeypatch.setitem(sys.modules, "vllm.v1.engine.async_llm", None)  # importing it raises ImportError
    with caplog.at_level("WARNING", logger="vllm.agentkv.prefill_token"):
        assert _prefill_token.install() is False
    assert "AGENTKV_PREFILL_TOKEN=off" in caplog.text
