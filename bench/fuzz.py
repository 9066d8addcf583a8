"""Fuzz the router's HTTP surface over real sockets: tens of thousands of generated requests, no engines.

    python -m bench.fuzz                      # 10,000 cases, seed 0 -> bench/results/fuzz/fuzz.json
    python -m bench.fuzz --cases 50000 --seed 7 --out /tmp/fuzz

The router runs as ``agentkv router`` (uvicorn, real HTTP parsing) in front of the stub prefill and decode
(``bench/_stub.py``, with the retention service), configured with a 4096-byte body limit. Every case is one
request from ``bench/_http_cases.py`` (the unit test's 300 in-process cases come from the same strategies);
every answer must be a completion or an OpenAI-shaped error, never a 5xx, never ``kv_transfer_params``
a client did not send, and one conversation (the sentinel) that no case names must keep its decode, its
retained tokens and its lease (never extended, never dropped). The run records every status per route and
every problem, and exits 1 when there is one.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, seed, settings

from agentkv._constants import LEASE_PORT_OFFSET
from agentkv.server.launch._launcher import free_port
from bench._common import console, make_progress, print_table, results_dir, write_results
from bench._http_cases import MAX_BODY_BYTES, SENTINEL, answer_problems, requests, touches_sentinel
from bench._procs import ProcessSampler, ServerProcess, exit_on_sigterm, running, stub_command
from bench._servers import router_server

NAME = "fuzz"
KEPT_PROBLEMS = 20  # examples of problems kept in the JSON (all are counted)
# The stub decode's lease outlasts any run, so the sentinel's lease may only shrink.
STUB_LEASE_ARGS = ("--lease", "--lease-s", "86400", "--max-lease-s", "86400")
STUB_MODEL = "tiny"  # the name the generated bodies use for the served model (the other is "nope")


def _servers(logs: Path) -> tuple[list[ServerProcess], str]:
    prefill_port, decode_port = free_port(), free_port(offsets=[LEASE_PORT_OFFSET])
    router_port = free_port()
    prefill = ServerProcess(
        name="stub-prefill",
        command=stub_command("prefill", prefill_port, "--model", STUB_MODEL),
        health_url=f"http://127.0.0.1:{prefill_port}/health",
        log_dir=logs,
    )
    decode = ServerProcess(
        name="stub-decode",
        command=stub_command("decode", decode_port, "--model", STUB_MODEL, *STUB_LEASE_ARGS),
        health_url=f"http://127.0.0.1:{decode_port}/health",
        log_dir=logs,
    )
    router = router_server(
        port=router_port,
        prefill_url=f"http://127.0.0.1:{prefill_port}",
        decode_url=f"http://127.0.0.1:{decode_port}",
        log_dir=logs,
        max_body_bytes=MAX_BODY_BYTES,
    )
    return [prefill, decode, router], f"http://127.0.0.1:{router_port}"


def _sentinel_changes(before: dict[str, Any], now: dict[str, Any]) -> str | None:
    """Why the sentinel's view ``now`` shows it was touched since ``before`` (None: it was not)."""
    same = ("decode", "retained_tokens")
    if any(before[k] != now[k] for k in same) or before["lease"]["state"] != now["lease"]["state"]:
        return f"sentinel changed: {before} -> {now}"
    if now["lease"]["expires_in_s"] > before["lease"]["expires_in_s"] + 0.01:
        return f"sentinel's lease was extended: {before} -> {now}"
    return None


