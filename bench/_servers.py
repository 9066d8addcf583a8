"""The servers benchmarks compare: agentkv's router and the upstream example proxy, as subprocesses."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from agentkv.server.launch._launcher import router_command
from bench._procs import ServerProcess
from bench._upstream import proxy_command

__all__ = ["agentkv_available", "proxy_server", "router_server"]


def router_server(
    *, port: int, prefill_url: str, decode_url: str, log_dir: Path, **settings: Any
) -> ServerProcess:
    """``agentkv router`` (the package's command line) as a bench subprocess, whose CPU and memory a bench can
    sample; ``settings`` reach it as AGENTKV_* environment variables (pydantic-settings)."""
    env = {
        "AGENTKV_LOG_LEVEL": "warning",
        "AGENTKV_HEALTH_INTERVAL_S": "1.0",
        **{f"AGENTKV_{key.upper()}": str(value) for key, value in settings.items()},
    }
    command = router_command(prefill=[prefill_url], decode=[decode_url], host="127.0.0.1", port=port)
    return ServerProcess(
        name="agentkv-router",
        command=command,
        health_url=f"http://127.0.0.1:{port}/health",
        log_dir=log_dir,
        env=env,
    )


def proxy_server(
    *, script: Path, port: int, prefill_port: int, decode_port: int, log_dir: Path, quiet: bool
) -> ServerProcess:
    command = proxy_command(script, port=port, prefill_port=prefill_port, decode_port=decode_port)
    if quiet:
        # The example logs every request at INFO (and uvicorn's access log is on); silencing INFO measures
        # the proxy's logic rather than its logging, which favours the proxy.
        code = (
            "import logging, runpy, sys; logging.disable(logging.INFO); "
            f"sys.argv = {command[1:]!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
        )
        command = [sys.executable, "-c", code]
    return ServerProcess(
        name="upstream-proxy", command=command, health_url=f"http://127.0.0.1:{port}/health", log_dir=log_dir
    )


def agentkv_available() -> str | None:
    """None when the router can be imported, else why not (it is built in parallel with this bench)."""
    try:
        from agentkv.server.router import RouterSettings, run_router  # noqa: F401
    except Exception as exc:  # any import failure means "skip this target", reported in the results
        return f"{type(exc).__name__}: {exc}"
    return None
