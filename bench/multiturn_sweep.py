"""Multi-turn sweep through the router: TTFT vs prompt length, reuse OFF vs ON (the published result).

    python -m bench.multiturn_sweep                         # CPU, tiny model, small lengths
    python -m bench.multiturn_sweep --device gpu --model /root/model --lengths 2048,8192,16384,24576

Legs, each on its own freshly started 1P1D cluster: ``off`` (``bidirectional_kv_xfer`` false on both servers,
router reuse off), ``on`` (true on both, reuse on, the router's default ``exact=false``) and ``exact`` (as
``on`` with ``exact=true``: only prefill-computed KV reused, answers bit-identical to a recompute).
Prefill runs without prefix caching in every leg (the cache-eviction case the published benchmark
emulates), so every reused token comes from decode. A further, optional leg ``floor`` measures what
reuse can at best achieve: OFF with prefill's own prefix cache on, so
turn N's prefill computes only what is new since turn N-1, over the same context, with no transfer (it
computes up to one block more than ON, whose reuse also covers the previous prompt's partial last block).
Leg ``agg`` is what a user would otherwise run on the same hardware: one vLLM server with prefix caching, no
P/D and no router (``--agg-engine-arg``: give it the memory of P and D); the client talks to it directly, and
its one hop is the whole TTFT (``p_*`` columns: its queue, its compute, the rest).

Per turn, prefill's and decode's engine histograms split the time: engine queue (for a request with remote
KV this is the wait for the transfer and the steps around it), engine prefill compute, and the rest of the
router's prefill hop (HTTP, tokenization, detokenization).

Shapes: ``published`` grows each conversation turn by turn to the given lengths (router path always P/D, so
the pull is measured); ``agentic`` builds a context of each length, then sends a tool-result-sized suffix
(router path ``auto``, so short suffixes may be prefilled on decode). Conversations run one at a time so the
engine's NIXL counters can be attributed to a turn. Per request the fields follow vLLM's multi-turn
benchmark (``ttft_ms``, ``input_num_tokens``, ``output_num_tokens``, ``conversation_id``, ...), plus the
router's prefill time and the KV transfer time/bytes/descriptors read from prefill's ``/metrics``, and
from both engines the bytes moved each way (``bytes_d_to_p``: prefill's reads of decode's retained KV;
``bytes_p_to_d``: decode's reads of the prompt's KV) with a modeled ``ttft_two_node_ms``: P and D on two
nodes at 400 Gb/s, i.e. the measured TTFT with the measured transfer time replaced by bytes / 50 GB/s.

Writes ``multiturn_sweep.json`` (+ PNGs when matplotlib is installed; ``--plot FILE`` re-plots a JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from bench._common import sse_chunks
from bench._plugin_args import (
    add_env_arg,
    add_kv_config_arg,
    add_plugin_args,
    add_prefill_cache_arg,
    plugin_fields,
)

NIXL = {
    "xfer_s": "vllm:nixl_xfer_time_seconds_sum",
    "xfers": "vllm:nixl_xfer_time_seconds_count",
    "post_s": "vllm:nixl_post_time_seconds_sum",
    "bytes": "vllm:nixl_bytes_transferred_sum",
    "descriptors": "vllm:nixl_num_descriptors_sum",
}
# Request-phase histograms, read on both engines (sums, in seconds).
PHASES = {
    "queue_s": "vllm:request_queue_time_seconds_sum",
    "engine_prefill_s": "vllm:request_prefill_time_seconds_sum",
    "e2e_s": "vllm:e2e_request_latency_seconds_sum",
    "ttft_s": "vllm:time_to_first_token_seconds_sum",
}
_SAMPLE = re.compile(r"^([a-zA-Z_:]+)(?:\{[^}]*\})? ([-+0-9.eE]+)$")


def scrape(url: str, metrics: dict[str, str] | None = None) -> dict[str, float]:
    metrics = NIXL | PHASES if metrics is None else metrics
    out = dict.fromkeys(metrics, 0.0)
    names = {v: k for k, v in metrics.items()}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        m = _SAMPLE.match(line)
        if m and m[1] in names:
            out[names[m[1]]] += float(m[2])
    return out


# Filler text. The tiny CPU model's BPE knows these English words; the GPU recipe's WordLevel tokenizer knows
# only "w<id>" words, one token each (gpu_words).
FILLER_WORDS = "agent tool search file row column query report number answer table cache block".split()


def gpu_words(rng: random.Random, n: int) -> str:
    """``n`` random words of the GPU recipe's vocabulary, i.e. ``n`` tokens."""
    return " ".join(f"w{rng.randint(10, 150_000)}" for _ in range(n))


