"""The ``agentkv`` command line through typer's CliRunner: help texts, and clear errors for bad settings.

Nothing here starts an engine, a cluster or a server: `run_router`, `Cluster.up` and the tiny model build are
replaced by tripwires, so a regression that lets bad settings through fails the test instead of starting
anything.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from agentkv.cli import app

runner = CliRunner()


def flat(text: str) -> str:
    """Rich wraps long messages at 80 columns; compare with runs of whitespace collapsed."""
    return re.sub(r"\s+", " ", text)


def invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    return runner.invoke(app, list(args), prog_name="agentkv", env=env)


@pytest.fixture(autouse=True)
def tripwires(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """No AGENTKV_* settings from the caller's environment; record instead of serving or building."""
    for name in list(os.environ):
        if name.startswith("AGENTKV_"):
            monkeypatch.delenv(name)
    served: list[Any] = []
    monkeypatch.setattr("agentkv.server.router.run_router", served.append)

    def no_cluster(*_a: Any, **_k: Any) -> None:
        raise AssertionError("the CLI tried to start a cluster")

    def no_model(*_a: Any, **_k: Any) -> Path:
        raise AssertionError("the CLI tried to build the tiny model")

    monkeypatch.setattr("agentkv.server.launch._cluster.Cluster.up", no_cluster)
    monkeypatch.setattr("agentkv.cli.ensure_tiny_model", no_model)
    return served


def test_top_level_help_lists_every_subcommand() -> None:
    result = invoke("--help")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Usage: agentkv" in out
    for command in ("serve", "up", "down", "router", "demo", "model", "warm-up"):
        assert re.search(rf"^\W*{command}\s", out, re.M), f"{command} missing from:\n{out}"


def test_no_arguments_shows_help_instead_of_doing_anything() -> None:
    result = invoke()
    # no_args_is_help: click prints the help and exits with 2 (usage) in click >= 8.2, 0 before.
    assert result.exit_code in (0, 2)
    assert "Commands" in result.output and "router" in result.output


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["serve"], ["ROLE", "--model", "--port", "--side-channel-port", "--lease-s", "--agentkv-connector"]),
        (["up"], ["--config", "--model", "--prefill", "--decode", "--router-port", "--foreground"]),
        (["down"], ["Stop what", "--help"]),
        (
            ["router"],
            [
                "--prefill",
                "--decode",
                "--config",
                "--port",
                "--path-policy",
                "--store-url",
                "--api-keys-file",
            ],
        ),
        (["demo"], ["--turns", "--conversations", "--keep", "--json"]),
        (["model"], ["tiny"]),
        (["model", "tiny"], ["OUT_DIR", "--seed"]),
    ],
    ids=["serve", "up", "down", "router", "demo", "model", "model-tiny"],
)
def test_subcommand_help_exits_0_and_lists_its_options(args: list[str], expected: list[str]) -> None:
    result = invoke(*args, "--help")
    assert result.exit_code == 0, result.output
    assert f"Usage: agentkv {' '.join(args)}" in result.output
    for item in expected:  # arguments show as ROLE or {role} depending on the typer version
        assert item.lower() in result.output.lower(), f"{item} missing from `agentkv {' '.join(args)} --help`"


def test_router_without_prefill_is_a_clear_usage_error(tripwires: list[Any]) -> None:
    result = invoke("router", "--decode", "http://127.0.0.1:8200")
    assert result.exit_code == 2
    assert isinstance(result.exception, SystemExit)
    out = flat(result.output)
    assert "invalid router settings" in out and "at least one --prefill URL is required" in out
    assert "Traceback" not in result.output
    assert tripwires == []  # the router never ran


def test_router_with_a_malformed_url_names_it(tripwires: list[Any]) -> None:
    result = invoke("router", "--prefill", "ftp://p0", "--decode", "http://127.0.0.1:8200")
    assert result.exit_code == 2
    out = flat(result.output)
    assert "invalid backend URL 'ftp://p0': expected http://host:port" in out
    assert "Traceback" not in result.output
    assert tripwires == []


