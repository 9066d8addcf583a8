"""Engines joining and leaving through discovery while agents run: a bounded multi-turn load against the
router (stub engines on loopback), during which a decode appears and another one disappears.

    python -m bench.discovery                       # ~1 min: 1 prefill, decodes a and b, c joins, a leaves

The router runs as its own process with ``discovery = "dns"``: the real `DnsSource`, reconciler, health
checks and drain, with one stand-in, the resolver, which reads a JSON file this bench rewrites (names to
addresses, as a headless Service's DNS answers); every decode listens on its own loopback address
(127.0.0.2, 127.0.0.3, ...) and the same port, as pods behind one Service do. The leaving decode keeps serving
for ``--grace-s`` after it left the DNS answer (a pod's preStop wait) and is then stopped.

Reports turns, failed turns, the reuse rate before the join, between join and leave, and after the leave,
the time from an engine's appearance in DNS to the router counting it healthy and to its first routed turn,
and from the leaving engine's disappearance to the router draining it and to its last turn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from agentkv._constants import LEASE_PORT_OFFSET
from agentkv.server.launch._launcher import free_port
from bench._common import (
    command_line,
    console,
    line_chart,
    print_table,
    results_dir,
    write_results,
)
from bench._loadgen import LoadSpec, TurnResult, run_load
from bench._procs import ServerProcess, exit_on_sigterm, running, stub_command

NAME = "discovery"
PREFILL_NAME, DECODE_NAME = "prefill.bench", "decode.bench"
# Each decode its own loopback address, one port for all, as the pods behind one Service.
DECODE_HOSTS = {"a": "127.0.0.2", "b": "127.0.0.3", "c": "127.0.0.4"}


# --- the router process --------------------------------------------------------------------------------


def _serve_router(hosts: Path, port: int) -> None:
    """The router (settings from AGENTKV_* as `agentkv router` reads them) with the file as its resolver."""
    import uvicorn

    from agentkv.server.router import RouterSettings, create_app
    from agentkv.server.router._discovery import DnsSource

    settings = RouterSettings()
    assert settings.prefill_dns and settings.decode_dns, "AGENTKV_DISCOVERY=dns and both names are set"

    async def resolve(host: str, port: int) -> list[str]:
        table = json.loads(hosts.read_text())
        return [str(a) for a in table.get(host, [])]

    source = DnsSource(prefill=settings.prefill_dns, decode=settings.decode_dns, resolve=resolve)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    uvicorn.run(
        create_app(settings, discovery=source),
        host="127.0.0.1",
        port=port,
        log_level=settings.log_level,
        access_log=False,
        loop="auto",
        http="auto",
    )


# --- the run -------------------------------------------------------------------------------------------


def _publish(hosts: Path, prefill: list[str], decode: list[str]) -> None:
    """Rewrite the fake DNS answer atomically (the router reads it on every discovery round)."""
    tmp = hosts.with_suffix(".tmp")
    tmp.write_text(json.dumps({PREFILL_NAME: prefill, DECODE_NAME: decode}))
    os.replace(tmp, hosts)


def _decode_stub(key: str, port: int, args: argparse.Namespace, logs: Path) -> ServerProcess:
    host = DECODE_HOSTS[key]
    extra = ("--host", host, "--lease", "--output-tokens", str(args.max_tokens))
    return ServerProcess(
        name=f"stub-decode-{key}",
        command=stub_command("decode", port, *extra, "--token-ms", str(args.stub_token_ms)),
        health_url=f"http://{host}:{port}/health",
        log_dir=logs,
    )


class _Watch:
    """Samples, every `interval_s`: each decode's request count (stub counters) and the router's healthy
    decode count. The times of the events the report derives come from these samples."""

    def __init__(self, *, router: str, decodes: dict[str, str], t0: float, interval_s: float) -> None:
        self.router, self.decodes, self.t0, self.interval_s = router, decodes, t0, interval_s
        self.samples: list[tuple[float, int | None, dict[str, int | None]]] = []

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=2.0) as client:
            while not stop.is_set():
                now = time.perf_counter() - self.t0
                healthy, *counts = await asyncio.gather(
                    self._healthy(client), *(self._requests(client, url) for url in self.decodes.values())
                )
                self.samples.append((now, healthy, dict(zip(self.decodes, counts, strict=True))))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval_s)

    async def _healthy(self, client: httpx.AsyncClient) -> int | None:
        try:
            return int((await client.get(f"{self.router}/health")).json()["decode"])
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    async def _requests(self, client: httpx.AsyncClient, url: str) -> int | None:
        try:
            return int((await client.get(f"{url}/stub/stats")).json()["requests"])
        except (httpx.HTTPError, ValueError, KeyError):
            return None  # not started yet, or stopped

    def first(self, after: float, test: Any) -> float | None:
        return next((t for t, healthy, counts in self.samples if t >= after and test(healthy, counts)), None)

    def last_change(self, key: str, after: float) -> float | None:
        """The first sample at which `key`'s count reached its final value, if it changed after `after`."""
        seen = [(t, counts[key]) for t, _, counts in self.samples if counts[key] is not None]
        final = seen[-1][1] if seen else None
        reached = next((t for t, n in seen if n == final), None)
        return reached if reached is not None and reached >= after else None


