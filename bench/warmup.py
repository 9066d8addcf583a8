"""What NIXL's first handshakes cost a user's turn, and so what ``Cluster.up``'s warm-up takes off it.

    python -m bench.warmup [--rounds 6]

Starts a 1P1D cluster (tiny model, prefill prefix cache off) *without* its warm-up, then runs the warm-up's
two turns (``agentkv.server.launch._warmup.warm_up_pair``) ``--rounds`` times through the pair. Round 1 is
what the
first user's turn would meet: decode's first read of prefill's blocks and prefill's first pull from decode
each begin with a NIXL handshake. The later rounds are the steady state. Per round: turn 1 (prefill and
decode hops, decode reading from prefill), turn 2's prefill hop (prefill pulling from decode), tokens pulled.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench._common import bar_chart, command_line, console, print_table, results_dir, summarize, write_results

NAME = "warmup"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.warmup", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--model", default=".agentkv/models/tiny")
    ap.add_argument("--out", type=Path, default=None, help="output dir (default bench/results/warmup)")
    args = ap.parse_args(argv)
    from agentkv.server.launch._cluster import Cluster, ClusterConfig
    from agentkv.server.launch._model import ensure_tiny_model, tiny_serving
    from agentkv.server.launch._warmup import warm_up_pair

    out = results_dir(NAME, args.out)
    cfg = ClusterConfig(
        model=str(ensure_tiny_model(Path(args.model))),
        router_port=None,
        prefill_port=25100,
        decode_port=25200,
        side_channel_port=9600,
        prefill_prefix_caching=False,
        warm_up=False,  # the point: the first round below is the cold pair
        **tiny_serving(),
        log_dir=Path(".agentkv/bench-logs/warmup"),
    )
    cluster = Cluster(config=cfg)
    with console.status("starting 1P1D (1-3 minutes on CPU) ..."):
        cluster.up()
    try:
        p, d = cluster.prefills[0].spec.url, cluster.decodes[0].spec.url
        rounds = [asdict(warm_up_pair(prefill_url=p, decode_url=d)) for _ in range(args.rounds)]
    finally:
        cluster.down()
    warm = rounds[1:]
    data: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rounds": rounds,
        "cold": {k: rounds[0][k] for k in ("first_turn_ms", "pull_ms", "pulled_tokens")},
        "warm": {k: summarize([r[k] for r in warm]) for k in ("first_turn_ms", "pull_ms", "pulled_tokens")},
    }
    print_table(
        "NIXL first handshakes: cold pair (round 1) vs warm (later rounds), ms",
        ["round", "turn 1 (D reads P)", "turn 2 prefill hop (P pulls D)", "tokens pulled"],
        [[i + 1, r["first_turn_ms"], r["pull_ms"], r["pulled_tokens"]] for i, r in enumerate(rounds)],
    )
    bar_chart(
        out / "warmup.png",
        title="what the first turns pay for NIXL's handshakes",
        labels=["turn 1 (decode reads prefill)", "turn 2 prefill hop (prefill pulls decode)"],
        ylabel="ms",
        series={
            "cold pair (round 1)": [rounds[0]["first_turn_ms"], rounds[0]["pull_ms"]],
            "warm (p50 of later rounds)": [
                data["warm"]["first_turn_ms"]["p50"],
                data["warm"]["pull_ms"]["p50"],
            ],
        },
    )
    console.print(f"wrote {write_results(NAME, data, command_line(), out_dir=out)}")
    return data


if __name__ == "__main__":
    main()
