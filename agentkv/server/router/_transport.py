"""A lean HTTP/1.1 keep-alive transport for the hops to engines (plain http on a private network).

httpx's default pool (httpcore over anyio) scans every pooled connection on each request and on each
release, and asks the socket whether it is readable through several layers each time: at a few dozen
warm connections that scan cost more than the rest of a turn. Here each origin keeps a stack of idle
connections, so taking and returning one is O(1). Anything but plain http goes to httpx's transport."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

__all__ = ["PooledTransport"]

Origin = tuple[str, int]
_READ_SIZE = 65536
_HEAD_LIMIT = 65536


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0
        self.reused = False

    def usable(self, now: float, expiry_s: float) -> bool:
        # The engine may have closed an idle connection (keep-alive timeout, restart): drop it first.
        return now - self.idle_since < expiry_s and not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


class _Stale(Exception):
    """A reused connection failed before any byte of the answer: the engine never saw the request."""


class PooledTransport(httpx.AsyncBaseTransport):
    def __init__(self, *, max_idle_per_origin: int = 256, keepalive_expiry_s: float = 4.0) -> None:
        self._idle: dict[Origin, list[_Connection]] = {}
        self._max_idle = max_idle_per_origin
        # Below uvicorn's 5 s keep-alive, so the engine rarely closes a connection we are about to reuse.
        self._expiry_s = keepalive_expiry_s
        self._fallback = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            return await self._fallback.handle_async_request(request)
        origin = (url.host, url.port or 80)
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        head = _head(request, await request.aread())
        while True:
            conn = self._checkout(origin)
            if conn is None:
                conn = await _connect(origin, timeouts.get("connect"), request)
            try:
                status, headers, framing, keep = await _exchange(conn, head, timeouts.get("read"), request)
            except _Stale:
                continue  # the next connection is fresh (or another idle one), so this ends
            except BaseException:
                conn.close()
                raise
            if request.method == "HEAD" or status in (204, 304):
                framing = 0
            body = _Body(self, origin, conn, framing, keep, timeouts.get("read"), request)
            return httpx.Response(
                status, headers=headers, stream=body, extensions={"http_version": b"HTTP/1.1"}
            )

    def _checkout(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to have expired
            if conn.usable(now, self._expiry_s):
                conn.reused = True
                return conn
            conn.close()
        return None

    def checkin(self, origin: Origin, conn: _Connection) -> None:
        idle = self._idle.setdefault(origin, [])
        if len(idle) >= self._max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        await self._fallback.aclose()


def _head(request: httpx.Request, content: bytes) -> bytes:
    url = request.url
    target = url.raw_path.decode("ascii")
    lines = [f"{request.method} {target} HTTP/1.1".encode()]
    has_length = False
    for name, value in request.headers.raw:
        has_length = has_length or name.lower() == b"content-length"
        if name.lower() != b"transfer-encoding":
            lines.append(name + b": " + value)
    if not has_length and (content or request.method in ("POST", "PUT", "PATCH")):
        lines.append(b"content-length: " + str(len(content)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + content


async def _connect(origin: Origin, timeout: float | None, request: httpx.Request) -> _Connection:
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(*origin, limit=_HEAD_LIMIT)
    except TimeoutError:
        raise httpx.ConnectTimeout("connect timed out", request=request) from None
    except OSError as exc:
        raise httpx.ConnectError(str(exc) or "connection failed", request=request) from None
    return _Connection(reader, writer)


async def _exchange(
    conn: _Connection, head: bytes, read_s: float | None, request: httpx.Request
) -> tuple[int, list[tuple[bytes, bytes]], int | None, bool]:
    """Send the request, read the answer's head. Framing: content length, None = chunked, -1 = to EOF."""
    try:
        conn.writer.write(head)
        async with asyncio.timeout(read_s):
            raw = await conn.reader.readuntil(b"\r\n\r\n")
    except TimeoutError:
        raise httpx.ReadTimeout("timed out waiting for the response", request=request) from None
    except asyncio.IncompleteReadError as exc:
        if conn.reused and not exc.partial:
            conn.close()
            raise _Stale from None
        raise httpx.RemoteProtocolError("connection closed before a full response", request=request) from None
    except asyncio.LimitOverrunError:
        raise httpx.RemoteProtocolError("response head too large", request=request) from None
    except (OSError, RuntimeError) as exc:  # uvloop raises RuntimeError writing to a closed transport
        if conn.reused:
            conn.close()
            raise _Stale from None
        raise httpx.ReadError(str(exc) or "connection lost", request=request) from None
    status_line, *header_lines = raw[:-4].split(b"\r\n")
    try:
        version, code = status_line.split(b" ", 2)[:2]
        status = int(code)
    except ValueError:
        raise httpx.RemoteProtocolError("malformed status line", request=request) from None
    headers: list[tuple[bytes, bytes]] = []
    framing: int | None = -1
    keep = version == b"HTTP/1.1"
    for line in header_lines:
        name, _, value = line.partition(b":")
        value = value.strip()
        headers.append((name, value))
        lower = name.lower()
        if lower == b"content-length" and framing == -1:
            framing = int(value)
        elif lower == b"transfer-encoding" and b"chunked" in value.lower():
            framing = None
        elif lower == b"connection":
            keep = b"close" not in value.lower() and (keep or b"keep-alive" in value.lower())
    return status, headers, framing, keep and framing != -1


class _Body(httpx.AsyncByteStream):
    """The answer's body; the connection goes back to the pool once the body was read to its end."""

    def __init__(
        self,
        pool: PooledTransport,
        origin: Origin,
        conn: _Connection,
        framing: int | None,
        keep: bool,
        read_s: float | None,
        request: httpx.Request,
    ) -> None:
        self._pool, self._origin, self._conn = pool, origin, conn
        self._framing, self._keep, self._read_s, self._request = framing, keep, read_s, request
        self._done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._chunks():
                yield chunk
        except TimeoutError:
            raise httpx.ReadTimeout("timed out reading the response", request=self._request) from None
        except (asyncio.IncompleteReadError, OSError, ValueError):
            raise httpx.ReadError(
                "connection lost while reading the response", request=self._request
            ) from None
        self._done = True
        if self._keep:
            self._pool.checkin(self._origin, self._conn)
        else:
            self._conn.close()

    async def _read(self, call: Any) -> bytes:
        if self._read_s is None:
            data: bytes = await call
            return data
        async with asyncio.timeout(self._read_s):
            data = await call
        return data

    async def _chunks(self) -> AsyncIterator[bytes]:
        reader = self._conn.reader
        if self._framing is None:
            while True:
                size = int((await self._read(reader.readuntil(b"\r\n"))).split(b";")[0], 16)
                if size == 0:
                    while await self._read(reader.readuntil(b"\r\n")) != b"\r\n":
                        pass  # trailers
                    return
                data = await self._read(reader.readexactly(size + 2))
                yield data[:-2]
        elif self._framing >= 0:
            left = self._framing
            while left > 0:
                data = await self._read(reader.read(min(left, _READ_SIZE)))
                if not data:
                    raise asyncio.IncompleteReadError(b"", left)
                left -= len(data)
                yield data
        else:
            while data := await self._read(reader.read(_READ_SIZE)):
                yield data

    async def aclose(self) -> None:
        if not self._done:
            # Closed before its end: the rest of the body is still on the wire, so no reuse.
            self._done = True
            with contextlib.suppress(Exception):
                self._conn.close()
