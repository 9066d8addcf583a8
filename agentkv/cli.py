"""The ``agentkv`` command line: build a tiny model, run engines, a cluster, the router, the demo."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from agentkv._exceptions import AgentKVError
from agentkv.server.engine.plugin import DEFAULT_PRIME_TOKENS, FORWARDED_IDS_MODES, TOKENIZER_CACHE_MODES
from agentkv.server.launch._model import DEFAULT_MODEL_DIR, TinyModelSpec, ensure_tiny_model, make_tiny_model

app = typer.Typer(
    help="KV-cache reuse for multi-turn agents on prefill/decode disaggregated vLLM.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
model_app = typer.Typer(help="Make models for tests and demos (no downloads needed).", no_args_is_help=True)
app.add_typer(model_app, name="model")
console = Console(stderr=True)


# A table printed to a pipe or a file keeps its full rows: rich would cut it at 80 columns (URLs as "http://12…").
_UNCUT_WIDTH = 1000


def _stdout() -> Console:
    """Where results go: stdout at the terminal's width, or uncut when stdout is a pipe or a file."""
    out = Console()
    return out if out.is_terminal else Console(width=_UNCUT_WIDTH)


def _fail(exc: AgentKVError, *, code: int = 1) -> NoReturn:
    # Escaped: a message quotes paths and values, and rich would read "[...]" in them as markup.
    console.print(f"[bold red]error:[/] {escape(str(exc))}")
    raise typer.Exit(code)


@model_app.command("tiny")
def model_tiny(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the model to.")],
    seed: Annotated[int, typer.Option(help="Same seed, same weights and tokenizer.")] = 0,
) -> None:
    """Build a tiny Qwen3-architecture model with random weights and a locally trained tokenizer."""
    try:
        with console.status("training tokenizer and writing weights ..."):
            path = make_tiny_model(out_dir, spec=TinyModelSpec(seed=seed))
    except AgentKVError as exc:
        _fail(exc)
    console.print(f"tiny model written to [bold]{path}[/]")


