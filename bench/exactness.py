"""Exactness: are a reuse turn's logprobs bit-identical to a recompute's? (issue 5)

    python -m bench.exactness                       # starts a 1P1D CPU cluster with the tiny model (~4 min)
    python -m bench.exactness --no-exact            # the reuse router not exact (decode reads its own cache)
    python -m bench.exactness --on URL --off URL    # two routers in front of a running cluster

Per seeded conversation: three turns through the reuse router (each adds its answer and a tool result), each
reuse turn repeated through the no-reuse router, all greedy with ``logprobs`` and ``top_logprobs=2``.
Reported per reuse turn: whether the tokens are equal, the largest logprob difference, and the smallest
top-1/top-2 gap of the baseline (a near tie is where a tiny difference flips a greedy token). The baseline
router is always exact (it keeps decode's own prefix cache out of its decode hops), so it is an independent
recompute; ``--no-exact`` makes only the reuse router let decode read its own prefix cache.
"""

from __future__ import annotations

import argparse
import random
import uuid
from pathlib import Path
from typing import Any

import httpx

from bench._common import bar_chart, make_progress, print_table, results_dir, write_results
from bench._plugin_args import add_env_arg
from bench.multiturn_sweep import FILLER_WORDS, gpu_words

NAME = "exactness"


def _text(rng: random.Random, lo: int, hi: int, *, words: list[str] | None) -> str:
    """Random words; ``words=None``: the GPU model's vocabulary ("w<id>", one token each)."""
    n = rng.randint(lo, hi)
    if words is None:
        return gpu_words(rng, n)
    return " ".join(rng.choice(words) for _ in range(n))


def _turn(
    url: str, model: str, messages: list[dict[str, str]], cid: str | None
) -> tuple[str, list[Any], str | None]:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "return_tokens_as_token_ids": True,
    }
    headers = {"x-session-id": cid} if cid else {}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=600)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["message"]["content"] or "", choice["logprobs"]["content"], r.headers.get("x-agentkv-reuse")


def compare(
    on: str, off: str, model: str, seeds: range, *, words: list[str] | None = FILLER_WORDS
) -> list[dict[str, Any]]:
    rows = []
    with make_progress() as progress:
        task = progress.add_task("conversations", total=len(seeds))
        for seed in seeds:
            rng = random.Random(seed)
            cid = f"exact-{uuid.uuid4().hex[:12]}"
            first = uuid.uuid4().hex + " " + _text(rng, 150, 300, words=words)
            history = [{"role": "user", "content": first}]
            answer, _, _ = _turn(on, model, history, cid)
            for turn in (2, 3):
                history += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": _text(rng, 40, 120, words=words)},
                ]
                answer, reused, reuse = _turn(on, model, history, cid)
                _, baseline, _ = _turn(off, model, history, None)
                gaps = [
                    abs(t["top_logprobs"][0]["logprob"] - t["top_logprobs"][1]["logprob"]) for t in baseline
                ]
                rows.append(
                    {
                        "seed": seed,
                        "turn": turn,
                        "reuse": reuse,
                        "same_tokens": [t["token"] for t in reused] == [t["token"] for t in baseline],
                        "max_logprob_diff": max(
                            abs(a["logprob"] - b["logprob"]) for a, b in zip(reused, baseline, strict=False)
                        ),
                        "min_top2_gap": min(gaps) if gaps else None,
                    }
                )
            progress.advance(task)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--on", default=None, help="reuse router URL (with --off: attach instead of starting)")
    ap.add_argument("--off", default=None, help="no-reuse router URL")
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--no-exact", dest="exact", action="store_false", help="the reuse router not exact")
    ap.add_argument("--model", default=".agentkv/models/tiny")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="gpu: the H200, dummy weights")
    ap.add_argument("--engine-arg", action="append", default=[], help="extra vLLM flag (repeat)")
    add_env_arg(ap)
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args(argv)
    seeds = range(700, 700 + args.seeds)
    if args.on and args.off:
        model = httpx.get(f"{args.on}/v1/models", timeout=10).json()["data"][0]["id"]
        rows = compare(args.on, args.off, model, seeds, words=_words(args.device))
    else:
        rows = _with_cluster(args, seeds)
    identical = sum(r["max_logprob_diff"] == 0.0 for r in rows)
    changed = sum(not r["same_tokens"] for r in rows)
    hits = sum(r["reuse"] == "hit" for r in rows)
    mode = "exact" if args.exact else "not exact"
    print_table(
        f"reuse vs recompute ({mode}): {identical} of {len(rows)} reuse turns bit-identical, "
        f"{changed} answers changed, {hits} hits",
        ["seed", "turn", "reuse", "same tokens", "max |d logprob|", "min top-2 gap"],
        [
            [r["seed"], r["turn"], r["reuse"], r["same_tokens"], r["max_logprob_diff"], r["min_top2_gap"]]
            for r in rows
        ],
    )
    plot(rows, results_dir(NAME, args.out), title=f"reuse turns vs an independent recompute ({mode})")
    data = {"exact": args.exact, "turns": rows, "bit_identical": identical, "changed": changed, "hits": hits}
    write_results(NAME, {**data, "device": args.device, "engine_env": dict(args.env)}, out_dir=args.out)


