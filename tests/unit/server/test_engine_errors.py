"""The launcher's errors and process handling, with vLLM replaced by tiny Python processes.

Only two things are faked: the `vllm` lookup in `Engine.check` (so these tests run where vLLM is and is not
installed) and `build_command`'s argv (the environment it builds is kept and checked in the child).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agentkv._exceptions import EngineError, EngineNotInstalledError, EngineStartError
from agentkv.server.launch import _launcher
from agentkv.server.launch._launcher import Engine, EngineSpec, free_port, kill_group

_real_find_spec = importlib.util.find_spec


def pretend_vllm(monkeypatch: pytest.MonkeyPatch, *, installed: bool) -> list[str]:
    """Answer `find_spec("vllm")` as if vLLM were (not) installed; every other lookup is real."""
    asked: list[str] = []

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "vllm":
            asked.append(name)
            return object() if installed else None
        return _real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(_launcher.importlib.util, "find_spec", find_spec)
    return asked


def spec_for(tmp_path: Path, **kw: Any) -> EngineSpec:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    return EngineSpec(
        role="decode",
        model=str(model),
        port=free_port(),
        side_channel_port=free_port(),
        log_path=tmp_path / "logs" / "decode.log",
        **kw,
    )


def run_instead(monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    """`Engine.start` runs `python -c script` with the environment `build_command` made for the spec."""
    real = _launcher.build_command

    def build_command(spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
        _argv, env = real(spec)
        return [sys.executable, "-c", script], env

    monkeypatch.setattr(_launcher, "build_command", build_command)


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie waiting for its parent."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_for(predicate: Any, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


@pytest.mark.parametrize(("device", "extra"), [("cpu", "agentkv[cpu]"), ("gpu", "agentkv[gpu]")])
def test_missing_vllm_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, device: str, extra: str
) -> None:
    asked = pretend_vllm(monkeypatch, installed=False)
    popen: list[Any] = []
    monkeypatch.setattr(_launcher.subprocess, "Popen", lambda *a, **k: popen.append(a))
    engine = Engine(spec=spec_for(tmp_path, device=device), name="decode0")
    with pytest.raises(EngineNotInstalledError) as info:
        engine.start()
    assert asked == ["vllm"]
    assert f"pip install '{extra}'" in str(info.value) and "vLLM is not installed" in str(info.value)
    assert isinstance(info.value, EngineError)
    assert popen == [] and engine.proc is None  # failed before starting anything


def test_a_server_that_dies_during_start_raises_with_its_log_tail(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pretend_vllm(monkeypatch, installed=True)
    # The child sees the environment build_command made: prove it by echoing a value from it.
    run_instead(
        monkeypatch,
        "import os, sys\n"
        "for i in range(60): print(f'noise {i}')\n"
        "print('FATAL: no kv cache on port', os.environ['VLLM_NIXL_SIDE_CHANNEL_PORT'])\n"
        "sys.exit(1)\n",
    )
    spec = spec_for(tmp_path)
    engine = Engine(spec=spec, name="decode0")
    engine.start()
    try:
        with pytest.raises(EngineStartError) as info:
            engine.wait_healthy(timeout_s=300)  # it dies within a second; a bound for starved hosts
    finally:
        engine.stop(timeout_s=1)
    err = info.value
    assert str(err).startswith("decode0 died during start")
    last = f"FATAL: no kv cache on port {spec.side_channel_port}"
    assert err.log_tail.splitlines()[-1] == last
    lines = err.log_tail.splitlines()
    assert len(lines) == 40 and lines[0] == "noise 21"  # the last 40 lines, not the whole log
    assert "--- log tail ---" in str(err) and last in str(err)
    assert engine.proc is not None and engine.proc.returncode == 1


def test_a_server_that_never_gets_healthy_times_out_and_is_stopped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pretend_vllm(monkeypatch, installed=True)
    run_instead(monkeypatch, "import time\nprint('loading weights', flush=True)\ntime.sleep(60)\n")
    # wait_healthy stops with stop()'s default 20 s timeout, which a child that ignores SIGTERM would wait
    # out; shorten it, and record which group was killed.
    real_kill_group = _launcher.kill_group
    killed: list[int] = []

    def short_kill_group(pid: int, *, timeout_s: float = 20) -> None:
        killed.append(pid)
        real_kill_group(pid, timeout_s=min(timeout_s, 1))

    monkeypatch.setattr(_launcher, "kill_group", short_kill_group)
    engine = Engine(spec=spec_for(tmp_path), name="prefill0")
    engine.start()
    try:
        ticks: list[float] = []
        with pytest.raises(EngineStartError, match=r"^prefill0 not healthy after 1s") as info:
            engine.wait_healthy(timeout_s=1, on_tick=ticks.append)
        assert "loading weights" in info.value.log_tail
        assert ticks and all(t >= 0 for t in ticks)
        assert killed == [engine.pid]
        assert engine.proc is not None and engine.proc.returncode == -signal.SIGTERM  # stopped, not left
    finally:
        if engine.proc is not None and engine.proc.poll() is None:
            real_kill_group(engine.proc.pid, timeout_s=0)


def test_stop_kills_the_whole_process_group(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """vLLM's API server forks an engine core and workers; stop must take them all, including one that
    ignores SIGTERM (it gets SIGKILL after the timeout)."""
    pretend_vllm(monkeypatch, installed=True)
    pids = tmp_path / "pids"
    grandchild = (
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    run_instead(
        monkeypatch,
        "import os, subprocess, sys, time\n"
        f"g = subprocess.Popen([sys.executable, '-c', {grandchild!r}], stdout=subprocess.PIPE)\n"
        "g.stdout.readline()\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{g.pid}}')\n"
        "time.sleep(60)\n",
    )
    engine = Engine(spec=spec_for(tmp_path), name="decode0")
    engine.start()
    grand = None
    try:
        assert wait_for(pids.exists, timeout_s=60), "the fake server did not start its child"
        child, grand = (int(p) for p in pids.read_text().split())
        assert child == engine.pid
        assert os.getpgid(grand) == engine.pid  # its own process group, the child's children in it
        assert os.getpgid(engine.pid) != os.getpgid(0)  # not ours: stopping it cannot hit the test runner
        engine.stop(timeout_s=1)
        assert engine.proc is not None and engine.proc.returncode == -signal.SIGTERM
        assert wait_for(lambda: gone(grand)), "the grandchild survived stop()"
    finally:  # leave nothing behind when an assertion failed
        if engine.proc is not None and engine.proc.poll() is None:
            kill_group(engine.proc.pid, timeout_s=0)
        if grand is not None and not gone(grand):
            os.kill(grand, signal.SIGKILL)


def test_kill_group_of_a_process_already_gone_returns_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait(timeout=60)
    waits: list[float] = []
    monkeypatch.setattr(_launcher.time, "sleep", waits.append)
    kill_group(proc.pid, timeout_s=10)  # no such group any more: no error, no waiting
    assert waits == []


def test_stop_returns_soon_after_the_server_exits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A server that exits on SIGTERM is not waited for until the timeout (and then killed): its exited,
    unreaped process must not count as running."""
    pretend_vllm(monkeypatch, installed=True)
    run_instead(monkeypatch, "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    engine = Engine(spec=spec_for(tmp_path), name="decode0")
    engine.start()
    assert wait_for(lambda: "up" in (tmp_path / "logs" / "decode.log").read_text(), timeout_s=60)
    sent: list[int] = []
    real_killpg = os.killpg

    def killpg(pgid: int, sig: int) -> None:
        if sig:
            sent.append(sig)
        real_killpg(pgid, sig)

    monkeypatch.setattr(_launcher.os, "killpg", killpg)
    engine.stop(timeout_s=120)  # only a stop that waited out the timeout would send SIGKILL
    assert sent == [signal.SIGTERM]
    assert engine.proc is not None and engine.proc.returncode == -signal.SIGTERM
