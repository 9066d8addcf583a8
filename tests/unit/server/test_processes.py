"""The package's one router launcher and one free-port helper, and the CLI as a leaf of the import graph."""

import ast
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

import agentkv
from agentkv._exceptions import EngineStartError, PortInUseError
from agentkv.server.launch._launcher import _keep_pinned, free_port, port_in_use, start_router

NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing answers


def test_free_port_from_a_start_skips_ports_whose_offsets_are_taken() -> None:
    port = free_port(24000, offsets=[7])  # port + 7 free too, for this test to take it
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


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable cores"
)
def test_keep_pinned_moves_a_group_main_thread_pinned_elsewhere_back_to_its_core() -> None:
    """What vLLM's CPU NixlConnector does to a stock engine (its worker pinned to the last core), undone."""
    first, last = min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))
    pinned = (
        f"import os, time; os.sched_setaffinity(0, {{{last}}}); print('pinned', flush=True); time.sleep(60)"
    )
    free = "import time; time.sleep(60)"  # floats over all cores: not ours to place
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
        for code in (pinned, free)
    ]
    try:
        assert procs[0].stdout is not None and procs[0].stdout.readline() == b"pinned\n"
        everything = os.sched_getaffinity(procs[1].pid)
        _keep_pinned(procs[0].pid, first)
        _keep_pinned(procs[1].pid, first)
        assert os.sched_getaffinity(procs[0].pid) == {first}
        assert os.sched_getaffinity(procs[1].pid) == everything
    finally:
        for p in procs:
            p.kill()
            p.wait()
