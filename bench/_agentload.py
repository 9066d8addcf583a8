"""Open-loop agent load: conversations arrive at a rate, each runs its turns with tool gaps in between.

Unlike ``_loadgen`` (closed loop: N workers, each starts its next conversation when the last one ends),
arrivals here do not wait for the server, so a server that falls behind builds a queue, as agents arriving
at a deployment do. Within a conversation turns are sequential: the next turn is sent a tool gap after the
previous answer ended.

Plans are pure data (``generate_plans``, ``trace_plans``); ``run_step`` drives one plan over HTTP (streaming,
``x-session-id``); ``summarize_step`` and ``knee`` turn the records into goodput and percentiles. Text is
token-exact on the GPU recipe's WordLevel tokenizer (``bench.multiturn_sweep.Words``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from agentkv._constants import (
    DEFAULT_SESSION_HEADER,
    H_PATH,
    H_PULLED_TOKENS,
    H_REUSE,
    H_REUSED_TOKENS,
    H_TIER,
)
from bench._common import sse_chunk

__all__ = [
    "SLO",
    "ConversationPlan",
    "TurnPlan",
    "TurnRecord",
    "generate_plans",
    "knee",
    "run_step",
    "summarize_step",
    "trace_plans",
]

# Router verdicts that mean the turn did not recompute what an earlier turn computed ("local": decode
# prefilled only the suffix on top of its own retained KV; "cached": on top of what its prefix cache or host
# KV tier still held once the lease had ended).
HIT_VERDICTS = frozenset({"hit", "local", "cached"})


@dataclass(frozen=True, kw_only=True)
class SLO:
    ttft_s: float = 1.0
    tpot_s: float = 0.05

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        # A one-token answer has no TPOT; it is judged on TTFT alone.
        return ttft_s is not None and ttft_s <= self.ttft_s and (tpot_s is None or tpot_s <= self.tpot_s)


@dataclass(frozen=True, kw_only=True)
class TurnPlan:
    new_tokens: int  # tokens this turn appends (the whole context on the first turn, a tool result later)
    output_tokens: int
    gap_s: float  # tool time before this turn is sent (0 on the first turn)


@dataclass(frozen=True, kw_only=True)
class ConversationPlan:
    index: int
    arrival_s: float
    turns: tuple[TurnPlan, ...]


def generate_plans(
    *,
    rate: float,
    window_s: float,
    contexts: Sequence[int],
    turns: int,
    suffix: int,
    output_tokens: int,
    gap_median_s: float,
    gap_sigma: float,
    max_gap_s: float,
    seed: int,
) -> list[ConversationPlan]:
    """``round(rate * window_s)`` conversations arriving at Poisson times over ``window_s``; each starts with
    a context drawn from ``contexts``, then ``turns - 1`` tool results of ``suffix`` tokens after lognormal
    gaps (median ``gap_median_s``, shape ``gap_sigma``, capped at ``max_gap_s``).

    The count is fixed and the times are a Poisson process's given that count (sorted uniform draws): a free
    count over a short window is too noisy to sweep rates with (over 12 s a draw at 1.5/s can bring fewer
    conversations than one at 1/s, and a step would then offer less load than the one below it)."""
    if rate <= 0 or window_s <= 0 or turns < 1:
        raise ValueError("rate, window_s and turns must be positive")
    rng = random.Random(seed)
    arrivals = sorted(rng.uniform(0.0, window_s) for _ in range(max(1, round(rate * window_s))))
    plans: list[ConversationPlan] = []
    for t in arrivals:
        context = rng.choice(list(contexts))
        steps = [TurnPlan(new_tokens=context, output_tokens=output_tokens, gap_s=0.0)]
        for _ in range(turns - 1):
            gap = min(max_gap_s, rng.lognormvariate(math.log(gap_median_s), gap_sigma))
            steps.append(TurnPlan(new_tokens=suffix, output_tokens=output_tokens, gap_s=round(gap, 3)))
        plans.append(ConversationPlan(index=len(plans), arrival_s=round(t, 3), turns=tuple(steps)))
    return plans


def trace_plans(
    conversations: Sequence[Any],
    *,
    rate: float,
    window_s: float,
    max_tokens: int,
    max_output: int,
    gap_scale: float,
    max_gap_s: float,
) -> list[ConversationPlan]:
    """Conversations of the Mooncake trace (``bench._trace.Conversation``), in trace order, re-timed so
    they arrive at ``rate`` per second (the trace's own spacing, time-scaled) within ``window_s``.

    Each request's new tokens are its input length minus what the conversation held before (previous
    input + output); gaps are the trace's inter-request times x ``gap_scale`` (capped). A conversation is
    cut at the first request longer than ``max_tokens``, outputs at ``max_output``."""
    usable = [c for c in conversations if c.requests and c.requests[0].input_length + 1 <= max_tokens]
    if not usable or rate <= 0:
        return []
    first = [c.requests[0].timestamp_s for c in usable]
    natural = max(1e-9, (first[-1] - first[0]) / max(1, len(usable) - 1))  # seconds between arrivals
    scale = 1.0 / (rate * natural)
    plans: list[ConversationPlan] = []
    for conversation, start in zip(usable, first, strict=True):
        arrival = (start - first[0]) * scale
        if arrival >= window_s:
            break
        steps: list[TurnPlan] = []
        held, last_t = 0, start
        for request in conversation.requests:
            output = max(1, min(max_output, request.output_length))
            if request.input_length + output > max_tokens:
                break
            gap = 0.0 if not steps else min(max_gap_s, (request.timestamp_s - last_t) * gap_scale)
            steps.append(
                TurnPlan(new_tokens=max(16, request.input_length - held), output_tokens=output, gap_s=gap)
            )
            held, last_t = request.input_length + output, request.timestamp_s
        plans.append(ConversationPlan(index=len(plans), arrival_s=round(arrival, 3), turns=tuple(steps)))
    return plans


@dataclass(kw_only=True)
class TurnRecord:
    conversation: int
    turn: int
    sent_s: float  # since the step began
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details: local prefix cache + external KV
    reuse: str | None = None  # the router's verdict header; None from a plain server
    tier: str | None = None  # a "cached" turn's x-agentkv-tier: hbm, or host (decode restored the KV)
    path: str | None = None
    reused_tokens: int | None = None
    pulled_tokens: int | None = None  # of reused_tokens, read from decode (our connector on prefill says)
    error: str | None = None
    cut: bool = False  # still running when the step's drain time ran out

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cut


TextFn = Callable[[int, int], str]  # (conversation index, tokens) -> text


@dataclass(kw_only=True)
class StepRun:
    records: list[TurnRecord]
    wall_s: float
    peak_active: int
    start_delays_s: list[float] = field(default_factory=list)


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], record: TurnRecord
) -> str:
    t0 = time.perf_counter()
    first = last = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            record.error = f"http {response.status_code}"
            return ""
        record.reuse = response.headers.get(H_REUSE)
        record.tier = response.headers.get(H_TIER)
        record.path = response.headers.get(H_PATH)
        reused = response.headers.get(H_REUSED_TOKENS)
        record.reused_tokens = int(reused) if reused and reused.isdigit() else None
        pulled = response.headers.get(H_PULLED_TOKENS)
        record.pulled_tokens = int(pulled) if pulled and pulled.isdigit() else None
        async for line in response.aiter_lines():
            chunk = sse_chunk(line)
            if chunk is None:
                continue
            if "error" in chunk:
                record.error = "stream error"
                return ""
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    last = time.perf_counter()
                    first = first or last
                    parts.append(piece)
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    record.latency_s = end - t0
    record.ttft_s = None if first is None else first - t0
    record.prompt_tokens = usage.get("prompt_tokens")
    record.output_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = details.get("cached_tokens") if isinstance(details, dict) else None
    n = record.output_tokens or len(parts)
    if first is not None and last is not None and n > 1:
        record.tpot_s = (last - first) / (n - 1)
    if first is None:
        record.error = "no tokens"
    return "".join(parts)


async def _heartbeat(client: httpx.AsyncClient, url: str, cid: str, gap_s: float, every_s: float) -> None:
    """Sleep through a tool gap, heartbeating every ``every_s`` as the SDK's Session does (0: never); its
    first beat, at once, says a tool call started, as the SDK's does after an answer that calls tools."""
    end = time.perf_counter() + gap_s

    async def beat(body: dict[str, Any] | None = None) -> None:
        # A missed beat shows as an expired lease on the next turn, which is what we measure.
        with contextlib.suppress(httpx.HTTPError):
            await client.post(f"{url}/v1/conversations/{cid}/heartbeat", json=body, timeout=5)

    if every_s > 0:
        await beat({"tool_call": True})
    while (left := end - time.perf_counter()) > 0:
        step = left if every_s <= 0 else min(left, every_s)
        await asyncio.sleep(step)
        if every_s > 0 and end - time.perf_counter() > 0:
            await beat()