def _rate(turns: list[TurnResult], start: float, end: float) -> tuple[int, float | None]:
    """(turns, reuse rate) of the turns after a conversation's first that started in [start, end)."""
    later = [t for t in turns if t.turn > 0 and start <= t.started < end]
    hits = sum(1 for t in later if t.reuse in ("hit", "local"))
    return len(later), (hits / len(later) if later else None)


async def _scenario(
    args: argparse.Namespace, hosts: Path, spec: LoadSpec, stubs: dict[str, Any]
) -> dict[str, Any]:
    prefill_addr = ["127.0.0.1"]
    t0 = time.perf_counter()
    watch = _Watch(router=spec.url, decodes=stubs["urls"], t0=t0, interval_s=args.sample_s)
    stop = asyncio.Event()
    sampler = asyncio.create_task(watch.run(stop))
    events: dict[str, float] = {}

    async def schedule() -> None:
        await asyncio.sleep(args.join_at_s)
        events["c_appears"] = time.perf_counter() - t0
        _publish(hosts, prefill_addr, [DECODE_HOSTS["a"], DECODE_HOSTS["b"], DECODE_HOSTS["c"]])
        await asyncio.sleep(max(args.leave_at_s - args.join_at_s, 0.0))
        events["a_disappears"] = time.perf_counter() - t0
        _publish(hosts, prefill_addr, [DECODE_HOSTS["b"], DECODE_HOSTS["c"]])
        await asyncio.sleep(args.grace_s)
        events["a_stopped"] = time.perf_counter() - t0
        await asyncio.to_thread(stubs["a"].stop)

    load = asyncio.create_task(run_load(spec))
    await schedule()
    result = await load
    stop.set()
    await sampler

    turns = result.turns
    join, leave = events["c_appears"], events["a_disappears"]
    in_rotation = watch.first(join, lambda healthy, _: healthy is not None and healthy >= 3)
    first_turn_c = watch.first(join, lambda _, counts: (counts["c"] or 0) > 0)
    drained = watch.first(leave, lambda healthy, _: healthy is not None and healthy <= 2)
    last_turn_a = watch.last_change("a", leave)
    phases = {
        "before_join": _rate(turns, 0.0, join),
        "join_to_leave": _rate(turns, join, leave),
        "after_leave": _rate(turns, leave, float("inf")),
    }
    failed = [t for t in turns if t.error is not None]
    # Each decode's last count seen (a's from before it was stopped).
    final_counts = {
        key: next((c[key] for _, _, c in reversed(watch.samples) if c[key] is not None), None)
        for key in stubs["urls"]
    }
    return {
        "turns": len(turns),
        "turns_ok": len(result.ok),
        "turns_failed": len(failed),
        "errors": result.errors(),
        "wall_s": result.wall_s,
        "reuse_counts": result.reuse_counts(),
        "events_s": events,
        "reuse_rate": {name: rate for name, (_, rate) in phases.items()},
        "later_turns": {name: n for name, (n, _) in phases.items()},
        "join": {
            "to_healthy_s": None if in_rotation is None else in_rotation - join,
            "to_first_turn_s": None if first_turn_c is None else first_turn_c - join,
        },
        "leave": {
            "to_drained_s": None if drained is None else drained - leave,
            # The sample at which decode a's request count reached its last value (None: it took no turn
            # after it left DNS).
            "to_last_turn_s": None if last_turn_a is None else last_turn_a - leave,
        },
        "decode_requests": final_counts,
        "per_second": _per_second(turns),
        # Every tenth sample: the figures above are read from all of them.
        "samples": [[t, healthy, counts] for t, healthy, counts in watch.samples[::10]],
    }


