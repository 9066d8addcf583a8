"""Multi-turn conversation load generator (asyncio + httpx), shared by router_overhead and load.

A conversation is a growing chat: a system prompt, then per turn a user (or tool-result) message, the
model's answer appended before the next turn. ``concurrency`` conversations run at once, each turn
waiting for the previous one, like agents do. Targets differ only in how the conversation id travels:

* ``agentkv``: header ``x-session-id`` (our router's primary carrier).
* ``proxy``: body ``conversation_id`` (the only carrier the upstream example proxy reads).
* ``direct``: no proxy at all: the client itself calls prefill then decode with ``kv_transfer_params``,
  exactly the two hops a zero-overhead proxy would make. This is the baseline for "added latency".
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from agentkv._constants import DEFAULT_SESSION_HEADER, H_REUSE
from bench._common import sse_chunk

__all__ = ["LoadResult", "LoadSpec", "Target", "TurnResult", "run_load", "run_load_processes"]

Target = Literal["agentkv", "proxy", "direct"]


@dataclass(kw_only=True)
class LoadSpec:
    target: Target
    url: str = ""  # router/proxy base URL (agentkv, proxy) ...
    prefill_url: str = ""  # ... or the two backends (direct)
    decode_url: str = ""
    conversations: int = 32
    turns: int = 4
    concurrency: int = 8
    stream: bool = False
    system_chars: int = 2000
    turn_chars: int = 400
    max_tokens: int = 16
    model: str = "stub-model"
    session_header: str = DEFAULT_SESSION_HEADER
    timeout_s: float = 30.0
    # Stop early after this many seconds (bounded runs); conversations in flight finish their turn.
    duration_s: float | None = None
    api_key: str | None = None
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])


@dataclass(kw_only=True)
class TurnResult:
    conversation: int
    turn: int
    started: float  # monotonic seconds since the run began
    latency_s: float
    ttft_s: float | None
    status: int
    reuse: str | None
    error: str | None = None


@dataclass(kw_only=True)
class LoadResult:
    spec: LoadSpec
    turns: list[TurnResult]
    wall_s: float

    @property
    def ok(self) -> list[TurnResult]:
        return [turn for turn in self.turns if turn.error is None]

    @property
    def throughput(self) -> float:
        return len(self.ok) / self.wall_s if self.wall_s > 0 else 0.0

    def reuse_counts(self) -> dict[str, int]:
        return dict(Counter(turn.reuse or "absent" for turn in self.ok))

    def errors(self) -> dict[str, int]:
        return dict(Counter(turn.error for turn in self.turns if turn.error is not None))


def _filler(seed: str, chars: int) -> str:
    # Distinct per conversation and turn so no two prompts share more than they should.
    words = f"{seed} lorem ipsum dolor sit amet consectetur "
    return (words * (chars // len(words) + 1))[:chars]


class _Conversation:
    def __init__(self, *, spec: LoadSpec, index: int) -> None:
        self.spec = spec
        self.index = index
        self.conversation_id = f"bench-{spec.tag}-{index}"
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": _filler(f"sys{index}", spec.system_chars)}
        ]
        self.decode_params: dict[str, Any] | None = None  # direct mode: what decode retained last turn

    def next_body(self, turn: int) -> dict[str, Any]:
        # Later turns stand for tool results (what agents send most), as user messages so any backend
        # accepts them without a matching tool call id.
        prefix = "" if turn == 0 else "tool result: "
        content = prefix + _filler(f"c{self.index}t{turn}", self.spec.turn_chars)
        self.messages.append({"role": "user", "content": content})
        return {
            "model": self.spec.model,
            "messages": list(self.messages),
            "max_tokens": self.spec.max_tokens,
            "stream": self.spec.stream,
        }

    def record_answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


async def _post(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], stream: bool
) -> tuple[int, dict[str, str], str, dict[str, Any] | None, float | None]:
    """(status, headers, answer text, kv_transfer_params, ttft seconds) for one request."""
    started = time.perf_counter()
    if not stream:
        response = await client.post(url, json=body, headers=headers)
        if response.status_code != 200:
            return response.status_code, dict(response.headers), "", None, None
        data = response.json()
        message = data["choices"][0].get("message") or {}
        text = message.get("content") or data["choices"][0].get("text") or ""
        return 200, dict(response.headers), text, data.get("kv_transfer_params"), None
    parts: list[str] = []
    params = None
    ttft = None
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, dict(response.headers), "", None, None
        async for line in response.aiter_lines():
            chunk = sse_chunk(line)
            if chunk is None:
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
            if "error" in chunk:
                raise ValueError(f"stream broke: {chunk['error']}")
            for choice in chunk.get("choices", []):
                parts.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
            params = chunk.get("kv_transfer_params") or params
    return 200, dict(response.headers), "".join(parts), params, ttft


async def _turn(
    client: httpx.AsyncClient, conversation: _Conversation, turn: int
) -> tuple[int, str | None, float | None]:
    spec = conversation.spec
    body = conversation.next_body(turn)
    headers = {"authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    if spec.target == "agentkv":
        headers[spec.session_header] = conversation.conversation_id
    elif spec.target == "proxy":
        body["conversation_id"] = conversation.conversation_id
    if spec.target != "direct":
        status, response_headers, text, _, ttft = await _post(
            client, f"{spec.url}/v1/chat/completions", body, headers, spec.stream
        )
        if status == 200:
            conversation.record_answer(text)
        return status, response_headers.get(H_REUSE), ttft
    # direct: the two hops a proxy makes, with nothing in between.
    request_id = uuid.uuid4().hex
    offer = conversation.decode_params or {"do_remote_decode": True, "do_remote_prefill": False}
    offer = {**offer, "do_remote_decode": True, "do_remote_prefill": False}
    prefill_body = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": offer}
    prefill_body.pop("stream_options", None)
    status, _, _, prefill_params, _ = await _post(
        client, f"{spec.prefill_url}/v1/chat/completions", prefill_body, {"x-request-id": request_id}, False
    )
    if status != 200:
        return status, None, None
    decode_body = {**body, "kv_transfer_params": prefill_params}
    status, _, text, decode_params, ttft = await _post(
        client,
        f"{spec.decode_url}/v1/chat/completions",
        decode_body,
        {"x-request-id": request_id},
        spec.stream,
    )
    if status == 200:
        conversation.record_answer(text)
        conversation.decode_params = decode_params
    return status, ("hit" if offer.get("remote_block_ids") else "miss"), ttft


async def run_load(
    spec: LoadSpec,
    *,
    on_turn: Callable[[TurnResult], None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> LoadResult:
    """Run ``spec.conversations`` conversations of ``spec.turns`` turns, ``spec.concurrency`` at a time.

    ``transport`` is for tests (in-process apps); benchmarks always go over loopback TCP.
    """
    limits = httpx.Limits(
        max_connections=spec.concurrency * 2, max_keepalive_connections=spec.concurrency * 2
    )
    results: list[TurnResult] = []
    indices = iter(range(spec.conversations))  # lazy: a duration-bounded run may ask for "unlimited"
    t0 = time.perf_counter()
    deadline = None if spec.duration_s is None else t0 + spec.duration_s

    async def worker(client: httpx.AsyncClient) -> None:
        for index in indices:
            if deadline is not None and time.perf_counter() > deadline:
                return
            conversation = _Conversation(spec=spec, index=index)
            for turn in range(spec.turns):
                started = time.perf_counter()
                error = None
                status, reuse, ttft = 0, None, None
                try:
                    status, reuse, ttft = await _turn(client, conversation, turn)
                    if status != 200:
                        error = f"http {status}"
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    error = type(exc).__name__
                result = TurnResult(
                    conversation=conversation.index,
                    turn=turn,
                    started=started - t0,
                    latency_s=time.perf_counter() - started,
                    ttft_s=ttft,
                    status=status,
                    reuse=reuse,
                    error=error,
                )
                results.append(result)
                if on_turn is not None:
                    on_turn(result)
                if error is not None:
                    break  # an agent whose turn failed gives up on the conversation
                if deadline is not None and time.perf_counter() > deadline:
                    return

    timeout = httpx.Timeout(spec.timeout_s)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport) as client:
        await asyncio.gather(*(worker(client) for _ in range(spec.concurrency)))
    return LoadResult(spec=spec, turns=results, wall_s=time.perf_counter() - t0)


def _worker(spec: LoadSpec, cpus: Collection[int] | None) -> LoadResult:
    if cpus:
        os.sched_setaffinity(0, cpus)
    return asyncio.run(run_load(spec))


def run_load_processes(spec: LoadSpec, *, processes: int, cpus: Collection[int] | None = None) -> LoadResult:
    """``run_load`` split over worker processes, so one Python client is not what saturates first.

    Concurrency is shared out; each process has its own conversation ids. Throughput counts the turns
    of all processes over the longest wall time.
    """
    if processes <= 1:
        if cpus:
            os.sched_setaffinity(0, cpus)
        return asyncio.run(run_load(spec))
    shares = [spec.concurrency // processes + (i < spec.concurrency % processes) for i in range(processes)]
    specs = [
        dataclasses.replace(spec, concurrency=share, tag=f"{spec.tag}p{i}")
        for i, share in enumerate(shares)
        if share
    ]
    # spawn: the parent may hold threads (progress bars, samplers) that fork would copy mid-state.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=len(specs), mp_context=context) as pool:
        parts = list(pool.map(_worker, specs, [cpus] * len(specs)))
    turns = [turn for part in parts for turn in part.turns]
    return LoadResult(spec=spec, turns=turns, wall_s=max(part.wall_s for part in parts))
