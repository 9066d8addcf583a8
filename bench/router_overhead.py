"""Router overhead: agentkv's router vs vLLM's example proxy, side by side, on the same stub backends.

    python -m bench.router_overhead                       # ~1.5 min on 2 cores
    python -m bench.router_overhead --throughput-s 60 --concurrency 64 --stream

Three targets, each driven by the same multi-turn load (bench/_loadgen.py):
  direct   the client calls prefill then decode itself (what a zero-cost proxy would do) = the baseline
  proxy    upstream ``disagg_proxy_multiturn.py`` from vLLM's sdist (fetched at bench time, never committed)
  agentkv  ``agentkv.server.router`` (uvicorn subprocess)
Reported: added latency p50/p99 over ``direct`` at concurrency 1, and saturated requests/s at
``--concurrency``. Targets (reported, not asserted): <= 1 ms p50 added, >= 3x the proxy's throughput.
Everything shares the machine's cores (load generator, stubs, proxy): compare targets within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import httpx

from agentkv._constants import LEASE_PORT_OFFSET
from agentkv.server.launch._launcher import free_port
from bench._common import (
    bar_chart,
    cdf_chart,
    command_line,
    console,
    make_progress,
    print_table,
    results_dir,
    summarize,
    write_results,
)
from bench._loadgen import LoadResult, LoadSpec, Target, run_load, run_load_processes
from bench._procs import (
    ProcessSampler,
    ServerProcess,
    exit_on_sigterm,
    parse_cpus,
    running,
    stub_command,
)
from bench._servers import agentkv_available, proxy_server, router_server
from bench._upstream import DEFAULT_VERSION, fetch_upstream_proxy

NAME = "router_overhead"
TARGETS = ("direct", "proxy", "agentkv")


def _run(spec: LoadSpec, label: str, total: int) -> LoadResult:
    with make_progress() as progress:
        task = progress.add_task(label, total=total)
        return asyncio.run(run_load(spec, on_turn=lambda _: progress.advance(task)))


def _tag() -> str:
    # Fresh conversation ids per phase: a warm-up conversation must not leak state into a measured one.
    return uuid.uuid4().hex[:8]


def _stub_stats(urls: dict[str, str]) -> dict[str, dict[str, int]]:
    return {role: httpx.get(f"{url}/stub/stats", timeout=5).json() for role, url in urls.items()}


def _calls_per_turn(before: dict[str, Any], after: dict[str, Any], turns: int) -> dict[str, float]:
    """Upstream requests the target made per client turn (P, D and decode's retention service)."""
    if turns == 0:
        return {}
    return {
        "prefill": (after["prefill"]["requests"] - before["prefill"]["requests"]) / turns,
        "decode": (after["decode"]["requests"] - before["decode"]["requests"]) / turns,
        "retention_service": (after["decode"]["service_calls"] - before["decode"]["service_calls"]) / turns,
        "prefill_pulls": (after["prefill"]["pulls"] - before["prefill"]["pulls"]) / turns,
    }


def measure_target(
    target: Target, base: LoadSpec, args: argparse.Namespace, pid: int | None, stubs: dict[str, str]
) -> dict[str, Any]:
    warm = dataclasses.replace(base, target=target, conversations=4, concurrency=2, tag=_tag())
    asyncio.run(run_load(warm))
    latency_spec = dataclasses.replace(
        base,
        target=target,
        concurrency=1,
        conversations=math.ceil(args.latency_turns / args.turns),
        tag=_tag(),
    )
    before = _stub_stats(stubs)
    latency = _run(
        latency_spec, f"{target}: latency (concurrency 1)", latency_spec.conversations * args.turns
    )
    calls = _calls_per_turn(before, _stub_stats(stubs), len(latency.turns))
    throughput_spec = dataclasses.replace(
        base,
        target=target,
        concurrency=args.concurrency,
        conversations=10**9,  # bounded by duration_s
        duration_s=args.throughput_s,
        tag=_tag(),
    )
    sampler = ProcessSampler(pid=pid) if pid is not None else contextlib.nullcontext()
    label = f"{target}: saturate {args.concurrency} conv x {args.loadgen_procs} proc"
    with make_progress() as progress, sampler, ThreadPoolExecutor(1) as pool:
        task = progress.add_task(label, total=args.throughput_s)
        job = pool.submit(
            run_load_processes,
            throughput_spec,
            processes=args.loadgen_procs,
            cpus=parse_cpus(args.loadgen_cpus),
        )
        started = time.monotonic()
        while not job.done():
            time.sleep(0.5)
            progress.update(task, completed=min(args.throughput_s, time.monotonic() - started))
        throughput = job.result()
    return {
        "latency_ms": summarize([t.latency_s for t in latency.ok], scale=1000),
        "latency_samples_ms": [t.latency_s * 1000 for t in latency.ok],
        "latency_errors": latency.errors(),
        "reuse": latency.reuse_counts(),
        "upstream_calls_per_turn": calls,
        "throughput_rps": throughput.throughput,
        "throughput_turns": len(throughput.ok),
        "throughput_wall_s": throughput.wall_s,
        "throughput_latency_ms": summarize([t.latency_s for t in throughput.ok], scale=1000),
        "throughput_errors": throughput.errors(),
        "server_cpu_cores": sampler.cpu_fraction if isinstance(sampler, ProcessSampler) else None,
        "server_peak_rss_mib": sampler.peak_rss / 2**20 if isinstance(sampler, ProcessSampler) else None,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.router_overhead", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma list of direct,proxy,agentkv")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--latency-turns", type=int, default=200, help="requests measured at concurrency 1")
    parser.add_argument("--concurrency", type=int, default=32, help="conversations in flight when saturating")
    parser.add_argument(
        "--throughput-s", type=float, default=15.0, help="seconds of saturated load per target"
    )
    parser.add_argument("--stream", action="store_true", help="stream answers (SSE) instead of JSON")
    parser.add_argument("--system-chars", type=int, default=2000)
    parser.add_argument("--turn-chars", type=int, default=400)
    parser.add_argument("--output-tokens", type=int, default=16, help="tokens each stub decode returns")
    parser.add_argument(
        "--router-path-policy", default="always-pd", choices=["always-pd", "auto", "always-local"]
    )
    parser.add_argument("--proxy-version", default=DEFAULT_VERSION)
    parser.add_argument(
        "--proxy-script", type=Path, default=None, help="use this proxy file, skip the download"
    )
    parser.add_argument("--proxy-logging", action="store_true", help="keep the proxy's per-request INFO logs")
    parser.add_argument(
        "--loadgen-procs", type=int, default=1, help="load generator processes when saturating"
    )
    parser.add_argument("--server-cpus", default=None, help="pin proxy/router to these cores, e.g. 0,1")
    parser.add_argument("--stub-cpus", default=None, help="pin the stub backends, e.g. 2-5")
    parser.add_argument("--loadgen-cpus", default=None, help="pin the load generator, e.g. 6-13")
    parser.add_argument(
        "--out", type=Path, default=None, help="output dir (default bench/results/router_overhead)"
    )
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    exit_on_sigterm()
    out = results_dir(NAME, args.out)
    logs = out / "logs"
    targets = [cast(Target, t) for t in args.targets.split(",") if t in TARGETS]
    skipped: dict[str, str] = {}
    if "agentkv" in targets and (why := agentkv_available()) is not None:
        skipped["agentkv"] = why
        targets.remove("agentkv")
    script = None
    if "proxy" in targets:
        script = args.proxy_script or fetch_upstream_proxy(args.proxy_version)
    prefill_port, decode_port = free_port(), free_port(offsets=[LEASE_PORT_OFFSET])
    prefill_url, decode_url = f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"
    stub_args = ("--output-tokens", str(args.output_tokens))
    stub_cpus, server_cpus = parse_cpus(args.stub_cpus), parse_cpus(args.server_cpus)
    stubs = [
        ServerProcess(
            name="stub-prefill",
            command=stub_command("prefill", prefill_port, *stub_args),
            health_url=f"{prefill_url}/health",
            log_dir=logs,
            cpus=stub_cpus,
        ),
        ServerProcess(
            name="stub-decode",
            command=stub_command("decode", decode_port, "--lease", *stub_args),
            health_url=f"{decode_url}/health",
            log_dir=logs,
            cpus=stub_cpus,
        ),
    ]
    if (loadgen_cpus := parse_cpus(args.loadgen_cpus)) is not None:
        os.sched_setaffinity(0, loadgen_cpus)  # the latency phase runs in this process
    base = LoadSpec(
        target="direct",
        prefill_url=prefill_url,
        decode_url=decode_url,
        turns=args.turns,
        stream=args.stream,
        system_chars=args.system_chars,
        turn_chars=args.turn_chars,
        max_tokens=args.output_tokens,
    )
    results: dict[str, Any] = {}
    with running(stubs):
        for target in targets:
            port = free_port()
            server = None
            if target == "proxy":
                assert script is not None
                server = proxy_server(
                    script=script,
                    port=port,
                    prefill_port=prefill_port,
                    decode_port=decode_port,
                    log_dir=logs,
                    quiet=not args.proxy_logging,
                )
            elif target == "agentkv":
                # always-pd: the same two hops as the proxy and the baseline; "auto" may skip prefill for
                # short suffixes (decode-local), which would flatter the router here.
                server = router_server(
                    port=port,
                    prefill_url=prefill_url,
                    decode_url=decode_url,
                    log_dir=logs,
                    path_policy=args.router_path_policy,
                    exact=args.router_path_policy != "always-local",  # decode-local is not exact
                )
            spec = dataclasses.replace(base, url=f"http://127.0.0.1:{port}")
            stub_urls = {"prefill": prefill_url, "decode": decode_url}
            if server is None:
                results[target] = measure_target(target, spec, args, None, stub_urls)
                continue
            server.cpus = server_cpus
            with running([server]):
                results[target] = measure_target(target, spec, args, server.pid, stub_urls)
    data = _summarize(results, skipped, args, decode_port + LEASE_PORT_OFFSET)
    _report(data, out)
    return data


def _summarize(
    results: dict[str, Any], skipped: dict[str, str], args: argparse.Namespace, lease_port: int
) -> dict[str, Any]:
    base = results.get("direct")
    for result in results.values():
        if base is not None:
            result["added_p50_ms"] = result["latency_ms"]["p50"] - base["latency_ms"]["p50"]
            result["added_p99_ms"] = result["latency_ms"]["p99"] - base["latency_ms"]["p99"]
    ratio = None
    if "proxy" in results and "agentkv" in results and results["proxy"]["throughput_rps"] > 0:
        ratio = results["agentkv"]["throughput_rps"] / results["proxy"]["throughput_rps"]
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "targets": results,
        "skipped": skipped,
        "agentkv_vs_proxy_throughput": ratio,
        "goals": {"added_p50_ms_max": 1.0, "throughput_ratio_min": 3.0},
        "decode_retention_port": lease_port,
    }


