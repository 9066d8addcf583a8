"""The decode retention service: a tiny JSON-over-HTTP listener in the decode scheduler process.

Why stdlib ``http.server`` and a thread: it runs inside vLLM's engine-core process, where we must not start
an event loop or pull in the router's dependencies; the traffic is a handful of lookups/renewals per turn.
Routes are in docs/protocol.md, section 2.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote

from agentkv.server.engine._connector._cached import CachedPrompts
from agentkv.server.engine._connector._host_policy import occupancy
from agentkv.server.engine._connector._leases import LeaseTable, match_request_id

__all__ = ["COUNTERS", "READ_SPARE_S", "RetentionService", "render_metrics"]

logger = logging.getLogger("agentkv.connector")
_PREFIX = "/agentkv/v1/"
_MAX_BODY = 4096
# Finished requests remembered, so a lookup that waits for one knows when it is done: a few minutes of turns.
_FINISHED_KEPT = 4096
# The longest a lookup may wait for its request to finish (`wait_ms`).
_MAX_WAIT_S = 5.0
# How long after a prefill's still-held check its lease is spared from demotion under pressure: the NIXL read
# that follows the check must never find its blocks freed. Reads of a 127k-token conversation take under 2 s
# on an H100 pair; the margin is for starved hosts.
READ_SPARE_S = 30.0

# Counters of the connector's decisions (``AgentKVScheduler.stats``), as Prometheus exposes them. vLLM's own
# /metrics lives in the API-server process; these live in the engine-core process, so this service serves
# them on its own /metrics. The scheduler keeps exactly these keys.
COUNTERS = {
    "pulls": "turns whose offered blocks were pulled from decode",
    "recomputes": "turns offered blocks that recomputed instead (cost, mismatch, released or expired)",
    "tokens_offered": "prompt tokens decode offered to prefill",
    "tokens_pulled": "prompt tokens pulled from decode instead of computed",
    "tokens_trimmed": "offered tokens refused because their fingerprints did not match this prompt",
    "tokens_refused": "offered tokens not pulled for any reason",
    "refused_mismatch": "offers trimmed by the token-exact prefix check",
    "refused_unverified": "offers refused for lack of fingerprints (agentkv_require_fingerprints)",
    "refused_released": "offers whose lease was released or expired before the read (or decode was silent)",
    "retained": "finished requests whose blocks decode retained",
    "not_retained": "finished requests decode did not retain: no room under agentkv_max_retained_fraction",
    "demotions": "leases ended early because the host KV tier holds their blocks (the router's call, or "
    "decode's own to make room: demotions_pressure)",
    "demotions_pressure": "of those, leases decode demoted to retain a newer request under its retention cap",
    "host_evicted": "chunks the host KV tier evicted of conversations decode does not keep (ended, released, "
    "expired, one-off requests)",
    "host_evicted_kept": "chunks the host KV tier evicted of kept conversations (live leases, and those "
    "without one the router still beats for): the live set is more than the tier holds",
    "fingerprint_blocks_hashed": "KV blocks whose token fingerprints were hashed from their tokens",
    "fingerprint_blocks_reused": "KV blocks whose token fingerprints came from an earlier turn's chain",
    "block_hashes_computed": "prompt blocks whose vLLM prefix-cache hash vLLM computed on arrival",
    "block_hashes_reused": "prompt blocks whose vLLM prefix-cache hash came from an earlier prompt's",
}


# Gauges of the host KV tier (`_host_policy.occupancy`), where it runs agentkv's eviction policy.
HOST_TIER_GAUGES = {
    "held": ("host_tier_chunks", "chunks the host KV tier holds now"),
    "kept": (
        "host_tier_kept_chunks",
        "of those, chunks of kept conversations (live leases, and those the router still beats for)",
    ),
    "capacity": ("host_tier_capacity_chunks", "chunks the host KV tier has room for"),
    "held_bytes": ("host_tier_bytes", "bytes of KV the host KV tier holds now"),
}


def render_metrics(
    info: dict[str, Any], retained_now: int, retained_blocks: int, host_tier: dict[str, int] | None = None
) -> str:
    """Prometheus text exposition of the connector's counters, labelled with the engine's role."""
    role = info.get("role", "unknown")
    stats = info.get("stats") or {}
    lines = []
    for key, doc in COUNTERS.items():
        name = f"agentkv_connector_{key}_total"
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} counter"]
        lines.append(f'{name}{{role="{role}"}} {float(stats.get(key, 0))}')
    lines += [
        "# HELP agentkv_connector_retained_requests requests whose blocks decode holds now",
        "# TYPE agentkv_connector_retained_requests gauge",
        f'agentkv_connector_retained_requests{{role="{role}"}} {float(retained_now)}',
        "# HELP agentkv_connector_retained_blocks KV blocks that decode's leases hold now",
        "# TYPE agentkv_connector_retained_blocks gauge",
        f'agentkv_connector_retained_blocks{{role="{role}"}} {float(retained_blocks)}',
    ]
    for key, (metric, doc) in HOST_TIER_GAUGES.items():
        if host_tier is not None and key in host_tier:
            name = f"agentkv_connector_{metric}"
            lines += [
                f"# HELP {name} {doc}",
                f"# TYPE {name} gauge",
                f'{name}{{role="{role}"}} {host_tier[key]:.1f}',
            ]
    return "\n".join(lines) + "\n"


class RetentionService:
    def __init__(
        self,
        *,
        table: LeaseTable,
        host: str,
        port: int,
        info: Callable[[], dict[str, Any]],
        token: str | None = None,
        cached: CachedPrompts | None = None,
        stats: dict[str, int] | None = None,
    ) -> None:
        self.table = table
        self.cached = cached
        # The scheduler's counters: the service adds its own (`demotions`), which the scheduler never writes.
        self.stats = stats if stats is not None else {}
        self._demote_lock = threading.Lock()
        self._finished = _RecentIds(_FINISHED_KEPT)
        # Leases decode demoted (the router's call, or its own in `make_room`): their renewal answers
        # "demoted", so the router's record says where the blocks went instead of only that the lease is gone.
        self._demoted = _RecentIds(_FINISHED_KEPT)
        # Conversations without a lease whose host copy the tier's evictions spare (`kept_host_keys`), by
        # vLLM's request id: until when, on the table's clock. A demotion keeps one lease time; a renewal
        # the router sends for a conversation decode holds no lease for (demoted, declined at the cap, run
        # out: its heartbeats go on through the tool call) keeps it or extends it, as it would a lease. A
        # release, or beats that stop, end it.
        self._kept_until: dict[str, float] = {}
        self._info = info
        self._expected = f"Bearer {token}".encode() if token else None
        handler = type("_Handler", (_Handler,), {"service": self})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="agentkv-retention", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()
        logger.info("agentkv retention service listening on port %d", self.port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def authorized(self, authorization: str | None) -> bool:
        """Without a token anyone who reaches the port may call (keep it on the private network); with one,
        the Bearer token must match (compared in constant time)."""
        if self._expected is None:
            return True
        return hmac.compare_digest((authorization or "").encode(), self._expected)

    def finished(self, request_id: str) -> None:
        """Decode's scheduler is done with this request (its blocks leased or not): a lookup waiting for it
        answers now. Called after the lease is added."""
        self._finished.add(request_id)

    def _lookup(self, request_id: str, wait_s: float, *, reading: bool) -> dict[str, Any] | None:
        """The request's lease, waiting up to `wait_s` for the request to finish. An answer can reach the
        client before decode's scheduler has finished its request: a stop string is found in vLLM's API
        server, which then aborts the request in the engine core. ``reading``: a prefill's still-held check
        before its read (the lease is then spared from demotion under pressure for a while)."""
        deadline = time.monotonic() + wait_s
        while True:
            found = self.table.lookup(request_id, reading=reading)
            if found or request_id in self._finished or time.monotonic() >= deadline:
                # Looked up once more after `finished`: the lease is added before the request is marked.
                return found or self.table.lookup(request_id, reading=reading)
            time.sleep(0.005)

    def has_host_tier(self) -> bool:
        """Whether decode runs vLLM's host KV tier beside us (found at the first finished request)."""
        return self.cached is not None and self.cached.host_lookup is not None

    def demote(self, request_id: str) -> tuple[int, dict[str, Any]]:
        """End a lease early because its blocks are in the host tier too: vLLM's OffloadingConnector writes
        each block to host memory as it is computed, so ending the lease moves nothing; it makes the blocks
        free, still in decode's prefix cache, and evicted from there (least recently used first) only when
        decode needs the room. The next turn, sent decode-local, reads them from decode's KV cache or, once
        evicted, back from host memory. Refused (409, the lease kept) where the host tier does not hold the
        lease's whole chunks, except at most its last (a store still in flight): those would be recomputed."""
        status, payload = self._demotable(request_id)
        if status != 200:
            return status, payload
        if not self._end(request_id):
            return 404, {"demoted": False, "error": f"no retained blocks for {request_id}"}
        return 200, {"demoted": True, **payload}

    def _end(self, request_id: str) -> bool:
        """Release a lease `_demotable` found the host tier holds, counted as a demotion; its host copy is
        kept (`kept_host_keys`) for a lease time."""
        rid = self.table.resolve(request_id)
        if rid is None or not self.table.release(rid):
            return False
        with self._demote_lock:
            self.stats["demotions"] = self.stats.get("demotions", 0) + 1
            self._keep(rid, self.table.lease_s)
        self._demoted.add(rid)
        return True

    def _keep(self, rid: str, duration_s: float) -> None:
        """Keep ``rid``'s host copy at least ``duration_s`` from now (under the demote lock)."""
        now = self.table.clock()
        for old in [r for r, until in self._kept_until.items() if until <= now]:
            del self._kept_until[old]
        self._kept_until[rid] = max(self._kept_until.get(rid, now), now + duration_s)

    def _kept_id(self, request_id: str) -> str | None:
        """The kept request ``request_id`` names (the router's id is contained in vLLM's)."""
        with self._demote_lock:
            return match_request_id(request_id, self._kept_until, self._kept_until)

    def _keep_alive(self, request_id: str, duration: float | None) -> None:
        """The router renewed a conversation decode holds no lease for: it is alive, so its host copy is
        kept for ``duration`` (the lease time where None)."""
        rid = self._kept_id(request_id) or self._finished.find(request_id)
        if rid is None:
            return
        with self._demote_lock:
            self._keep(rid, self.table.duration(duration))

    def kept_host_keys(self) -> list[frozenset[Any]]:
        """The host tier's keys of every kept conversation, one set each: those with a live lease (their
        blocks are in HBM; the host copy is what a demotion under pressure needs) and those without a lease
        while their keep lasts (a demotion, or the router's renewals). Called by the host tier's eviction
        policy on the scheduler thread."""
        if self.cached is None or self.cached.host_key is None:
            return []
        sets = (self.cached.host_keys(rid) for rid in self.kept_ids())
        return [keys for keys in sets if keys]

    def kept_ids(self) -> set[str]:
        """vLLM's ids of the kept conversations' requests (`kept_host_keys`)."""
        now = self.table.clock()
        with self._demote_lock:
            demoted = [rid for rid, until in self._kept_until.items() if until > now]
        return {*self.table.live_ids(), *demoted}

    def make_room(self, block_ids: Collection[Hashable]) -> list[str]:
        """Demote the leases a retention of ``block_ids`` needs the room of (soonest deadline first, only
        those whose blocks the host tier holds, none a prefill may be reading), on the scheduler thread before
        the retention is declined; the ids demoted. None is demoted unless together they make the room: a
        retention still declined should cost no other conversation its lease."""
        if not self.has_host_tier():
            return []
        short, candidates = self.table.room_for(block_ids, spare_s=READ_SPARE_S)
        chosen: list[str] = []
        freed = 0
        for rid, own in candidates:
            if freed >= short:
                break
            if own > 0 and self._demotable(rid)[0] == 200:
                chosen.append(rid)
                freed += own
        if freed < short:
            return []
        done = [rid for rid in chosen if self._end(rid)]
        with self._demote_lock:
            self.stats["demotions_pressure"] = self.stats.get("demotions_pressure", 0) + len(done)
        return done

    def _demotable(self, request_id: str) -> tuple[int, dict[str, Any]]:
        """200 with the lease's counts where its host tier holds its blocks (`demote`), else why not."""
        lease = self.table.lookup(request_id)
        if lease is None:
            return 404, {"demoted": False, "error": f"no retained blocks for {request_id}"}
        host = self.cached.host_tokens(request_id) if self.cached is not None else None
        if host is None:
            return 409, {"demoted": False, "error": "decode has no host KV tier (or forgot the request)"}
        assert self.cached is not None
        block = self.cached.block_size
        held = int(lease.get("num_tokens") or 0) // block * block
        chunk = self.cached.blocks_per_chunk * block
        if host < held - chunk:
            return 409, {
                "demoted": False,
                "host_tokens": host,
                "num_tokens": held,
                "error": f"the host tier holds {host} of the lease's {held} tokens",
            }
        return 200, {"host_tokens": min(host, held), "num_tokens": held}

    # Routing lives here, not in the handler, so it can be tested without sockets.
    def handle(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if not path.startswith(_PREFIX):
            return 404, {"error": "not found"}
        path, _, query = path.partition("?")
        parts = [unquote(p) for p in path[len(_PREFIX) :].split("/") if p]
        match method, parts:
            case "GET", ["info"]:
                return 200, {
                    **self._info(),
                    "host_tier": self.has_host_tier(),
                    "retained": len(self.table),
                    "retained_blocks": self.table.blocks_in_use(),
                }
            case "GET", ["retained", rid]:
                params = parse_qs(query)
                try:
                    wait_s = min(int(params.get("wait_ms", ["0"])[0]) / 1000, _MAX_WAIT_S)
                except ValueError:
                    return 400, {"error": "wait_ms must be a whole number"}
                reading = params.get("reading", ["0"])[0] == "1"
                found = self._lookup(rid, max(wait_s, 0.0), reading=reading)
                return (200, found) if found else (404, {"error": f"no retained blocks for {rid}"})
            case "GET", ["cached", rid]:
                # What decode's prefix cache still holds of a finished request's tokens (`CachedPrompts`).
                held = self.cached.cached_tokens(rid) if self.cached is not None else None
                if held is None:
                    return 404, {"error": f"no cached blocks known for {rid}"}
                return 200, {"request_id": rid, "cached_tokens": held.tokens, "host_tokens": held.host_tokens}
            case "POST", ["leases", rid, "renew"]:
                duration = body.get("duration_s")
                if duration is not None and not isinstance(duration, int | float):
                    return 400, {"error": "duration_s must be a number"}
                found = self.table.renew(rid, duration)
                if found:
                    return 200, found
                # No lease (demoted, declined, run out), but the conversation is alive: its host copy is kept.
                self._keep_alive(rid, duration)
                if rid in self._demoted:
                    return 409, {"demoted": True, "error": f"{rid} was demoted to the host KV tier"}
                return 404, {"error": f"no retained blocks for {rid}"}
            case "POST", ["leases", rid, "demote"]:
                return self.demote(rid)
            case "DELETE", ["leases", rid]:
                # A demoted conversation's release ends its keep: its host copy goes first from then on.
                kept = self._kept_id(rid)
                if kept is not None:
                    with self._demote_lock:
                        self._kept_until.pop(kept, None)
                released = self.table.release(rid) or kept is not None
                return (200, {"released": True}) if released else (404, {"released": False})
        return 404, {"error": "not found"}


class _RecentIds:
    """The newest ``kept`` request ids, matched as leases are (`LeaseTable.resolve`): vLLM turns the router's
    id into ``chatcmpl-<id>-<suffix>``. Newest first: the id asked after is usually a recent one."""

    def __init__(self, kept: int) -> None:
        self._kept = kept
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, request_id: str) -> None:
        with self._lock:
            self._ids[request_id] = None
            self._ids.move_to_end(request_id)
            while len(self._ids) > self._kept:
                self._ids.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and self.find(request_id) is not None

    def find(self, request_id: str) -> str | None:
        """The kept id ``request_id`` names, itself or the newest that contains it."""
        with self._lock:
            return match_request_id(request_id, self._ids, reversed(self._ids))