def fuzz(url: str, *, cases: int, seed_value: int) -> dict[str, Any]:
    statuses: Counter[int] = Counter()
    by_route: dict[str, Counter[int]] = {}
    problems: Counter[str] = Counter()
    errors: Counter[str] = Counter()  # the router's error messages, cut before the values they quote
    examples: list[dict[str, Any]] = []
    sent = {"requests": 0, "skipped": 0, "unsendable": 0}
    with httpx.Client(base_url=url, timeout=30) as client:
        body = {"model": STUB_MODEL, "messages": [{"role": "user", "content": "keep me " * 40}]}
        first = client.post("/v1/chat/completions", json=body, headers={"x-session-id": SENTINEL})
        first.raise_for_status()
        sentinel = client.get(f"/v1/conversations/{SENTINEL}").json()
        if sentinel["lease"]["state"] != "held" or not sentinel["retained_tokens"]:
            raise SystemExit(f"the sentinel conversation is not retained on decode: {sentinel}")

        with make_progress() as progress:
            task = progress.add_task(f"{cases} cases", total=cases)

            @seed(seed_value)
            @settings(
                max_examples=cases,
                deadline=None,
                database=None,
                phases=[Phase.generate],  # count every problem; no shrinking of the first one
                suppress_health_check=list(HealthCheck),
            )
            @given(requests)
            def case(request: tuple[Any, ...]) -> None:
                nonlocal sentinel
                progress.advance(task)
                (method, path), content, headers, conversation_id = request
                if touches_sentinel(content, headers, conversation_id):
                    sent["skipped"] += 1
                    return
                target = path.replace("{id}", urllib.parse.quote(conversation_id, safe="") or "x")
                found: list[str] = []
                try:
                    resp = client.request(method, target, content=content, headers=headers)
                except httpx.LocalProtocolError:
                    # The client's HTTP library refuses to send it (a header value with leading or trailing
                    # whitespace): no router ever sees such a request over a socket.
                    sent["unsendable"] += 1
                    return
                except httpx.HTTPError as exc:
                    status, found = 0, [f"no answer: {type(exc).__name__}: {exc}"]
                else:
                    status = resp.status_code
                    found = answer_problems(status, resp.headers.get("content-type", ""), resp.text, content)
                    if status >= 400 and not found:
                        errors[f"{status} {resp.json()['error']['message'][:48]}"] += 1
                sent["requests"] += 1
                statuses[status] += 1
                by_route.setdefault(f"{method} {path}", Counter())[status] += 1
                now = client.get(f"/v1/conversations/{SENTINEL}").json()
                changed = _sentinel_changes(sentinel, now)
                sentinel = now
                if changed:
                    found.append(changed)
                for problem in found:
                    problems[problem.split(":")[0]] += 1
                    if len(examples) < KEPT_PROBLEMS:
                        examples.append(
                            {
                                "problem": problem,
                                "method": method,
                                "path": target,
                                "headers": headers,
                                "body": content[:500].decode(errors="replace"),
                            }
                        )

            case()
    server_errors = sum(n for status, n in statuses.items() if status >= 500)
    return {
        "cases": cases,
        "seed": seed_value,
        "requests": sent["requests"],
        "skipped_sentinel_cases": sent["skipped"],
        "unsendable_cases": sent["unsendable"],
        "max_body_bytes": MAX_BODY_BYTES,
        "server_errors": server_errors,
        "problems": dict(problems),
        "problem_examples": examples,
        "top_errors": dict(errors.most_common(15)),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "statuses_by_route": {
            route: {str(k): v for k, v in sorted(c.items())} for route, c in sorted(by_route.items())
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0, help="hypothesis seed: same seed, same requests")
    ap.add_argument("--out", default=None, help="results directory (default bench/results/fuzz/)")
    args = ap.parse_args()
    exit_on_sigterm()
    out = results_dir(NAME, args.out)
    servers, url = _servers(out / "logs")
    t0 = time.monotonic()
    with running(servers), ProcessSampler(pid=servers[-1].pid) as sampler:
        data = fuzz(url, cases=args.cases, seed_value=args.seed)
    data["wall_s"] = round(time.monotonic() - t0, 1)
    data["router_cores"] = round(sampler.cpu_fraction, 2)
    data["router_peak_rss_mib"] = round(sampler.peak_rss / 2**20, 1)
    statuses = sorted({s for c in data["statuses_by_route"].values() for s in c}, key=int)
    print_table(
        f"router HTTP fuzz: {data['requests']:,} requests, seed {args.seed}, {data['server_errors']} 5xx",
        ["route", *statuses],
        [[route, *(c.get(s, 0) for s in statuses)] for route, c in data["statuses_by_route"].items()],
    )
    if data["problems"]:
        console.print(f"[bold red]problems:[/] {data['problems']}")
    print(write_results(NAME, data, out_dir=out))
    sys.exit(1 if data["problems"] else 0)


if __name__ == "__main__":
    main()
