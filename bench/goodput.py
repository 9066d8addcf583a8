"""Goodput under load: many agent conversations at once, reuse OFF / ON / ON exact vs one aggregated server.

    python -m bench.goodput --legs off,on,exact,agg                     # CPU smoke, tiny model
    bash scripts/gpu/load.sh "$OUT" off,on,exact,agg                   # the H200 run (see the script)

Conversations arrive open-loop (``rate x --window-s`` of them per ``--rates`` value, at Poisson times),
each with a context drawn from ``--contexts``, then ``--turns - 1`` tool results of ``--suffix`` tokens after
lognormal tool gaps; every turn streams ``--output-tokens`` tokens. ``--trace`` replays the Mooncake trace's
conversations instead, time-scaled to each rate. Clients heartbeat through tool gaps and close each
conversation after its last turn, as the SDK's Session does.

Legs (each on freshly started engines; ``on`` and ``exact`` share one cluster, each with its own router):

* ``off``: 1P1D, ``bidirectional_kv_xfer`` false, router ``reuse`` off: every turn recomputes on P.
* ``floor``: ``off`` with prefill's own prefix cache on (P keeps what it can of earlier turns itself).
* ``on``: 1P1D with reuse, the router's default (``exact=false``: decode's own KV and decode-local turns).
* ``tiered``: ``on`` with a host KV tier on decode (``--host-tier-bytes``: vLLM's OffloadingConnector beside
  agentkv's, ``EngineSpec.kv_offload_bytes``): a retention the cap declines, a lease that ends, and a
  conversation demoted when its tool starts (the first beat of each gap says so) are served decode-local from
  what decode's KV cache or host tier still holds (``cached``).
* ``exact``: the same cluster, router ``exact=true`` (only prefill-computed KV, bit-identical answers).
* ``agg``: one vLLM server with prefix caching, no P/D, ``--agg-engine-arg`` (give it the memory of P + D);
  clients talk to it directly (no router; the session header is sent and ignored).

Prefill runs without prefix caching except in ``floor`` (the multi-turn sweep's OFF/ON definition). Per rate
step: goodput (turns/s meeting TTFT <= ``--slo-ttft-ms`` and TPOT <= ``--slo-tpot-ms``), TTFT and TPOT
p50/p90/p99, reuse hit rate of later turns, and from the engines' ``/metrics`` (polled every ``--poll-s``):
KV occupancy and the retained share of decode's KV, declined retentions, preemptions, mean engine queue
time, and what ran out. A leg's knee is its highest rate whose step met the SLO at p90 with no error.

Writes ``goodput.json`` (``goodput.partial.json`` after every step) and ``goodput_vs_rate.png``,
``kv_occupancy.png``; ``--plot FILE`` re-plots and re-prints a JSON (the GPU host has no matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from bench._agentload import (
    SLO,
    ConversationPlan,
    generate_plans,
    knee,
    records_json,
    run_step,
    summarize_step,
    trace_plans,
)
from bench._engine_metrics import Endpoint, EngineWatch, digest, series
from bench._plugin_args import (
    add_env_arg,
    add_kv_config_arg,
    add_plugin_args,
    add_prefill_cache_arg,
    plugin_fields,
)

NAME = "goodput"
LEGS = ("off", "floor", "on", "tiered", "exact", "agg")
# Legs that run on the same engines (one start for both).
CLUSTER_OF = {
    "off": "off",
    "floor": "floor",
    "on": "reuse",
    "tiered": "tiered",
    "exact": "reuse",
    "agg": "agg",
}


def groups(legs: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Legs grouped by the engines they run on, in the order first asked for."""
    out: dict[str, list[str]] = {}
    for leg in legs:
        if leg not in CLUSTER_OF:
            raise ValueError(f"unknown leg {leg!r} (known: {', '.join(LEGS)})")
        out.setdefault(CLUSTER_OF[leg], []).append(leg)
    return list(out.items())