class _Handler(BaseHTTPRequestHandler):
    service: RetentionService
    protocol_version = "HTTP/1.1"

    def _dispatch(self, method: str) -> None:
        if method == "GET" and self.path.split("?", 1)[0] == "/metrics":
            # Counters only, nothing a caller could act on: Prometheus scrapes it without the token.
            table = self.service.table
            text = render_metrics(self.service._info(), len(table), table.blocks_in_use(), occupancy())
            self._reply(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")
            return
        body: dict[str, Any] = {}
        length = int(self.headers.get("content-length") or 0)
        if length > _MAX_BODY:
            self._send(413, {"error": "body too large"})
            return
        if length:
            try:
                parsed = json.loads(self.rfile.read(length))
            except ValueError:
                self._send(400, {"error": "malformed JSON"})
                return
            if not isinstance(parsed, dict):
                self._send(400, {"error": "body must be a JSON object"})
                return
            body = parsed
        # After the body is read: what is left unread of a request would be parsed as the next one on this
        # keep-alive connection.
        if not self.service.authorized(self.headers.get("authorization")):
            # Lease calls free or pin decode memory and lookups name NIXL hosts and block ids.
            self._send(401, {"error": "unauthorized"})
            return
        try:
            status, payload = self.service.handle(method, self.path, body)
        except Exception:  # never let a bug take the engine's thread down with it
            logger.exception("retention service error")
            status, payload = 500, {"error": "internal error"}
        self._send(status, payload)

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        self._reply(status, json.dumps(payload).encode(), "application/json")

    def _reply(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per renewal is noise
        logger.debug(format, *args)
