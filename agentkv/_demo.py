"""``agentkv demo``: the whole product on one CPU machine in a few minutes.

Builds the tiny model, starts 1P1D (prefill without prefix caching, so every reused token comes from decode)
with the router, and runs the SDK's tool-calling research agent through two routers on the same engines:
reuse OFF (prefill recomputes every turn) then ON. Prints one row per model call and a summary.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.table import Table

from agentkv.server.launch._launcher import start_router

__all__ = ["run_demo"]

ON_PORT, OFF_PORT = 8000, 8001


@contextlib.contextmanager
def _status(console: Console, message: str) -> Iterator[Callable[[str], None]]:
    """A spinner at a terminal; a plain line otherwise (rich shows no spinner in a pipe or a log file, and a
    minutes-long wait must still say what it waits for). Yields the spinner's update."""
    if console.is_terminal:
        with console.status(message) as status:
            yield status.update
    else:
        console.print(message)
        yield lambda _message: None


def run_demo(*, turns: int, conversations: int, keep: bool, console: Console) -> dict[str, Any]:
    from agentkv.server.launch._cluster import Cluster, ClusterConfig
    from agentkv.server.launch._model import ensure_tiny_model, tiny_serving
    from agentkv.session import run_research_agent

    model = ensure_tiny_model()
    cfg = ClusterConfig(
        model=str(model),
        router_port=ON_PORT,
        prefill_prefix_caching=False,
        lease_s=120,
        **tiny_serving(),
    )
    cluster = Cluster(config=cfg)
    t0 = time.monotonic()
    with _status(
        console, "starting prefill, decode and the router (1-3 minutes on 2 CPU cores) ..."
    ) as update:
        cluster.up(on_tick=lambda name, t: update(f"starting engines ... {name} {t:.0f}s"))
    console.print(f"cluster ready in {time.monotonic() - t0:.0f}s: router at {cfg.router_url}/v1")
    off = start_router(
        port=OFF_PORT,
        prefill=[e.spec.url for e in cluster.prefills],
        decode=[e.spec.url for e in cluster.decodes],
        log=cfg.log_dir / "router-off.log",
        args=["--no-reuse"],
    )
    rows: list[dict[str, Any]] = []
    try:
        for leg, port in (("OFF", OFF_PORT), ("ON", ON_PORT)):
            for conv in range(conversations):
                with _status(
                    console, f"reuse {leg}: research agent, conversation {conv + 1}/{conversations} ..."
                ):
                    run = run_research_agent(
                        f"http://127.0.0.1:{port}/v1",
                        turns=turns,
                        force_tool_steps=1,
                        max_steps=3,
                        max_tokens=64,
                    )
                for t in run.turns:
                    rows.append(
                        {
                            "leg": leg,
                            "conversation": conv + 1,
                            "call": t.index,
                            "prompt_tokens": t.prompt_tokens,
                            "reused_tokens": t.reused_tokens or 0,
                            "reuse": t.reuse,
                            "path": t.path,
                            "prefill_ms": t.prefill_ms,
                            "total_ms": round(t.total_s * 1e3, 1),
                        }
                    )
    finally:
        off.stop()
        if not keep:
            cluster.down()
        else:
            cluster.write_state()
    _print(rows, console)
    return {"rows": rows, "engine_start_s": cluster.start_seconds}


# What each timing column measures. The agent's calls are not streamed (its tool loop needs whole answers),
# so no time to first token is observable; the router's prefill hop is the part reuse shortens.
_CAPTION = (
    "prefill ms: the router's prefill hop (prefill's compute plus, with reuse, pulling decode's KV); "
    "call ms: the whole call, request to last token. The calls are not streamed, so there is no TTFT."
)


def _print(rows: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="agentkv demo: every model call of the research agent", caption=_CAPTION)
    cols = {
        "leg": "leg",
        "conversation": "conversation",
        "call": "call",
        "prompt_tokens": "prompt tokens",
        "reused_tokens": "reused tokens",
        "reuse": "reuse",
        "path": "path",
        "prefill_ms": "prefill ms",
        "total_ms": "call ms",
    }
    for label in cols.values():
        table.add_column(label, justify="right")
    for r in rows:
        table.add_row(*("-" if r[c] is None else str(r[c]) for c in cols))
    console.print(table)
    for leg in ("OFF", "ON"):
        rs = [r for r in rows if r["leg"] == leg and r["call"] > 1]
        pre = [r["prefill_ms"] for r in rs if r["prefill_ms"]]
        tot = [r["total_ms"] for r in rs]
        reused = sum(r["reused_tokens"] for r in rs)
        prompt = sum(r["prompt_tokens"] or 0 for r in rs)
        med_pre = statistics.median(pre) if pre else 0.0
        med_tot = statistics.median(tot) if tot else 0.0
        console.print(
            f"reuse {leg}: calls after the first: median prefill {med_pre:.0f} ms, "
            f"median call {med_tot:.0f} ms, {reused}/{prompt} prompt tokens reused"
        )
