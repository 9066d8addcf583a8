"""The block hashing every hop does in an engine core, per turn, as the conversation grows (CPU, vLLM's own
hash functions, no server): vLLM's prefix-cache block hashes of a new request, and agentkv's token
fingerprints with and without the chain an earlier turn left.

    python -m bench.fingerprints [--lengths 32768,65536,131072] [--block-size 16] [--rounds 7]

A turn at a context of N tokens: decode's previous turn finished at ``N - suffix - output`` tokens; the new
request holds N. Per length:

- vLLM: a ``Request`` built with vLLM's block hasher (what the engine core does for every request it is
  sent), less the same ``Request`` built without one, for each ``--prefix-caching-hash-algo``; and with
  sha256 through agentkv's ``_block_hashes`` holding the previous turn's prompt (what the engine core does
  under agentkv's connector: the shared blocks' hashes taken, the ids compared, the new blocks hashed);
- agentkv, whole chain: every full block hashed from its tokens (what the connector did on every hop);
- agentkv, from the previous chain: ``ChainCache`` holding the previous turn's chain, found through the new
  request's vLLM block hashes (what the connector does now); and a cache holding nothing (the first turn:
  the whole chain plus the lookups that found nothing);
- the wire: ``json.loads`` of the fingerprints as a list of per-block hex strings and as one hex string.

Median of ``--rounds`` each, on one core, with the GIL held the whole time: in an engine core that is time
its scheduler step, and every request in its batch, waits.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentkv.server.engine._connector._hashing import DIGEST, ChainCache, block_fingerprints
from bench._common import line_chart, print_table, results_dir, write_rows

NAME = "fingerprints"
ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def _median_ms(fn: Callable[..., object], *args: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _extend_ms(previous: list[int], old_keys: Any, ids: list[int], keys: Any, bs: int, rounds: int) -> float:
    """The new turn's chain from a cache that holds the previous turn's (timed without filling the cache)."""
    times = []
    for _ in range(rounds):
        cache = ChainCache()
        cache.chain(previous, bs, len(previous) // bs, old_keys)
        t = time.perf_counter()
        cache.chain(ids, bs, len(ids) // bs, keys)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _reuse_ms(previous: list[int], ids: list[int], bs: int, rounds: int) -> float:
    """The new turn's ``Request`` with vLLM's sha256 hasher behind agentkv's reuse, which holds the previous
    turn's prompt (timed without that turn; checked against vLLM's own hashes)."""
    from agentkv.server.engine._connector._block_hashes import HashReuse

    times = []
    for _ in range(rounds):
        reuse = HashReuse(max_tokens=1 << 22, block_size=bs)
        make = _request_factory(bs, "sha256", reuse=reuse)
        make(list(previous))
        t = time.perf_counter()
        request = make(ids)
        times.append((time.perf_counter() - t) * 1e3)
        assert reuse.reused == len(previous) // bs
    assert request.block_hashes == _request_factory(bs, "sha256")(ids).block_hashes
    return statistics.median(times)


def _first_turn(ids: list[int], keys: Any, bs: int) -> bytes:
    return ChainCache().chain(ids, bs, len(ids) // bs, keys)


def _row(n: int, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    bs, rounds = args.block_size, args.rounds
    ids = [rng.randrange(150_000) for _ in range(n)]
    previous = ids[: n - args.suffix - args.output]
    row: dict[str, Any] = {"tokens": n, "blocks": n // bs}
    base = _median_ms(_request_factory(bs, None), ids, rounds=rounds)
    for algo in ALGOS:
        row[f"vllm {algo}"] = max(0.0, _median_ms(_request_factory(bs, algo), ids, rounds=rounds) - base)
    row["vllm sha256 from the previous prompt (agentkv)"] = max(
        0.0, _reuse_ms(previous, ids, bs, rounds) - base
    )
    # Keys as the engine core has them: vLLM's default hash of each request's blocks.
    make = _request_factory(bs, "sha256")
    keys, old_keys = make(ids).block_hashes, make(previous).block_hashes
    row["agentkv whole chain"] = _median_ms(block_fingerprints, ids, bs, rounds=rounds)
    row["agentkv from the previous chain"] = _extend_ms(previous, old_keys, ids, keys, bs, rounds)
    row["agentkv first turn (nothing cached)"] = _median_ms(_first_turn, ids, keys, bs, rounds=rounds)
    chain = block_fingerprints(ids, bs)
    as_list = json.dumps([chain[i : i + DIGEST].hex() for i in range(0, len(chain), DIGEST)])
    as_string = json.dumps(chain.hex())
    row["wire list: json.loads"] = _median_ms(json.loads, as_list, rounds=rounds)
    row["wire string: json.loads"] = _median_ms(json.loads, as_string, rounds=rounds)
    row["wire bytes (list, string)"] = [len(as_list), len(as_string)]
    return row


def _request_factory(block_size: int, algo: str | None, *, reuse: Any = None) -> Callable[[list[int]], Any]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hasher = None
    if algo is not None:
        fn = get_hash_fn_by_name(algo)
        init_none_hash(fn)
        hasher = get_request_block_hasher(block_size, fn)
        if reuse is not None:
            from agentkv.server.engine._connector._block_hashes import reusing_hasher

            hasher = reusing_hasher(hasher, reuse)
    params = SamplingParams(max_tokens=1)

    def make(ids: list[int]) -> Any:
        return Request(
            request_id="r",
            prompt_token_ids=ids,
            sampling_params=params,
            pooling_params=None,
            block_hasher=hasher,
        )

    return make


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.fingerprints", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="32768,65536,131072", help="context lengths in tokens")
    ap.add_argument("--block-size", type=int, default=16, help="KV block size (vLLM's GPU default: 16)")
    ap.add_argument("--suffix", type=int, default=512, help="new tokens a turn adds (a tool result)")
    ap.add_argument("--output", type=int, default=128, help="tokens the previous turn generated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None, help="output dir (default bench/results/fingerprints)")
    args = ap.parse_args(argv)
    bs = args.block_size
    rng = random.Random(0)
    rows = [_row(int(n), args, rng) for n in args.lengths.split(",")]
    columns = [k for k in rows[0] if k not in ("tokens", "blocks")]
    print_table(
        f"block hashing per request in an engine core, median ms (block size {bs}, a turn adds "
        f"{args.suffix} + {args.output} tokens)",
        ["context tokens", *columns],
        [[r["tokens"], *(r[c] for c in columns)] for r in rows],
    )
    out = results_dir(NAME, args.out)
    plotted = [c for c in columns if not c.startswith("wire")]
    line_chart(
        out / "fingerprints.png",
        title=f"block hashing per request in an engine core (block size {bs}), median",
        series={c: ([r["tokens"] for r in rows], [r[c] for r in rows]) for c in plotted},
        xlabel="context tokens",
        ylabel="ms",
    )
    return write_rows(NAME, args, rows, out)


if __name__ == "__main__":
    main()
