"""A local xPyD cluster (default 1P1D) plus the router, described by one ``ClusterConfig``.

``agentkv up`` starts it and writes a state file so ``agentkv down`` (another process) can stop it; tests and
the demo use ``Cluster`` as a context manager in-process. Ports: prefill i -> ``prefill_port + i``,
decode i -> ``decode_port + i``; NIXL side channels 5600+i / 5700+i (configurable); our connector's service at
HTTP port + 1000.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import TypeAdapter, ValidationError

from agentkv._constants import (
    DEFAULT_DECODE_PORT,
    DEFAULT_PREFILL_PORT,
    DEFAULT_ROUTER_PORT,
    LEASE_PORT_OFFSET,
)
from agentkv._exceptions import ConfigError
from agentkv.server.engine.plugin import (
    DEFAULT_PRIME_TOKENS,
    FORWARDED_IDS_MODES,
    TOKENIZER_CACHE_MODES,
    ForwardedIdsMode,
    TokenizerCacheMode,
)
from agentkv.server.launch._launcher import (
    Device,
    Engine,
    EngineSpec,
    RouterProcess,
    detect_device,
    kill_group,
    start_router,
)
from agentkv.server.launch._versions import check_versions, engine_version

if TYPE_CHECKING:
    from agentkv.server.launch._warmup import WarmUpReport

__all__ = ["Cluster", "ClusterConfig", "stop_from_state"]

DEFAULT_STATE = Path(".agentkv/cluster.json")


@dataclass(kw_only=True)
class ClusterConfig:
    model: str
    n_prefill: int = 1
    n_decode: int = 1
    host: str = "127.0.0.1"
    prefill_port: int = DEFAULT_PREFILL_PORT
    decode_port: int = DEFAULT_DECODE_PORT
    router_port: int | None = DEFAULT_ROUTER_PORT  # None: no router
    side_channel_port: int = 5600  # NIXL side channels: prefill i -> +i, decode i -> +100+i
    device: Device | None = None  # None: detect from the installed vLLM
    bidirectional: bool = True
    prefill_prefix_caching: bool = True
    decode_prefix_caching: bool = True
    agentkv_connector: bool = True
    lease_s: float = 30.0
    max_lease_s: float = 600.0
    decoder_kv_blocks_ttl: float = 480.0
    kv_recompute_threshold: int = 64
    prefix_check: bool = True
    cost_model: bool = True
    max_model_len: int = 8192
    block_size: int | None = None
    tool_call_parser: str | None = None
    log_dir: Path = Path(".agentkv/logs")
    router_env: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for every engine
    # CUDA_VISIBLE_DEVICES per engine, prefills first then decodes ("0", "1" or "0,1" for tensor parallel):
    # without it every engine sees every device and vLLM puts them all on the first.
    gpus: list[str] = field(default_factory=list)
    tokenizer_cache: TokenizerCacheMode = "on"  # agentkv/server/engine/plugin/_register.py
    detokenizer_prime_tokens: int = DEFAULT_PRIME_TOKENS  # the same plugin; 0: vLLM's whole-prompt priming
    forwarded_ids: ForwardedIdsMode = "always"  # the same plugin: decode runs the router's forwarded ids
    fast_json: bool = True  # the same plugin: request and answer JSON through msgspec in vLLM's API server
    prefill_token: bool = True  # the same plugin: decode starts from the token prefill sampled
    extra_args: list[str] = field(default_factory=list)
    # After extra_args, for one role only (vLLM takes a flag's last value): e.g. a decode that retains
    # conversations gets more of a shared GPU's KV memory than its prefill.
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    # Each decode's host KV tier (vLLM's OffloadingConnector beside agentkv's, `EngineSpec.kv_offload_bytes`);
    # 0: none. docs/tiers.md.
    decode_kv_offload_bytes: int = 0
    # That tier's evictions ordered by lease state (`EngineSpec.lease_aware_host_tier`).
    lease_aware_host_tier: bool = True
    # CPU engines run vLLM's worker in the engine-core process (`EngineSpec.in_process_worker`).
    in_process_worker: bool = True
    extra_kv_config: dict[str, Any] = field(default_factory=dict)
    # Two turns through every prefill/decode pair once the engines are up, so that no user's turn pays
    # NIXL's first handshakes (agentkv.server.launch._warmup). A pair that cannot serve them fails the start.
    warm_up: bool = True

    def __post_init__(self) -> None:
        if self.n_prefill < 1 or self.n_decode < 1:
            raise ConfigError("a cluster needs at least one prefill and one decode")
        if self.tokenizer_cache not in TOKENIZER_CACHE_MODES:
            raise ConfigError(f"tokenizer_cache must be on, off or verify, not {self.tokenizer_cache!r}")
        if self.forwarded_ids not in FORWARDED_IDS_MODES:
            raise ConfigError(f"forwarded_ids must be on, off or always, not {self.forwarded_ids!r}")
        if self.gpus and len(self.gpus) != self.n_prefill + self.n_decode:
            raise ConfigError(
                f"gpus needs one entry per engine, prefills first: {self.n_prefill + self.n_decode}, "
                f"not {len(self.gpus)}"
            )
        self.gpus = [str(g).strip() for g in self.gpus]
        if any(not g or not all(part.strip().isdigit() for part in g.split(",")) for g in self.gpus):
            raise ConfigError(f"gpus entries are device indices such as '0' or '0,1', not {self.gpus!r}")
        self.log_dir = Path(self.log_dir)

    @classmethod
    def from_file(
        cls, path: str | Path, *, default_model: Callable[[], dict[str, Any]] | None = None, **overrides: Any
    ) -> ClusterConfig:
        """Read a TOML/JSON config; ``overrides`` that are not None win. A file and overrides that name no
        model take ``default_model()`` (the CLI builds the tiny model lazily, only when it is needed)."""
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"cluster config {p} does not exist")
        try:
            data = tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot parse {p}: {exc}") from exc
        data = data.get("cluster", data)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown keys in {p}: {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        data = {**data, **{k: v for k, v in overrides.items() if v is not None}}
        if "model" not in data:
            if default_model is None:
                raise ConfigError(f"{p} names no model")
            data = {**default_model(), **data}
        return cls(**data)

    def shares_a_gpu(self) -> bool:
        """Whether a prefill and a decode run on the same GPU (no `gpus`, or one listed for both roles)."""
        if (self.device or detect_device()) != "gpu":
            return False
        if not self.gpus:
            return True

        def devices(entries: list[str]) -> set[str]:
            return {d.strip() for entry in entries for d in entry.split(",")}

        return bool(devices(self.gpus[: self.n_prefill]) & devices(self.gpus[self.n_prefill :]))

    def router_environment(self) -> dict[str, str]:
        """`router_env`, plus `always-local` where P and D share a GPU and the user chose no path policy:
        there the split buys no isolation, and prefilling every turn on decode matched an aggregated
        server's goodput where the default paths did not (bench/README.md, "Goodput at equal loads")."""
        env = dict(self.router_env)
        try:  # read as the router's settings read it
            exact = TypeAdapter(bool).validate_python(env.get("AGENTKV_EXACT", False))
        except ValidationError:
            exact = False  # the router refuses the value at its start
        if "AGENTKV_PATH_POLICY" not in env and not exact and self.shares_a_gpu():
            env["AGENTKV_PATH_POLICY"] = "always-local"
        return env

    def specs(self) -> list[tuple[str, EngineSpec]]:
        device = self.device or detect_device()
        ncpu = os.cpu_count() or 1
        # One core per engine only when there are enough. Pinned, 2P2D on 2 cores put P0 and D0 on one core,
        # where decode's busy stepping (awaiting P's KV) starved prefill's worker. Oversubscribed engines
        # float over all cores with one OpenMP thread each.
        pin = device == "cpu" and self.n_prefill + self.n_decode <= ncpu
        floats = device == "cpu" and not pin
        float_env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"} if floats else {}
        common: dict[str, Any] = dict(
            model=self.model,
            host=self.host,
            device=device,
            bidirectional=self.bidirectional,
            use_agentkv_connector=self.agentkv_connector,
            lease_s=self.lease_s,
            max_lease_s=self.max_lease_s,
            decoder_kv_blocks_ttl=self.decoder_kv_blocks_ttl,
            kv_recompute_threshold=self.kv_recompute_threshold,
            prefix_check=self.prefix_check,
            cost_model=self.cost_model,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            tool_call_parser=self.tool_call_parser,
            tokenizer_cache=self.tokenizer_cache,
            detokenizer_prime_tokens=self.detokenizer_prime_tokens,
            forwarded_ids=self.forwarded_ids,
            fast_json=self.fast_json,
            prefill_token=self.prefill_token,
            extra_kv_config=dict(self.extra_kv_config),
            in_process_worker=self.in_process_worker,
            env={**float_env, **self.env},
        )

        def placed(index: int) -> dict[str, Any]:
            if not self.gpus:
                return common
            return {**common, "env": {**common["env"], "CUDA_VISIBLE_DEVICES": self.gpus[index]}}

        out = []
        for i in range(self.n_prefill):
            port = self.prefill_port + i
            out.append(
                (
                    f"prefill{i}",
                    EngineSpec(
                        role="prefill",
                        port=port,
                        side_channel_port=self.side_channel_port + i,
                        service_port=port + LEASE_PORT_OFFSET if self.agentkv_connector else None,
                        prefix_caching=self.prefill_prefix_caching,
                        cpu_core=i % ncpu if pin else None,
                        extra_args=[*self.extra_args, *self.prefill_args],
                        log_path=self.log_dir / f"prefill{i}.log",
                        **placed(i),
                    ),
                )
            )
        for i in range(self.n_decode):
            port = self.decode_port + i
            out.append(
                (
                    f"decode{i}",
                    EngineSpec(
                        role="decode",
                        port=port,
                        side_channel_port=self.side_channel_port + 100 + i,
                        service_port=port + LEASE_PORT_OFFSET if self.agentkv_connector else None,
                        prefix_caching=self.decode_prefix_caching,
                        cpu_core=(self.n_prefill + i) % ncpu if pin else None,
                        extra_args=[*self.extra_args, *self.decode_args],
                        kv_offload_bytes=self.decode_kv_offload_bytes,
                        lease_aware_host_tier=self.lease_aware_host_tier,
                        log_path=self.log_dir / f"decode{i}.log",
                        **placed(self.n_prefill + i),
                    ),
                )
            )
        return out

    @property
    def router_url(self) -> str | None:
        return None if self.router_port is None else f"http://{self.host}:{self.router_port}"


