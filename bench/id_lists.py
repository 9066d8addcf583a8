"""Decode's packed forwarded ids made into the list vLLM takes: every int made anew beside agentkv's `IdLists`
(the ints of the previous turn's prompt reused; CPU, no engine).

    python -m bench.id_lists [--lengths 32768,65536,131072] [--new 512] [--rounds 31]

An agent's turn at a context of N ids: the previous turn's prompt (N - ``--new`` ids) went through decode's
plugin, and this turn's packed ids arrive (`agentkv._wire.pack_ids`). Per length, the median of ``--rounds``
of: unpacking and `array.tolist()` (what the plugin did), and unpacking and `IdLists.to_list` with the
previous prompt kept (what it does). For scale, the part of vLLM's own work over the same list that agentkv
leaves to it: the msgpack decode in the engine core, which makes every int again.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

from bench._common import bar_chart, print_table, results_dir, summarize, write_rows

NAME = "id_lists"
LABELS = ("every int made (tolist)", "previous turn's ints (agentkv IdLists)", "vLLM's msgpack decode")


def _median_ms(run: Callable[[Any], Any], setup: Callable[[], Any], rounds: int) -> float:
    times: list[float] = []
    for _ in range(rounds):
        state = setup()
        t0 = time.perf_counter()
        run(state)
        times.append((time.perf_counter() - t0) * 1e3)
    return round(float(summarize(times)["p50"]), 3)


def _row(n: int, new: int, rounds: int, rng: random.Random) -> dict[str, Any]:
    import msgspec

    from agentkv._wire import pack_ids, unpack_ids
    from agentkv.server.engine.plugin._id_lists import IdLists

    prompt = [rng.randrange(1000, 150_000) for _ in range(n)]  # a real vocabulary's ids: few small ints
    previous, packed = prompt[: n - new], pack_ids(prompt)
    assert packed is not None
    encoded = msgspec.msgpack.encode(prompt)
    decoder = msgspec.msgpack.Decoder(list[int])

    def kept() -> IdLists:
        lists = IdLists(max_ids=1 << 20)
        lists.to_list(unpack_ids(pack_ids(previous)))
        return lists

    made = _median_ms(lambda _: unpack_ids(packed).tolist(), lambda: None, rounds)
    reused = _median_ms(lambda lists: lists.to_list(unpack_ids(packed)), kept, rounds)
    vllm = _median_ms(lambda _: decoder.decode(encoded), lambda: None, rounds)
    assert kept().to_list(unpack_ids(packed)) == (prompt, len(previous))
    return {"tokens": n, LABELS[0]: made, LABELS[1]: reused, LABELS[2]: vllm}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.id_lists", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="32768,65536,131072")
    ap.add_argument("--new", type=int, default=512, help="ids the turn adds to the previous prompt")
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--out", default=None, help="output dir (default bench/results/id_lists)")
    args = ap.parse_args(argv)

    rng = random.Random(0)
    rows = [_row(int(n), args.new, args.rounds, rng) for n in args.lengths.split(",")]
    print_table(
        f"packed ids of an agent's turn ({args.new} new) into vLLM's list, median ms",
        ["prompt tokens", *LABELS],
        [[r["tokens"], *(r[k] for k in LABELS)] for r in rows],
    )
    out = results_dir(NAME, args.out)
    bar_chart(
        out / f"{NAME}.png",
        title="an agent's packed prompt ids into vLLM's list (median)",
        labels=[f"{r['tokens']:,}" for r in rows],
        series={k: [r[k] for r in rows] for k in LABELS},
        ylabel="ms",
    )
    return write_rows(NAME, args, rows, out)


if __name__ == "__main__":
    main()