def limits(summary: dict[str, Any], engines: dict[str, dict[str, Any]], slo: SLO) -> list[str]:
    """Which resource ran out in one step, from what the engines and the router reported."""
    found: list[str] = []
    d = engines.get("decode") or engines.get("single") or {}
    p = engines.get("prefill") or {}
    if (d.get("kv_usage_max") or 0) >= 0.95:
        share = d.get("retained_share_max")
        held = f", retained up to {share:.0%}" if share is not None else ""
        found.append(f"decode KV full (peak {d['kv_usage_max']:.0%}{held})")
    if (d.get("preemptions_delta") or 0) > 0:
        found.append(f"decode preempted {d['preemptions_delta']:.0f} requests")
    if (d.get("not_retained_delta") or 0) > 0:
        found.append(f"retention cap declined {d['not_retained_delta']:.0f} finished turns")
    counts = summary.get("reuse_counts") or {}
    for verdict, what in (("expired", "leases expired before"), ("declined", "prefill declined the pull of")):
        if counts.get(verdict):
            found.append(f"{what} {counts[verdict]} turns")
    budget_ms = slo.ttft_s * 1e3 / 4  # a queue eating a quarter of the TTFT budget is what ran out
    for role, entry in (("prefill", p), ("decode", d)):
        queue = entry.get("queue_ms_mean")
        if queue is not None and queue > budget_ms:
            found.append(f"{role} queue (mean {queue:.0f} ms per request)")
    tpot = (summary.get("tpot_ms") or {}).get("p90")
    if tpot is not None and tpot > slo.tpot_s * 1e3:
        found.append(f"decode step time (TPOT p90 {tpot:.0f} ms)")
    if (summary.get("start_delay_ms_max") or 0) > 100:
        found.append("the client's cap on concurrent conversations (--max-active)")
    return found


