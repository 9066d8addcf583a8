"""Router configuration: flags, env (`AGENTKV_*`) and TOML/JSON files all land in one `RouterSettings`."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from agentkv._constants import (
    DEFAULT_LEASE_S,
    DEFAULT_MAX_LEASE_S,
    DEFAULT_ROUTER_PORT,
    DEFAULT_SESSION_HEADER,
    LEASE_PORT_OFFSET,
    VLLM_FIXED_TTL_S,
)
from agentkv._exceptions import ConfigError

from ._backend import Backend

__all__ = ["DiscoveryMode", "PathPolicy", "RouterSettings", "Timeouts", "control_url", "split_host_port"]

PathPolicy = Literal["auto", "always-pd", "always-local"]
# Where the engine lists come from: the settings (`prefill`, `decode`), a headless Service's DNS records
# (`prefill_dns`, `decode_dns`) or a Service's EndpointSlices through the Kubernetes API (`*_service`).
DiscoveryMode = Literal["static", "dns", "kubernetes"]
_DNS_FIELDS = ("prefill_dns", "decode_dns")
_KUBERNETES_FIELDS = ("prefill_service", "decode_service", "discovery_namespace")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class Timeouts(BaseModel):
    """Deadlines per hop. `decode_idle_s` is per read of a stream, not per response."""

    model_config = {"frozen": True, "extra": "forbid"}

    connect_s: float = Field(default=5.0, gt=0)
    prefill_s: float = Field(default=120.0, gt=0)
    decode_first_byte_s: float = Field(default=120.0, gt=0)
    decode_idle_s: float = Field(default=60.0, gt=0)
    # A non-streaming decode answers with one body at the end, so it needs a total deadline.
    decode_total_s: float = Field(default=600.0, gt=0)
    control_s: float = Field(default=2.0, gt=0)


def _split_csv(value: Any) -> Any:
    # Env vars and CLI flags give "a,b"; files and Python give lists. Accept both.
    if isinstance(value, str):
        value = value.strip()
        if value.startswith("["):
            return json.loads(value)
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def split_host_port(value: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` for an IPv6 literal) as (host, port); ValueError if it is not one."""
    parts = urlsplit(f"//{value.strip()}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or port == 0 or parts.path or parts.username is not None:
        raise ValueError(f"invalid DNS name {value!r}: expected host:port")
    return parts.hostname, port


def _normalise_url(url: str, what: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"invalid {what} URL {url!r}: expected http://host:port")
    return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


class RouterSettings(BaseSettings):
    """Everything the router needs. Build from keyword arguments, env `AGENTKV_*`, or `from_file`."""

    model_config = SettingsConfigDict(
        env_prefix="AGENTKV_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    host: str = "127.0.0.1"
    port: int = Field(default=DEFAULT_ROUTER_PORT, ge=0, le=65535)
    prefill: Annotated[list[str], NoDecode] = Field(default_factory=list)
    decode: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Aligned with `decode`; empty entries mean "HTTP port + LEASE_PORT_OFFSET on the same host".
    decode_control: Annotated[list[str], NoDecode] = Field(default_factory=list)
    session_header: str = DEFAULT_SESSION_HEADER
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    api_keys_file: Path | None = None
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    max_conversations: int = Field(default=100_000, gt=0)
    decode_load_cap: int = Field(default=64, gt=0)
    reuse: bool = True
    # Router-side guard: reuse only when the new prompt extends what decode holds exactly (on token ids with
    # `tokens`, else on messages). Our connector checks tokens on prefill as well; turning this off leaves
    # that check alone in charge.
    prefix_guard: bool = True
    # Tokens between router and engines: each turn is rendered once by prefill's own renderer, prefill gets
    # the ids, decode gets them forwarded, reuse is checked on them. Engines without vLLM's render API
    # (`--enable-scale-out` on 0.32+) are served text as before.
    tokens: bool = True
    # On the token path, a chat decode hop carries only the conversation's last message beside the packed ids,
    # where decode's plugin says it takes that (`agentkv._wire.cut_messages`); off sends every message.
    cut_messages: bool = True
    # On the token path, decode starts from the token prefill sampled instead of computing the prompt's last
    # token again, where its plugin can put that token back at the answer's front
    # (`agentkv.server.engine.plugin._prefill_token`): a P/D answer then computes what one server computes.
    prefill_token: bool = True
    # Off (the default): vLLM's own prefix-cache semantics. Only KV of exactly the same token prefix is reused
    # (token ids checked here, block fingerprints on prefill), including KV decode computed itself: decode
    # keeps its prefix cache (prefill sends only what it lacks), offers its answer's KV, and short suffixes
    # may run decode-local. Answers equal a recompute up to rounding, as with vLLM's prefix cache.
    # On: every answer equals a recompute bit for bit. Only KV a prefill computed is reused: each decode hop
    # gets a fresh `cache_salt` (decode loads the whole prompt from prefill), decode offers the prompt alone,
    # no decode-local turns (docs/architecture.md, "Exactness"; what it costs: docs/findings.md).
    exact: bool = False
    path_policy: PathPolicy = "auto"
    decode_local_max_tokens: int = Field(default=512, ge=0)
    # Conditional disaggregation (as in Dynamo): once the least busy prefill has this many P hops in flight
    # (prompts being computed; renders do not count), turns are prefilled on their decode whatever their
    # length, cold ones included. 0: never. Not in exact mode. Counts every replica's hops where the store
    # is shared (Redis), this router's own otherwise.
    prefill_queue_cap: int = Field(default=4, ge=0)
    lease_s: float = Field(default=DEFAULT_LEASE_S, gt=0)
    max_lease_s: float = Field(default=DEFAULT_MAX_LEASE_S, gt=0)
    vllm_fixed_ttl_s: float = Field(default=VLLM_FIXED_TTL_S, gt=0)
    # Prefill declines a pull within 5 s of decode's expiry; stay clear of that window.
    expiry_margin_s: float = Field(default=6.0, ge=0)
    conversation_lock_timeout_s: float = Field(default=30.0, ge=0)
    # Demotion to decode's host KV tier (vLLM's OffloadingConnector beside ours, `kv_offload_bytes`), where
    # that tier holds a conversation's blocks: a heartbeat saying a tool call started (the SDK sends one), or
    # one that comes `demote_idle_s` after the conversation's last turn (0: never), ends decode's lease early,
    # so its blocks stay in decode's prefix cache only until decode needs the room, and the next turn runs
    # decode-local over them (or over their host copies). Not in exact mode, nor with `always-pd`: both
    # exclude decode-local turns, and a demoted conversation cannot be pulled. docs/tiers.md.
    demote_on_tool_call: bool = True
    demote_idle_s: float = Field(default=0.0, ge=0)
    # What the path choice assumes a restore from decode's host tier moves, GB/s: decode's KV bytes per token
    # (its retention service says) times the tokens restored, over this. Measured on an H100 (PCIe Gen5 x16,
    # vLLM's offloading worker): 52 GB/s (bench/results/tiers_h100).
    host_restore_gbps: float = Field(default=50.0, gt=0)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    health_interval_s: float = Field(default=5.0, ge=0)
    store_url: str | None = None
    # Engines that come and go (docs/deployment.md, "Discovery"): "static" serves `prefill` and `decode` as
    # given; "dns" re-resolves `prefill_dns` / `decode_dns` ("host:port" of headless Services) every
    # `discovery_interval_s`; "kubernetes" lists and watches the EndpointSlices of `prefill_service` /
    # `decode_service` in `discovery_namespace` (default: the router's own). A discovered decode's retention
    # service is at its port + LEASE_PORT_OFFSET, as for a static decode without `decode_control`.
    discovery: DiscoveryMode = "static"
    prefill_dns: str | None = None
    decode_dns: str | None = None
    prefill_service: str | None = None
    decode_service: str | None = None
    discovery_namespace: str | None = None
    discovery_interval_s: float = Field(default=5.0, gt=0)
    # Decode's retention-service secret (env AGENTKV_SERVICE_TOKEN, the name the engines read): sent on every
    # lease call. Not a CLI flag, so it never shows in `ps`.
    service_token: SecretStr | None = None
    log_level: str = "info"

    @field_validator("prefill", "decode", "decode_control", "api_keys", mode="before")
    @classmethod
    def _csv(cls, value: Any) -> Any:
        return _split_csv(value)

    @field_validator("session_header")
    @classmethod
    def _header(cls, value: str) -> str:
        if not value or not all(c.isalnum() or c == "-" for c in value):
            raise ValueError(f"invalid session header name {value!r}")
        return value.lower()

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        if value.lower() not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError(f"invalid log level {value!r}")
        return value.lower()

    @model_validator(mode="after")
    def _check(self) -> RouterSettings:
        self._check_discovery()
        if self.decode_control and len(self.decode_control) != len(self.decode):
            raise ValueError("--decode-control must have one entry per --decode URL")
        if self.exact and self.path_policy == "always-local":
            raise ValueError("path_policy always-local reuses decode-computed KV: it needs exact=false")
        if self.lease_s > self.max_lease_s:
            raise ValueError("lease_s must not exceed max_lease_s")
        for url in (*self.prefill, *self.decode, *filter(None, self.decode_control)):
            _normalise_url(url, "backend")
        if self.store_url is not None and not self.store_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("store_url must be a redis:// URL (or unset for the in-memory store)")
        if self.api_keys_file is not None and not self.api_keys_file.is_file():
            raise ValueError(f"api_keys_file {str(self.api_keys_file)!r} does not exist")
        return self

    def _check_discovery(self) -> None:
        mode = self.discovery
        for name in (*_DNS_FIELDS, *_KUBERNETES_FIELDS):
            wanted = "dns" if name in _DNS_FIELDS else "kubernetes"
            if getattr(self, name) and mode != wanted:
                raise ValueError(f"{name} is read only with discovery={wanted} (discovery is {mode})")
        if mode == "static":
            if not self.prefill:
                raise ValueError("at least one --prefill URL is required")
            if not self.decode:
                raise ValueError("at least one --decode URL is required")
            return
        for name in ("prefill", "decode", "decode_control"):
            if getattr(self, name):
                raise ValueError(f"discovery={mode} finds the engines itself: leave {name} empty")
        required = _DNS_FIELDS if mode == "dns" else _KUBERNETES_FIELDS[:2]
        for name in required:
            if not getattr(self, name):
                raise ValueError(f"discovery={mode} needs {name}")
        prefill, decode = (getattr(self, name) for name in required)
        if prefill == decode:
            raise ValueError(f"{required[0]} and {required[1]} name the same engines: one serves one role")
        if mode == "dns":
            for name in _DNS_FIELDS:
                split_host_port(getattr(self, name))
            return
        for name in _KUBERNETES_FIELDS:
            value = getattr(self, name)
            # Kubernetes' own rule for Service and namespace names (a DNS label); it also keeps the label
            # selector the names go into well formed.
            if value and not _DNS_LABEL.fullmatch(value):
                raise ValueError(f"invalid {name} {value!r}: expected a DNS label (a-z, 0-9, '-')")

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> RouterSettings:
        """Load a TOML or JSON file (optionally under a `[router]` table); keyword overrides win."""
        path = Path(path)
        try:
            raw = path.read_bytes()
            data: Any = tomllib.loads(raw.decode()) if path.suffix != ".json" else json.loads(raw)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read router settings from {str(path)!r}: {exc}") from exc
        if isinstance(data, dict) and isinstance(data.get("router"), dict):
            data = data["router"]
        if not isinstance(data, dict):
            raise ConfigError(f"{str(path)!r} must hold a table/object of router settings")
        return cls.build(**{**data, **overrides})

    @classmethod
    def build(cls, **values: Any) -> RouterSettings:
        """Like the constructor, but raises ConfigError with readable messages."""
        try:
            return cls(**values)
        except ValidationError as exc:
            lines = []
            for err in exc.errors():
                loc = ".".join(str(p) for p in err["loc"])
                lines.append(f"{loc}: {err['msg']}" if loc else str(err["msg"]).removeprefix("Value error, "))
            raise ConfigError("invalid router settings: " + "; ".join(lines)) from None

    def all_api_keys(self) -> frozenset[str]:
        keys = set(self.api_keys)
        if self.api_keys_file is not None:
            for line in self.api_keys_file.read_text().splitlines():
                if line.strip() and not line.lstrip().startswith("#"):
                    keys.add(line.strip())
        return frozenset(keys)

    def backends(self) -> tuple[list[Backend], list[Backend]]:
        """The prefill and decode backends, named p0.. / d0.. in flag order."""
        prefill = [
            Backend(name=f"p{i}", role="prefill", url=_normalise_url(u, "prefill"))
            for i, u in enumerate(self.prefill)
        ]
        decode = []
        for i, u in enumerate(self.decode):
            url = _normalise_url(u, "decode")
            control = self.decode_control[i] if self.decode_control else ""
            decode.append(
                Backend(
                    name=f"d{i}",
                    role="decode",
                    url=url,
                    control_url=_normalise_url(control, "decode control") if control else control_url(url),
                )
            )
        return prefill, decode


def control_url(url: str) -> str:
    """Decode's retention service where none is configured: its HTTP port + LEASE_PORT_OFFSET, same host."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port + LEASE_PORT_OFFSET}"