def _words(device: str) -> list[str] | None:
    # The GPU model's tokenizer knows "w<id>" words only; the tiny CPU model's BPE knows English.
    return None if device == "gpu" else FILLER_WORDS


def plot(rows: list[dict[str, Any]], out: Path, *, title: str) -> Path:
    """Per reuse turn (2 and 3): how many were bit-identical, kept their tokens, were hits."""
    labels = ["bit-identical logprobs", "same tokens", "reuse hit"]
    series = {
        f"turn {turn}": [
            sum(r["max_logprob_diff"] == 0.0 for r in rows if r["turn"] == turn),
            sum(r["same_tokens"] for r in rows if r["turn"] == turn),
            sum(r["reuse"] == "hit" for r in rows if r["turn"] == turn),
        ]
        for turn in sorted({r["turn"] for r in rows})
    }
    n = max((sum(1 for r in rows if r["turn"] == t) for t in {r["turn"] for r in rows}), default=0)
    return bar_chart(out / "exactness.png", title=title, labels=labels, series=series, ylabel=f"of {n} turns")


def _with_cluster(args: argparse.Namespace, seeds: range) -> list[dict[str, Any]]:
    from agentkv.server.launch._cluster import Cluster, ClusterConfig
    from agentkv.server.launch._model import ensure_tiny_model, tiny_serving
    from bench._servers import router_server

    serving: dict[str, Any] = {"device": "gpu"}
    if args.device == "cpu":
        ensure_tiny_model(Path(args.model))
        serving = tiny_serving()
    serving["extra_args"] = [*serving.get("extra_args", []), *args.engine_arg]
    serving["env"] = {**serving.get("env", {}), **dict(args.env)}
    logs = Path(".agentkv/bench-logs/exactness")
    cfg = ClusterConfig(
        model=args.model,
        prefill_port=21600,
        decode_port=21700,
        router_port=None,
        prefill_prefix_caching=False,
        max_model_len=args.max_model_len,
        **serving,
        log_dir=logs,
    )
    cluster = Cluster(config=cfg)
    cluster.up()
    try:
        urls = {"prefill_url": cluster.prefills[0].spec.url, "decode_url": cluster.decodes[0].spec.url}
        # The baseline is always exact: an independent recompute that reads nothing decode computed.
        on = router_server(port=21601, log_dir=logs / "on", path_policy="always-pd", exact=args.exact, **urls)
        off = router_server(
            port=21602, log_dir=logs / "off", path_policy="always-pd", reuse=False, exact=True, **urls
        )
        with on, off:  # ServerProcess starts on enter and waits until healthy
            on_url, off_url = (s.health_url.removesuffix("/health") for s in (on, off))
            model = httpx.get(f"{on_url}/v1/models", timeout=10).json()["data"][0]["id"]
            # The first pull in each direction pays NIXL's handshake: one throwaway conversation first.
            words = _words(args.device)
            compare(on_url, off_url, model, range(1), words=words)
            return compare(on_url, off_url, model, seeds, words=words)
    finally:
        cluster.down()


if __name__ == "__main__":
    main()
