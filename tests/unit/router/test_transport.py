"""The router's keep-alive transport against a scripted HTTP/1.1 server on a loopback socket (port 0)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from agentkv.server.router._hops import is_connect_failure
from agentkv.server.router._transport import PooledTransport

Answer = Callable[[bytes], Awaitable[bytes | None]]  # request head + body -> raw answer (None: hang)


class Server:
    """Answers each request on a connection with `answer(request)`; counts connections."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        with contextlib.suppress(Exception):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                raw = await self.answer(request)
                if raw is None:
                    await asyncio.sleep(3600)
                writer.write(raw)
                await writer.drain()
                if b"connection: close" in raw.lower():
                    break
        writer.close()


@contextlib.asynccontextmanager
async def serving(answer: Answer) -> AsyncIterator[Server]:
    server = Server(answer)
    listener = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    server.port = listener.sockets[0].getsockname()[1]
    try:
        yield server
    finally:
        for writer in server.writers:
            writer.close()
        listener.close()


def fixed(raw: bytes) -> Answer:
    async def answer(_request: bytes) -> bytes:
        return raw

    return answer


JSON_OK = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok": "y"}'
CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"7\r\ndata: 1\r\n9;ext=1\r\n\n\ndata: 2\r\n0\r\nx-trailer: t\r\n\r\n"
)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=PooledTransport()) as c:
        yield c


async def test_post_json_reuses_one_connection(client: httpx.AsyncClient) -> None:
    async with serving(fixed(JSON_OK)) as server:
        url = f"http://127.0.0.1:{server.port}/v1/x?a=1"
        for _ in range(3):
            r = await client.post(url, json={"messages": ["hi"]}, headers={"x-request-id": "r1"})
            assert r.status_code == 200 and r.json() == {"ok": "y"}
    assert server.connections == 1
    head = server.requests[0].split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"post /v1/x?a=1 http/1.1\r\n")
    body = b'{"messages":["hi"]}'
    assert b"x-request-id: r1" in head and f"content-length: {len(body)}".encode() in head
    assert server.requests[0].endswith(b"\r\n\r\n" + body)


async def test_chunked_stream_arrives_chunk_by_chunk_then_the_connection_is_reused(
    client: httpx.AsyncClient,
) -> None:
    async with serving(fixed(CHUNKED)) as server:
        url = f"http://127.0.0.1:{server.port}/s"
        async with client.stream("POST", url, content=b"{}") as r:
            parts = [part async for part in r.aiter_raw()]
        assert parts == [b"data: 1", b"\n\ndata: 2"]
        assert (await client.get(url)).content == b"data: 1\n\ndata: 2"
    assert server.connections == 1


async def test_connection_close_and_body_to_eof_are_not_reused(client: httpx.AsyncClient) -> None:
    raw = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end"
    async with serving(fixed(raw)) as server:
        for _ in range(2):
            assert (await client.get(f"http://127.0.0.1:{server.port}/")).content == b"until the end"
    assert server.connections == 2


async def test_a_body_closed_early_is_not_reused(client: httpx.AsyncClient) -> None:
    async with serving(fixed(CHUNKED)) as server:
        url = f"http://127.0.0.1:{server.port}/s"
        async with client.stream("GET", url) as r:
            await r.aiter_raw().__anext__()  # leave the rest unread
        assert (await client.get(url)).status_code == 200
    assert server.connections == 2


async def test_an_idle_connection_the_engine_closed_is_replaced(client: httpx.AsyncClient) -> None:
    async with serving(fixed(JSON_OK)) as server:
        url = f"http://127.0.0.1:{server.port}/"
        assert (await client.get(url)).status_code == 200
        server.writers[0].close()  # the engine's keep-alive timeout
        await asyncio.sleep(0.05)
        assert (await client.post(url, content=b"x")).status_code == 200
    assert server.connections == 2 and len(server.requests) == 2


async def test_refused_connection_is_a_connect_failure(client: httpx.AsyncClient) -> None:
    async with serving(fixed(JSON_OK)) as server:
        port = server.port
    with pytest.raises(httpx.ConnectError) as info:
        await client.get(f"http://127.0.0.1:{port}/")
    assert is_connect_failure(info.value)  # so the router fails over to another backend


async def test_read_timeout_and_truncated_answers_are_httpx_errors(client: httpx.AsyncClient) -> None:
    async def hang(_request: bytes) -> None:
        return None

    async with serving(hang) as server:
        with pytest.raises(httpx.ReadTimeout):
            await client.get(f"http://127.0.0.1:{server.port}/", timeout=httpx.Timeout(5, read=0.05))
    truncated = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\nconnection: close\r\n\r\nshort"
    async with serving(fixed(truncated)) as server:
        with pytest.raises(httpx.ReadError):
            await client.get(f"http://127.0.0.1:{server.port}/")
    async with serving(fixed(b"garbage\r\n\r\n")) as server:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(f"http://127.0.0.1:{server.port}/")
