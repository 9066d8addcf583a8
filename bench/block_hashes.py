"""What hashing a request's blocks costs in vLLM's engine core, vLLM's way beside agentkv's reuse (CPU, no
engine; needs vLLM installed).

    python -m bench.block_hashes [--lengths 32768,65536,131072,200000] [--suffix 512] [--block-size 16]

vLLM hashes every full block of a request when it arrives in the engine core (with a KV connector or prefix
caching), before it can be scheduled. agentkv's connector (`_connector/_block_hashes`) keeps the prompts of
recent requests and takes the hashes of the blocks a new prompt shares with one of them. Per context length,
the median of ``--rounds`` over building vLLM's `Request` (which hashes) for an agent's turn: the previous
prompt plus ``--suffix`` new ids; vLLM's hasher alone, and agentkv's with the previous prompt kept (the
lookup, the ids compared, the new blocks hashed by vLLM, the prompt kept). Random ids; sha256, vLLM's
default hash.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from bench._common import bar_chart, print_table, results_dir, summarize, write_rows

NAME = "block_hashes"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.block_hashes", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="32768,65536,131072,200000")
    ap.add_argument("--suffix", type=int, default=512, help="ids the turn adds to the previous prompt")
    ap.add_argument("--block-size", type=int, default=16, help="vLLM's hash block size (16 on GPUs)")
    ap.add_argument("--hash", default="sha256", help="vLLM's --prefix-caching-hash-algo")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--out", default=None, help="output dir (default bench/results/block_hashes)")
    args = ap.parse_args(argv)

    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from agentkv.server._connector._block_hashes import HashReuse, reusing_hasher

    fn = get_hash_fn_by_name(args.hash)
    init_none_hash(fn)
    vllms = get_request_block_hasher(args.block_size, fn)
    params = SamplingParams(max_tokens=1)

    def build(ids: list[int], hasher: Any) -> tuple[float, Any]:
        t = time.perf_counter()
        request = Request(
            request_id="r",
            prompt_token_ids=ids,
            sampling_params=params,
            pooling_params=None,
            block_hasher=hasher,
        )
        return (time.perf_counter() - t) * 1e3, request

    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    for n in (int(x) for x in args.lengths.split(",")):
        previous = [rng.randrange(150_000) for _ in range(n - args.suffix)]
        turn = previous + [rng.randrange(150_000) for _ in range(args.suffix)]
        plain: list[float] = []
        ours: list[float] = []
        for _ in range(args.rounds):
            plain.append(build(list(turn), vllms)[0])
            reuse = HashReuse(max_tokens=1 << 22, block_size=args.block_size)
            hasher = reusing_hasher(vllms, reuse)
            build(list(previous), hasher)  # the previous turn, as the engine saw it
            ms, request = build(list(turn), hasher)
            ours.append(ms)
            assert reuse.reused == len(previous) // args.block_size
        assert request.block_hashes == build(list(turn), vllms)[1].block_hashes
        rows.append(
            {
                "tokens": n,
                "blocks": n // args.block_size,
                "vllm_ms": round(float(summarize(plain)["p50"]), 3),
                "agentkv_ms": round(float(summarize(ours)["p50"]), 3),
            }
        )

    print_table(
        f"a turn's Request built in vLLM's engine core (+{args.suffix} ids, {args.block_size}-id blocks, "
        f"{args.hash}), median ms",
        ["prompt tokens", "blocks", "vLLM: every block hashed", "agentkv: new blocks hashed"],
        [[f"{r['tokens']:,}", r["blocks"], r["vllm_ms"], r["agentkv_ms"]] for r in rows],
    )
    out = results_dir(NAME, args.out)
    bar_chart(
        out / f"{NAME}.png",
        title=f"a turn's block hashes in vLLM's engine core (+{args.suffix} ids; median)",
        labels=[f"{r['tokens']:,}" for r in rows],
        series={
            "vLLM: every block": [r["vllm_ms"] for r in rows],
            "agentkv: the new blocks": [r["agentkv_ms"] for r in rows],
        },
        ylabel="ms",
        log=True,
    )
    return write_rows(NAME, args, rows, out)


if __name__ == "__main__":
    main()
