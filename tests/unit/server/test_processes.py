"""The package's one router launcher and one free-port helper, and the CLI as a leaf of the import graph."""

import ast
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

import agentkv
from agentkv._exceptions import EngineStartError, PortInUseError
from agentkv.server._launcher import free_port, port_in_use, start_router

NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing answers


def test_free_port_from_a_start_skips_ports_whose_offsets_are_taken() -> None:
    port = free_port(24000)
    assert port >= 24000 and not port_in_use("127.0.0.1", port)
    with socket.socket() as held:
        held.bind(("127.0.0.1", port + 7))
        held.listen()
        assert free_port(port) == port  # only the port itself has to be free
        assert free_port(port, offsets=[7]) > port  # port + 7 is taken


def test_free_port_from_the_kernel_honours_offsets_too() -> None:
    ports = {free_port(offsets=[1000]) for _ in range(5)}
    for port in ports:
        assert port >= 20000 and not port_in_use("127.0.0.1", port + 1000)


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engine_url() -> Iterator[str]:
    """A stand-in engine that answers /health, so the router it fronts reports healthy."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_start_router_waits_until_healthy_and_stop_ends_it(tmp_path: Path, engine_url: str) -> None:
    router = start_router(port=free_port(), prefill=[engine_url], decode=[engine_url], log=tmp_path / "r.log")
    try:
        assert httpx.get(f"{router.url}/health", timeout=5).status_code == 200
    finally:
        router.stop()
    assert router.proc.poll() is not None


def test_start_router_reports_a_router_that_dies_with_its_log(tmp_path: Path) -> None:
    with pytest.raises(EngineStartError, match="died during start") as info:
        start_router(
            port=free_port(),
            prefill=[NOWHERE],
            decode=[NOWHERE],
            log=tmp_path / "r.log",
            args=["--path-policy", "sideways"],
        )
    assert "path_policy" in info.value.log_tail


def test_start_router_refuses_a_taken_port_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(PortInUseError, match=str(port)):
            start_router(port=port, prefill=[NOWHERE], decode=[NOWHERE], log=tmp_path / "r.log")
    assert not (tmp_path / "r.log").exists()


def test_nothing_in_the_package_imports_the_cli() -> None:
    """The CLI is a leaf: what it offers (the tiny model, the launcher) lives in modules it imports."""
    root = Path(agentkv.__file__).parent
    importers = []
    for path in root.rglob("*.py"):
        if path.name == "__main__.py" or path == root / "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n == "agentkv.cli" for n in names):
                importers.append(str(path.relative_to(root)))
    assert importers == []
