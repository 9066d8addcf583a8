"""Greedy agreement with a recompute: agentkv's default mode beside a single vLLM server's prefix cache.

    python -m bench.agreement                 # CPU, tiny model: a 1P1D cluster, then one vLLM server (~8 min)
    python -m bench.agreement --seeds 24      # more conversations
    python -m bench.agreement --sides default --also-kv-config agentkv_decode_tail_tokens=2
                                              # the default mode with and without a connector setting
    python -m bench.agreement --sides default --prefill-first-token
                                              # also P/D in which decode starts from the token prefill
                                              # sampled: a recompute of every reuse turn, and a side of
                                              # its own (experiments, not agentkv's hops)
    python -m bench.agreement --sides default --decode-alone
                                              # also P/D's decode engine served as a single server
    python -m bench.agreement --sides default --single-env VLLM_KV_CACHE_LAYOUT=HND
                                              # the single server with P/D's KV layout
    bash scripts/gpu/agreement.sh OUT         # the GPU host: bf16 on CUDA, 8B shape with dummy weights

The standard users already accept is vLLM's own prefix cache: a single server answers a turn from KV it
cached in earlier turns (including KV it computed while decoding), which can round differently from a
recompute. agentkv's default mode (router ``exact = false``) reuses KV of the same tokens in the same way,
across P and D. Per seeded conversation (a first message, then two follow-ups, each turn on the history the
reuse side produced), both sides answer each reuse turn twice:

* P/D: through the default router (reuse ON), the same forced through prefill (a pull), and an exact router
  with reuse (the control: it must equal the recompute bit for bit), each against an exact no-reuse router
  (an independent recompute: decode reads nothing it cached);
* one server with prefix caching: with the conversation's cache salt (its earlier turns' KV is reused) and
  with a fresh salt (nothing is reused);
* with ``--prefill-first-token``, P/D in which decode starts from the token prefill sampled (an experiment on
  the engines' completions route, `_first_token_turn`): first turns P then D that way, later turns
  decode-local, against that scheme's recompute;
* with ``--decode-alone``, the P/D cluster's decode engine asked directly, as one server with prefix caching
  (its own prefill of every prompt, no KV from prefill): the same engine and settings as P/D's decode, none
  of P/D's hops, which tells an engine's settings apart from KV crossing engines.

Reported per side: the share of reuse turns whose greedy token ids equal the recompute's, and the largest
difference of the first token's logprob. A P/D recompute is not a single server's: decode computes the
prompt's last token alone over prefill's KV. So the single server also answers every P/D side's reuse turns
with a fresh salt (one prefill of the whole prompt), and each P/D side reports how often its reuse answer and
its recompute each equal that common reference, with Fisher's exact p of each share against the single
server's own (issue 15's standard: ``p_vs_single``, ``p_vs_single_reference``). Every side starts each seed's
conversation from the same words (their cache salts keep their KV apart), so a side's reuse turn and the
single server's on the same history pair up: McNemar's exact p over the pairs where only one of them departed
(``p_paired_vs_single``), and in how many pairs the two reuse answers, and the two recomputes, are the same
tokens (``paired_same_reuse_answer``, ``paired_same_recompute_answer``). Writes ``agreement.json`` and
``agreement.png``.
"""

from __future__ import annotations

import argparse
import json
import random
import uuid
from collections.abc import Callable
from math import comb
from pathlib import Path
from typing import Any

import httpx

from agentkv._wire import KV_KEY, decode_body, prefill_params, token_prefill
from agentkv.server.router._backend import block_size_of
from bench._common import bar_chart, make_progress, print_table, results_dir, write_results
from bench._plugin_args import add_kv_config_arg, env_item, kv_config_item
from bench.multiturn_sweep import FILLER_WORDS, Words, gpu_words, plugin_counts

