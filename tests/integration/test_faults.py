"""Issues 3 and 7 on the real engine: a 2P2D cluster, two router replicas sharing a real Redis, and faults.

Order matters (module-scoped cluster): stickiness first, then replica/Redis faults, a frozen decode, a decode
killed between turns and restarted, prefill down, and a decode killed mid-stream last.

Not here: a decode shut down (SIGTERM) mid-stream. vLLM 0.32 ended such a stream three ways in three runs
(finish_reason "abort"; silence until the router's idle timeout; its own error event, which the router
forwards but counts as a clean end), so the router's abort handling is covered by unit tests only.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentkv.server.launch._cluster import Cluster
from agentkv.server.launch._launcher import Engine

from ._clusters import Clusters
from ._helpers import (
    RouterProc,
    chat,
    conversation_script,
    conversation_state,
    free_port,
    metric,
    new_id,
    pd_turn,
    service_info,
    wait_until,
)

SHORT = {
    "AGENTKV_TIMEOUTS__DECODE_FIRST_BYTE_S": "20",
    "AGENTKV_TIMEOUTS__DECODE_TOTAL_S": "90",  # a first P->D handshake on 2 busy cores can take 30 s
    "AGENTKV_TIMEOUTS__PREFILL_S": "60",
}


# Below Linux's ephemeral range (32768-60999), where an engine's own listeners (vLLM's ZMQ sockets, UCX) or an
# outgoing connection can take a port at any moment.
P_PORT, D_PORT, SIDE_PORT = 24100, 24200, 7600
REDIS_PORT_FROM = 24050
# The decode lease: it must outlast a decode's restart (about a minute here, several on a slow host), so that
# a conversation left on the killed decode still holds its lease when it comes back and only the engine's new
# registration can keep the router from offering the old engine's blocks.
LEASE_S = 300
# The frozen-decode test's router: how long it waits for a frozen decode's first byte.
FROZEN_FIRST_BYTE_S = 5


@pytest.fixture(scope="module")
def redis_server() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is required (scripts/setup.sh installs it)")
    port = free_port(REDIS_PORT_FROM)
    proc = _start_redis(binary, port)
    yield proc, port
    proc.terminate()


def _start_redis(binary: str, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60  # milliseconds, unless four engines starve the host
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


@pytest.fixture(scope="module")
def cluster22(clusters: Clusters) -> Cluster:
    return clusters.get(
        "2p2d",
        n_prefill=2,
        n_decode=2,
        prefill_port=P_PORT,
        decode_port=D_PORT,
        side_channel_port=SIDE_PORT,
        lease_s=LEASE_S,
        # Four engines on 2 cores: measured pulls (tens of ms of CPU starvation each) often lose to
        # recomputing a few hundred tiny-model tokens, so every verified offer is pulled (cost model off, the
        # suite's default, see _clusters.cluster_config): these tests are about routing and faults.
    )


@pytest.fixture(scope="module")
def replicas(
    clusters: Clusters, cluster22: Cluster, redis_server: tuple[Any, int]
) -> Iterator[list[RouterProc]]:
    store = ["--store-url", f"redis://127.0.0.1:{redis_server[1]}/0"]
    rs = [
        clusters.router(f"r{i}", "--exact", "--path-policy", "always-pd", *store, env=SHORT, shared=False)
        for i in range(2)
    ]
    yield rs
    for r in rs:
        r.stop()


@pytest.fixture(scope="module")
def off22(clusters: Clusters, cluster22: Cluster) -> RouterProc:
    return clusters.router("off", "--no-reuse", "--exact")


def _decode_of(router: RouterProc, cid: str) -> str:
    """The decode the router's record of the conversation names. The record of a turn is stored after the
    client has the answer: a conversation's first record is waited for (a later one may still name the decode
    of the turn before; tests that expect a move wait for it with `_wait_moved`)."""
    return str(conversation_state(router.url, cid)["decode"])


def _wait_moved(router: RouterProc, cid: str, gone: str) -> None:
    """Until the router's record of the conversation names another decode than ``gone``."""
    seen: list[str] = []

    def moved() -> bool:
        seen[:] = [_decode_of(router, cid)]
        return seen[0] != gone

    wait_until(moved, timeout_s=60, what=lambda: f"{cid} is still recorded on {seen}, not moved off {gone}")


