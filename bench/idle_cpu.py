"""CPU burnt by idle engines: agentkv's connector vs stock vLLM NIXL, measured from /proc.

    python -m bench.idle_cpu [--window 10] [--lease 15]

For each variant a 1P1D cluster is started; CPU seconds of every process in each engine's process group are
read from /proc/<pid>/stat over a window in three states: idle after start, right after a turn while decode
retains the turn's blocks, and after the lease (ours) has run out. Reported as cores in use (1.0 = one core).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import httpx

TICK = os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pgid: int) -> float:
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 (pgrp) after the comm
            total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / TICK


def measure(pgids: dict[str, int], window: float) -> dict[str, float]:
    before = {k: group_cpu_seconds(v) for k, v in pgids.items()}
    time.sleep(window)
    return {k: round((group_cpu_seconds(v) - before[k]) / window, 3) for k, v in pgids.items()}


def run_variant(name: str, *, agentkv: bool, args: argparse.Namespace) -> dict[str, Any]:
    from agentkv.server.launch._cluster import Cluster, ClusterConfig
    from agentkv.server.launch._model import ensure_tiny_model

    model = ensure_tiny_model(Path(args.model))
    cfg = ClusterConfig(
        model=str(model),
        router_port=None,
        agentkv_connector=agentkv,
        lease_s=args.lease,
        decoder_kv_blocks_ttl=480,
        prefill_port=23100,
        decode_port=23200,
        side_channel_port=8600,
        log_dir=Path(".agentkv/bench-logs/idle") / name,
    )
    c = Cluster(config=cfg)
    c.up()
    try:
        pgids = {e.name: int(e.pid or 0) for e in c.engines}
        time.sleep(5)
        idle = measure(pgids, args.window)
        p, d = c.prefills[0].spec.url, c.decodes[0].spec.url
        body = {
            "model": model.name,
            "messages": [{"role": "user", "content": "hello " * 300}],
            "temperature": 0,
        }
        rid = f"idle-{time.time_ns()}"
        pr = httpx.post(
            f"{p}/v1/chat/completions",
            timeout=300,
            headers={"X-Request-Id": rid},
            json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        ).json()
        httpx.post(
            f"{d}/v1/chat/completions",
            timeout=300,
            headers={"X-Request-Id": rid},
            json={**body, "max_tokens": 8, "kv_transfer_params": pr["kv_transfer_params"]},
        )
        holding = measure(pgids, args.window)
        time.sleep(max(0.0, args.lease + 2 - args.window))
        after = measure(pgids, args.window) if agentkv else None
        return {"idle": idle, "holding_blocks": holding, "after_lease": after}
    finally:
        c.down()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--window", type=float, default=10)
    ap.add_argument("--lease", type=float, default=15)
    ap.add_argument("--model", default=".agentkv/models/tiny")
    ap.add_argument("--variants", default="agentkv,stock")
    args = ap.parse_args()
    data = {v: run_variant(v, agentkv=v == "agentkv", args=args) for v in args.variants.split(",")}
    from bench._common import print_table, write_results

    rows = []
    for v, states in data.items():
        for state, cores in states.items():
            if cores is not None:
                rows.append([v, state, cores.get("prefill0"), cores.get("decode0")])
    print_table(
        "CPU cores used by idle engines (2-core machine)", ["variant", "state", "prefill", "decode"], rows
    )
    print(write_results("idle_cpu", data))


if __name__ == "__main__":
    main()