@app.command()
def serve(
    role: Annotated[str, typer.Argument(help="prefill | decode | single")],
    model: Annotated[Path, typer.Option(help="Model directory.")] = DEFAULT_MODEL_DIR,
    port: Annotated[int, typer.Option(help="HTTP port (default 8100 prefill / 8200 decode).")] = 0,
    host: str = "127.0.0.1",
    side_channel_port: Annotated[int, typer.Option(help="NIXL side channel port.")] = 0,
    bidirectional: Annotated[bool, typer.Option(help="Decode -> prefill KV transfer.")] = True,
    prefix_caching: bool = True,
    lease_s: Annotated[float, typer.Option(help="Decode-side lease on retained blocks.")] = 30.0,
    decoder_kv_blocks_ttl: float = 480.0,
    kv_recompute_threshold: int = 64,
    agentkv_connector: Annotated[
        bool, typer.Option(help="Use agentkv's connector (else stock vLLM).")
    ] = True,
    batch_invariant: Annotated[
        bool,
        typer.Option(
            help="vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1): on GPUs, what the router's "
            "--exact needs on every engine for answers bit-identical to a recompute."
        ),
    ] = False,
    tokenizer_cache: Annotated[
        str,
        typer.Option(
            help="on: vLLM's API server tokenizes only what a prompt adds to one it tokenized before; "
            "verify: also tokenizes the whole prompt and compares (for evaluations); off: vLLM as shipped."
        ),
    ] = "on",
    detokenizer_prime_tokens: Annotated[
        int,
        typer.Option(
            help="Prime vLLM's incremental detokenizer with the prompt's last N ids instead of the whole "
            "prompt (0: as vLLM does)."
        ),
    ] = DEFAULT_PRIME_TOKENS,
    forwarded_ids: Annotated[
        str,
        typer.Option(
            help="always: a decode runs the prompt ids the router forwards instead of rendering the messages "
            "again, through agentkv's plugin, which also reads them packed and takes a body cut to its last "
            "message; on: the same, but vLLM 0.32+'s own code takes them there (as a list, with every "
            "message); off: vLLM as shipped."
        ),
    ] = "always",
    fast_json: Annotated[
        bool,
        typer.Option(
            help="Parse request bodies and encode JSON answers in vLLM's API server with msgspec (the "
            "standard library where it would differ): token-path bodies and answers of 100k+ ids."
        ),
    ] = True,
    prefill_token: Annotated[
        bool,
        typer.Option(
            help="A decode given the token prefill sampled (the router forwards it) starts from it instead "
            "of computing the prompt's last token again, so a P/D answer computes what one server computes."
        ),
    ] = True,
    kv_offload_bytes: Annotated[
        int,
        typer.Option(
            help="Host memory for vLLM's KV offload tier beside NIXL (its OffloadingConnector): blocks "
            "the prefix cache evicts stay loadable from host memory on a later decode-local turn; 0: off "
            "(docs/tiers.md)."
        ),
    ] = 0,
    log: Annotated[Path | None, typer.Option(help="Log file (default .agentkv/logs/ROLE.log).")] = None,
) -> None:
    """Start one vLLM server as prefill or decode, wait until healthy, run until Ctrl-C."""
    from agentkv._constants import LEASE_PORT_OFFSET
    from agentkv.server.launch._launcher import Engine, EngineSpec, detect_device

    if role not in ("prefill", "decode", "single"):
        raise typer.BadParameter("role must be prefill, decode or single", param_hint="ROLE")
    if tokenizer_cache not in TOKENIZER_CACHE_MODES:
        raise typer.BadParameter("must be on, off or verify", param_hint="--tokenizer-cache")
    if forwarded_ids not in FORWARDED_IDS_MODES:
        raise typer.BadParameter("must be on, off or always", param_hint="--forwarded-ids")
    if kv_offload_bytes > 0 and role == "single":
        raise typer.BadParameter(
            "the offload tier goes beside NIXL: prefill or decode", param_hint="--kv-offload-bytes"
        )
    port = port or (8100 if role == "prefill" else 8200)
    spec = EngineSpec(
        role=role,  # type: ignore[arg-type]
        model=str(model),
        port=port,
        host=host,
        device=detect_device(),
        side_channel_port=side_channel_port or (5600 if role == "prefill" else 5700),
        service_port=port + LEASE_PORT_OFFSET if agentkv_connector else None,
        use_agentkv_connector=agentkv_connector,
        bidirectional=bidirectional,
        prefix_caching=prefix_caching,
        lease_s=lease_s,
        decoder_kv_blocks_ttl=decoder_kv_blocks_ttl,
        kv_recompute_threshold=kv_recompute_threshold,
        env={"VLLM_BATCH_INVARIANT": "1"} if batch_invariant else {},
        tokenizer_cache=tokenizer_cache,  # type: ignore[arg-type]
        detokenizer_prime_tokens=max(0, detokenizer_prime_tokens),
        forwarded_ids=forwarded_ids,  # type: ignore[arg-type]
        fast_json=fast_json,
        prefill_token=prefill_token,
        kv_offload_bytes=max(0, kv_offload_bytes),
        log_path=log or Path(f".agentkv/logs/{role}.log"),
    )
    engine = Engine(spec=spec, name=role)
    try:
        engine.start()
        with console.status(f"starting {role} on {spec.url} (log: {spec.log_path}) ...") as status:
            secs = engine.wait_healthy(on_tick=lambda t: status.update(f"starting {role} ... {t:.0f}s"))
    except AgentKVError as exc:
        engine.stop()
        _fail(exc)
    console.print(
        f"{role} ready on [bold]{spec.url}[/] after {secs:.0f}s (pid {engine.pid}); Ctrl-C stops it"
    )
    _wait_forever(engine.stop)


def _wait_forever(stop: Any) -> None:
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        stop()