def targets(legs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, from each leg's knee: ON >= 2x OFF goodput, ON >= the aggregated server's,
    no error in any step, ON's hit rate at its knee >= 90 % of eligible turns."""

    def goodput(leg: str) -> float | None:
        return legs[leg]["knee"]["goodput_turns_s"] if leg in legs else None

    def ratio(a: float | None, b: float | None) -> float | None:
        # None where b is 0: JSON has no infinity, and `_met` says whether a leg without a knee was beaten.
        return None if a is None or b is None or b <= 0 else round(a / b, 3)

    def met(a: float | None, b: float | None, need: float) -> bool | None:
        if a is None or b is None:
            return None
        return a > 0 if b <= 0 else a / b >= need

    def by_load(leg: str, key: str = "goodput_turns_s") -> dict[int, Any]:
        return {
            step["conversations"]: step["summary"].get(key)
            for step in legs[leg]["steps"]
            if "summary" in step and "conversations" in step
        }

    def at_equal_loads(mine: str, other: str) -> list[dict[str, Any]]:
        # A leg that meets the SLO at no load tried has no knee, so its knee ratio says little; the same
        # offered load (conversations per step) compares the two legs turn for turn.
        ours, theirs = by_load(mine), by_load(other)
        return [
            {"conversations": n, mine: a, other: theirs[n], "ratio": ratio(a, theirs[n])}
            for n, a in ours.items()
            if n in theirs
        ]

    def all_met(verdicts: list[bool | None]) -> bool | None:
        return None if not verdicts or None in verdicts else all(verdicts)

    reached = {leg: bool(r["knee"].get("reached")) for leg, r in legs.items()}
    errors = sum(
        sum(step["summary"]["errors"].values())
        for leg in legs.values()
        for step in leg["steps"]
        if "summary" in step
    )
    # A ratio between knees the sweep did not reach compares lower bounds (knees_reached says which).
    out: dict[str, Any] = {"errors": errors, "errors_met": errors == 0, "knees_reached": reached}
    for name, other, need in (
        ("on_vs_off", "off", 2.0),
        ("on_vs_agg", "agg", 1.0),
        ("exact_vs_off", "off", 2.0),
        # Issue 46: the host tier serves >= 2x the HBM-only lease's turns within the SLO, and >= one server's.
        ("tiered_vs_on", "on", 2.0),
        ("tiered_vs_agg", "agg", 1.0),
    ):
        mine = name.split("_vs_")[0]
        out[f"{name}_goodput"] = ratio(goodput(mine), goodput(other))
        out[f"{name}_met"] = met(goodput(mine), goodput(other), need)
        if mine in legs and other in legs:
            loads = out[f"{name}_at_equal_loads"] = at_equal_loads(mine, other)
            # The wording ("at the same offered load"), every load both legs ran.
            out[f"{name}_at_equal_loads_met"] = all_met([met(e[mine], e[other], need) for e in loads])
    for leg in ("on", "tiered", "exact"):
        if leg in legs:
            hit = legs[leg]["knee"]["hit_rate"]
            out[f"{leg}_hit_rate_at_knee"] = hit
            out[f"{leg}_hit_rate_met"] = None if hit is None else hit >= 0.9
            hits = by_load(leg, "hit_rate")
            out[f"{leg}_hit_rate_by_load"] = [{"conversations": n, "hit_rate": h} for n, h in hits.items()]
            out[f"{leg}_hit_rate_by_load_met"] = all_met(
                [None if h is None else h >= 0.9 for h in hits.values()]
            )
    return out


def merge(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One run's data from the JSONs of several calls (the GPU host gives a command 10 minutes): the legs of
    all of them (a later file's leg replaces an earlier one's), with knees and ``targets`` computed over the
    merged legs, since each file's own ``targets`` compared only the legs that file ran."""
    merged = dict(docs[0]["data"])
    merged["legs"] = {leg: dict(r) for d in docs for leg, r in d["data"]["legs"].items()}
    for result in merged["legs"].values():
        result["knee"] = knee(result["steps"])
    merged["skipped_legs"] = {}
    merged["targets"] = targets(merged["legs"])
    merged["merged_from"] = [d["command"] for d in docs]
    merged["merged_versions"] = [d.get("versions") for d in docs]  # the runs' hosts, not this one
    merged["wall_s"] = sum(d["data"].get("wall_s") or 0 for d in docs)
    return merged


def router_settings(leg: str, path_policy: str, extra: Sequence[str]) -> dict[str, Any]:
    """The router's settings in a P/D leg: reuse only in ``on``, ``tiered`` and ``exact``, ``exact=true``
    only in ``exact`` (OFF is stock P/D: decode keeps its prefix cache); ``extra`` (``KEY=VALUE``) wins."""
    if leg not in ("off", "floor", "on", "tiered", "exact"):
        raise ValueError(f"leg {leg!r} has no router")
    settings: dict[str, Any] = {
        "reuse": leg in ("on", "tiered", "exact"),
        "exact": leg == "exact",
        "path_policy": path_policy,
        # The router's per-turn lines (path, reuse, host-tier tokens) are what a load's misses are read from,
        # a few hundred bytes a turn; the benches' router otherwise logs warnings only.
        "log_level": "info",
    }
    settings.update(dict(item.split("=", 1) for item in extra))
    return settings


class _Text:
    """Token-exact filler per conversation (``bench.multiturn_sweep.Words``), seeded by leg, step, index."""

    def __init__(self, model: str) -> None:
        from bench.multiturn_sweep import Words

        self._base = Words(model, seed=0)
        self._by: dict[tuple[str, int, int], Any] = {}

    def for_step(self, leg: str, step: int) -> Callable[[int, int], str]:
        def text(conversation: int, tokens: int) -> str:
            key = (leg, step, conversation)
            if key not in self._by:
                words = copy.copy(self._base)
                words.rng = random.Random(f"{leg}/{step}/{conversation}")
                self._by[key] = words
            return str(self._by[key].text(tokens))

        return text


def _plans(args: argparse.Namespace, rate: float, step: int) -> list[ConversationPlan]:
    if args.trace:
        from bench._trace import group_conversations, load_trace

        conversations = group_conversations(load_trace(Path(args.trace), limit=args.trace_limit))
        return trace_plans(
            conversations,
            rate=rate,
            window_s=args.window_s,
            max_tokens=args.max_model_len - 64,
            max_output=args.output_tokens,
            gap_scale=args.trace_gap_scale,
            max_gap_s=args.max_gap_s,
        )
    return generate_plans(
        rate=rate,
        window_s=args.window_s,
        contexts=[int(x) for x in args.contexts.split(",")],
        turns=args.turns,
        suffix=args.suffix,
        output_tokens=args.output_tokens,
        gap_median_s=args.gap_median_s,
        gap_sigma=args.gap_sigma,
        max_gap_s=args.max_gap_s,
        seed=step,
    )


class _Deployment:
    """The engines of one group (and, per leg, the router in front of them)."""

    def __init__(self, args: argparse.Namespace, group: str) -> None:
        self.args, self.group = args, group
        self.cluster: Any = None
        self.engine: Any = None
        self.endpoints: list[Endpoint] = []
        self.router: Any = None

    def up(self) -> float:
        from agentkv._constants import LEASE_PORT_OFFSET
        from agentkv.server.launch._launcher import free_port

        args = self.args
        env = dict(args.env)
        log_dir = Path(args.log_dir) / self.group
        t = time.monotonic()
        if self.group == "agg":
            from agentkv.server.launch._launcher import Engine, EngineSpec

            spec = EngineSpec(
                role="single",
                model=args.model,
                port=free_port(),
                device=args.device,
                max_model_len=args.max_model_len,
                prefix_caching=True,
                # On CPU, the KV space of P and D together (each engine's default is 1 GiB); on GPU the
                # memory flags come with --agg-engine-arg.
                cpu_kvcache_gib=2,
                **plugin_fields(args, reuse=False),  # vLLM as a user would run it alone
                extra_args=list(
                    args.agg_engine_arg if args.agg_engine_arg is not None else args.engine_arg or []
                ),
                env=env,
                log_path=log_dir / "single.log",
            )
            self.engine = Engine(spec=spec, name="single")
            self.engine.start()
            try:
                self.engine.wait_healthy(timeout_s=900)
            except BaseException:
                self.engine.stop()
                raise
            self.endpoints = [Endpoint(role="single", url=spec.url)]
        else:
            from agentkv.server.launch._cluster import Cluster, ClusterConfig

            reuse = self.group in ("reuse", "tiered")
            config = ClusterConfig(
                model=args.model,
                device=args.device,
                bidirectional=reuse,
                prefill_prefix_caching=self.group == "floor" or (reuse and args.prefill_prefix_caching),
                router_port=None,
                max_model_len=args.max_model_len,
                lease_s=args.lease_s,
                cost_model=args.cost_model,
                log_dir=log_dir,
                extra_args=list(args.engine_arg or []),
                prefill_args=list(args.prefill_engine_arg or []),
                decode_args=list(args.decode_engine_arg or []),
                decode_kv_offload_bytes=args.host_tier_bytes if self.group == "tiered" else 0,
                lease_aware_host_tier=args.host_tier_eviction == "lease",
                extra_kv_config=dict(args.kv_config),
                env=env,
                **plugin_fields(args, reuse=reuse),
                prefill_port=free_port(offsets=[LEASE_PORT_OFFSET]),
                decode_port=free_port(offsets=[LEASE_PORT_OFFSET]),
            )
            self.cluster = Cluster(config=config)
            self.cluster.up()
            self.endpoints = [
                Endpoint(role=e.spec.role, url=e.spec.url, service_url=e.spec.service_url)
                for e in self.cluster.engines
            ]
        return round(time.monotonic() - t, 1)

    def url_for(self, leg: str) -> str:
        """The URL clients talk to in ``leg``: a fresh router for P/D legs, the server itself for ``agg``."""
        if self.engine is not None:
            return str(self.engine.spec.url)
        from agentkv.server.launch._launcher import free_port
        from bench._servers import router_server

        settings = router_settings(leg, self.args.path_policy, self.args.router_setting or [])
        port = free_port()
        self.router = router_server(
            port=port,
            prefill_url=self.cluster.prefills[0].spec.url,
            decode_url=self.cluster.decodes[0].spec.url,
            log_dir=Path(self.args.log_dir) / self.group / leg,
            **settings,
        )
        self.router.start(timeout_s=60)
        return f"http://127.0.0.1:{port}"

    def leg_done(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None

    def down(self) -> None:
        self.leg_done()
        if self.cluster is not None:
            self.cluster.down()
        if self.engine is not None:
            self.engine.stop()


def _write_partial(out: Path, doc: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.partial.json").write_text(json.dumps(doc, indent=1, default=str))


def _line(leg: str, step: dict[str, Any]) -> str:
    s, e = step["summary"], step["engines"]
    d = e.get("decode") or e.get("single") or {}
    return json.dumps(
        {
            "leg": leg,
            "rate": step["rate"],
            "conversations": step["conversations"],
            "turns_s": s["turns_s"],
            "goodput": s["goodput_turns_s"],
            "slo_ok": s["slo_ok"],
            "ttft_p90": s["ttft_ms"]["p90"],
            "tpot_p90": s["tpot_ms"]["p90"],
            "hit_rate": s["hit_rate"],
            "errors": s["errors"],
            "cut": s["cut"],
            "d_kv_max": d.get("kv_usage_max"),
            "retained_max": d.get("retained_share_max"),
            "limits": step["limits"],
        }
    )


def run_leg(
    args: argparse.Namespace,
    deployment: _Deployment,
    leg: str,
    text: _Text,
    deadline: float,
    save: Callable[[], None],
) -> dict[str, Any]:
    slo = SLO(ttft_s=args.slo_ttft_ms / 1e3, tpot_s=args.slo_tpot_ms / 1e3)
    url = deployment.url_for(leg)
    routed = leg != "agg"  # every leg but agg talks to our router
    result: dict[str, Any] = {"leg": leg, "engines_on": deployment.group, "url": url, "steps": []}
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        with EngineWatch(endpoints=deployment.endpoints, interval_s=args.poll_s) as watch:
            for index, rate in enumerate(float(r) for r in args.rates.split(",")):
                left = deadline - time.monotonic()
                if left < args.window_s + args.drain_s + 5:
                    result["steps"].append({"rate": rate, "skipped": f"budget ({left:.0f} s left)"})
                    continue
                plans = _plans(args, rate, index)
                paths_before = router_paths(url) if routed else {}
                start = watch.snapshot().t_s
                run = asyncio.run(
                    run_step(
                        plans,
                        url=url,
                        model=model,
                        text=text.for_step(leg, index),
                        tag=f"{leg}-{index}-{time.time_ns() % 10**6}",
                        router=routed,
                        heartbeat_s=args.heartbeat_s,
                        max_active=args.max_active,
                        drain_s=args.drain_s,
                        timeout_s=args.timeout_s,
                    )
                )
                end = watch.snapshot().t_s
                summary = summarize_step(run, slo=slo)
                engines = digest(watch.between(start, end))
                step = {
                    "rate": rate,
                    "conversations": len(plans),
                    "t_start_s": start,
                    "t_end_s": end,
                    "summary": summary,
                    "engines": engines,
                    "limits": limits(summary, engines, slo),
                }
                if routed:
                    after = router_paths(url)
                    step["router_paths"] = {k: v - paths_before.get(k, 0.0) for k, v in after.items()}
                if args.records:
                    step["records"] = records_json(run.records)
                result["steps"].append(step)
                result["series"] = {e.role: series(watch.samples, e.role) for e in deployment.endpoints}
                result["knee"] = knee(result["steps"])
                print(_line(leg, step), flush=True)
                save()
                ttft90 = summary["ttft_ms"]["p90"]
                if summary["cut"] or (ttft90 is not None and ttft90 > args.stop_factor * args.slo_ttft_ms):
                    result["stopped_after"] = rate  # far past the knee: higher rates only cost budget
                    break
                time.sleep(args.settle_s)  # closed conversations' KV freed before the next step
            result["series"] = {e.role: series(watch.samples, e.role) for e in deployment.endpoints}
    finally:
        deployment.leg_done()
    result["knee"] = knee(result["steps"])
    return result


def router_paths(url: str) -> dict[str, float]:
    """The router's path decisions so far, by path, and how many were made because prefill was saturated
    (``prefill_busy``; the router's ``prefill_queue_cap``); empty when the router does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "agentkv_path_decisions_total":
                out[sample.labels["path"]] = float(sample.value)
            elif sample.name == "agentkv_prefill_busy_total":
                out["prefill_busy"] = float(sample.value)
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.goodput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--legs", default="off,on,exact,agg", help=f"comma list of {', '.join(LEGS)}")
    ap.add_argument("--device", choices=["cpu", "gpu"], default=None)
    ap.add_argument("--model", default=".agentkv/models/tiny")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--rates", default="0.1,0.2", help="conversation arrivals per second, one step each")
    ap.add_argument("--window-s", type=float, default=30.0, help="arrivals per step span this long")
    ap.add_argument("--drain-s", type=float, default=30.0, help="then in-flight conversations get this long")
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument(
        "--contexts", default="512,1024", help="first-turn context tokens, drawn per conversation"
    )
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--suffix", type=int, default=128, help="tokens of each later turn (a tool result)")
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--gap-median-s", type=float, default=2.0, help="lognormal tool gap: median")
    ap.add_argument("--gap-sigma", type=float, default=1.0, help="lognormal tool gap: shape")
    ap.add_argument("--max-gap-s", type=float, default=60.0)
    ap.add_argument("--trace", default=None, help="replay this Mooncake trace instead of generated turns")
    ap.add_argument("--trace-limit", type=int, default=4000, help="trace rows read")
    ap.add_argument("--trace-gap-scale", type=float, default=1.0, help="x the trace's gaps between turns")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument("--max-active", type=int, default=64, help="client cap on concurrent conversations")
    ap.add_argument("--heartbeat-s", type=float, default=10.0, help="beat every N s of a tool gap (0: none)")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--stop-factor", type=float, default=3.0, help="stop a leg once TTFT p90 > this x SLO")
    ap.add_argument("--path-policy", default="auto")
    ap.add_argument("--router-setting", action="append", help="KEY=VALUE router setting (repeat)")
    ap.add_argument("--lease-s", type=float, default=30.0)
    ap.add_argument(
        "--host-tier-bytes",
        type=int,
        default=256 << 20,
        help="tiered leg: decode's host KV tier (vLLM's OffloadingConnector, EngineSpec.kv_offload_bytes)",
    )
    ap.add_argument(
        "--host-tier-eviction",
        choices=("lease", "lru"),
        default="lease",
        help="tiered leg: the tier evicts by lease state (agentkv's policy) or by vLLM's LRU alone",
    )
    ap.add_argument("--cost-model", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--engine-arg", action="append", help="extra vLLM flag for P and D (repeat)")
    ap.add_argument(
        "--prefill-engine-arg",
        action="append",
        help="extra vLLM flag for P only, after --engine-arg (repeat; vLLM takes a flag's last value)",
    )
    ap.add_argument("--decode-engine-arg", action="append", help="the same for D only")
    add_kv_config_arg(ap)
    ap.add_argument(
        "--agg-engine-arg", action="append", help="extra vLLM flag for agg (default: --engine-arg)"
    )
    add_env_arg(ap)
    add_prefill_cache_arg(ap)
    add_plugin_args(ap)
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting steps/legs after this long")
    ap.add_argument("--start-estimate-s", type=float, default=100.0, help="budget kept for one engine start")
    ap.add_argument("--poll-s", type=float, default=1.0)
    ap.add_argument("--records", action="store_true", help="keep every turn's record in the JSON")
    ap.add_argument("--log-dir", default=".agentkv/bench-logs/goodput")
    ap.add_argument("--out", default=None, help="output dir (default bench/results/goodput_<device>)")
    ap.add_argument("--plot", default=None, help="only re-plot and re-print this JSON")
    ap.add_argument(
        "--merge",
        nargs="+",
        default=None,
        help="combine the legs of runs of one config into --out, then plot",
    )
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    if args.merge:
        # The GPU host gives a command 10 minutes, so a run's legs may come from several calls.
        merged = merge([json.loads(Path(p).read_text()) for p in args.merge])
        from bench._common import write_results

        path = write_results(NAME, merged, out_dir=Path(args.out or "bench/results/goodput_merged"))
        args.plot = str(path)
    if args.plot:
        doc = json.loads(Path(args.plot).read_text())
        stored = doc.get("data", doc)
        for result in stored["legs"].values():  # derived fields, from the steps, by this version's rules
            result["knee"] = knee(result["steps"])
        stored["targets"] = targets(stored["legs"])
        report(stored, Path(args.plot).parent)
        return dict(doc)
    from bench._procs import exit_on_sigterm

    exit_on_sigterm()
    t0 = time.monotonic()
    deadline = t0 + (args.budget_s if args.budget_s is not None else 1e9)
    if args.device is None:
        from agentkv.server.launch._launcher import detect_device

        args.device = detect_device()
    if args.device == "cpu":
        from agentkv.server.launch._model import ensure_tiny_model

        ensure_tiny_model(Path(args.model))
    out = Path(args.out or f"bench/results/{NAME}_{args.device}")
    legs = [leg.strip() for leg in args.legs.split(",") if leg.strip()]
    data: dict[str, Any] = {
        "device": args.device,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "at": "p90"},
        "config": vars(args),
        "legs": {},
        "skipped_legs": {},
    }
    command = " ".join(["python", "-m", "bench.goodput", *(sys.argv[1:] if argv is None else argv)])

    def save() -> None:
        data["targets"] = targets(data["legs"])
        _write_partial(out, {"benchmark": NAME, "command": command, "data": data})

    text = _Text(args.model)
    for group, members in groups(legs):
        left = deadline - time.monotonic()
        if left < args.start_estimate_s + args.window_s + args.drain_s:
            for leg in members:
                data["skipped_legs"][leg] = f"budget ({left:.0f} s left)"
            save()
            continue
        deployment = _Deployment(args, group)
        try:
            started = deployment.up()
            print(f"[{group}] engines ready in {started:.0f} s", flush=True)
            for leg in members:
                data["legs"][leg] = run_leg(args, deployment, leg, text, deadline, save)
                data["legs"][leg]["engine_start_s"] = started
                save()
        finally:
            deployment.down()
    data["wall_s"] = round(time.monotonic() - t0, 1)
    data["targets"] = targets(data["legs"])
    try:
        from bench._common import write_results

        path = write_results(NAME, data, command, out_dir=out)
    except ImportError:  # the GPU host: no rich/matplotlib; JSON only, plot later with --plot
        path = out / f"{NAME}.json"
        path.write_text(
            json.dumps({"benchmark": NAME, "command": command, "data": data}, indent=1, default=str)
        )
    print(f"wrote {path}", flush=True)
    report(data, out)
    return data


def _num(value: Any) -> Any:
    return float("nan") if value is None else value


def report(data: dict[str, Any], out: Path) -> None:
    """The tables (and, where matplotlib is installed, the PNGs) of one run."""
    latency, resources = [], []
    for leg, result in data["legs"].items():
        for step in result["steps"]:
            if "summary" not in step:
                continue
            s, e = step["summary"], step["engines"]
            d = e.get("decode") or e.get("single") or {}
            p = e.get("prefill") or {}
            latency.append(
                [
                    leg,
                    step["rate"],
                    step["conversations"],
                    s["turns_s"],
                    s["goodput_turns_s"],
                    "yes" if s["slo_ok"] else "no",
                    *(_num(s["ttft_ms"][k]) for k in ("p50", "p90", "p99")),
                    *(_num(s["tpot_ms"][k]) for k in ("p50", "p90", "p99")),
                    _num(s["hit_rate"]),
                    sum(s["errors"].values()),
                    s["cut"],
                ]
            )
            resources.append(
                [
                    leg,
                    step["rate"],
                    s["peak_active_conversations"],
                    _num(d.get("kv_usage_max")),
                    _num(d.get("retained_share_max")),
                    _num(d.get("not_retained_delta")),
                    (d.get("preemptions_delta") or 0) + (p.get("preemptions_delta") or 0),
                    _num(p.get("queue_ms_mean")),
                    _num(d.get("queue_ms_mean")),
                    "; ".join(step["limits"]) or "-",
                ]
            )
    latency_cols = ["leg", "conv/s", "convs", "turns/s", "goodput", "SLO met"]
    latency_cols += ["TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50", "TPOT p90", "TPOT p99", "hit rate"]
    latency_cols += ["errors", "cut"]
    resource_cols = ["leg", "conv/s", "peak convs", "D KV peak", "retained peak", "declined", "preempted"]
    resource_cols += ["P queue ms", "D queue ms", "what ran out"]
    knees = [
        [
            leg,
            _num(r["knee"]["rate"]),
            r["knee"]["goodput_turns_s"],
            _num(r["knee"]["hit_rate"]),
            "yes" if r["knee"].get("reached") else "no: a lower bound",
        ]
        for leg, r in data["legs"].items()
    ]
    extra = {"targets": data.get("targets"), "skipped_legs": data.get("skipped_legs")}
    try:
        from bench._common import print_table
    except ImportError:
        for name, cols, rows in (("latency", latency_cols, latency), ("resources", resource_cols, resources)):
            print(json.dumps({"table": name, "columns": cols, "rows": rows}))
        print(json.dumps({"knees": knees, **extra}))
        return
    slo = data["slo"]
    title = f"SLO: TTFT p90 <= {slo['ttft_ms']:.0f} ms and TPOT p90 <= {slo['tpot_ms']:.0f} ms"
    print_table(f"goodput under load ({data['device']}; {title}; ms)", latency_cols, latency)
    print_table(
        "what the engines held and waited for (KV shares of the engine's blocks)", resource_cols, resources
    )
    print_table(
        "knee per leg (highest rate within the SLO)",
        ["leg", "conv/s", "goodput turns/s", "hit rate", "knee reached"],
        knees,
    )
    print(json.dumps(extra))
    _plot(data, out)


def _plot(data: dict[str, Any], out: Path) -> None:
    import matplotlib.pyplot as plt

    legs = {leg: r for leg, r in data["legs"].items() if any("summary" in s for s in r["steps"])}
    if not legs:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11.0, 4.0))
    for leg, r in legs.items():
        steps = [s for s in r["steps"] if "summary" in s]
        rates = [s["rate"] for s in steps]
        ax1.plot(rates, [s["summary"]["goodput_turns_s"] for s in steps], marker="o", label=leg)
        ax2.plot(rates, [s["summary"]["ttft_ms"]["p90"] or 0 for s in steps], marker="o", label=leg)
    ax1.set_xlabel("conversations arriving per s")
    ax1.set_ylabel("goodput (turns/s within SLO)")
    ax2.axhline(data["slo"]["ttft_ms"], color="black", linestyle=":", label="SLO")
    ax2.set_xlabel("conversations arriving per s")
    ax2.set_ylabel("TTFT p90 ms")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"goodput under load ({data['device']})")
    fig.tight_layout()
    fig.savefig(out / "goodput_vs_rate.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(len(legs), 1, figsize=(10.0, 2.6 * len(legs)), squeeze=False)
    for ax, (leg, r) in zip(axes[:, 0], legs.items(), strict=True):
        role = "decode" if "decode" in r.get("series", {}) else "single"
        s = r.get("series", {}).get(role)
        if not s:
            continue
        ax.plot(
            s["t_s"], [v if v is not None else float("nan") for v in s["kv_usage"]], label=f"{role} KV used"
        )
        if any(v is not None for v in s["retained_share"]):
            share = [v if v is not None else float("nan") for v in s["retained_share"]]
            ax.plot(s["t_s"], share, label="retained (leases)")
        # Scaled to what was used: a small engine load (the CPU smoke) would be a flat line on 0..1.
        top = max([v for v in (*s["kv_usage"], *s["retained_share"]) if v is not None] + [0.0]) * 1.15 or 1.0
        for step in r["steps"]:
            if "t_start_s" in step:
                ax.axvspan(step["t_start_s"], step["t_end_s"], alpha=0.06, color="gray")
                ax.text(step["t_start_s"], top * 0.93, f"{step['rate']}/s", fontsize=7)
        ax.set_ylim(0, top)
        ax.set_ylabel(f"{leg}: share of KV")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("s since the leg's first poll (shaded: rate steps)")
    fig.tight_layout()
    fig.savefig(out / "kv_occupancy.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