async def run_step(
    plans: Sequence[ConversationPlan],
    *,
    url: str,
    model: str,
    text: TextFn,
    tag: str,
    router: bool,
    heartbeat_s: float = 10.0,
    max_active: int = 64,
    drain_s: float = 30.0,
    timeout_s: float = 120.0,
    on_turn: Callable[[TurnRecord], None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> StepRun:
    """Replay ``plans`` against ``url``; after the last arrival, give in-flight conversations ``drain_s``
    to finish, then cut them (their open turns are recorded as ``cut``, not as errors). ``transport`` is
    for tests."""
    records: list[TurnRecord] = []
    active = 0
    peak = 0
    delays: list[float] = []
    gate = asyncio.Semaphore(max_active)
    t0 = time.perf_counter()

    async def conversation(client: httpx.AsyncClient, plan: ConversationPlan) -> None:
        nonlocal active, peak
        await asyncio.sleep(max(0.0, plan.arrival_s - (time.perf_counter() - t0)))
        ready = time.perf_counter()
        async with gate:
            delays.append(time.perf_counter() - ready)
            active += 1
            peak = max(peak, active)
            cid = f"load-{tag}-{plan.index}"
            messages: list[dict[str, str]] = []
            try:
                for index, step in enumerate(plan.turns):
                    if step.gap_s > 0:
                        await _heartbeat(client, url, cid, step.gap_s, heartbeat_s if router else 0)
                    prefix = "" if index == 0 else "tool result: "
                    messages.append({"role": "user", "content": prefix + text(plan.index, step.new_tokens)})
                    body = {
                        "model": model,
                        "messages": messages,
                        "max_tokens": step.output_tokens,
                        "min_tokens": step.output_tokens,
                        "ignore_eos": True,
                        "temperature": 0,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    }
                    record = TurnRecord(conversation=plan.index, turn=index, sent_s=time.perf_counter() - t0)
                    records.append(record)
                    try:
                        answer = await _stream(client, url, body, {DEFAULT_SESSION_HEADER: cid}, record)
                    except asyncio.CancelledError:
                        record.cut = True
                        raise
                    except (httpx.HTTPError, ValueError) as exc:
                        record.error = type(exc).__name__
                    if on_turn is not None:
                        on_turn(record)
                    if record.error is not None:
                        break  # an agent whose turn failed gives up on the conversation
                    messages.append({"role": "assistant", "content": answer})
            finally:
                active -= 1
                if router:
                    # The SDK's Session.close: decode releases the conversation's KV at once.
                    with contextlib.suppress(httpx.HTTPError, asyncio.CancelledError):
                        await asyncio.shield(client.delete(f"{url}/v1/conversations/{cid}", timeout=5))

    limits = httpx.Limits(max_connections=2 * max_active + 8, max_keepalive_connections=2 * max_active)
    async with httpx.AsyncClient(
        limits=limits, timeout=httpx.Timeout(timeout_s), transport=transport
    ) as client:
        tasks = [asyncio.create_task(conversation(client, plan)) for plan in plans]
        last_arrival = max((p.arrival_s for p in plans), default=0.0)
        deadline = last_arrival + drain_s
        # A low rate over a short window may draw no arrival at all: an empty step, not an error.
        pending: set[asyncio.Task[None]] = set()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - (time.perf_counter() - t0)))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return StepRun(records=records, wall_s=time.perf_counter() - t0, peak_active=peak, start_delays_s=delays)