@app.command()
def up(
    config: Annotated[Path | None, typer.Option(help="Cluster config file (TOML or JSON).")] = None,
    model: Annotated[
        Path | None, typer.Option(help="Model dir (default: the tiny model, built if missing).")
    ] = None,
    prefill: Annotated[
        int | None, typer.Option("--prefill", "-p", help="Number of prefill instances.")
    ] = None,
    decode: Annotated[int | None, typer.Option("--decode", "-d", help="Number of decode instances.")] = None,
    router_port: Annotated[int | None, typer.Option(help="Router port (default 8000).")] = None,
    bidirectional: Annotated[bool | None, typer.Option(help="Decode -> prefill KV transfer.")] = None,
    lease_s: Annotated[float | None, typer.Option(help="Decode-side lease on retained blocks.")] = None,
    gpus: Annotated[
        str | None,
        typer.Option(help="GPU per engine, prefills first, ';'-separated: '0;1', or '0,1;2,3' for TP 2."),
    ] = None,
    foreground: Annotated[bool, typer.Option(help="Stay attached; Ctrl-C stops everything.")] = False,
) -> None:
    """Start a local xPyD cluster (default 1P1D) and the router; print where everything listens."""
    from agentkv.server.launch._cluster import Cluster, ClusterConfig

    overrides: dict[str, Any] = dict(
        n_prefill=prefill,
        n_decode=decode,
        router_port=router_port,
        bidirectional=bidirectional,
        lease_s=lease_s,
        gpus=gpus.split(";") if gpus else None,
    )
    try:
        if model is not None:
            overrides["model"] = str(model)
        if config is not None:
            cfg = ClusterConfig.from_file(config, **overrides, default_model=_tiny_model_defaults)
        else:
            given = {k: v for k, v in overrides.items() if v is not None}
            cfg = ClusterConfig(**given) if model else ClusterConfig(**{**_tiny_model_defaults(), **given})
        cluster = Cluster(config=cfg)
        with console.status("starting engines (1-3 minutes on CPU) ...") as status:
            cluster.up(on_tick=lambda name, t: status.update(f"starting engines ... {name} {t:.0f}s"))
    except AgentKVError as exc:
        _fail(exc)
    cluster.write_state()
    _print_cluster(cluster.describe())
    if foreground:
        _wait_forever(cluster.down)
    else:
        console.print("stop with: [bold]agentkv down[/]")


def _tiny_model_defaults() -> dict[str, Any]:
    """No model named: the tiny model (built if missing), served as ``tiny_serving()`` says."""
    from agentkv.server.launch._model import tiny_serving

    return {"model": str(ensure_tiny_model()), **tiny_serving()}


def _print_cluster(info: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="agentkv cluster")
    for col in ("name", "role", "url", "agentkv service", "pid", "ready (s)", "log"):
        table.add_column(col)
    for e in info["engines"]:
        table.add_row(
            e["name"], e["role"], e["url"], str(e["service"]), str(e["pid"]), str(e["ready_s"]), e["log"]
        )
    out = _stdout()
    out.print(table)
    for w in info.get("warm_ups") or []:
        out.print(_warm_up_line(w))
    if info["router"]:
        out.print(f"router (OpenAI API): [bold]{info['router']}/v1[/]")
        if info.get("router_path_policy", "auto") != "auto":
            out.print(f"router path policy: {info['router_path_policy']}")


def _warm_up_line(w: dict[str, Any]) -> str:
    pulled = f"{w['pulled_tokens']} tokens pulled" if w["pulled_tokens"] else "prefill declined the pull"
    return (
        f"warm-up {w['prefill']} <-> {w['decode']}: first turn {w['first_turn_ms']:.0f} ms, "
        f"first pull {w['pull_ms']:.0f} ms ({pulled})"
    )