class Words:
    """Filler text. A WordLevel tokenizer (the GPU recipe's) makes one token per ``w<N>`` word."""

    def __init__(self, model_dir: str, seed: int) -> None:
        self.rng = random.Random(seed)
        kind = ""
        tok = Path(model_dir) / "tokenizer.json"
        if tok.exists():
            kind = json.loads(tok.read_text()).get("model", {}).get("type", "")
        self.wordlevel = kind == "WordLevel"

    def text(self, n_tokens: int) -> str:
        if self.wordlevel:
            return gpu_words(self.rng, n_tokens)
        # BPE on the tiny model: about 1.3 tokens per word+number pair; corrected by measured usage.
        return " ".join(
            self.rng.choice(FILLER_WORDS) + str(self.rng.randint(0, 99)) for _ in range(n_tokens // 2)
        )


CALL_TOKENS = 40  # the tiny model's chat template; `measure_call_tokens` asks the served model's


def _read_file(call_id: str, path: str, result: str) -> list[dict[str, Any]]:
    from bench._common import tool_step

    return tool_step(call_id, result, name="read_file", arguments=json.dumps({"path": path}))


def measure_call_tokens(client: httpx.Client, prefill_url: str, model: str) -> int:
    """The tokens one tool call and the markers around its (empty) result take under the served model's chat
    template, from prefill's `/tokenize`: what `turn_messages` leaves out of each result's text."""

    def count(messages: list[dict[str, Any]]) -> int:
        r = client.post(f"{prefill_url}/tokenize", json={"model": model, "messages": messages})
        r.raise_for_status()
        return int(r.json()["count"])

    task = [{"role": "user", "content": "task"}]
    return max(0, count(task + _read_file("call_000000000000", "src/main.py", "")) - count(task))


def turn_messages(
    words: Words, tokens: int, message_tokens: int, *, first: bool = True, call_tokens: int = CALL_TOKENS
) -> list[dict[str, Any]]:
    """A turn's new text as messages: one user message, or (``message_tokens`` > 0) as an agent's: on the
    first turn the user's task, then tool calls (an assistant message calling ``read_file``) each answered by
    a tool result of about ``message_tokens`` tokens, the turn ending on a tool result. Work that grows with
    the number of messages (their validation on every hop, the client's own transform) shows only in the
    second form."""
    if message_tokens <= 0 or (first and tokens <= message_tokens):
        return [{"role": "user", "content": words.text(tokens)}]
    n = max(1, -(-tokens // message_tokens))
    messages: list[dict[str, Any]] = [{"role": "user", "content": words.text(tokens // n)}] if first else []
    # A call and the markers around its result take tokens of their own: left out of the result's text, so
    # that a turn keeps about the length asked for.
    result_tokens = max(16, tokens // n - call_tokens)
    for _ in range(n - 1 if first else n):
        call_id = f"call_{words.rng.randrange(16**12):012x}"
        path = f"src/{words.text(2).replace(' ', '_')}.py"
        messages += _read_file(call_id, path, words.text(result_tokens))
    return messages


def stream_turn(
    client: httpx.Client,
    router: str,
    model: str,
    cid: str,
    messages: list[dict[str, Any]],
    out_tokens: int,
) -> dict[str, Any]:
    """One streamed turn, timed from the request's send on `client`, a client kept for the whole leg as an
    agent keeps one: a client built per turn (`httpx.stream`) would put its construction into every TTFT
    (~21 ms on a 2-core CPU, most of it its TLS context)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": out_tokens,
        "min_tokens": out_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    ttft = first_event = None
    text = ""
    usage: dict[str, Any] = {}
    with client.stream(
        "POST", f"{router}/v1/chat/completions", json=body, headers={"x-session-id": cid}, timeout=600
    ) as r:
        headers = dict(r.headers)
        for chunk in sse_chunks(r):
            for ch in chunk.get("choices", []):
                # vLLM's first chunk (the role) leaves with the first token, whatever its text.
                first_event = first_event or time.perf_counter()
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft or time.perf_counter()
                    text += piece
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    if ttft is None:
        # Tokens without text (a random model past its trained length emits some): the whole answer would
        # pass for the first token. The first event is when the first token arrived.
        print(f"warning: {cid}: no text in the answer; ttft_ms is the first event's time", flush=True)
    return {
        "ttft_ms": round(((ttft or first_event or end) - t0) * 1e3, 2),
        # The first streamed event (vLLM sends the role with the first token): ttft_ms unless that token had
        # no text of its own (a partial character, a skipped special token).
        "first_event_ms": round(((first_event or end) - t0) * 1e3, 2),
        "text_in_answer": ttft is not None,
        "latency_ms": round((end - t0) * 1e3, 2),
        "input_num_tokens": usage.get("prompt_tokens"),
        "output_num_tokens": usage.get("completion_tokens"),
        "prefill_ms": float(headers.get("x-agentkv-prefill-ms") or "nan"),
        # The token path's one render (chat template + tokenizer on prefill's API server), before the P hop.
        "render_ms": float(headers.get("x-agentkv-render-ms") or "nan"),
        "reuse": headers.get("x-agentkv-reuse"),
        "path": headers.get("x-agentkv-path"),
        "reused_tokens": int(headers.get("x-agentkv-reused-tokens") or 0),
        "text": text,
    }


def api_ms(prefill_ms: float, queue_ms: float, engine_prefill_ms: float) -> float:
    """The router's prefill hop minus the engine's queue and compute: HTTP, rendering, tokenization.

    Not hop minus the engine's e2e histogram: vLLM 0.26 records no e2e for a request that ends holding its
    KV for a remote decode (every P request), which made this the whole hop."""
    if prefill_ms != prefill_ms:  # NaN: the router sent no timing header
        return float("nan")
    return round(prefill_ms - queue_ms - engine_prefill_ms, 2)


def phase_split(
    p: dict[str, float], d: dict[str, float], prefill_ms: float, *, ttft_ms: float, render_ms: float
) -> dict[str, float]:
    """Where one turn's time went, from the engines' histogram deltas and the router's headers (ms).

    TTFT = render (token path) + P hop + D hop; each hop = its engine's queue + compute (for decode: from
    scheduled to first token, waiting for P's KV included) + the rest (HTTP, JSON, rendering and tokenizing
    where the hop still does it, the detokenizer's first step: `*_api_ms`).

    vLLM's own TTFT histogram is kept as `d_vllm_ttft_ms` but is not the engine's part: vLLM takes a request's
    arrival time before it renders and tokenizes the prompt, so on a decode that renders the messages again
    (vLLM < 0.32) it counts that too."""
    ms = {k: round(v * 1e3, 2) for k, v in p.items() if k in PHASES}
    render = 0.0 if render_ms != render_ms else render_ms
    d_hop = round(ttft_ms - render - prefill_ms, 2)
    d_queue, d_engine = round(d["queue_s"] * 1e3, 2), round(d["engine_prefill_s"] * 1e3, 2)
    return {
        "p_queue_ms": ms["queue_s"],
        "p_engine_prefill_ms": ms["engine_prefill_s"],
        "p_api_ms": api_ms(prefill_ms, ms["queue_s"], ms["engine_prefill_s"]),
        "d_hop_ms": d_hop,
        "d_queue_ms": d_queue,
        "d_engine_prefill_ms": d_engine,
        "d_vllm_ttft_ms": round(d["ttft_s"] * 1e3, 2),
        "d_api_ms": round(d_hop - d_queue - d_engine, 2),
    }


# Bytes each way and a two-node TTFT (issue 15). NIXL counts a transfer on the engine that initiates the
# read: prefill's reads pull decode's retained KV (D->P), decode's reads pull the prompt's KV from prefill
# (P->D). Both sit on a turn's path to its first token.
TWO_NODE_BYTES_PER_S = 50e9  # 400 Gb/s, one NIC per node


def transfer_directions(p: dict[str, float], d: dict[str, float]) -> dict[str, float | int]:
    """Bytes, transfer time (ms) and transfer count of one turn, per direction, from both engines' NIXL
    deltas (keys of ``NIXL``)."""
    out: dict[str, float | int] = {}
    for way, delta in (("d_to_p", p), ("p_to_d", d)):
        out[f"bytes_{way}"] = int(delta["bytes"])
        out[f"xfer_ms_{way}"] = round(delta["xfer_s"] * 1e3, 3)
        out[f"xfers_{way}"] = int(delta["xfers"])
    return out


def two_node_ttft_ms(
    ttft_ms: float, directions: dict[str, float | int], *, bytes_per_s: float = TWO_NODE_BYTES_PER_S
) -> float:
    """The measured TTFT with the same-GPU copies replaced by a link: measured transfer time out, bytes over
    ``bytes_per_s`` in, both directions. Models the wire only (no extra latency, no overlap with compute)."""
    measured_ms = float(directions["xfer_ms_d_to_p"]) + float(directions["xfer_ms_p_to_d"])
    wire_ms = (int(directions["bytes_d_to_p"]) + int(directions["bytes_p_to_d"])) / bytes_per_s * 1e3
    return round(ttft_ms - measured_ms + wire_ms, 2)


def run_leg(
    args: argparse.Namespace,
    shape: str,
    leg: str,
    prefill_url: str,
    router: str,
    model: str,
    decode_url: str | None = None,
    on_turn: Callable[[], None] = lambda: None,
) -> list[dict[str, Any]]:
    with httpx.Client(timeout=600) as client:
        rows: list[dict[str, Any]] = []
        lengths = [int(x) for x in args.lengths.split(",")]
        per_call = measure_call_tokens(client, prefill_url, model) if args.message_tokens > 0 else CALL_TOKENS
        for conv in range(args.conversations):
            words = Words(args.model, seed=1000 * conv + 7)  # same text in both legs
            if shape == "published":
                plan = [(f"turn{i + 1}", n) for i, n in enumerate(lengths)]
                convs = [plan]
            else:
                convs = [[("context", n), ("suffix", n + args.suffix)] for n in lengths]
            for plan in convs:
                cid = f"{leg}-{conv}-{uuid.uuid4().hex[:8]}"
                history: list[dict[str, Any]] = []
                have = 0
                for turn, (label, target) in enumerate(plan):
                    # The agentic suffix is what the turn adds to the history as it is, whatever the context's
                    # length came to.
                    add = max(16, args.suffix - args.output_tokens if label == "suffix" else target - have)
                    history += turn_messages(
                        words, add, args.message_tokens, first=turn == 0, call_tokens=per_call
                    )
                    before = scrape(prefill_url)
                    d_before = scrape(decode_url) if decode_url else dict.fromkeys(NIXL | PHASES, 0.0)
                    row = stream_turn(client, router, model, cid, history, args.output_tokens)
                    if leg == "agg":  # no router, no headers: the one server's hop is the whole turn
                        row["prefill_ms"] = row["ttft_ms"]
                    after = scrape(prefill_url)
                    d_after = scrape(decode_url) if decode_url else dict.fromkeys(NIXL | PHASES, 0.0)
                    history.append({"role": "assistant", "content": row.pop("text")})
                    have = (row["input_num_tokens"] or target) + args.output_tokens
                    xfer = {k: after[k] - before[k] for k in NIXL}
                    row.update(
                        leg=leg,
                        shape=args.shape,
                        conversation_id=cid,
                        turn=turn + 1,
                        label=label,
                        target_tokens=target,
                        transfer_ms=round(xfer["xfer_s"] * 1e3, 3),
                        post_ms=round(xfer["post_s"] * 1e3, 3),
                        transfer_bytes=int(xfer["bytes"]),
                        descriptors=int(xfer["descriptors"]),
                        transfers=int(xfer["xfers"]),
                    )
                    on_turn()
                    row.update(
                        transfer_directions(
                            {k: after[k] - before[k] for k in NIXL},
                            {k: d_after[k] - d_before[k] for k in NIXL},
                        )
                    )
                    row["ttft_two_node_ms"] = two_node_ttft_ms(row["ttft_ms"], row)
                    row["compute_ms"] = round(row["prefill_ms"] - row["transfer_ms"], 2)
                    row.update(
                        phase_split(
                            {k: after[k] - before[k] for k in PHASES},
                            {k: d_after[k] - d_before[k] for k in PHASES},
                            row["prefill_ms"],
                            ttft_ms=row["ttft_ms"],
                            render_ms=row["render_ms"],
                        )
                    )
                    rows.append(row)
                    print(
                        json.dumps(
                            {
                                k: row[k]
                                for k in (
                                    "leg",
                                    "label",
                                    "input_num_tokens",
                                    "ttft_ms",
                                    "render_ms",
                                    "prefill_ms",
                                    "transfer_ms",
                                    "p_queue_ms",
                                    "p_api_ms",
                                    "d_api_ms",
                                    "p_engine_prefill_ms",
                                    "d_queue_ms",
                                    "bytes_d_to_p",
                                    "bytes_p_to_d",
                                    "ttft_two_node_ms",
                                    "reuse",
                                    "path",
                                )
                            }
                        ),
                        flush=True,
                    )
                # Close the conversation as the SDK's Session.close does: decode releases its lease at
                # once, so the next conversation finds decode's KV free (on a 32B shape one retained 24k
                # turn fills it).
                if leg != "agg":
                    client.delete(f"{router}/v1/conversations/{cid}", timeout=30)
        return rows

    # Legs whose router reuses decode's KV (the engines run with bidirectional transfer).


REUSE_LEGS = ("on", "exact")


def start_leg(args: argparse.Namespace, leg: str) -> Any:
    from agentkv.server.launch._cluster import Cluster, ClusterConfig

    on = leg in REUSE_LEGS
    extra_args = list(args.engine_arg or [])
    cfg = ClusterConfig(
        model=args.model,
        device=args.device,
        bidirectional=on,
        prefill_prefix_caching=leg == "floor" or (on and args.prefill_prefix_caching),
        router_port=None,
        max_model_len=args.max_model_len,
        lease_s=args.lease_s,
        log_dir=Path(args.log_dir) / leg,
        extra_args=extra_args,
        env=dict(args.env),
        extra_kv_config=dict(args.kv_config),
        # The stock legs run vLLM as shipped; the reuse legs run agentkv's engines.
        **plugin_fields(args, reuse=on),
        prefill_port=args.port_base + 100,
        decode_port=args.port_base + 200,
    )
    cluster = Cluster(config=cfg)
    t = time.monotonic()
    cluster.up()
    print(f"[{leg}] engines ready in {time.monotonic() - t:.0f}s", flush=True)
    return cluster


def plugin_counts(url: str) -> dict[str, float]:
    """An engine's counters of agentkv's vLLM plugin ({} without it), keyed like
    `tokenizer_cache_prompts{result="hit"}` or `forwarded_ids_prompts{form="packed"}`."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    counts = {}
    for line in text.splitlines():
        if line.startswith("agentkv_") and "_total" in line:
            name, _, value = line.rpartition(" ")
            counts[name.removeprefix("agentkv_").replace("_total", "")] = float(value)
    return counts


def run_agg(args: argparse.Namespace, shape: str) -> list[dict[str, Any]]:
    """Leg ``agg``: one vLLM server with prefix caching; the client streams to it directly."""
    from agentkv.server.launch._launcher import Engine, EngineSpec

    spec = EngineSpec(
        role="single",
        model=args.model,
        device=args.device,
        port=args.port_base + 300,
        max_model_len=args.max_model_len,
        prefix_caching=True,
        cpu_kvcache_gib=2,  # on CPU, the KV space of P and D together (1 GiB each)
        extra_args=list(args.agg_engine_arg if args.agg_engine_arg is not None else args.engine_arg or []),
        env=dict(args.env),
        **plugin_fields(args, reuse=False),  # vLLM as a user would run it alone
        log_path=Path(args.log_dir) / "agg" / "single.log",
    )
    engine = Engine(spec=spec, name="single")
    t = time.monotonic()
    engine.start()
    try:
        engine.wait_healthy(timeout_s=900)
        print(f"[agg] engine ready in {time.monotonic() - t:.0f}s", flush=True)
        model = httpx.get(f"{spec.url}/v1/models", timeout=10).json()["data"][0]["id"]
        with _progress(f"agg {shape}", _turns(args, shape)) as advance:
            return run_leg(args, shape, "agg", spec.url, spec.url, model, on_turn=advance)
    finally:
        engine.stop()


def start_leg_router(args: argparse.Namespace, cluster: Any, leg: str, shape: str) -> Any:
    from agentkv.server.launch._launcher import start_router

    policy = args.path_policy or ("always-pd" if shape == "published" else "auto")
    # `on` is the router's default (vLLM's prefix-cache semantics: decode serves what it holds from its own
    # prefix cache); `exact` makes every answer bit-identical to a recompute.
    flags = ["--path-policy", policy, "--exact" if leg == "exact" else "--no-exact"]
    return start_router(
        port=args.port_base + {"on": 1, "off": 2, "exact": 4}.get(leg, 3),
        prefill=[cluster.prefills[0].spec.url],
        decode=[cluster.decodes[0].spec.url],
        log=Path(args.log_dir) / f"router-{leg}-{shape}.log",
        args=[*flags, *([] if leg in REUSE_LEGS else ["--no-reuse"])],
    )


def summarize(rows: list[dict[str, Any]], shape: str) -> list[dict[str, Any]]:
    from statistics import median

    out = []
    labels = sorted({(r["target_tokens"], r["label"]) for r in rows})
    for target, label in labels:
        if shape == "agentic" and label != "suffix":
            continue
        entry: dict[str, Any] = {"target_tokens": target, "label": label}
        for leg in ("off", "on", "exact", "floor", "agg"):
            rs = [r for r in rows if r["leg"] == leg and r["target_tokens"] == target and r["label"] == label]
            if not rs:
                continue
            for r in rs:  # results written before api_ms existed carry the whole hop here
                if isinstance(r.get("p_engine_prefill_ms"), int | float):
                    r["p_api_ms"] = api_ms(r["prefill_ms"], r["p_queue_ms"], r["p_engine_prefill_ms"])
            for key in (
                "ttft_ms",
                "render_ms",
                "prefill_ms",
                "transfer_ms",
                "compute_ms",
                "input_num_tokens",
                "reused_tokens",
                "p_queue_ms",
                "p_engine_prefill_ms",
                "p_api_ms",
                "d_queue_ms",
                "d_engine_prefill_ms",
                "d_vllm_ttft_ms",
                "d_hop_ms",
                "d_api_ms",
                "bytes_d_to_p",
                "bytes_p_to_d",
                "ttft_two_node_ms",
            ):
                vals = [r[key] for r in rs if isinstance(r.get(key), int | float)]
                entry[f"{key}_{leg}"] = round(median(vals), 2) if vals else None
            entry[f"paths_{leg}"] = sorted({str(r["path"]) for r in rs})
        for leg in REUSE_LEGS:
            if entry.get("ttft_ms_off") and entry.get(f"ttft_ms_{leg}"):
                entry[f"ttft_ratio_{leg}_off"] = round(entry[f"ttft_ms_{leg}"] / entry["ttft_ms_off"], 3)
        if entry.get("ttft_ms_agg") and entry.get("ttft_ms_on"):
            entry["ttft_ratio_on_agg"] = round(entry["ttft_ms_on"] / entry["ttft_ms_agg"], 3)
        if entry.get("prefill_ms_floor") and entry.get("prefill_ms_on"):
            entry["prefill_ratio_on_floor"] = round(entry["prefill_ms_on"] / entry["prefill_ms_floor"], 3)
        out.append(entry)
    return out


def _mb(value: float | None) -> float | None:
    return None if value is None else round(value / 1e6, 1)


def plot(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    from bench._common import bar_chart, line_chart, print_table

    summary = doc["data"]["summary"]
    tag = f"{doc['data']['device']} {doc['data']['shape']}"
    # A single leg (the repro trio writes one per run) has only its own columns.
    xs = [
        next(
            (
                s[k]
                for k in (
                    "input_num_tokens_on",
                    "input_num_tokens_off",
                    "input_num_tokens_floor",
                    "input_num_tokens_agg",
                )
                if s.get(k)
            ),
            s["target_tokens"],
        )
        for s in summary
    ]
    paths = [
        line_chart(
            out_dir / f"ttft_vs_length_{doc['data']['shape']}.png",
            title=f"TTFT vs prompt length ({tag})",
            series={
                label: (xs, [s.get(f"ttft_ms_{leg}") or 0 for s in summary])
                for leg, label in (
                    ("off", "reuse OFF"),
                    ("on", "reuse ON"),
                    ("exact", "reuse ON, exact"),
                    ("floor", "floor (prefill cache warm)"),
                    ("agg", "one vLLM server, prefix cache"),
                )
                if leg in ("off", "on") or any(s.get(f"ttft_ms_{leg}") for s in summary)
            },
            xlabel="prompt tokens",
            ylabel="TTFT ms (median)",
        )
    ]
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(summary)), 4.0))
    for i, s in enumerate(summary):
        off = s.get("prefill_ms_off") or 0
        comp, xfer = s.get("compute_ms_on") or 0, s.get("transfer_ms_on") or 0
        ax.bar(i - 0.2, off, 0.4, color="tab:gray", label="OFF: prefill (recompute)" if i == 0 else None)
        ax.bar(i + 0.2, comp, 0.4, color="tab:blue", label="ON: prefill compute" if i == 0 else None)
        ax.bar(
            i + 0.2, xfer, 0.4, bottom=comp, color="tab:orange", label="ON: KV transfer" if i == 0 else None
        )
        if s.get("prefill_ms_floor"):
            ax.hlines(s["prefill_ms_floor"], i, i + 0.4, colors="black", label="floor" if i == 0 else "")
    ax.set_xticks(range(len(summary)), [f"{x:,.0f}" for x in xs])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill ms (median)")
    ax.set_title(f"Prefill time, OFF vs ON ({tag})")
    ax.legend()
    fig.tight_layout()
    p = out_dir / f"prefill_split_{doc['data']['shape']}.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)
    cols = [
        "tokens",
        "TTFT off",
        "TTFT on",
        "on/off",
        "prefill off",
        "prefill on",
        "xfer on",
        "P queue on",
        "floor",
        "on/floor",
        "reused",
        "paths on",
        "D->P MB on",
        "P->D MB on",
        "2-node TTFT off",
        "2-node TTFT on",
        "TTFT agg",
        "on/agg",
    ]
    rows = [
        [
            s.get("input_num_tokens_on"),
            s.get("ttft_ms_off"),
            s.get("ttft_ms_on"),
            s.get("ttft_ratio_on_off"),
            s.get("prefill_ms_off"),
            s.get("prefill_ms_on"),
            s.get("transfer_ms_on"),
            s.get("p_queue_ms_on"),
            s.get("prefill_ms_floor"),
            s.get("prefill_ratio_on_floor"),
            s.get("reused_tokens_on"),
            ",".join(s.get("paths_on") or []),
            _mb(s.get("bytes_d_to_p_on")),
            _mb(s.get("bytes_p_to_d_on")),
            s.get("ttft_two_node_ms_off"),
            s.get("ttft_two_node_ms_on"),
            s.get("ttft_ms_agg"),
            s.get("ttft_ratio_on_agg"),
        ]
        for s in summary
    ]
    print_table(f"multi-turn sweep ({tag})", cols, rows)
    del bar_chart
    return paths


def _turns(args: argparse.Namespace, shape: str) -> int:
    n = len(args.lengths.split(","))
    return args.conversations * (n if shape == "published" else 2 * n)


@contextlib.contextmanager
def _progress(description: str, total: int) -> Iterator[Callable[[], None]]:
    """A progress bar on stderr; none where rich is missing (the GPU host may lack it)."""
    try:
        from bench._common import make_progress
    except ImportError:
        yield lambda: None
        return
    with make_progress() as progress:
        task = progress.add_task(description, total=total)
        yield lambda: progress.advance(task)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "gpu"], default=None)
    ap.add_argument("--model", default=".agentkv/models/tiny")
    ap.add_argument("--shape", default="published", help="published, agentic or both: published,agentic")
    ap.add_argument("--lengths", default="512,1024,2048,3072")
    ap.add_argument("--suffix", type=int, default=256, help="agentic shape: new tokens in the suffix turn")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument(
        "--message-tokens",
        type=int,
        default=0,
        help="send each turn's new text as an agent's: tool calls answered by tool results of about this "
        "many tokens, after the user's task on the first turn (default 0: one user message a turn)",
    )
    ap.add_argument(
        "--path-policy",
        choices=("auto", "always-local", "always-pd"),
        default=None,
        help="the reuse legs' router path policy (default: always-pd for the published shape, so that the "
        "pull is measured; auto for agentic). always-local measures the decode-local turn where the cost "
        "model would pull (this CPU at long contexts)",
    )
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--lease-s", type=float, default=60)
    ap.add_argument(
        "--legs",
        default="off,on",
        help="off, on (the router's default), exact (bit-identical), floor (OFF, prefill prefix cache), "
        "agg (one vLLM server with prefix caching, no router)",
    )
    ap.add_argument("--engine-arg", action="append", help="extra vLLM flag (repeat)")
    ap.add_argument(
        "--agg-engine-arg", action="append", help="extra vLLM flag for agg (default: --engine-arg)"
    )
    add_env_arg(ap)
    add_kv_config_arg(ap)
    add_prefill_cache_arg(ap)
    add_plugin_args(ap)
    ap.add_argument("--port-base", type=int, default=21000)
    ap.add_argument("--log-dir", default=".agentkv/bench-logs")
    ap.add_argument(
        "--out", default=None, help="output dir (default bench/results/multiturn_sweep_<device>_<shape>)"
    )
    ap.add_argument("--router", default=None, help="attach to this running router instead of starting legs")
    ap.add_argument("--prefill-url", default=None, help="with --router: the prefill engine (for its metrics)")
    ap.add_argument("--decode-url", default=None, help="with --router: the decode engine (for its metrics)")
    ap.add_argument("--plot", default=None, help="only re-plot this JSON")
    ap.add_argument("--merge", nargs="+", default=None, help="combine per-leg JSONs (same shape) into --out")
    args = ap.parse_args(argv)
    if args.merge:
        docs = [json.loads(Path(p).read_text()) for p in args.merge]
        shape, device = docs[0]["data"]["shape"], docs[0]["data"]["device"]
        merged = [r for d in docs for r in d["data"]["requests"]]
        data = {
            "device": device,
            "shape": shape,
            "requests": merged,
            "summary": summarize(merged, shape),
            "merged_from": [d.get("command") for d in docs],
            # The runs' own engines and host (the device's vLLM/NIXL), not this machine's.
            "merged_versions": [d.get("versions") for d in docs],
        }
        from bench._common import write_results

        path = write_results(f"multiturn_sweep_{shape}", data, out_dir=args.out)
        plot(json.loads(path.read_text()), path.parent)
        return
    if args.plot:
        doc = json.loads(Path(args.plot).read_text())
        plot(doc, Path(args.plot).parent)
        return
    if args.device is None:
        from agentkv.server.launch._launcher import detect_device

        args.device = detect_device()
    if args.device == "cpu":
        from agentkv.server.launch._model import ensure_tiny_model

        ensure_tiny_model(Path(args.model))
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    shapes = args.shape.split(",")
    rows: dict[str, list[dict[str, Any]]] = {shape: [] for shape in shapes}
    plugin: dict[str, dict[str, dict[str, float]]] = {}
    if args.router:
        # Attached to a cluster someone else started (bench/repro/serve.sh): one leg, one shape at a time.
        if not (args.prefill_url and args.decode_url) or len(args.legs.split(",")) != 1:
            ap.error("--router needs --prefill-url, --decode-url and exactly one --legs name")
        model = httpx.get(f"{args.router}/v1/models", timeout=10).json()["data"][0]["id"]
        for shape in shapes:
            with _progress(f"{args.legs} {shape}", _turns(args, shape)) as advance:
                rows[shape] += run_leg(
                    args,
                    shape,
                    args.legs,
                    args.prefill_url,
                    args.router,
                    model,
                    decode_url=args.decode_url,
                    on_turn=advance,
                )
    for leg in [] if args.router else args.legs.split(","):
        if leg == "agg":
            for shape in shapes:
                rows[shape] += run_agg(args, shape)
            continue
        cluster = start_leg(args, leg)
        try:
            for shape in shapes:
                router_proc = start_leg_router(args, cluster, leg, shape)
                router = router_proc.url
                try:
                    model = httpx.get(f"{router}/v1/models", timeout=10).json()["data"][0]["id"]
                    with _progress(f"{leg} {shape}", _turns(args, shape)) as advance:
                        rows[shape] += run_leg(
                            args,
                            shape,
                            leg,
                            cluster.prefills[0].spec.url,
                            router,
                            model,
                            decode_url=cluster.decodes[0].spec.url,
                            on_turn=advance,
                        )
                    # Partial results survive a killed run (the GPU host gives each command 10 minutes).
                    partial = Path(args.out or ".") / f"partial_{shape}.json"
                    partial.parent.mkdir(parents=True, exist_ok=True)
                    partial.write_text(
                        json.dumps({"data": {"device": args.device, "shape": shape, "requests": rows[shape]}})
                    )
                finally:
                    router_proc.stop()
            # The plugin's counters (API server) and the connector's (engine core, on its service's /metrics).
            plugin[leg] = {
                e.spec.role: {
                    **plugin_counts(e.spec.url),
                    **(plugin_counts(e.spec.service_url) if e.spec.service_url else {}),
                }
                for e in cluster.engines
            }
        finally:
            cluster.down()
    for shape in shapes:
        data = {
            "device": args.device,
            "shape": shape,
            "requests": rows[shape],
            "summary": summarize(rows[shape], shape),
            # Each engine's plugin counters (tokenizer cache, detokenizer tail, forwarded ids) and its
            # connector's (`connector_...`: block hashes, pulls) at the end of its leg (all its shapes).
            "plugin": plugin,
        }
        out_dir = Path(args.out or f"bench/results/multiturn_sweep_{args.device}")
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            from bench._common import write_results

            path = write_results(f"multiturn_sweep_{shape}", data, out_dir=out_dir)
            plot(json.loads(path.read_text()), out_dir)
        except ImportError:  # no matplotlib/rich (the GPU host): JSON only, plot later with --plot
            path = out_dir / f"multiturn_sweep_{shape}.json"
            doc = {"benchmark": "multiturn_sweep", "command": " ".join(sys.argv), "data": data}
            path.write_text(json.dumps(doc, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