NAME = "agreement"
Send = Callable[..., dict[str, Any]]
_MAX_TOKENS = 24  # greedy output tokens per answer
# What the completions-route experiments ask for: the first logprob and the tokens as their ids.
_IDS_AND_LOGPROBS = {"logprobs": 1, "return_tokens_as_token_ids": True}
FIRST_TOKEN_SIDE = "P/D from P's token"
DECODE_ALONE_SIDE = "decode alone"


class TurnFailed(RuntimeError):
    """A side's turn got no answer (a hop of an experimental side failed)."""


def _text(rng: random.Random, lo: int, hi: int, *, wordlevel: bool) -> str:
    n = rng.randint(lo, hi)
    if wordlevel:  # the GPU recipe's tokenizer knows only w<N> words: English would be all <unk>
        return gpu_words(rng, n)
    return " ".join(rng.choice(FILLER_WORDS) for _ in range(n))


def _sender(url: str, model: str) -> Send:
    """``send(messages, key)``: one greedy turn; ``key`` is the conversation: its id for a router and its
    cache salt for every engine it reaches (a router passes a client's salt on), so that sides sending the
    same words never share KV."""

    def send(messages: list[dict[str, str]], key: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": _MAX_TOKENS,
            "temperature": 0,
            "logprobs": True,
            "return_tokens_as_token_ids": True,
        }
        headers = {}
        if key is not None:
            body["cache_salt"] = key
            headers["x-session-id"] = key
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=600)
        r.raise_for_status()
        data = r.json()
        choice = data["choices"][0]
        content = choice["logprobs"]["content"]
        details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
        return {
            "text": choice["message"]["content"] or "",
            "tokens": [t["token"] for t in content],
            "first_logprob": content[0]["logprob"] if content else None,
            "reuse": r.headers.get("x-agentkv-reuse"),
            "cached_tokens": details.get("cached_tokens"),
        }

    return send


def run_side(
    side: str, seeds: range, *, reuse: Send, recompute: Send, wordlevel: bool
) -> list[dict[str, Any]]:
    """The conversations of one side: ``reuse(messages, key)`` drives them, ``recompute(messages)`` answers
    each reuse turn again from nothing. A conversation whose turn raises `TurnFailed` is left out whole (and
    said so): its later turns would build on an answer nobody gave."""
    rows: list[dict[str, Any]] = []
    with make_progress() as progress:
        task = progress.add_task(side, total=len(seeds))
        for seed in seeds:
            try:
                rows += _conversation(side, seed, reuse=reuse, recompute=recompute, wordlevel=wordlevel)
            except TurnFailed as exc:
                progress.console.print(f"{side}: conversation {seed} left out: {exc}")
            progress.advance(task)
    return rows


def _conversation(
    side: str, seed: int, *, reuse: Send, recompute: Send, wordlevel: bool
) -> list[dict[str, Any]]:
    """One seeded conversation of a side: a first message, then two follow-ups on the history it produced."""
    rows = []
    rng = random.Random(seed)
    key = f"agree-{uuid.uuid4().hex[:12]}"
    # The same words on every side (each side's salt keeps their KV apart): turns pair across sides.
    history = [
        {
            "role": "user",
            "content": f"{rng.getrandbits(128):032x} " + _text(rng, 150, 300, wordlevel=wordlevel),
        }
    ]
    answer = reuse(history, key)["text"]
    for turn in (2, 3):
        history += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": _text(rng, 40, 120, wordlevel=wordlevel)},
        ]
        on, off = reuse(history, key), recompute(history)
        answer = on["text"]
        rows.append(
            {
                "side": side,
                "seed": seed,
                "turn": turn,
                "reuse": on["reuse"],
                "cached_tokens": on["cached_tokens"],
                "same_tokens": on["tokens"] == off["tokens"],
                "first_logprob_diff": abs(on["first_logprob"] - off["first_logprob"]),
                "tokens": on["tokens"],
                "recompute_tokens": off["tokens"],
                "history": list(history),
            }
        )
    return rows