def _engine(cluster: Cluster, backend_name: str) -> Engine:
    """Router names decodes d0, d1 in the order given; our cluster names them decode0, decode1."""
    role = "decode" if backend_name.startswith("d") else "prefill"
    return next(e for e in cluster.engines if e.name == f"{role}{backend_name[1:]}")


def test_conversations_stay_on_their_decode(replicas: list[RouterProc]) -> None:
    r = replicas[0]
    eligible = hits = 0
    decodes = set()
    for i in range(20):
        cid = new_id(f"sticky{i}")
        h: list[dict[str, object]] = []
        for j, msg in enumerate(conversation_script(500 + i, 3)):
            # Whole messages: a first turn shorter than one CPU block (128 tokens) leaves only a partial block
            # to offer, which the token-exact check refuses whenever the answer re-tokenizes differently.
            h.append({"role": "user", "content": msg})
            turn = chat(r.url, h, conversation_id=cid, max_tokens=4)
            h.append({"role": "assistant", "content": turn.text})
            if j > 0:
                eligible += 1
                hits += turn.headers.get("x-agentkv-reuse") == "hit"
        decodes.add(_decode_of(r, cid))
    assert hits >= 0.95 * eligible, (hits, eligible)
    assert decodes == {"d0", "d1"}  # least-loaded choice spreads new conversations


def test_replica_continues_a_conversation_and_survives_the_other_dying(
    replicas: list[RouterProc], off22: RouterProc
) -> None:
    a, b = replicas
    cid = new_id("replica")
    script = conversation_script(530, 3)
    h: list[dict[str, object]] = [{"role": "user", "content": script[0]}]
    off: list[list[int]] = []
    on: list[list[int]] = []
    reuse = []
    for i, router in enumerate([a, b, b]):
        if i == 2:
            a.stop()  # replica A dies; B carries on from the shared store
        t = chat(router.url, h, conversation_id=cid)
        on.append(t.ids)
        off.append(chat(off22.url, h).ids)
        reuse.append(t.headers.get("x-agentkv-reuse"))
        h += [{"role": "assistant", "content": t.text}, {"role": "user", "content": script[min(i + 1, 2)]}]
    assert reuse == ["miss", "hit", "hit"]
    assert on == off


def test_redis_restart_costs_reuse_once_then_resumes(
    replicas: list[RouterProc], redis_server: tuple[subprocess.Popen[bytes], int], off22: RouterProc
) -> None:
    b = replicas[1]
    proc, port = redis_server
    cid = new_id("redis")
    script = conversation_script(540, 3)
    h: list[dict[str, object]] = [{"role": "user", "content": script[0]}]
    h.append({"role": "assistant", "content": chat(b.url, h, conversation_id=cid).text})
    proc.terminate()
    proc.wait(5)
    binary = shutil.which("redis-server")
    assert binary
    new = _start_redis(binary, port)
    try:
        h.append({"role": "user", "content": script[1]})
        t = chat(b.url, h, conversation_id=cid)  # no error: the state is gone, so this turn recomputes
        assert t.ids == chat(off22.url, h).ids
        assert t.headers.get("x-agentkv-reuse") in ("miss", "hit")
        h += [{"role": "assistant", "content": t.text}, {"role": "user", "content": script[2]}]
        t3 = chat(b.url, h, conversation_id=cid)
        assert t3.headers.get("x-agentkv-reuse") == "hit"
        assert t3.ids == chat(off22.url, h).ids
    finally:
        redis_server[0].__dict__.update(new.__dict__)  # the fixture stops the live one