def _pcts(values: Sequence[float], scale: float = 1e3) -> dict[str, float | None]:
    import numpy as np

    if not values:
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=float), [50, 90, 99]) * scale
    return {"p50": round(float(p50), 2), "p90": round(float(p90), 2), "p99": round(float(p99), 2)}


def summarize_step(run: StepRun, *, slo: SLO) -> dict[str, Any]:
    """Goodput, latency percentiles and reuse of one rate step.

    ``goodput_turns_s``: turns that met both SLO bounds per second of the step. ``slo_ok``: the step as a
    whole met the stated SLO (TTFT p90 and TPOT p90 within bounds, no error, nothing cut)."""
    records = run.records
    ok = [r for r in records if r.ok]
    good = [r for r in ok if slo.met(r.ttft_s, r.tpot_s)]
    errors = dict(Counter(r.error for r in records if r.error is not None))
    cut = sum(1 for r in records if r.cut)
    ttft = _pcts([r.ttft_s for r in ok if r.ttft_s is not None])
    tpot = _pcts([r.tpot_s for r in ok if r.tpot_s is not None])
    # Eligible for reuse: every later turn (the previous one of its conversation succeeded, or it would not
    # have been sent). From a router the verdict header says; from a plain server its prefix cache does.
    eligible = [r for r in ok if r.turn > 0]
    hits = [
        r
        for r in eligible
        if (r.reuse in HIT_VERDICTS if r.reuse is not None else (r.cached_tokens or 0) > 0)
    ]
    prompt = sum(r.prompt_tokens or 0 for r in eligible)
    cached = sum(r.cached_tokens or 0 for r in eligible)
    pulled = [r.pulled_tokens for r in eligible if r.pulled_tokens is not None]
    slo_ok = (
        not errors
        and not cut
        and bool(ok)
        and ttft["p90"] is not None
        and ttft["p90"] <= slo.ttft_s * 1e3
        and (tpot["p90"] is None or tpot["p90"] <= slo.tpot_s * 1e3)
    )
    wall = max(run.wall_s, 1e-9)
    return {
        "turns": len(records),
        "turns_ok": len(ok),
        "turns_good": len(good),
        "errors": errors,
        "cut": cut,
        "wall_s": round(run.wall_s, 2),
        "turns_s": round(len(ok) / wall, 3),
        "goodput_turns_s": round(len(good) / wall, 3),
        "slo_attainment": round(len(good) / len(records), 3) if records else None,
        "slo_ok": slo_ok,
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "eligible_turns": len(eligible),
        "hit_rate": round(len(hits) / len(eligible), 3) if eligible else None,
        "reuse_counts": dict(Counter(r.reuse or "no header" for r in eligible)),
        "tier_counts": dict(Counter(r.tier for r in eligible if r.tier)),
        "cached_token_share": round(cached / prompt, 3) if prompt else None,
        # Prompt tokens of eligible turns that prefill read from decode (None: no prefill reported any).
        "pulled_token_share": round(sum(pulled) / prompt, 3) if prompt and pulled else None,
        "prompt_tokens_mean": round(sum(r.prompt_tokens or 0 for r in ok) / len(ok), 1) if ok else None,
        "peak_active_conversations": run.peak_active,
        "start_delay_ms_max": round(max(run.start_delays_s, default=0.0) * 1e3, 1),
    }


def knee(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The leg's knee: its highest offered rate whose step met the SLO, and the goodput there.

    A leg none of whose steps met the SLO has no knee (goodput 0): its lowest rate was already past it.
    ``reached`` is False when the highest rate that ran still met the SLO. A step that drew no arrival says
    nothing either way and is left out."""
    steps = [s for s in steps if s.get("summary", {}).get("turns") != 0]
    met = [s for s in steps if s.get("summary", {}).get("slo_ok")]
    if not met:
        ran = any("summary" in s for s in steps)
        return {"rate": None, "goodput_turns_s": 0.0, "hit_rate": None, "reached": ran}
    best = max(met, key=lambda s: s["rate"])
    # Only a higher rate that missed the SLO shows the knee is here; otherwise the leg's goodput is only a
    # lower bound (the sweep stopped below the knee).
    reached = any("summary" in s and not s["summary"]["slo_ok"] and s["rate"] > best["rate"] for s in steps)
    return {
        "rate": best["rate"],
        "goodput_turns_s": best["summary"]["goodput_turns_s"],
        "hit_rate": best["summary"]["hit_rate"],
        "reached": reached,
    }


def records_json(records: Sequence[TurnRecord]) -> list[dict[str, Any]]:
    return [asdict(r) for r in records]