def _render_ids(prefill: str, model: str, messages: list[dict[str, str]]) -> list[int]:
    """The prompt's token ids as prefill's chat template renders them, with the generation prompt."""
    rendered = httpx.post(
        f"{prefill}/tokenize",
        json={"model": model, "messages": messages, "add_generation_prompt": True},
        timeout=600,
    )
    rendered.raise_for_status()
    ids: list[int] = rendered.json()["tokens"]
    return ids


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _answer(choice: dict[str, Any]) -> dict[str, Any]:
    """A completions choice (logprobs 1, ids as tokens): its tokens and first logprob."""
    logprobs = choice["logprobs"]
    return {
        "tokens": list(logprobs["tokens"]),
        "first_logprob": (logprobs.get("token_logprobs") or [None])[0],
    }


def _block_size(url: str) -> int:
    """The engine's KV block size, from vLLM's `/metrics`."""
    size = block_size_of(httpx.get(f"{url}/metrics", timeout=10).text)
    if size is None:
        raise RuntimeError(f"{url}/metrics reports no block size")
    return size


def _first_token_turn(
    prefill: str, decode: str, model: str, ids: list[int], salt: str, *, block_size: int
) -> dict[str, Any] | None:
    """One P/D turn in which decode starts from the token prefill sampled (as SGLang's P/D does) instead of
    computing the prompt's last token again: prefill computes the whole prompt and samples token 1; decode is
    given the prompt plus token 1, loads the prompt's KV (vLLM's decode loads all but its prompt's last
    token, i.e. exactly what prefill computed) and computes token 1 in its first step, as one server
    computes its first decode step. Completions with token ids, so no output parser needs to see token 1.
    Both hops carry `salt`. None where a hop failed or prefill's answer ended at its second token.

    A prompt of whole blocks needs one more step on prefill: decode allocates blocks for the prompt and
    token 1, one more than such a prompt fills, and vLLM's NIXL worker pairs block lists by count (it
    asserts that decode's is not the longer, and the engine dies). Prefill then also computes token 1 (two
    output tokens, the second thrown away), so that its blocks cover as many tokens as decode's; decode
    computes token 1's KV again in its first step either way."""
    aligned = len(ids) % block_size == 0
    path, body = token_prefill(
        {"token_ids": ids, "cache_salt": salt}, model=model, kv_params=prefill_params(None), generate=False
    )
    first = httpx.post(
        f"{prefill}{path}", json={**body, **_IDS_AND_LOGPROBS, "max_tokens": 2 if aligned else 1}, timeout=600
    )
    if first.status_code != 200:
        return None
    answered = first.json()
    choice = answered["choices"][0]
    head = _answer(choice)
    head["tokens"] = head["tokens"][:1]
    if choice["finish_reason"] == "stop" and len(choice["logprobs"]["tokens"]) == 1:
        return head  # token 1 ended the answer (EOS or a stop token)
    if not answered.get(KV_KEY):
        return None  # prefill stopped at its second token and handed no blocks on
    rest_body = {
        "model": model,
        "prompt": [*ids, *_ids(head["tokens"])],
        "max_tokens": _MAX_TOKENS - 1,
        "temperature": 0,
        **_IDS_AND_LOGPROBS,
    }
    rest = httpx.post(
        f"{decode}/v1/completions",
        json=decode_body(rest_body, answered[KV_KEY], cache_salt=salt),
        timeout=600,
    )
    if rest.status_code != 200:
        return None
    return {**head, "tokens": head["tokens"] + _answer(rest.json()["choices"][0])["tokens"]}


def _from_prefill_first_token(
    prefill: str, decode: str, model: str, *, block_size: int
) -> Callable[[list[dict[str, str]]], dict[str, Any] | None]:
    """``answer(messages)``: a P/D recompute in which decode starts from prefill's token
    (`_first_token_turn`): its tokens and first logprob, None where a hop failed. A fresh salt: decode's
    prefix cache holds this history from a reuse side, and a recompute must load every prompt token from
    prefill, never KV decode cached (as the exact router's decode hop)."""

    def answer(messages: list[dict[str, str]]) -> dict[str, Any] | None:
        ids = _render_ids(prefill, model, messages)
        return _first_token_turn(prefill, decode, model, ids, uuid.uuid4().hex, block_size=block_size)

    return answer


