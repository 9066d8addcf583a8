"""Server subprocesses for benchmarks: start-and-wait-healthy, stop, CPU/RSS sampling.

Every server a benchmark starts is its own process (so the load generator never shares a core's event
loop with what it measures) and is stopped by its own pid, never by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from agentkv._exceptions import EngineStartError

__all__ = [
    "ProcessSampler",
    "ServerProcess",
    "exit_on_sigterm",
    "parse_cpus",
    "read_process",
    "running",
    "stub_command",
]


def parse_cpus(text: str | None) -> frozenset[int] | None:
    """``"0,1"`` or ``"2-5"`` or ``"0,4-7"`` -> a set of core ids; empty or None -> None (no pinning)."""
    if not text:
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so ``finally`` blocks stop the servers a benchmark started."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def stub_command(role: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "bench._stub", "--role", role, "--port", str(port), *extra]


@dataclass(kw_only=True)
class ServerProcess:
    """One server subprocess with its log file; a context manager that always stops what it started."""

    name: str
    command: Sequence[str]
    health_url: str
    log_dir: Path
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    cpus: frozenset[int] | None = None  # pin the server to these cores (taskset), None = anywhere
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError(f"{self.name} is not running")
        return self._process.pid

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self, *, timeout_s: float = 60.0) -> ServerProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                list(self.command),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                cwd=self.cwd,
                start_new_session=True,  # a Ctrl-C on the bench must not race our own shutdown
            )
        if self.cpus:
            os.sched_setaffinity(self._process.pid, self.cpus)
        self._wait_healthy(timeout_s)
        return self

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise EngineStartError(
                    f"{self.name} exited with {self._process.returncode}", log_tail=self.tail()
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.health_url, timeout=1.0).status_code == 200:
                    return
            time.sleep(0.1)
        self.stop()
        raise EngineStartError(f"{self.name} not healthy after {timeout_s:.0f}s", log_tail=self.tail())

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, *, timeout_s: float = 10.0) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=timeout_s)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def read_process(pid: int) -> tuple[float, int]:
    """(cpu seconds user+system, RSS bytes) of a process, via psutil if present else /proc."""
    try:
        import psutil
    except ImportError:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        cpu = (int(fields[11]) + int(fields[12])) / ticks
        with open(f"/proc/{pid}/statm") as statm:
            rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return cpu, rss
    process = psutil.Process(pid)
    times = process.cpu_times()
    return times.user + times.system, process.memory_info().rss


class ProcessSampler:
    """Samples a process's CPU use and RSS in a background thread: ``with ProcessSampler(pid) as s: ...``."""

    def __init__(self, *, pid: int, interval_s: float = 0.5) -> None:
        self.pid = pid
        self.interval_s = interval_s
        # (seconds since start, cpu fraction of one core over the last interval, rss bytes)
        self.samples: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._cpu_start = 0.0
        self._cpu_end = 0.0
        self._t0 = 0.0
        self._t1 = 0.0

    def _run(self) -> None:
        last_t, last_cpu = self._t0, self._cpu_start
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(OSError, ProcessLookupError):
                cpu, rss = read_process(self.pid)
                now = time.monotonic()
                self.samples.append((now - self._t0, (cpu - last_cpu) / max(1e-9, now - last_t), rss))
                last_t, last_cpu = now, cpu

    def __enter__(self) -> ProcessSampler:
        self._t0 = time.monotonic()
        self._cpu_start = read_process(self.pid)[0]
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self._t1 = time.monotonic()
        with contextlib.suppress(OSError, ProcessLookupError):
            self._cpu_end = read_process(self.pid)[0]

    @property
    def cpu_fraction(self) -> float:
        """Average cores used over the sampled window (1.0 = one core fully busy)."""
        return (self._cpu_end - self._cpu_start) / max(1e-9, self._t1 - self._t0)

    @property
    def peak_rss(self) -> int:
        return max((rss for _, _, rss in self.samples), default=0)


@contextlib.contextmanager
def running(
    servers: Sequence[ServerProcess], *, timeout_s: float = 60.0
) -> Iterator[Sequence[ServerProcess]]:
    """Start several servers (in order) and stop them all (in reverse), even when one fails to start."""
    started: list[ServerProcess] = []
    try:
        for server in servers:
            started.append(server.start(timeout_s=timeout_s))
        yield started
    finally:
        for server in reversed(started):
            server.stop()