def test_router_settings_file_errors_are_one_readable_line(tmp_path: Path, tripwires: list[Any]) -> None:
    bad = tmp_path / "router.toml"
    bad.write_text('[router]\nprefill = ["ftp://p0"]\ndecode = ["http://127.0.0.1:8200"]\n')
    result = invoke("router", "--config", str(bad))
    assert result.exit_code == 1
    assert flat(result.output).strip() == (
        "error: invalid router settings: invalid backend URL 'ftp://p0': expected http://host:port"
    )
    missing = invoke("router", "--config", str(tmp_path / "nope.toml"))
    assert missing.exit_code == 1
    assert "cannot read router settings" in flat(missing.output) and "nope.toml" in missing.output
    assert "Traceback" not in result.output + missing.output
    assert tripwires == []


def test_router_flags_reach_the_settings(tripwires: list[Any]) -> None:
    result = invoke(
        "router",
        "--prefill",
        "http://127.0.0.1:8100",
        "--prefill",
        "127.0.0.1:8101",
        "--decode",
        "http://127.0.0.1:8200",
        "--path-policy",
        "always-pd",
        "--no-reuse",
        "--no-exact",
        "--port",
        "9000",
    )
    assert result.exit_code == 0, result.output
    [settings] = tripwires
    assert settings.exact is False
    assert settings.prefill == ["http://127.0.0.1:8100", "127.0.0.1:8101"]
    assert settings.decode == ["http://127.0.0.1:8200"]
    assert (settings.path_policy, settings.reuse, settings.port) == ("always-pd", False, 9000)


def test_router_settings_errors_do_not_print_api_keys_from_the_environment() -> None:
    result = invoke("router", "--decode", "http://d:1", env={"AGENTKV_API_KEYS": "sk-live-4f9a2c"})
    assert result.exit_code != 0
    assert "sk-live" not in result.output and "input_value" not in result.output


def test_error_messages_are_printed_verbatim(tmp_path: Path) -> None:
    missing = tmp_path / "[bold]router.toml"
    result = invoke("router", "--config", str(missing))
    assert result.exit_code == 1
    assert "[bold]router.toml" in flat(result.output).replace(" ", "")


def test_serve_rejects_an_unknown_role_before_starting_anything() -> None:
    result = invoke("serve", "bogus")
    assert result.exit_code == 2
    assert "role must be prefill, decode or single" in flat(result.output)
    assert "Traceback" not in result.output


def test_up_with_an_impossible_cluster_fails_cleanly(tmp_path: Path) -> None:
    result = invoke("up", "--model", str(tmp_path), "--prefill", "0")
    assert result.exit_code == 1
    assert "error: a cluster needs at least one prefill and one decode" in flat(result.output)
    missing = invoke("up", "--config", str(tmp_path / "cluster.toml"))
    assert missing.exit_code == 1
    assert "does not exist" in flat(missing.output)
    assert "Traceback" not in result.output + missing.output
    # --gpus reaches the cluster's config: one entry per engine, checked before anything starts.
    short = invoke("up", "--model", str(tmp_path), "--gpus", "0")
    assert short.exit_code == 1
    assert "gpus needs one entry per engine, prefills first: 2, not 1" in flat(short.output)


def test_warm_up_of_an_unreachable_pair_is_one_clear_error() -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = invoke(
        "warm-up", "--prefill", f"http://127.0.0.1:{port}", "--decode", f"http://127.0.0.1:{port}"
    )
    assert result.exit_code == 1
    assert "warm-up prefill /v1/models" in flat(result.output) and "Traceback" not in result.output


def test_up_prints_whole_rows_when_stdout_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    from agentkv import cli

    log = ".agentkv/logs/a-directory-name-long-enough-to-push-the-row-past-eighty-columns/decode0.log"
    engine = {
        "name": "decode0",
        "role": "decode",
        "url": "http://127.0.0.1:8200",
        "service": "http://127.0.0.1:9200",
        "pid": 4242,
        "ready_s": 61.5,
        "log": log,
    }
    cli._print_cluster({"engines": [engine], "router": "http://127.0.0.1:8000"})
    rows = capsys.readouterr().out.splitlines()
    row = next(line for line in rows if "decode0" in line)
    for cell in ("http://127.0.0.1:8200", "http://127.0.0.1:9200", "4242", "61.5", log):
        assert cell in row, row
    assert "router (OpenAI API): http://127.0.0.1:8000/v1" in rows