def _first_token_side(prefill: str, decode: str, model: str, *, block_size: int) -> tuple[Send, Send]:
    """``(reuse, recompute)`` for a side that runs P/D as a router would if decode started from prefill's
    token: a conversation's first turn through P then D that way, its later turns decode-local (decode
    computes what its prefix cache, salted per conversation, lacks, and samples token 1 itself, as one
    server's prefix-cache turn does); the recompute is `_from_prefill_first_token`'s. So the side's
    agreement with its own recompute is issue 15's standard for that scheme. Not agentkv's hops: the engines'
    completions route, no router. An answer's text (the next turn's history) is its ids detokenized."""
    started: set[str] = set()
    recompute_once = _from_prefill_first_token(prefill, decode, model, block_size=block_size)

    def answered(answer: dict[str, Any] | None) -> dict[str, Any]:
        if answer is None:
            raise TurnFailed("a P/D hop of the prefill-first-token side failed")
        return answer

    def text(tokens: list[str]) -> str:
        r = httpx.post(f"{prefill}/detokenize", json={"model": model, "tokens": _ids(tokens)}, timeout=600)
        r.raise_for_status()
        return str(r.json()["prompt"])

    def reuse(messages: list[dict[str, str]], key: str) -> dict[str, Any]:
        ids = _render_ids(prefill, model, messages)
        if key not in started:
            started.add(key)
            answer = answered(_first_token_turn(prefill, decode, model, ids, key, block_size=block_size))
            return {**answer, "text": text(answer["tokens"]), "reuse": "miss", "cached_tokens": None}
        body = {
            "model": model,
            "prompt": ids,
            "max_tokens": _MAX_TOKENS,
            "temperature": 0,
            "cache_salt": key,
            **_IDS_AND_LOGPROBS,
        }
        r = httpx.post(f"{decode}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        data = r.json()
        answer = _answer(data["choices"][0])
        details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return {**answer, "text": text(answer["tokens"]), "reuse": "local", "cached_tokens": cached}

    def recompute(messages: list[dict[str, str]]) -> dict[str, Any]:
        return answered(recompute_once(messages))

    return reuse, recompute


def _serving(args: argparse.Namespace) -> dict[str, Any]:
    """How the engines serve the model: the tiny model's settings on CPU, ``--engine-arg`` on either."""
    from agentkv.server.launch._model import tiny_serving

    if args.device == "cpu":
        serving = tiny_serving()
        serving["extra_args"] += args.engine_arg
        return serving
    return {"extra_args": list(args.engine_arg)}


def _pd_side(
    args: argparse.Namespace,
    seeds: range,
    logs: Path,
    kv_config: dict[str, Any],
    label: str = "",
    *,
    counters: dict[str, dict[str, float]],
) -> list[dict[str, Any]]:
    """The P/D sides on one 1P1D cluster whose engines get ``kv_config``; ``label`` ends each side's name.
    Decode's agentkv counters at the end go into ``counters`` under the label."""
    from agentkv.server.launch._cluster import Cluster, ClusterConfig
    from bench._servers import router_server

    cfg = ClusterConfig(
        model=args.model,
        device=args.device,
        prefill_port=21800,
        decode_port=21900,
        router_port=None,
        prefill_prefix_caching=False,
        max_model_len=4096,
        log_dir=logs,
        extra_kv_config=kv_config,
        **_serving(args),
        # After every other argument of prefill (vLLM takes a flag's last value): prefill's settings A/B'd
        # against its decode's.
        prefill_args=list(args.prefill_engine_arg),
    )
    cluster = Cluster(config=cfg)
    cluster.up()
    try:
        urls = {"prefill_url": cluster.prefills[0].spec.url, "decode_url": cluster.decodes[0].spec.url}
        # Every setting at its default (short suffixes go decode-local), and the same forced through a pull
        # (prefill reads decode's KV, decoded tokens included).
        on = router_server(port=21801, log_dir=logs / "on", **urls)
        pull = router_server(port=21803, log_dir=logs / "pull", path_policy="always-pd", **urls)
        # Exact mode with reuse: only prefill-computed KV, a salted decode; it must equal the recompute bit
        # for bit, which makes it the control for the other P/D sides on the same engines.
        exact = router_server(port=21804, log_dir=logs / "exact", exact=True, **urls)
        off = router_server(port=21802, log_dir=logs / "off", reuse=False, exact=True, **urls)
        with on, pull, exact, off:
            on_url, pull_url, exact_url, off_url = (
                s.health_url.removesuffix("/health") for s in (on, pull, exact, off)
            )
            model = httpx.get(f"{on_url}/v1/models", timeout=10).json()["data"][0]["id"]
            send_off = _sender(off_url, model)

            def recompute(m: list[dict[str, str]]) -> dict[str, Any]:
                return send_off(m, None)

            rows = []
            sides = (("P/D default", on_url), ("P/D default, pull", pull_url), ("P/D exact", exact_url))
            for side, url in sides[: 1 if args.sides == "default" else None]:
                send, words = _sender(url, model), args.wordlevel
                run_side("warm-up", range(1), reuse=send, recompute=recompute, wordlevel=words)
                rows += run_side(side + label, seeds, reuse=send, recompute=recompute, wordlevel=words)
            if args.prefill_first_token:
                p_url, d_url = urls["prefill_url"], urls["decode_url"]
                block_size = _block_size(p_url)
                answer = _from_prefill_first_token(p_url, d_url, model, block_size=block_size)
                with make_progress() as progress:
                    task = progress.add_task("from P's first token", total=len(rows))
                    for row in rows:
                        turn = answer(row["history"])
                        row["first_token_recompute_tokens"] = None if turn is None else turn["tokens"]
                        progress.advance(task)
                reuse, again = _first_token_side(p_url, d_url, model, block_size=block_size)
                try:
                    run_side("warm-up", range(1), reuse=reuse, recompute=again, wordlevel=args.wordlevel)
                    rows += run_side(
                        FIRST_TOKEN_SIDE + label,
                        seeds,
                        reuse=reuse,
                        recompute=again,
                        wordlevel=args.wordlevel,
                    )
                except httpx.HTTPError as exc:  # an engine down: keep the other sides' turns
                    print(f"the {FIRST_TOKEN_SIDE} side stopped: {exc}")
            if args.decode_alone:
                reuse, again = single_server_sides(_sender(urls["decode_url"], model))
                rows += run_side(
                    DECODE_ALONE_SIDE + label, seeds, reuse=reuse, recompute=again, wordlevel=args.wordlevel
                )
            # Which of decode's first steps started from prefill's token (agentkv_prefill_tokens_total).
            counters[label or "default"] = plugin_counts(urls["decode_url"])
            print(f"decode's agentkv counters{label}: {counters[label or 'default']}")
            return rows
    finally:
        cluster.down()


def single_server_sides(send: Send) -> tuple[Send, Send]:
    """``reuse`` and ``recompute`` of one server with prefix caching: the conversation's key as its cache salt
    (its earlier turns' KV is reused), and a fresh salt (nothing is)."""

    def reuse(messages: list[dict[str, str]], key: str | None) -> dict[str, Any]:
        return send(messages, key)

    def recompute(messages: list[dict[str, str]]) -> dict[str, Any]:
        return send(messages, uuid.uuid4().hex)

    return reuse, recompute


def _single_side(
    args: argparse.Namespace, seeds: range, logs: Path, pd_rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The single server's own side, then its fresh answer to every P/D reuse turn (the common reference)."""
    from agentkv.server.launch._launcher import Engine, EngineSpec

    serving = _serving(args)
    # Only the single server's: e.g. decode's KV layout (VLLM_KV_CACHE_LAYOUT=HND, which the NIXL connector
    # gives P/D's engines), to tell that setting apart from reuse.
    serving["env"] = {**serving.get("env", {}), **dict(args.single_env)}
    spec = EngineSpec(
        role="single",
        model=args.model,
        device=args.device,
        port=21950,
        max_model_len=4096,
        prefix_caching=True,
        **serving,
        log_path=logs / "single.log",
    )
    engine = Engine(spec=spec, name="single")
    engine.start()
    try:
        engine.wait_healthy(timeout_s=900)
        model = httpx.get(f"{spec.url}/v1/models", timeout=10).json()["data"][0]["id"]
        send = _sender(spec.url, model)
        reuse, recompute = single_server_sides(send)
        rows = run_side("single server", seeds, reuse=reuse, recompute=recompute, wordlevel=args.wordlevel)
        with make_progress() as progress:
            task = progress.add_task("reference", total=len(pd_rows))
            for row in pd_rows:
                reference = recompute(row["history"])["tokens"]
                row["same_as_reference"] = row["tokens"] == reference
                row["recompute_same_as_reference"] = row["recompute_tokens"] == reference
                if row.get("first_token_recompute_tokens") is not None:
                    row["first_token_recompute_same_as_reference"] = (
                        row["first_token_recompute_tokens"] == reference
                    )
                progress.advance(task)
        return rows
    finally:
        engine.stop()


def plot(rows: list[dict[str, Any]], out: Path) -> Path:
    sides = list(dict.fromkeys(r["side"] for r in rows))
    share = {
        side: [
            100.0
            * sum(r["same_tokens"] for r in rows if r["side"] == side)
            / max(1, sum(r["side"] == side for r in rows))
        ]
        for side in sides
    }
    return bar_chart(
        out / "agreement.png",
        title="reuse turns whose greedy answer equals a recompute's",
        labels=["same token ids"],
        series=share,
        ylabel="% of reuse turns",
    )


def _public(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows as written: without the histories (the seeds regenerate them)."""
    return [{k: v for k, v in r.items() if k != "history"} for r in rows]


def _summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    for side in dict.fromkeys(r["side"] for r in rows):
        mine = [r for r in rows if r["side"] == side]
        reference = [r for r in mine if "same_as_reference" in r]
        summary[side] = {
            "turns": len(mine),
            "same_tokens": sum(r["same_tokens"] for r in mine),
            "max_first_logprob_diff": max(r["first_logprob_diff"] for r in mine),
            "reused": sum(r["reuse"] in ("hit", "local") for r in mine),
            "paths": sorted({str(r["reuse"]) for r in mine}),
            "cached_tokens_reported": sum(bool(r["cached_tokens"]) for r in mine),
            # Against the single server's fresh recompute of the same history (P/D sides only).
            "same_as_reference": sum(r["same_as_reference"] for r in reference) if reference else None,
            "recompute_same_as_reference": (
                sum(r["recompute_same_as_reference"] for r in reference) if reference else None
            ),
        }
        first = [r for r in reference if "first_token_recompute_tokens" in r]
        if first:  # --prefill-first-token: of these turns, how many such recomputes gave the reference
            summary[side]["first_token_recompute_same_as_reference"] = sum(
                bool(r.get("first_token_recompute_same_as_reference")) for r in first
            )
            summary[side]["first_token_recompute_failed"] = sum(
                r["first_token_recompute_tokens"] is None for r in first
            )
    return summary


def fisher_p(a: int, n1: int, b: int, n2: int) -> float:
    """Two-sided p of Fisher's exact test: `a` of `n1` against `b` of `n2` (the probability, under equal
    rates, of a table at most as likely as this one). Unpaired: it ignores which turns the sides share
    (`paired_p` uses them)."""
    k, n = a + b, n1 + n2

    def table(x: int) -> float:
        return comb(n1, x) * comb(n2, k - x) / comb(n, k)

    observed = table(a)
    # Tables as likely as the observed one count too; the tolerance keeps float rounding from dropping them.
    tail = (table(x) for x in range(max(0, k - n2), min(n1, k) + 1))
    return min(1.0, sum(q for q in tail if q <= observed * (1 + 1e-7)))


def _against_single(summary: dict[str, dict[str, Any]]) -> None:
    """Per P/D side, Fisher's p of its agreement against the single server's own (issue 15's standard): with
    its own recompute and with the common reference."""
    single = summary.get("single server")
    if single is None:
        return
    n, same = single["turns"], single["same_tokens"]
    for side, s in summary.items():
        if side == "single server":
            continue
        s["p_vs_single"] = round(fisher_p(s["same_tokens"], s["turns"], same, n), 4)
        if s["same_as_reference"] is not None:
            s["p_vs_single_reference"] = round(fisher_p(s["same_as_reference"], s["turns"], same, n), 4)


def paired_p(only_a: int, only_b: int) -> float:
    """Two-sided p of McNemar's exact test: of the pairs where exactly one side departed from its recompute,
    `only_a` were side a's and `only_b` side b's (a binomial at 1/2 over those pairs)."""
    n = only_a + only_b
    tail = sum(comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2**n
    return min(1.0, 2 * tail)


def _paired_with_single(rows: list[dict[str, Any]], summary: dict[str, dict[str, Any]]) -> None:
    """Per side, its reuse turns beside the single server's on the same history (same seed and turn, same
    messages: every side starts from the seed's words, and a history parts once an earlier answer differed):
    how many such pairs, in how many only this side or only the single server departed from its recompute,
    and McNemar's exact p. Sharper than the unpaired p: a turn that any rounding tips counts on both sides."""
    single = {(r["seed"], r["turn"]): r for r in rows if r["side"] == "single server"}
    if not single:
        return
    for side, s in summary.items():
        if side == "single server":
            continue
        pairs = [
            (r, o)
            for r in rows
            if r["side"] == side
            and (o := single.get((r["seed"], r["turn"]))) is not None
            and o["history"] == r["history"]
        ]
        only_side = sum(not r["same_tokens"] and o["same_tokens"] for r, o in pairs)
        only_single = sum(r["same_tokens"] and not o["same_tokens"] for r, o in pairs)
        s["paired_turns"] = len(pairs)
        s["paired_only_side_departs"] = only_side
        s["paired_only_single_departs"] = only_single
        s["p_paired_vs_single"] = round(paired_p(only_side, only_single), 4)
        # Which half of a departure is whose: the side's reuse answer against the single server's reuse answer
        # (prefix cache ON), and its recompute against the single server's (OFF).
        s["paired_same_reuse_answer"] = sum(r.get("tokens") == o.get("tokens") for r, o in pairs)
        s["paired_same_recompute_answer"] = sum(
            r.get("recompute_tokens") == o.get("recompute_tokens") for r, o in pairs
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--model", default=".agentkv/models/tiny")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--engine-arg", action="append", default=[], help="one vLLM argument (repeatable)")
    ap.add_argument(
        "--prefill-engine-arg",
        action="append",
        default=[],
        help="one vLLM argument for the P/D clusters' prefill only, after the launcher's (repeatable): e.g. "
        "decode's CUDA graphs and prefix caching, to tell prefill's settings from KV crossing engines",
    )
    ap.add_argument(
        "--single-env",
        action="append",
        default=[],
        type=env_item,
        help="KEY=VALUE for the single server only (repeatable)",
    )
    add_kv_config_arg(ap)
    ap.add_argument(
        "--also-kv-config",
        action="append",
        default=[],
        type=kv_config_item,
        metavar="KEY=VALUE",
        help="then the P/D sides again on a second cluster with these keys over --kv-config (repeatable), "
        "against the same single server and common reference: an A/B of a connector setting in one run",
    )
    ap.add_argument(
        "--sides",
        choices=("all", "default", "single"),
        default="all",
        help="default: of the P/D sides only the router's default (with the single server and the common "
        "reference), for a short run; single: only the single server's own side (no P/D, so no common "
        "reference), e.g. to compare its agreement under two engine settings in one lease",
    )
    ap.add_argument(
        "--prefill-first-token",
        action="store_true",
        help="also recompute every P/D reuse turn's history with decode starting from prefill's sampled "
        "first token, against the common reference, and run a side of its own in that scheme (first turns "
        "P then D so, later turns decode-local) against its recompute: not agentkv's hops, an experiment on "
        "the engines' completions route",
    )
    ap.add_argument(
        "--decode-alone",
        action="store_true",
        help="also ask each P/D cluster's decode engine directly, as a single server (cache salt = the "
        "conversation), against its own fresh-salt recompute and the common reference",
    )
    args = ap.parse_args(argv)
    from agentkv.server.launch._model import ensure_tiny_model

    if args.device == "cpu":
        ensure_tiny_model(Path(args.model))
    args.wordlevel = Words(args.model, seed=0).wordlevel
    seeds = range(900, 900 + args.seeds)
    logs = Path(".agentkv/bench-logs/agreement")
    counters: dict[str, dict[str, float]] = {}
    pd_rows = []
    if args.sides != "single":
        base = dict(args.kv_config)
        pd_rows = _pd_side(args, seeds, logs / "pd", base, counters=counters)
        if args.also_kv_config:
            label = " [" + ", ".join(f"{k}={json.dumps(v)}" for k, v in args.also_kv_config) + "]"
            also = {**base, **dict(args.also_kv_config)}
            pd_rows += _pd_side(args, seeds, logs / "pd-also", also, label, counters=counters)
    if pd_rows:
        # Written now as well, so that a run stopped while the single server runs keeps the P/D sides.
        partial = {
            "partial": "P/D sides only",
            "summary": _summary(pd_rows),
            "decode_counters": counters,
            "turns": _public(pd_rows),
        }
        write_results(NAME, partial, out_dir=args.out)
    rows = pd_rows + _single_side(args, seeds, logs, pd_rows)
    summary = _summary(rows)
    _against_single(summary)
    _paired_with_single(rows, summary)
    print_table(
        "greedy agreement of reuse turns with a recompute",
        [
            "side",
            "reuse turns",
            "same token ids",
            "max |d first logprob|",
            "reuse = single recompute",
            "recompute = single recompute",
            "from P's first token = single recompute",
            "router: reused (verdicts)",
            "p vs single (own / reference)",
            "paired: only it / only single departs (p)",
            "paired: same reuse / recompute answer as single",
        ],
        [
            [
                side,
                s["turns"],
                s["same_tokens"],
                s["max_first_logprob_diff"],
                "-" if s["same_as_reference"] is None else s["same_as_reference"],
                "-" if s["recompute_same_as_reference"] is None else s["recompute_same_as_reference"],
                s.get("first_token_recompute_same_as_reference", "-"),
                f"{s['reused']} ({', '.join(s['paths'])})" if side != "single server" else "-",
                f"{s['p_vs_single']} / {s.get('p_vs_single_reference', '-')}" if "p_vs_single" in s else "-",
                (
                    f"{s['paired_only_side_departs']} / {s['paired_only_single_departs']} of "
                    f"{s['paired_turns']} ({s['p_paired_vs_single']})"
                    if "paired_turns" in s
                    else "-"
                ),
                (
                    f"{s['paired_same_reuse_answer']} / {s['paired_same_recompute_answer']}"
                    if "paired_turns" in s
                    else "-"
                ),
            ]
            for side, s in summary.items()
        ],
    )
    out = results_dir(NAME, args.out)
    plot(rows, out)
    data = {"summary": summary, "decode_counters": counters, "turns": _public(rows)}
    write_results(NAME, data, out_dir=args.out)


if __name__ == "__main__":
    main()