def _per_second(turns: list[TurnResult]) -> list[dict[str, Any]]:
    """Turns started in each second of the run: how many, how many failed, and the reuse rate of those after
    a conversation's first."""
    rows: dict[int, dict[str, Any]] = {}
    for t in turns:
        row = rows.setdefault(int(t.started), {"second": int(t.started), "turns": 0, "failed": 0, "later": 0})
        row["turns"] += 1
        row["failed"] += t.error is not None
        if t.turn > 0:
            row["later"] += 1
            row["hits"] = row.get("hits", 0) + (t.reuse in ("hit", "local"))
    for row in rows.values():
        row["reuse_rate"] = row.pop("hits", 0) / row["later"] if row["later"] else None
    return [rows[k] for k in sorted(rows)]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.discovery", description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation")
    parser.add_argument("--duration-s", type=float, default=50.0, help="new turns stop after this")
    parser.add_argument("--join-at-s", type=float, default=12.0, help="decode c appears in DNS")
    parser.add_argument("--leave-at-s", type=float, default=28.0, help="decode a leaves DNS")
    parser.add_argument("--grace-s", type=float, default=12.0, help="a serves this long after leaving DNS")
    parser.add_argument("--discovery-interval-s", type=float, default=5.0)
    parser.add_argument("--health-interval-s", type=float, default=5.0)
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--system-chars", type=int, default=2000)
    parser.add_argument("--turn-chars", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stub-token-ms", type=float, default=2.0, help="stub inter-token delay")
    parser.add_argument("--sample-s", type=float, default=0.05, help="how often the watcher samples")
    parser.add_argument("--out", type=Path, default=None, help="output dir (default bench/results/discovery)")
    # Internal: the router process this bench starts.
    parser.add_argument("--serve-router", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hosts", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    if args.serve_router:
        _serve_router(args.hosts, args.port)
        return {}
    exit_on_sigterm()
    out = results_dir(NAME, args.out)
    logs = out / "logs"
    hosts = logs / "dns.json"
    logs.mkdir(parents=True, exist_ok=True)
    _publish(hosts, ["127.0.0.1"], [DECODE_HOSTS["a"], DECODE_HOSTS["b"]])
    prefill_port = free_port()
    decode_port = free_port(offsets=[LEASE_PORT_OFFSET])
    router_port = free_port()
    stub_args = ("--output-tokens", str(args.max_tokens), "--token-ms", str(args.stub_token_ms))
    prefill = ServerProcess(
        name="stub-prefill",
        command=stub_command("prefill", prefill_port, *stub_args),
        health_url=f"http://127.0.0.1:{prefill_port}/health",
        log_dir=logs,
    )
    decodes = {key: _decode_stub(key, decode_port, args, logs) for key in DECODE_HOSTS}
    serve = ["--serve-router", "--hosts", str(hosts), "--port", str(router_port)]
    router = ServerProcess(
        name="agentkv-router",
        command=[sys.executable, "-m", "bench.discovery", *serve],
        health_url=f"http://127.0.0.1:{router_port}/health",
        log_dir=logs,
        env={
            "AGENTKV_LOG_LEVEL": "warning",
            "AGENTKV_DISCOVERY": "dns",
            "AGENTKV_PREFILL_DNS": f"{PREFILL_NAME}:{prefill_port}",
            "AGENTKV_DECODE_DNS": f"{DECODE_NAME}:{decode_port}",
            "AGENTKV_DISCOVERY_INTERVAL_S": str(args.discovery_interval_s),
            "AGENTKV_HEALTH_INTERVAL_S": str(args.health_interval_s),
        },
    )
    spec = LoadSpec(
        target="agentkv",
        url=f"http://127.0.0.1:{router_port}",
        conversations=1_000_000,  # bounded by --duration-s
        turns=args.turns,
        concurrency=args.concurrency,
        stream=args.stream,
        system_chars=args.system_chars,
        turn_chars=args.turn_chars,
        max_tokens=args.max_tokens,
        duration_s=args.duration_s,
    )
    stubs: dict[str, Any] = {
        "urls": {key: f"http://{host}:{decode_port}" for key, host in DECODE_HOSTS.items()},
        "a": decodes["a"],
    }
    # c runs from the start (healthy before it is published): what is measured is discovery, not its boot.
    with running([prefill, *decodes.values(), router]):
        data = asyncio.run(_scenario(args, hosts, spec, stubs))
    data["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    _report(data, out)
    return data


def _fmt(value: float | None, scale: float = 1.0) -> float:
    return float("nan") if value is None else value * scale


def _report(data: dict[str, Any], out: Path) -> None:
    rates, counts = data["reuse_rate"], data["later_turns"]
    print_table(
        "discovery under load: turns and reuse rate (turns after a conversation's first)",
        ["turns", "failed", "rate before join", "join to leave", "after leave", "later turns (3 phases)"],
        [
            [
                data["turns"],
                data["turns_failed"],
                _fmt(rates["before_join"]),
                _fmt(rates["join_to_leave"]),
                _fmt(rates["after_leave"]),
                " / ".join(str(counts[k]) for k in ("before_join", "join_to_leave", "after_leave")),
            ]
        ],
    )
    join, leave = data["join"], data["leave"]
    print_table(
        "engines through discovery (seconds from the DNS change; sampled every "
        f"{data['config']['sample_s']} s, discovery every {data['config']['discovery_interval_s']} s)",
        ["event", "router counts it", "its first / last turn"],
        [
            ["decode c appears", _fmt(join["to_healthy_s"]), _fmt(join["to_first_turn_s"])],
            ["decode a disappears", _fmt(leave["to_drained_s"]), _fmt(leave["to_last_turn_s"])],
        ],
    )
    console.print(f"requests per decode: {data['decode_requests']}  errors: {data['errors'] or 'none'}")
    samples = data["samples"]
    series = {}
    for key, role in (("a", "a (leaves)"), ("b", "b"), ("c", "c (joins)")):
        points = [(t, counts[key]) for t, _, counts in samples if counts[key] is not None]
        series[f"decode {role}"] = ([p[0] for p in points], [p[1] for p in points])
    line_chart(
        out / "discovery.png",
        title="turns served per decode (cumulative); c appears at "
        f"{data['events_s']['c_appears']:.0f} s, a leaves at {data['events_s']['a_disappears']:.0f} s",
        series=series,
        xlabel="seconds into the run",
        ylabel="requests served",
    )
    rows = [r for r in data["per_second"] if r["reuse_rate"] is not None]
    line_chart(
        out / "reuse_rate.png",
        title="reuse rate of turns after a conversation's first, per second",
        series={"reuse rate": ([r["second"] for r in rows], [r["reuse_rate"] for r in rows])},
        xlabel="seconds into the run",
        ylabel="hit rate",
    )
    path = write_results(NAME, data, command_line(), out_dir=out)
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