class Cluster:
    """Start/stop engines (in parallel) and the router. Use as a context manager or via up()/down()."""

    def __init__(self, *, config: ClusterConfig) -> None:
        self.config = config
        self.engines = [Engine(spec=spec, name=name) for name, spec in config.specs()]
        self.router: RouterProcess | None = None
        self.start_seconds: dict[str, float] = {}
        self.warm_ups: list[WarmUpReport] = []

    @property
    def prefills(self) -> list[Engine]:
        return [e for e in self.engines if e.spec.role == "prefill"]

    @property
    def decodes(self) -> list[Engine]:
        return [e for e in self.engines if e.spec.role == "decode"]

    def up(self, *, on_tick: Callable[[str, float], None] | None = None, timeout_s: float = 900) -> None:
        for e in self.engines:
            e.check()  # all errors (ports, model, vllm) before anything starts
        try:
            for e in self.engines:
                e.start()

            def wait(e: Engine) -> float:
                return e.wait_healthy(
                    timeout_s=timeout_s, on_tick=None if on_tick is None else lambda t: on_tick(e.name, t)
                )

            with ThreadPoolExecutor(len(self.engines)) as pool:
                for e, secs in zip(self.engines, pool.map(wait, self.engines), strict=True):
                    self.start_seconds[e.name] = round(secs, 1)
            with httpx.Client(timeout=10) as http:
                check_versions({e.name: engine_version(http, e.spec.url) for e in self.engines})
            if self.config.warm_up:
                self.warm_up()
            if self.config.router_port is not None:
                self._start_router()
        except BaseException:
            self.down()
            raise

    def warm_up(self) -> list[WarmUpReport]:
        """Warm every prefill/decode pair (both NIXL directions); raises WarmUpError if one fails."""
        from agentkv.server.launch._warmup import warm_up_pair  # the router's wire format: imported when used

        self.warm_ups = [
            warm_up_pair(prefill_url=p.spec.url, decode_url=d.spec.url)
            for p in self.prefills
            for d in self.decodes
        ]
        return self.warm_ups

    def _start_router(self) -> None:
        cfg = self.config
        assert cfg.router_port is not None
        self.router = start_router(
            host=cfg.host,
            port=cfg.router_port,
            prefill=[e.spec.url for e in self.prefills],
            decode=[e.spec.url for e in self.decodes],
            log=cfg.log_dir / "router.log",
            env=cfg.router_environment(),
        )

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None

    def down(self) -> None:
        self.stop_router()
        for e in self.engines:
            e.stop()

    def __enter__(self) -> Cluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def describe(self) -> dict[str, Any]:
        return {
            "router": self.config.router_url,
            "router_pid": None if self.router is None else self.router.pid,
            "engines": [
                {
                    "name": e.name,
                    "role": e.spec.role,
                    "url": e.spec.url,
                    "service": e.spec.service_url,
                    "pid": e.pid,
                    "log": str(e.spec.log_path),
                    "ready_s": self.start_seconds.get(e.name),
                }
                for e in self.engines
            ],
            "warm_ups": [asdict(w) for w in self.warm_ups],
            "router_path_policy": self.config.router_environment().get("AGENTKV_PATH_POLICY", "auto"),
            "config": {k: _stateable(k, v) for k, v in asdict(self.config).items()},
        }

    def write_state(self, path: Path = DEFAULT_STATE) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.describe(), indent=2))


_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def _stateable(name: str, value: Any) -> Any:
    """A config value as the state file keeps it: paths as text; in the environments, the values of
    variables named like secrets (AGENTKV_API_KEYS, AGENTKV_SERVICE_TOKEN) masked, since the file outlives
    the process and is written with the user's default permissions."""
    if isinstance(value, Path):
        return str(value)
    if name in ("env", "router_env"):
        return {k: "***" if any(w in k.upper() for w in _SECRET_WORDS) else v for k, v in value.items()}
    return value


def stop_from_state(path: Path = DEFAULT_STATE) -> list[str]:
    """Stop what ``agentkv up`` started (by process group). Returns the names stopped."""
    if not path.exists():
        return []
    state = json.loads(path.read_text())
    stopped = []
    if state.get("router_pid"):
        kill_group(int(state["router_pid"]), timeout_s=10)
        stopped.append("router")
    for e in state.get("engines", []):
        if e.get("pid"):
            kill_group(int(e["pid"]))
            stopped.append(e["name"])
    path.unlink()
    return stopped