def _report(data: dict[str, Any], out: Path) -> None:
    results = data["targets"]
    rows = []
    for name, r in results.items():
        lat = r["latency_ms"]
        rows.append(
            [
                name,
                lat["p50"],
                lat["p99"],
                r.get("added_p50_ms", math.nan),
                r.get("added_p99_ms", math.nan),
                r["throughput_rps"],
                r["server_cpu_cores"] if r["server_cpu_cores"] is not None else math.nan,
                sum(r["latency_errors"].values()) + sum(r["throughput_errors"].values()),
            ]
        )
    print_table(
        "router overhead (ms; rps saturated)",
        ["target", "p50", "p99", "added p50", "added p99", "req/s", "server cores", "errors"],
        rows,
    )
    if data["agentkv_vs_proxy_throughput"] is not None:
        console.print(f"agentkv / proxy throughput: {data['agentkv_vs_proxy_throughput']:.2f}x (goal >= 3x)")
    for name, why in data["skipped"].items():
        console.print(f"[yellow]skipped {name}: {why}")
    names = list(results)
    bar_chart(
        out / "latency.png",
        title="latency at concurrency 1",
        labels=names,
        ylabel="ms",
        series={
            "p50": [results[n]["latency_ms"]["p50"] for n in names],
            "p99": [results[n]["latency_ms"]["p99"] for n in names],
        },
    )
    bar_chart(
        out / "throughput.png",
        title="saturated throughput",
        labels=names,
        ylabel="requests/s",
        series={"req/s": [results[n]["throughput_rps"] for n in names]},
    )
    cdf_chart(
        out / "latency_cdf.png",
        title="latency at concurrency 1",
        xlabel="ms",
        log=True,
        samples={n: results[n]["latency_samples_ms"] for n in names},
    )
    path = write_results(NAME, data, command_line(), out_dir=out)
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
