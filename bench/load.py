"""Load test: N concurrent multi-turn conversations through the router (or any OpenAI-compatible URL).

    python -m bench.load                                   # router + stub backends, ~1 min
    python -m bench.load --url http://127.0.0.1:8000 --model tiny --router-pid 1234
    python -m bench.load --track-conversations 100000 --router-max-conversations 20000

Reports throughput, latency (and TTFT when streaming) percentiles, errors, the reuse rate read from the
``x-agentkv-reuse`` response header, and the router process's CPU and RSS. ``--track-conversations N``
instead opens N one-turn conversations (distinct ids) and samples the router's RSS as the count grows:
memory must level off once the router's ``max_conversations`` bound is reached.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
from pathlib import Path
from typing import Any

from agentkv._constants import LEASE_PORT_OFFSET
from agentkv.server.launch._launcher import free_port
from bench._common import (
    command_line,
    console,
    line_chart,
    make_progress,
    print_table,
    results_dir,
    summarize,
    write_results,
)
from bench._loadgen import LoadResult, LoadSpec, TurnResult, run_load
from bench._procs import (
    ProcessSampler,
    ServerProcess,
    exit_on_sigterm,
    running,
    stub_command,
)
from bench._servers import agentkv_available, router_server

NAME = "load"


def _stack(args: argparse.Namespace, logs: Path) -> tuple[list[ServerProcess], str, ServerProcess]:
    """Stub prefill + stub decode (with retention service) + our router; returns (servers, url, router)."""
    prefill_port, decode_port, router_port = free_port(), free_port(offsets=[LEASE_PORT_OFFSET]), free_port()
    stub_args = ("--output-tokens", str(args.max_tokens), "--token-ms", str(args.stub_token_ms))
    prefill = ServerProcess(
        name="stub-prefill",
        command=stub_command("prefill", prefill_port, *stub_args),
        health_url=f"http://127.0.0.1:{prefill_port}/health",
        log_dir=logs,
    )
    decode = ServerProcess(
        name="stub-decode",
        command=stub_command("decode", decode_port, "--lease", *stub_args),
        health_url=f"http://127.0.0.1:{decode_port}/health",
        log_dir=logs,
    )
    settings = {}
    if args.router_max_conversations is not None:
        settings["max_conversations"] = args.router_max_conversations
    router = router_server(
        port=router_port,
        prefill_url=f"http://127.0.0.1:{prefill_port}",
        decode_url=f"http://127.0.0.1:{decode_port}",
        log_dir=logs,
        **settings,
    )
    return [prefill, decode, router], f"http://127.0.0.1:{router_port}", router


def _drive(
    spec: LoadSpec, label: str, total: int, pid: int | None
) -> tuple[LoadResult, ProcessSampler | None]:
    sampler = ProcessSampler(pid=pid) if pid is not None else None
    with make_progress() as progress:
        task = progress.add_task(label, total=total)

        def advance(_: TurnResult) -> None:
            progress.advance(task)

        if sampler is None:
            return asyncio.run(run_load(spec, on_turn=advance)), None
        with sampler:
            result = asyncio.run(run_load(spec, on_turn=advance))
    return result, sampler


def _multiturn(spec: LoadSpec, pid: int | None) -> dict[str, Any]:
    result, sampler = _drive(
        spec, f"{spec.conversations} conversations", spec.conversations * spec.turns, pid
    )
    later = [turn for turn in result.ok if turn.turn > 0]
    # "local": decode prefilled the suffix itself on top of its own cache, which is reuse too.
    hits = sum(1 for turn in later if turn.reuse in ("hit", "local"))
    ttfts = [turn.ttft_s for turn in result.ok if turn.ttft_s is not None]
    return {
        "turns_ok": len(result.ok),
        "turns_failed": len(result.turns) - len(result.ok),
        "wall_s": result.wall_s,
        "throughput_rps": result.throughput,
        "latency_ms": summarize([turn.latency_s for turn in result.ok], scale=1000),
        "ttft_ms": summarize(ttfts, scale=1000),
        "errors": result.errors(),
        "reuse_counts": result.reuse_counts(),
        # Only turns after the first can reuse anything; "absent" means the server sent no header.
        "reuse_rate": hits / len(later) if later else None,
        "router_cpu_cores": None if sampler is None else sampler.cpu_fraction,
        "router_peak_rss_mib": None if sampler is None else sampler.peak_rss / 2**20,
    }


def _tracking(spec: LoadSpec, pid: int) -> dict[str, Any]:
    result, sampler = _drive(spec, f"tracking {spec.conversations} conversation ids", spec.conversations, pid)
    assert sampler is not None
    # Map each RSS sample to how many conversations had been opened by then.
    starts = sorted(turn.started for turn in result.turns)
    points = []
    for elapsed, _, rss in sampler.samples:
        points.append((bisect.bisect_right(starts, elapsed), rss / 2**20))
    return {
        "conversations": spec.conversations,
        "turns_ok": len(result.ok),
        "errors": result.errors(),
        "throughput_rps": result.throughput,
        "rss_mib_by_conversations": points,
        "rss_mib_first": points[0][1] if points else None,
        "rss_mib_last": points[-1][1] if points else None,
        "router_peak_rss_mib": sampler.peak_rss / 2**20,
        "router_cpu_cores": sampler.cpu_fraction,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=None, help="drive this server instead of starting router + stubs")
    parser.add_argument("--router-pid", type=int, default=None, help="with --url: sample this process")
    parser.add_argument("--model", default="stub-model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration-s", type=float, default=90.0, help="upper bound on the run")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--system-chars", type=int, default=2000)
    parser.add_argument("--turn-chars", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stub-token-ms", type=float, default=0.0, help="stub inter-token delay")
    parser.add_argument("--track-conversations", type=int, default=None, help="memory mode: N one-turn ids")
    parser.add_argument("--router-max-conversations", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="output dir (default bench/results/load)")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    exit_on_sigterm()
    out = results_dir(NAME, args.out)
    tracking = args.track_conversations is not None
    spec = LoadSpec(
        target="agentkv",
        conversations=args.track_conversations if tracking else args.conversations,
        turns=1 if tracking else args.turns,
        concurrency=args.concurrency,
        stream=args.stream,
        system_chars=200 if tracking else args.system_chars,
        turn_chars=50 if tracking else args.turn_chars,
        max_tokens=args.max_tokens,
        model=args.model,
        duration_s=None if tracking else args.duration_s,
        api_key=args.api_key,
    )
    if args.url is not None:
        spec.url = args.url.rstrip("/")
        pid = args.router_pid
        if tracking and pid is None:
            raise SystemExit("--track-conversations with --url needs --router-pid")
        data = _tracking(spec, pid) if tracking else _multiturn(spec, pid)
    else:
        if (why := agentkv_available()) is not None:
            raise SystemExit(f"agentkv router not importable: {why}")
        servers, spec.url, router = _stack(args, out / "logs")
        with running(servers):
            data = _tracking(spec, router.pid) if tracking else _multiturn(spec, router.pid)
    data["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    _report(data, out, tracking)
    return data


def _report(data: dict[str, Any], out: Path, tracking: bool) -> None:
    if tracking:
        print_table(
            "router memory while tracking conversations",
            ["conversations", "req/s", "RSS first MiB", "RSS last MiB", "RSS peak MiB", "errors"],
            [
                [
                    data["conversations"],
                    data["throughput_rps"],
                    data["rss_mib_first"] or float("nan"),
                    data["rss_mib_last"] or float("nan"),
                    data["router_peak_rss_mib"],
                    sum(data["errors"].values()),
                ]
            ],
        )
        points = data["rss_mib_by_conversations"]
        line_chart(
            out / "memory.png",
            title="router RSS vs conversations opened",
            series={"RSS": ([p[0] for p in points], [p[1] for p in points])},
            xlabel="conversations opened",
            ylabel="MiB",
        )
    else:
        lat = data["latency_ms"]
        cpu = data["router_cpu_cores"]
        rss = data["router_peak_rss_mib"]
        print_table(
            "load",
            [
                "turns ok",
                "req/s",
                "p50 ms",
                "p90 ms",
                "p99 ms",
                "reuse rate",
                "router cores",
                "router RSS MiB",
            ],
            [
                [
                    data["turns_ok"],
                    data["throughput_rps"],
                    lat["p50"],
                    lat["p90"],
                    lat["p99"],
                    float("nan") if data["reuse_rate"] is None else data["reuse_rate"],
                    float("nan") if cpu is None else cpu,
                    float("nan") if rss is None else rss,
                ]
            ],
        )
        console.print(f"reuse headers: {data['reuse_counts']}  errors: {data['errors'] or 'none'}")
    path = write_results(NAME if not tracking else f"{NAME}_memory", data, command_line(), out_dir=out)
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
