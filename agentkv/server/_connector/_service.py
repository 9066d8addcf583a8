"""The decode retention service: a tiny JSON-over-HTTP listener in the decode scheduler process.

Why stdlib ``http.server`` and a thread: it runs inside vLLM's engine-core process, where we must not start
an event loop or pull in the router's dependencies; the traffic is a handful of lookups/renewals per turn.
Routes are in docs/protocol.md, section 2.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

from agentkv.server._connector._leases import LeaseTable

__all__ = ["RetentionService"]

logger = logging.getLogger("agentkv.connector")
_PREFIX = "/agentkv/v1/"
_MAX_BODY = 4096


class RetentionService:
    def __init__(
        self, *, table: LeaseTable, host: str, port: int, info: Callable[[], dict[str, Any]]
    ) -> None:
        self.table = table
        self._info = info
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

    # Routing lives here, not in the handler, so it can be tested without sockets.
    def handle(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if not path.startswith(_PREFIX):
            return 404, {"error": "not found"}
        parts = [unquote(p) for p in path[len(_PREFIX) :].split("/") if p]
        match method, parts:
            case "GET", ["info"]:
                return 200, {**self._info(), "retained": len(self.table)}
            case "GET", ["retained", rid]:
                found = self.table.lookup(rid)
                return (200, found) if found else (404, {"error": f"no retained blocks for {rid}"})
            case "POST", ["leases", rid, "renew"]:
                duration = body.get("duration_s")
                if duration is not None and not isinstance(duration, int | float):
                    return 400, {"error": "duration_s must be a number"}
                found = self.table.renew(rid, duration)
                return (200, found) if found else (404, {"error": f"no retained blocks for {rid}"})
            case "DELETE", ["leases", rid]:
                return (200, {"released": True}) if self.table.release(rid) else (404, {"released": False})
        return 404, {"error": "not found"}


class _Handler(BaseHTTPRequestHandler):
    service: RetentionService
    protocol_version = "HTTP/1.1"

    def _dispatch(self, method: str) -> None:
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
        try:
            status, payload = self.service.handle(method, self.path, body)
        except Exception:  # never let a bug take the engine's thread down with it
            logger.exception("retention service error")
            status, payload = 500, {"error": "internal error"}
        self._send(status, payload)

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
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