def test_frozen_decode_times_out_cleanly_and_recovers(
    clusters: Clusters,
    cluster22: Cluster,
    replicas: list[RouterProc],
    off22: RouterProc,
    redis_server: tuple[subprocess.Popen[bytes], int],
) -> None:
    b = replicas[1]
    cid = new_id("frozen")
    h: list[dict[str, object]] = [{"role": "user", "content": conversation_script(550, 1)[0]}]
    h.append({"role": "assistant", "content": chat(b.url, h, conversation_id=cid).text})
    engine = _engine(cluster22, _decode_of(b, cid))
    assert engine.pid
    # The frozen turn goes through a third replica (same store, so the same sticky decode) whose first-byte
    # timeout is FROZEN_FIRST_BYTE_S: the replicas' own 20 s leave room for starved engines in the other
    # tests, and here only a frozen decode answers late, so waiting them out would prove nothing more.
    fast = clusters.router(
        "frozen",
        "--exact",
        "--path-policy",
        "always-pd",
        "--store-url",
        f"redis://127.0.0.1:{redis_server[1]}/0",
        env={**SHORT, "AGENTKV_TIMEOUTS__DECODE_FIRST_BYTE_S": str(FROZEN_FIRST_BYTE_S)},
        shared=False,
    )
    os.killpg(engine.pid, signal.SIGSTOP)
    try:
        assert _decode_of(fast, cid) == _decode_of(b, cid)
        h.append({"role": "user", "content": "tool result: 3 rows"})
        try:
            r = httpx.post(
                f"{fast.url}/v1/chat/completions",
                headers={"x-session-id": cid},
                # A hang detector, not a speed bound: decode stays frozen until the request has ended, so
                # only the router's timeouts can end it (streamed, as agents call: its first-byte timeout,
                # where a non-streamed request would wait out the whole-response one, 90 s).
                timeout=300,
                json={"model": "tiny", "messages": h, "max_tokens": 4, "temperature": 0, "stream": True},
            )
        except httpx.TimeoutException:
            pytest.fail("the request to a frozen decode hung")
        if r.status_code != 200:  # a clean OpenAI-style timeout error, never a hang or a 500
            assert r.status_code in (502, 503, 504) and "error" in r.json()
    finally:
        os.killpg(engine.pid, signal.SIGCONT)
        fast.stop()
    # Every router must see the thawed decode again before the next fault: a router that still counts it
    # down when the other decode is killed has no decode left (seen once).
    _wait_healthy_decodes([*replicas, off22], 2)
    t = chat(b.url, h, conversation_id=cid)
    assert t.ids == chat(off22.url, h).ids
    _resumes(b, off22, cid, h, t)


def _wait_healthy_decodes(routers: list[RouterProc], n: int, timeout_s: float = 60) -> None:
    live = [r for r in routers if r.proc.poll() is None]  # not replicas an earlier test stopped
    wait_until(
        lambda: all(metric(r.url, "agentkv_healthy_backends", role="decode") >= n for r in live),
        timeout_s=timeout_s,
        what=lambda: f"not every router of {[r.url for r in live]} sees {n} healthy decodes",
        every_s=0.5,
    )


def _resumes(router: RouterProc, off: RouterProc, cid: str, h: list[dict[str, object]], last: Any) -> None:
    """After a fault the conversation's next turn reuses decode KV again, with the same answer as OFF."""
    h += [{"role": "assistant", "content": last.text}, {"role": "user", "content": "tool result: all good"}]
    t = chat(router.url, h, conversation_id=cid)
    assert t.headers.get("x-agentkv-reuse") == "hit", t.headers.get("x-agentkv-reuse")
    assert t.ids == chat(off.url, h).ids