def test_demo_table_says_what_its_timings_measure(capsys: pytest.CaptureFixture[str]) -> None:
    from agentkv import cli
    from agentkv._demo import _print

    row = {
        "leg": "ON",
        "conversation": 1,
        "call": 2,
        "prompt_tokens": 612,
        "reused_tokens": 512,
        "reuse": "hit",
        "path": "pd",
        "prefill_ms": 41.5,
        "total_ms": 420.0,
    }
    _print([row], cli._stdout())
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "prefill ms" in line)
    assert "call ms" in header and "ttft" not in header.lower()
    assert "there is no TTFT" in flat(out) and "request to last token" in flat(out)
    assert "41.5" in out and "420.0" in out


@pytest.fixture
def engine_envs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, str]]:
    """The environment each `agentkv serve` in the test would start its engine with (nothing starts)."""
    from agentkv.server.launch._launcher import build_command

    envs: list[dict[str, str]] = []

    def no_start(engine: Any) -> None:
        envs.append(build_command(engine.spec)[1])
        raise SystemExit(0)

    monkeypatch.setattr("agentkv.server.launch._launcher.Engine.start", no_start)
    return envs


def test_serve_batch_invariant_reaches_the_engine_environment(engine_envs: list[dict[str, str]]) -> None:
    """The router's exact mode needs vLLM's batch-invariant kernels on GPUs: `serve` sets them per engine."""
    invoke("serve", "decode", "--batch-invariant")
    invoke("serve", "decode")
    assert [e.get("VLLM_BATCH_INVARIANT") for e in engine_envs] == ["1", None]


def test_serve_switches_the_vllm_plugin_per_engine(engine_envs: list[dict[str, str]]) -> None:
    invoke(
        "serve",
        "decode",
        "--tokenizer-cache",
        "verify",
        "--detokenizer-prime-tokens",
        "0",
        "--forwarded-ids",
        "off",
        "--no-prefill-token",
    )
    invoke("serve", "decode")
    names = ("TOKENIZER_CACHE", "DETOKENIZER_PRIME_TOKENS", "FORWARDED_IDS", "PREFILL_TOKEN")
    got = [tuple(e[f"AGENTKV_{n}"] for n in names) for e in engine_envs]
    assert got == [("verify", "0", "off", "off"), ("on", "128", "always", "on")]
    result = invoke("serve", "decode", "--tokenizer-cache", "maybe")
    assert result.exit_code != 0 and "on, off or verify" in flat(result.output)
    result = invoke("serve", "decode", "--forwarded-ids", "maybe")
    assert result.exit_code != 0 and "on, off or always" in flat(result.output)


@pytest.fixture
def engine_kv_configs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The --kv-transfer-config each `agentkv serve` in the test would start its engine with."""
    import json

    from agentkv.server.launch._launcher import build_command

    configs: list[dict[str, Any]] = []

    def no_start(engine: Any) -> None:
        argv = build_command(engine.spec)[0]
        configs.append(json.loads(argv[argv.index("--kv-transfer-config") + 1]))
        raise SystemExit(0)

    monkeypatch.setattr("agentkv.server.launch._launcher.Engine.start", no_start)
    return configs


def test_serve_kv_offload_bytes_wires_the_offload_tier_and_only_beside_nixl(
    engine_kv_configs: list[dict[str, Any]],
) -> None:
    invoke("serve", "decode", "--kv-offload-bytes", str(1 << 20))
    invoke("serve", "decode")
    assert [c["kv_connector"] for c in engine_kv_configs] == ["MultiConnector", "NixlConnector"]
    offload = engine_kv_configs[0]["kv_connector_extra_config"]["connectors"][1]
    assert offload["kv_connector_extra_config"]["cpu_bytes_to_use"] == 1 << 20
    result = invoke("serve", "single", "--kv-offload-bytes", "1024")
    assert result.exit_code != 0 and "prefill or decode" in flat(result.output)
