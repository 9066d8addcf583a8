"""The router's JSON on the token path beside the standard library's, per turn, as the prompt grows (CPU, no
engine): what the router spends encoding and decoding bodies that carry every prompt token id.

    python -m bench.hop_codec [--lengths 8192,32768,65536,131072] [--rounds 9]

Per turn at a context of N tokens the router decodes the client's request (an agent's messages: tool calls
and 512-token results, `bench.client_body`), decodes the render answer (N ids), encodes the prefill body (N
ids) and encodes the decode body (the messages; on vLLM >= 0.32 also the N ids, not counted here). Both
sides run the same bodies: `json` (the standard library, what the router used: for the request with the
hooks that refuse non-finite numbers, which take the parser off its fast path) and msgspec
(`agentkv.server.router._codec`; the request through `parse_body`'s reader, which keeps the standard
library's result). Median of ``--rounds`` per operation.

Then what the router does with the N ids themselves per turn (the type and range check of the render
answer's ids, the reuse check's digest of what decode holds, decode's packed ids, the next turn's digest),
done on the list at each use as the router did (a Python loop for the check, a uint32 copy per digest and for
the packing) beside one uint32 array made by the check and read by the rest (`agentkv._wire.rendered_request`,
`TokenPrefix`, `pack_ids`).

Last, the conversation's record as a router on the Redis store writes it after every turn and reads it at the
next (decode's block list, one id per block of 16 tokens, and the fingerprints): the record copied deeply and
twice through `dataclasses.asdict` and written with `json`, as the store did, beside one shallow dict written
with msgspec (`RedisStore`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentkv._wire import pack_ids, rendered_request
from agentkv.server.router import _codec, _ids
from agentkv.server.router._store import ConversationRecord
from agentkv.server.router._tokens import TokenPrefix
from bench._common import (
    line_chart,
    print_table,
    results_dir,
    summarize,
    write_rows,
)
from bench.client_body import conversation

NAME = "hop_codec"
WORDS = "agent tool search file row column query report number answer table cache block def return".split()


def _bodies(n: int, rng: random.Random) -> tuple[bytes, dict[str, Any], dict[str, Any]]:
    ids = [rng.randrange(150_000) for _ in range(n)]
    render = json.dumps({"request_id": "r", "token_ids": ids, "sampling_params": {"max_tokens": 32}}).encode()
    prefill = {"model": "m", "prompt": ids, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    messages: list[dict[str, str]] = []
    while sum(len(m["content"]) for m in messages) < 4 * n:
        text = " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 99)}" for _ in range(400))
        messages.append({"role": "tool", "content": text, "tool_call_id": f"call_{len(messages)}"})
    return render, prefill, {"model": "m", "messages": messages, "max_tokens": 256}


def _stdlib_request(raw: bytes) -> Any:
    return json.loads(raw, parse_constant=_ids._not_json, parse_float=_ids._finite)


def _ids_per_use(answer: dict[str, Any]) -> None:
    ids = answer["token_ids"]
    assert all(type(t) is int and t >= 0 for t in ids)
    for held in (len(ids) - 512, len(ids)):  # the reuse check, then the record of this turn
        hashlib.sha256(array("I", ids[:held]).tobytes()).hexdigest()
    pack_ids(list(ids))  # a list: pack_ids converts it


def _ids_one_array(answer: dict[str, Any]) -> None:
    rendered = rendered_request(answer)
    assert rendered is not None
    ids = rendered[1]
    held = TokenPrefix.of(ids, offered=len(ids) - 512, exact=False)
    assert held is not None and held.extended_by(ids)
    TokenPrefix.of(ids, offered=len(ids), exact=False)
    pack_ids(ids)


def _record(n: int, ids: list[int]) -> ConversationRecord:
    retained = {
        "do_remote_prefill": True,
        "remote_block_ids": list(range(50_000, 50_000 + n // 16)),
        "remote_engine_id": "decode-0-7f3c2a",
        "remote_host": "10.0.0.2",
        "remote_port": 5600,
        "remote_request_id": "chatcmpl-agentkv-0123456789abcdef",
        "remote_num_tokens": n,
    }
    tokens = TokenPrefix.of(ids, offered=n, exact=False)
    return ConversationRecord(
        decode="decode-0", request_id="r", retained=retained, expires_at=1e9, retained_tokens=n, tokens=tokens
    )


def _record_deep_json(record: ConversationRecord) -> None:
    new = ConversationRecord.from_json({**dataclasses.asdict(record), "version": 1})
    ConversationRecord.from_json(json.loads(json.dumps(dataclasses.asdict(new))))


def _record_shallow_msgspec(record: ConversationRecord) -> None:
    new = dataclasses.replace(record, version=1)
    ConversationRecord.from_json(_codec.decode(_codec.encode(new.to_json())))


def _median_ms(fn: Callable[[Any], object], arg: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn(arg)
        times.append((time.perf_counter() - t) * 1e3)
    return float(summarize(times)["p50"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.hop_codec", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="8192,32768,65536,131072", help="context lengths in tokens")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None, help="output dir (default bench/results/hop_codec)")
    args = ap.parse_args(argv)
    # The client's request is read by `parse_body` (`_ids._loads`: msgspec, the standard library where
    # msgspec refuses); the hops' JSON by `_codec`.
    codecs: dict[str, tuple[Callable[[bytes], Any], Callable[[bytes], Any], Callable[[Any], bytes]]] = {
        "json (stdlib)": (_stdlib_request, json.loads, lambda obj: json.dumps(obj).encode()),
        "msgspec (agentkv)": (_ids._loads, _codec.decode, _codec.encode),
    }
    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    for n in [int(x) for x in args.lengths.split(",")]:
        render, prefill, decode = _bodies(n, rng)
        row: dict[str, Any] = {"tokens": n}
        # As an agent sends it: tool calls and 512-token results, so hundreds of messages.
        agent = {"model": "m", "messages": conversation(n, 512, rng), "max_tokens": 256}
        request = json.dumps(agent).encode()
        for label, (read, loads, dumps) in codecs.items():
            parts = {
                "client request (decode)": _median_ms(read, request, args.rounds),
                "render answer (decode)": _median_ms(loads, render, args.rounds),
                "prefill body (encode)": _median_ms(dumps, prefill, args.rounds),
                "decode body (encode)": _median_ms(dumps, decode, args.rounds),
            }
            row[label] = {**parts, "per turn": sum(parts.values())}
        answer = json.loads(render)
        row["ids"] = {
            "per use (list)": _median_ms(_ids_per_use, answer, args.rounds),
            "one array (agentkv)": _median_ms(_ids_one_array, answer, args.rounds),
        }
        record = _record(n, answer["token_ids"])
        row["record"] = {
            "asdict + json": _median_ms(_record_deep_json, record, args.rounds),
            "shallow + msgspec (agentkv)": _median_ms(_record_shallow_msgspec, record, args.rounds),
        }
        rows.append(row)
    labels = list(codecs)
    print_table(
        "the router's JSON per turn on the token path, median ms",
        [
            "context tokens",
            *(
                f"{label}: {part}"
                for label in labels
                for part in ("request", "render", "prefill", "decode", "turn")
            ),
        ],
        [[r["tokens"], *(v for label in labels for v in r[label].values())] for r in rows],
    )
    print_table(
        "the router's work on the ids per turn (check, two digests, packed form), median ms",
        ["context tokens", *rows[0]["ids"]],
        [[r["tokens"], *r["ids"].values()] for r in rows],
    )
    print_table(
        "the conversation record on the Redis store per turn (write, then read), median ms",
        ["context tokens", *rows[0]["record"]],
        [[r["tokens"], *r["record"].values()] for r in rows],
    )
    out = results_dir(NAME, args.out)
    line_chart(
        out / "hop_codec.png",
        title="the router's JSON per turn (render answer + prefill and decode bodies), median",
        series={
            label: ([r["tokens"] for r in rows], [r[label]["per turn"] for r in rows]) for label in labels
        },
        xlabel="context tokens",
        ylabel="ms",
    )
    return write_rows(NAME, args, rows, out)


if __name__ == "__main__":
    main()