def test_decode_killed_between_turns_then_restarted(
    cluster22: Cluster, replicas: list[RouterProc], off22: RouterProc
) -> None:
    b = replicas[1]
    # Two conversations on the same decode.
    convs: dict[str, list[dict[str, object]]] = {}
    target = None
    for i in range(12):
        cid = new_id(f"kill{i}")
        h: list[dict[str, object]] = [{"role": "user", "content": conversation_script(560 + i, 1)[0]}]
        h.append({"role": "assistant", "content": chat(b.url, h, conversation_id=cid, max_tokens=6).text})
        d = _decode_of(b, cid)
        target = target or d
        if d == target:
            convs[cid] = h
        if len(convs) == 2:
            break
    assert len(convs) == 2 and target
    engine = _engine(cluster22, target)
    old_engine_id = _engine_id(engine)
    engine.stop()
    (c1, h1), (c2, h2) = convs.items()
    h2.append({"role": "user", "content": "tool result: the decode died"})
    t = chat(b.url, h2, conversation_id=c2)  # fails over to the other decode: reuse lost once
    assert t.headers.get("x-agentkv-reuse") != "hit"
    assert t.ids == chat(off22.url, h2).ids
    _wait_moved(b, c2, target)
    _resumes(b, off22, c2, h2, t)  # on the surviving decode
    engine.start()
    engine.wait_healthy(timeout_s=600)
    for p in cluster22.prefills:  # the restarted engine's first NIXL handshakes (slow on 2 busy cores)
        pd_turn(p.spec.url, engine.spec.url, [{"role": "user", "content": "warm up"}], max_tokens=2)
    # The restarted engine registers anew, and the routers read that registration in the same health check
    # that brings it back (HealthChecker._check probes decode right after counting it healthy).
    _wait_new_engine_id(engine, old_engine_id)
    _wait_healthy_decodes([*replicas, off22], 2)
    # c1's lease is still held (LEASE_S outlasts the restart): only the new registration can keep the router
    # from offering the old engine's blocks, so the turn below tests that, not an expired lease.
    lease = httpx.get(f"{b.url}/v1/conversations/{c1}", timeout=5).json()["lease"]
    assert lease["state"] == "held", lease
    h1.append({"role": "user", "content": "tool result: after the restart"})
    t1 = chat(b.url, h1, conversation_id=c1)  # stale params of the old engine must not be used
    assert t1.headers.get("x-agentkv-reuse") != "hit"
    assert t1.ids == chat(off22.url, h1).ids
    _resumes(b, off22, c1, h1, t1)


def _engine_id(engine: Engine) -> str:
    """The engine id a decode's retention service reports: a restarted engine registers under a new one."""
    assert engine.spec.service_url
    engine_id = service_info(engine.spec.service_url)["engine_id"]
    assert isinstance(engine_id, str), engine_id
    return engine_id


def _wait_new_engine_id(engine: Engine, old: str, timeout_s: float = 60) -> None:
    """Until the restarted decode's retention service reports an engine id other than ``old``."""

    def renewed() -> bool:
        try:
            return _engine_id(engine) != old
        except (httpx.HTTPError, ValueError):
            return False  # the service is not listening yet

    wait_until(
        renewed,
        timeout_s=timeout_s,
        what=lambda: f"{engine.name} still reports engine id {old} after its restart",
        every_s=0.5,
    )


def test_prefill_down_other_prefill_serves(
    cluster22: Cluster, replicas: list[RouterProc], off22: RouterProc
) -> None:
    b = replicas[1]
    cluster22.prefills[0].stop()
    for i in range(3):  # whichever prefill the router would pick, every turn is served
        h: list[dict[str, object]] = [{"role": "user", "content": conversation_script(580 + i, 1)[0]}]
        cid = new_id("pdown")
        t = chat(b.url, h, conversation_id=cid)
        assert t.ids == chat(off22.url, h).ids
        if i == 0:
            _resumes(b, off22, cid, h, t)  # the surviving prefill pulls decode's KV


def _placed(router: RouterProc, cluster: Cluster, prefix: str, seed: int) -> tuple[str, list[Any], Engine]:
    """A conversation with one turn behind it, and the decode engine the router placed it on.

    The decode to fault is known from the router's record before the stream starts. (Asking the engines which
    one is generating raced with the stream: the tiny model streams ~3,000 tokens a second, and on 2 busy
    cores the whole answer could be done before the check.)"""
    cid = new_id(prefix)
    h: list[dict[str, object]] = [{"role": "user", "content": conversation_script(seed, 1)[0]}]
    h.append({"role": "assistant", "content": chat(router.url, h, conversation_id=cid, max_tokens=6).text})
    engine = _engine(cluster, _decode_of(router, cid))
    assert engine.pid
    h.append({"role": "user", "content": "tool result: a long report follows"})
    return cid, h, engine