@app.command("warm-up")
def warm_up(
    prefill: Annotated[list[str], typer.Option("--prefill", help="Prefill URL (repeat).")],
    decode: Annotated[list[str], typer.Option("--decode", help="Decode URL (repeat).")],
) -> None:
    """Two turns through every prefill/decode pair, so no user's turn pays NIXL's first handshakes.

    `agentkv up` does this itself; run it after starting engines another way (and after a restart).
    """
    from dataclasses import asdict

    from agentkv.server.launch._warmup import warm_up_pair

    try:
        for p in prefill:
            for d in decode:
                console.print(_warm_up_line(asdict(warm_up_pair(prefill_url=p, decode_url=d))))
    except AgentKVError as exc:
        _fail(exc)


@app.command()
def down() -> None:
    """Stop what `agentkv up` started."""
    from agentkv.server.launch._cluster import stop_from_state

    stopped = stop_from_state()
    console.print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


@app.command()
def router(
    prefill: Annotated[list[str] | None, typer.Option("--prefill", help="Prefill URL (repeat).")] = None,
    decode: Annotated[list[str] | None, typer.Option("--decode", help="Decode URL (repeat).")] = None,
    config: Annotated[Path | None, typer.Option(help="Router settings file (TOML or JSON).")] = None,
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8000).")] = None,
    reuse: Annotated[bool | None, typer.Option(help="Reuse decode KV (off: every turn recomputes).")] = None,
    path_policy: Annotated[str | None, typer.Option(help="auto | always-pd | always-local")] = None,
    exact: Annotated[
        bool | None,
        typer.Option(
            help="Answers bit-identical to a recompute (default off: prefix-cache semantics, faster); on "
            "GPUs the engines also need batch-invariant kernels (agentkv serve --batch-invariant)."
        ),
    ] = None,
    prefix_guard: Annotated[
        bool | None, typer.Option(help="Router-side history check (the connector checks tokens too).")
    ] = None,
    tokens: Annotated[
        bool | None,
        typer.Option(help="Render each turn once and send engines token ids (off: text to both hops)."),
    ] = None,
    store_url: Annotated[str | None, typer.Option(help="redis://... for a shared store.")] = None,
    api_keys_file: Annotated[Path | None, typer.Option(help="File with one API key per line.")] = None,
    session_header: Annotated[str | None, typer.Option(help="Conversation id header.")] = None,
) -> None:
    """Run the KV-cache-aware router (also configurable by AGENTKV_* env vars)."""
    from agentkv.server.router import RouterSettings, run_router

    overrides: dict[str, Any] = {
        "prefill": prefill or None,
        "decode": decode or None,
        "host": host,
        "port": port,
        "reuse": reuse,
        "path_policy": path_policy,
        "exact": exact,
        "store_url": store_url,
        "api_keys_file": api_keys_file,
        "session_header": session_header,
        "prefix_guard": prefix_guard,
        "tokens": tokens,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if not config:
        # build() reports the messages only: pydantic's own text would echo input values, and those include
        # AGENTKV_API_KEYS from the environment.
        try:
            settings = RouterSettings.build(**overrides)
        except AgentKVError as exc:
            _fail(exc, code=2)  # a usage error, as typer's own
        run_router(settings)
        return
    try:
        settings = RouterSettings.from_file(config, **overrides)
    except AgentKVError as exc:
        _fail(exc)
    run_router(settings)


@app.command()
def demo(
    turns: Annotated[int, typer.Option(help="Turns per conversation.")] = 4,
    conversations: Annotated[int, typer.Option(help="Conversations per leg.")] = 2,
    keep: Annotated[bool, typer.Option(help="Leave the cluster running afterwards.")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the results as JSON.")] = None,
) -> None:
    """Build the tiny model, start 1P1D + routers, run an agent with reuse OFF then ON, show turn stats."""
    from agentkv._demo import run_demo

    try:
        result = run_demo(turns=turns, conversations=conversations, keep=keep, console=_stdout())
    except AgentKVError as exc:
        _fail(exc)
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2))


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
