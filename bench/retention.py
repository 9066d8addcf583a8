"""Retention: a heartbeat lease vs vLLM's fixed 480 s decode pin, on a replay of the Mooncake trace.

    python -m bench.retention                            # a few seconds: virtual time
    python -m bench.retention --vanish 0.5 --lease-s 15 --seeds 5
    python -m bench.retention --tiers                    # HBM + host + disk under the lease (below)

For each scenario (unbounded decode memory; the same with agents that stop heartbeating once idle for the
fixed TTL's window, so both policies keep a conversation for the same longest gap; and a decode whose
retention is capped at one H200's KV for Qwen3-8B) both policies replay the same scripted conversations.
Reported: KV block-seconds held by idle retained requests, the reuse hit rate of later turns, the share of
prompt tokens reused, and counters.
Target (reported, not asserted): >= 5x fewer block-seconds at an equal or better hit rate.

``--tiers`` replays instead, on the capped decode, the lease with tiers under it (``bench._retention_tiers``):
HBM-only lease, fixed pin, +host, +host+disk and the unbounded lease side by side, each tier's hits, blocks,
block-seconds, demotions and restores, misses by cause and modelled TTFT; results in
bench/results/retention_tiers/ with targets computed from the run.
What is real, modelled and synthesised is listed in bench/_retention_sim.py and bench/README.md.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from agentkv._constants import DEFAULT_IDLE_LIMIT_S
from bench._common import (
    bar_chart,
    command_line,
    console,
    line_chart,
    make_progress,
    print_table,
    results_dir,
    summarize,
    write_results,
)
from bench._retention_sim import Scenario, TierConfig, bounds, replay, script_scenario
from bench._retention_tiers import KvShape, kv_bytes_per_block
from bench._trace import DEFAULT_TRACE, group_conversations, load_trace, turn_histogram

NAME = "retention"
POLICIES = ("fixed", "lease")
BOUNDS = ("ideal window", "hindsight")
# One H200 holds ~0.72M tokens of Qwen3-8B KV (docs: landscape.md), in 16-token blocks.
H200_QWEN3_8B_BLOCKS = 720_000 // 16
_TIMELINE_POINTS = 400


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.retention", description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--seeds", type=int, default=3, help="independent scenario draws (seeds 0..N-1)")
    parser.add_argument("--vanish", type=float, default=0.3, help="fraction of agents that vanish")
    parser.add_argument(
        "--long-gaps", type=float, default=0.2, help="fraction of conversations with long tool gaps"
    )
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--ttl-s", type=float, default=480.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=19.0,
        help="recompute cost of a prompt token (default: Qwen3-8B prefill on an H200)",
    )
    parser.add_argument(
        "--heartbeat-idle-limit-s",
        type=float,
        default=DEFAULT_IDLE_LIMIT_S,
        help="agents stop heartbeating after this long idle (the SDK's heartbeat_idle_limit_s)",
    )
    parser.add_argument(
        "--capacity-blocks",
        type=int,
        default=H200_QWEN3_8B_BLOCKS,
        help="retention cap of the capped scenario (0 = only run unbounded)",
    )
    parser.add_argument("--out", type=Path, default=None, help="output dir (default bench/results/<name>)")
    tiers = parser.add_argument_group("tiers (with --tiers; HBM is --capacity-blocks)")
    tiers.add_argument("--tiers", action="store_true", help="replay tiers under the lease instead")
    tiers.add_argument("--host-blocks", type=int, default=106_000, help="pinned host tier (250 GB of 8B KV)")
    tiers.add_argument(
        "--disk-blocks", type=int, default=None, help="disk tier of the +host+disk row (default unbounded)"
    )
    tiers.add_argument(
        "--demote",
        default="pressure,idle,tool",
        help="when an entry leaves HBM: any of pressure, idle, tool (comma-separated)",
    )
    tiers.add_argument(
        "--idle-s", type=float, default=10.0, help="with idle: seconds idle in HBM before demotion"
    )
    tiers.add_argument(
        "--when-full",
        choices=("refuse", "evict"),
        default="refuse",
        help="no room in any tier: refuse the new retention (the connector's rule) or evict the longest idle",
    )
    tiers.add_argument("--host-gbps", type=float, default=55.5, help="host -> HBM (measured on an H100 host)")
    tiers.add_argument("--disk-gbps", type=float, default=6.0, help="disk <-> HBM (assumed: one NVMe)")
    tiers.add_argument("--layers", type=int, default=36, help="KV shape (default Qwen3-8B)")
    tiers.add_argument("--kv-heads", type=int, default=8)
    tiers.add_argument("--head-dim", type=int, default=128)
    tiers.add_argument("--dtype-bytes", type=int, default=2)
    return parser


def _downsample(timeline: list[tuple[float, int]]) -> list[tuple[float, int]]:
    step = max(1, len(timeline) // _TIMELINE_POINTS)
    return timeline[::step]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    if args.tiers:
        return _tiers_main(args)
    out = results_dir(NAME, args.out)
    conversations = group_conversations(load_trace(args.trace, limit=args.limit))
    base = Scenario(
        vanish_fraction=args.vanish,
        long_gap_fraction=args.long_gaps,
        lease_s=args.lease_s,
        ttl_s=args.ttl_s,
        block_size=args.block_size,
        prefill_us_per_token=args.prefill_us_per_token,
        heartbeat_idle_limit_s=args.heartbeat_idle_limit_s,
    )
    # Equal window: heartbeats stop when the lease would outlast the fixed pin, so a gap longer than the
    # TTL is lost under both policies. This is the equal-hit-rate comparison; `unbounded` keeps the SDK
    # default, which buys extra hits on long tool gaps with extra block-seconds.
    equal = replace(base, heartbeat_idle_limit_s=max(0.0, args.ttl_s - args.lease_s))
    scenarios = {"unbounded": base, "equal window": equal}
    if args.capacity_blocks:
        scenarios["capped"] = replace(base, capacity_blocks=args.capacity_blocks)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        # Capped: also the eviction policy the connector does not use, to show why (bench/README.md).
        name: {p: [] for p in (*POLICIES, *(("lease-evict",) if s.capacity_blocks else ()))}
        for name, s in scenarios.items()
    }
    # The bounds need an unbounded decode, so the capped scenario has none.
    bound_runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {b: [] for b in BOUNDS}
        for name, scenario in scenarios.items()
        if scenario.capacity_blocks is None
    }
    with make_progress() as progress:
        task = progress.add_task("replaying", total=sum(len(r) for r in runs.values()) * args.seeds)
        for name, scenario in scenarios.items():
            for seed in range(args.seeds):
                scripts = script_scenario(conversations, replace(scenario, seed=seed))
                for policy in runs[name]:
                    runs[name][policy].append(replay(scripts, replace(scenario, seed=seed), policy))
                    progress.advance(task)
                if name in bound_runs:
                    for bound, result in bounds(scripts, scenario).items():
                        bound_runs[name][bound].append(result)
    data: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "trace": {
            "requests": sum(c.turns for c in conversations),
            "conversations": len(conversations),
            "turn_histogram": turn_histogram(conversations),
        },
        "scenarios": {},
        "goals": {"block_seconds_ratio_min": 5.0, "hit_rate": "lease >= fixed"},
    }
    for name in scenarios:
        data["scenarios"][name] = _scenario_summary(runs[name], bound_runs.get(name))
    _report(data, runs, out)
    return data


def _scenario_summary(
    runs: dict[str, list[dict[str, Any]]], bound_runs: dict[str, list[dict[str, Any]]] | None
) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for policy, results in runs.items():
        summary[policy] = {
            "policy": results[0]["policy"],
            "block_seconds": summarize([r["block_seconds"] for r in results]),
            "hit_rate": summarize([r["hit_rate"] for r in results]),
            "reused_token_fraction": summarize([r["reused_token_fraction"] for r in results]),
            "peak_blocks": summarize([r["peak_blocks"] for r in results]),
            "per_seed": [{k: v for k, v in r.items() if k != "timeline"} for r in results],
        }
    fixed, lease = summary["fixed"], summary["lease"]
    summary["block_seconds_ratio"] = fixed["block_seconds"]["mean"] / max(
        1e-9, lease["block_seconds"]["mean"]
    )
    summary["hit_rate_delta"] = lease["hit_rate"]["mean"] - fixed["hit_rate"]["mean"]
    if bound_runs:
        summary["bounds"] = {}
        for bound, results in bound_runs.items():
            block_seconds = summarize([r["block_seconds"] for r in results])
            summary["bounds"][bound] = {
                "policy": results[0]["policy"],
                "block_seconds": block_seconds,
                "hit_rate": summarize([r["hit_rate"] for r in results]),
                "block_seconds_ratio": fixed["block_seconds"]["mean"] / max(1e-9, block_seconds["mean"]),
            }
        # How much of what any online policy could save (fixed -> ideal window) the lease saves.
        ideal = summary["bounds"]["ideal window"]["block_seconds"]["mean"]
        saved = fixed["block_seconds"]["mean"] - lease["block_seconds"]["mean"]
        summary["lease_share_of_ideal_saving"] = saved / max(1e-9, fixed["block_seconds"]["mean"] - ideal)
    summary["timeline_seed0"] = {p: _downsample(runs[p][0]["timeline"]) for p in runs}
    return summary


def _report(data: dict[str, Any], runs: dict[str, Any], out: Path) -> None:
    rows = []
    for name, summary in data["scenarios"].items():
        for policy in runs[name]:
            s = summary[policy]
            first = s["per_seed"][0]
            rows.append(
                [
                    f"{name}: {s['policy']}",
                    s["block_seconds"]["mean"] / 1e6,
                    s["hit_rate"]["mean"],
                    s["reused_token_fraction"]["mean"],
                    s["peak_blocks"]["mean"],
                    first["released"],
                    first["expired"],
                    first["refused"],
                    first["evicted"],
                ]
            )
        for bound in summary.get("bounds", {}).values():
            rows.append(
                [
                    f"{name}: {bound['policy']}",
                    bound["block_seconds"]["mean"] / 1e6,
                    bound["hit_rate"]["mean"],
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                ]
            )
    print_table(
        f"retention replay ({data['trace']['conversations']} conversations; mean of seeds; counters seed 0)",
        [
            "scenario: policy",
            "M block-s",
            "hit rate",
            "tokens reused",
            "peak blocks",
            "released",
            "expired",
            "refused",
            "evicted",
        ],
        rows,
    )
    for name, summary in data["scenarios"].items():
        console.print(
            f"{name}: lease holds {summary['block_seconds_ratio']:.1f}x fewer block-seconds (goal >= 5x), "
            f"hit rate {summary['hit_rate_delta']:+.3f} vs fixed TTL"
        )
        if "bounds" in summary:
            ideal, hindsight = summary["bounds"]["ideal window"], summary["bounds"]["hindsight"]
            console.print(
                f"  hitting every turn the fixed pin hits, no online policy beats "
                f"{ideal['block_seconds_ratio']:.1f}x (ideal window), and only foresight of the gaps reaches "
                f"{hindsight['block_seconds_ratio']:.1f}x (hindsight); the lease makes "
                f"{summary['lease_share_of_ideal_saving']:.0%} of the ideal window's saving"
            )
    names = list(data["scenarios"])
    bar_chart(
        out / "block_seconds.png",
        title="idle retained KV (block-seconds)",
        labels=names,
        log=True,
        ylabel="block-seconds",
        series={
            data["scenarios"][names[0]][p]["policy"]: [
                data["scenarios"][n][p]["block_seconds"]["mean"] for n in names
            ]
            for p in POLICIES
        },
    )
    bar_chart(
        out / "hit_rate.png",
        title="reuse hit rate of later turns",
        labels=names,
        ylabel="hit rate",
        series={
            data["scenarios"][names[0]][p]["policy"]: [
                data["scenarios"][n][p]["hit_rate"]["mean"] for n in names
            ]
            for p in POLICIES
        },
    )
    bounded = [n for n in names if "bounds" in data["scenarios"][n]]
    if bounded:
        first = data["scenarios"][bounded[0]]
        bar_chart(
            out / "block_seconds_bounds.png",
            title="idle retained KV, with the bounds at the fixed pin's hits",
            labels=bounded,
            log=True,
            ylabel="block-seconds",
            series={
                **{
                    first[p]["policy"]: [data["scenarios"][n][p]["block_seconds"]["mean"] for n in bounded]
                    for p in POLICIES
                },
                **{
                    first["bounds"][b]["policy"]: [
                        data["scenarios"][n]["bounds"][b]["block_seconds"]["mean"] for n in bounded
                    ]
                    for b in BOUNDS
                },
            },
        )
    timeline = data["scenarios"][names[0]]["timeline_seed0"]
    line_chart(
        out / "retained_blocks.png",
        title=f"retained blocks over time ({names[0]}, seed 0)",
        series={
            data["scenarios"][names[0]][p]["policy"]: (
                [t for t, _ in timeline[p]],
                [b for _, b in timeline[p]],
            )
            for p in POLICIES
        },
        xlabel="seconds (virtual)",
        ylabel="retained blocks",
    )
    path = write_results(NAME, data, command_line(), out_dir=out)
    console.print(f"wrote {path}")


# --- tiers -----------------------------------------------------------------------------------------------
TIERS_NAME = "retention_tiers"
TIER_NAMES = ("hbm", "host", "disk")
# The done-when, checked against this run's own rows.
TIER_GOALS = {"host_hit_rate_min": 0.80, "disk_hit_rate_min": 0.95, "hbm_block_seconds_ratio_max": 0.10}


def _tier_rows(args: argparse.Namespace, base: Scenario) -> dict[str, tuple[str, Scenario]]:
    """Row name -> (policy, scenario). The first five are the comparison; the rest vary the demotion."""
    demote = frozenset(d.strip() for d in args.demote.split(",") if d.strip())
    shape = KvShape(
        layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype_bytes=args.dtype_bytes
    )
    common = {
        "demote_on": demote,
        "idle_s": args.idle_s,
        "evict_when_full": args.when_full == "evict",
        "host_gbps": args.host_gbps,
        "disk_gbps": args.disk_gbps,
        "kv_shape": shape,
    }
    host = TierConfig(host_blocks=args.host_blocks, disk_blocks=0, **common)
    disk = replace(host, disk_blocks=args.disk_blocks)
    rows: dict[str, tuple[str, Scenario]] = {
        "HBM-only lease": ("tiered", replace(base, tiers=TierConfig(**common))),
        "fixed pin": ("fixed", base),
        "+host": ("tiered", replace(base, tiers=host)),
        "+host+disk": ("tiered", replace(base, tiers=disk)),
        "unbounded lease": ("lease", replace(base, capacity_blocks=None)),
    }
    # What the host tier alone gives when HBM may retain only a tenth as much (the HBM block-seconds goal).
    tenth = max(1, (base.capacity_blocks or 0) // 10)
    rows[f"+host, HBM cap {tenth:,}"] = ("tiered", replace(base, capacity_blocks=tenth, tiers=host))
    for variant in ("pressure", "pressure,idle", "pressure,tool"):
        triggers = frozenset(variant.split(","))
        if triggers != demote:
            for name, config in (("+host", host), ("+host+disk", disk)):
                rows[f"{name} (demote: {variant})"] = (
                    "tiered",
                    replace(base, tiers=replace(config, demote_on=triggers)),
                )
    return rows


def _tiers_main(args: argparse.Namespace) -> dict[str, Any]:
    if not args.capacity_blocks:
        raise SystemExit("--tiers needs an HBM cap (--capacity-blocks > 0)")
    out = results_dir(TIERS_NAME, args.out)
    conversations = group_conversations(load_trace(args.trace, limit=args.limit))
    base = Scenario(
        vanish_fraction=args.vanish,
        long_gap_fraction=args.long_gaps,
        lease_s=args.lease_s,
        ttl_s=args.ttl_s,
        block_size=args.block_size,
        prefill_us_per_token=args.prefill_us_per_token,
        heartbeat_idle_limit_s=args.heartbeat_idle_limit_s,
        capacity_blocks=args.capacity_blocks,
    )
    rows = _tier_rows(args, base)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in rows}
    with make_progress() as progress:
        task = progress.add_task("replaying", total=len(rows) * args.seeds)
        for seed in range(args.seeds):
            scripts = script_scenario(conversations, replace(base, seed=seed))
            for name, (policy, scenario) in rows.items():
                runs[name].append(replay(scripts, replace(scenario, seed=seed), policy))
                progress.advance(task)
    bytes_per_block = kv_bytes_per_block(
        KvShape(
            layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype_bytes=args.dtype_bytes
        ),
        args.block_size,
    )
    summaries = {name: _tier_summary(results) for name, results in runs.items()}
    data: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "bytes_per_block": bytes_per_block,
        "trace": {
            "requests": sum(c.turns for c in conversations),
            "conversations": len(conversations),
        },
        "rows": summaries,
        "targets": _tier_targets(summaries),
        "timeline_seed0": {
            name: _downsample_rows(runs[name][0]["tier_timeline"]) for name in ("+host", "+host+disk")
        },
    }
    _tier_report(data, out)
    return data


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None and v == v]  # NaN: no sample in that seed
    return sum(present) / len(present) if present else None


def _tier_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    turns = [r["continuation_turns"] for r in results]
    tiers: dict[str, Any] = {}
    for tier in results[0]["tiers"]:
        per_seed = [r["tiers"][tier] for r in results]
        hits = [r["hits_by_tier"][tier] for r in results]
        tiers[tier] = {
            "capacity_blocks": per_seed[0]["capacity_blocks"],
            "hit_rate": _mean([h / t for h, t in zip(hits, turns, strict=True)]),
            # Residency plus the time an entry is held as the source of its demotion's copy.
            "block_seconds": _mean([s["block_seconds"] + s["copy_block_seconds"] for s in per_seed]),
            "copy_block_seconds": _mean([s["copy_block_seconds"] for s in per_seed]),
            "peak_blocks": _mean([s["peak_blocks"] for s in per_seed]),
            "peak_bytes": _mean([s["peak_bytes"] for s in per_seed]),
            "demotions_out": _mean([s["demotions_out"] for s in per_seed]),
            "evictions": _mean([s["evictions"] for s in per_seed]),
            "restores": _mean([s["restores"] for s in per_seed]),
            "restore_gbps": _mean([s["restore_gbps"] for s in per_seed]),
            "restore_ms_p50": _mean([s["restore_ms"]["p50"] for s in per_seed]),
            "restore_ms_p90": _mean([s["restore_ms"]["p90"] for s in per_seed]),
        }
    return {
        "policy": results[0]["policy"],
        "hit_rate": summarize([r["hit_rate"] for r in results]),
        "block_seconds": summarize([r["block_seconds"] for r in results]),
        "reused_token_fraction": summarize([r["reused_token_fraction"] for r in results]),
        "misses": {cause: _mean([r["misses"][cause] for r in results]) for cause in results[0]["misses"]},
        "slow_restores": _mean([r["slow_restores"] for r in results]),
        # Per-seed percentiles of every turn's modelled TTFT, averaged over the seeds.
        "ttft_s_p50": _mean([r["ttft_s"]["p50"] for r in results]),
        "ttft_s_p90": _mean([r["ttft_s"]["p90"] for r in results]),
        "ttft_continuation_s_p50": _mean([r["ttft_continuation_s"]["p50"] for r in results]),
        "ttft_continuation_s_p90": _mean([r["ttft_continuation_s"]["p90"] for r in results]),
        "tiers": tiers,
        "per_seed": [{k: v for k, v in r.items() if k not in ("timeline", "tier_timeline")} for r in results],
    }


def _tier_targets(rows: dict[str, Any]) -> dict[str, Any]:
    """The issue's done-when, from this run's rows: flat ``*_met`` keys, as the other benches write them."""
    hbm_only = rows["HBM-only lease"]["tiers"]["hbm"]["block_seconds"]
    targets: dict[str, Any] = {
        "host_hit_rate": rows["+host"]["hit_rate"]["mean"],
        "host_hit_rate_goal": TIER_GOALS["host_hit_rate_min"],
        "disk_hit_rate": rows["+host+disk"]["hit_rate"]["mean"],
        "disk_hit_rate_goal": TIER_GOALS["disk_hit_rate_min"],
        # HBM block-seconds (copies included) over the HBM-only lease's; the goal is a ceiling.
        "hbm_block_seconds_ratio_host": rows["+host"]["tiers"]["hbm"]["block_seconds"] / hbm_only,
        "hbm_block_seconds_ratio_host_disk": rows["+host+disk"]["tiers"]["hbm"]["block_seconds"] / hbm_only,
        "hbm_block_seconds_ratio_goal": TIER_GOALS["hbm_block_seconds_ratio_max"],
    }
    targets["host_hit_rate_met"] = targets["host_hit_rate"] >= targets["host_hit_rate_goal"]
    targets["disk_hit_rate_met"] = targets["disk_hit_rate"] >= targets["disk_hit_rate_goal"]
    for key in ("hbm_block_seconds_ratio_host", "hbm_block_seconds_ratio_host_disk"):
        targets[f"{key}_met"] = targets[key] <= targets["hbm_block_seconds_ratio_goal"]
    targets["all_met"] = all(v for k, v in targets.items() if k.endswith("_met"))
    return targets


def _downsample_rows(timeline: list[tuple[float, ...]]) -> list[tuple[float, ...]]:
    step = max(1, len(timeline) // _TIMELINE_POINTS)
    return timeline[::step]


def _tier_report(data: dict[str, Any], out: Path) -> None:
    rows = data["rows"]
    hbm_only = rows["HBM-only lease"]["tiers"]["hbm"]["block_seconds"]

    def by_tier(values: dict[str, Any], fmt: str) -> str:
        return " / ".join(format(values[t], fmt) if t in values else "-" for t in TIER_NAMES)

    print_table(
        f"retention with tiers: {data['trace']['conversations']} conversations, HBM "
        f"{data['config']['capacity_blocks']:,} blocks; mean of {data['config']['seeds']} seeds",
        [
            "row",
            "hit rate",
            "hit hbm / host / disk",
            "HBM M block-s",
            "vs HBM-only",
            "TTFT ms p50 / p90",
            "misses never retained / expired / evicted",
            "slow restores",
        ],
        [
            [
                name,
                row["hit_rate"]["mean"],
                by_tier({t: v["hit_rate"] for t, v in row["tiers"].items()}, ".3f"),
                row["tiers"]["hbm"]["block_seconds"] / 1e6,
                row["tiers"]["hbm"]["block_seconds"] / hbm_only,
                f"{row['ttft_s_p50'] * 1000:.0f} / {row['ttft_s_p90'] * 1000:.0f}",
                " / ".join(f"{row['misses'][c]:.0f}" for c in ("never_retained", "expired", "evicted")),
                row["slow_restores"],
            ]
            for name, row in rows.items()
        ],
    )
    print_table(
        "tiers of the tiered rows (mean of seeds)",
        [
            "row: tier",
            "cap blocks",
            "M block-s",
            "peak blocks",
            "peak GB",
            "demoted out",
            "restores",
            "restore ms p50",
            "p90",
            "GB/s",
        ],
        [
            [
                f"{name}: {tier}",
                "-" if t["capacity_blocks"] is None else f"{t['capacity_blocks']:,}",
                t["block_seconds"] / 1e6,
                t["peak_blocks"],
                t["peak_bytes"] / 1e9,
                t["demotions_out"],
                t["restores"],
                "-" if t["restore_ms_p50"] is None else t["restore_ms_p50"],
                "-" if t["restore_ms_p90"] is None else t["restore_ms_p90"],
                "-" if t["restore_gbps"] is None else t["restore_gbps"],
            ]
            for name, row in rows.items()
            if len(row["tiers"]) > 1
            for tier, t in row["tiers"].items()
        ],
    )
    targets = data["targets"]
    for key, relation, goal in (
        ("host_hit_rate", ">=", targets["host_hit_rate_goal"]),
        ("disk_hit_rate", ">=", targets["disk_hit_rate_goal"]),
        ("hbm_block_seconds_ratio_host", "<=", targets["hbm_block_seconds_ratio_goal"]),
        ("hbm_block_seconds_ratio_host_disk", "<=", targets["hbm_block_seconds_ratio_goal"]),
    ):
        met = "met" if targets[f"{key}_met"] else "not met"
        console.print(f"{key}: {targets[key]:.3f} (goal {relation} {goal}): {met}")
    main_rows = ["HBM-only lease", "fixed pin", "+host", "+host+disk", "unbounded lease"]
    bar_chart(
        out / "hit_rate_by_tier.png",
        title="hit rate of later turns, by the tier the hit was read from",
        labels=main_rows,
        ylabel="hit rate",
        series={
            tier: [rows[n]["tiers"][tier]["hit_rate"] if tier in rows[n]["tiers"] else 0.0 for n in main_rows]
            for tier in TIER_NAMES
        },
    )
    bar_chart(
        out / "block_seconds_by_tier.png",
        title="retained KV block-seconds, by tier",
        labels=main_rows,
        log=True,
        ylabel="block-seconds",
        series={
            tier: [
                rows[n]["tiers"][tier]["block_seconds"] if tier in rows[n]["tiers"] else float("nan")
                for n in main_rows
            ]
            for tier in TIER_NAMES
        },
    )
    for name, timeline in data["timeline_seed0"].items():
        tiers = list(rows[name]["tiers"])
        line_chart(
            out / f"tier_blocks_{'host_disk' if 'disk' in name else 'host'}.png",
            title=f"retained blocks per tier over time ({name}, seed 0)",
            series={
                tier: ([point[0] for point in timeline], [point[1 + index] for point in timeline])
                for index, tier in enumerate(tiers)
            },
            xlabel="seconds (virtual)",
            ylabel="retained blocks",
        )
    path = write_results(TIERS_NAME, data, command_line(), out_dir=out)
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