def _stream_then_kill(router: RouterProc, cid: str, h: list[Any], pgid: int) -> list[str] | None:
    """Stream a long answer of the conversation's next turn (sticky to the decode whose process group is
    `pgid`), stop that decode (SIGSTOP) at the answer's first event, and kill it (SIGKILL) once the stream
    has gone quiet. Returns every event; the stream must end, with [DONE], however decode ended.

    Returns None, with decode resumed (SIGCONT), when the answer was already complete when decode stopped:
    on 2 busy cores the tiny model can stream its 3,000 tokens before this process reads the first event,
    and killing a decode that has finished would not test a stream cut short."""
    body = {
        "model": "tiny",
        "messages": h,
        "max_tokens": 3000,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        # Twenty alternatives per token make every event costlier for decode to produce, so the answer is
        # usually still being generated when its first event arrives here.
        "logprobs": True,
        "top_logprobs": 20,
    }
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        try:
            with httpx.stream(
                "POST",
                f"{router.url}/v1/chat/completions",
                json=body,
                headers={"x-session-id": cid},
                timeout=60,
            ) as r:
                lines.put(f"status {r.status_code}")
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.put(line[6:])
        except httpx.HTTPError as exc:
            lines.put(f"client error: {exc!r}")
        finally:
            lines.put(None)

    def complete() -> None:
        """Decode resumed, the rest of a finished answer read: it must be whole."""
        os.killpg(pgid, signal.SIGCONT)
        while (event := lines.get(timeout=60)) is not None:
            events.append(event)
        whole = events[-1] == "[DONE]" and not any(_is_error(e) for e in events[:-1])
        assert whole, events[-3:]

    threading.Thread(target=read, daemon=True).start()
    assert lines.get(timeout=60) == "status 200"
    first = lines.get(timeout=60)
    assert first is not None, "the stream ended without an event"
    events = [first]
    os.killpg(pgid, signal.SIGSTOP)
    # What decode sent before it stopped still arrives (the kernel delivers it; the router relays it); a
    # stream that then ends, or shows the answer's end, was complete already. The quiet window is for
    # starved relays: only they keep a finished answer's last events from arriving.
    while True:
        try:
            event = lines.get(timeout=10)
        except queue.Empty:
            break  # quiet: decode is stopped in the middle of the answer
        if event is not None:
            events.append(event)
        if event is None or _finished(event):
            if event is None:
                lines.put(None)  # the end, for `complete` to read again
            complete()
            return None
    os.killpg(pgid, signal.SIGKILL)
    # Each event within 60 s: a stream that stops short of its end without ending is a hang.
    while (event := lines.get(timeout=60)) is not None:
        events.append(event)
    assert events[-1] == "[DONE]", events[-3:]
    return events


def _finished(event: str) -> bool:
    """Whether an event is the one that ends an answer (a choice with its finish reason)."""
    try:
        chunk = json.loads(event)
    except ValueError:
        return False
    return isinstance(chunk, dict) and any(c.get("finish_reason") for c in chunk.get("choices") or [])


def _is_error(event: str) -> bool:
    try:
        return "error" in json.loads(event)
    except ValueError:
        return True  # not an answer chunk: the reader's own failure


def test_decode_killed_mid_stream_gets_an_sse_error_not_a_hang(
    cluster22: Cluster, replicas: list[RouterProc], off22: RouterProc
) -> None:
    b = replicas[1]
    # A crash, not a shutdown (see the module's docstring). Had the turn run on another decode than the one
    # killed, the stream would end normally and the error check would fail.
    for attempt in range(3):
        cid, h, engine = _placed(b, cluster22, f"midstream{attempt}", 590 + attempt)
        assert engine.pid
        events = _stream_then_kill(b, cid, h, engine.pid)
        if events is not None:
            break
        _wait_healthy_decodes([*replicas, off22], 2)  # the stopped decode missed health checks
    else:
        pytest.fail("decode finished every answer before it could be stopped")
    assert json.loads(events[-2])["error"]["message"] == "decode engine connection lost", events[-2]
    # The conversation goes on (on the surviving decode) with a correct answer, then reuses again.
    h += [{"role": "user", "content": "again"}]
    t = chat(b.url, h, conversation_id=cid)
    assert t.ids == chat(off22.url, h).ids
    _wait_moved(b, cid, engine.name.replace("decode", "d"))
    _resumes(b, off22, cid, h, t)
