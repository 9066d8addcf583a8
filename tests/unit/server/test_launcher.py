import json
from pathlib import Path

import pytest

from agentkv._exceptions import ConfigError, EngineVersionError, ModelNotFoundError, PortInUseError
from agentkv.server.launch._cluster import ClusterConfig
from agentkv.server.launch._launcher import (
    GPU_DECODE_GRAPHS,
    HOST_POLICY_MODULE,
    HOST_POLICY_NAME,
    HOST_SPEC_MODULE,
    HOST_SPEC_NAME,
    Engine,
    EngineSpec,
    build_command,
)


def _kv(argv: list[str]) -> dict:  # type: ignore[type-arg]
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_decode_on_cpu_gets_connector_lease_service_and_loopback_networking() -> None:
    spec = EngineSpec(role="decode", model="/m", port=8200, service_port=9200, cpu_core=1, lease_s=12)
    argv, env = build_command(spec)
    kv = _kv(argv)
    assert kv["kv_role"] == "kv_consumer" and kv["kv_load_failure_policy"] == "recompute"
    assert kv["kv_connector_module_path"] == "agentkv.server.engine.connector"
    assert kv["kv_buffer_device"] == "cpu"
    extra = kv["kv_connector_extra_config"]
    assert extra["bidirectional_kv_xfer"] is True and extra["agentkv_service_port"] == 9200
    assert extra["agentkv_lease_s"] == 12
    assert env["UCX_NET_DEVICES"] == "lo" and env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "--enable-prefix-caching" in argv
    assert "--enable-prompt-tokens-details" in argv  # the router reads cached_tokens from usage


def test_stock_prefill_without_our_connector_and_without_prefix_cache() -> None:
    spec = EngineSpec(
        role="prefill", model="/m", port=8100, use_agentkv_connector=False, prefix_caching=False
    )
    argv, _ = build_command(spec)
    kv = _kv(argv)
    assert kv["kv_role"] == "kv_producer" and "kv_connector_module_path" not in kv
    assert not any(k.startswith("agentkv_") for k in kv["kv_connector_extra_config"])
    assert "--no-enable-prefix-caching" in argv


def test_gpu_defaults_are_the_measured_best_settings() -> None:
    argv, env = build_command(EngineSpec(role="decode", model="/m", port=1, device="gpu"))
    kv = _kv(argv)
    assert argv[argv.index("--block-size") + 1] == "64"
    assert kv["kv_connector_extra_config"]["enable_cross_layers_blocks"] == "True"
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0" and env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
    assert "kv_buffer_device" not in kv
    cc = json.loads(argv[argv.index("--compilation-config") + 1])  # decode graphs: measured faster
    assert cc == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"} and "--enforce-eager" not in argv


def test_gpu_graphs_alike_on_both_roles_and_can_be_turned_off() -> None:
    # P and D under one setting: their KV must be computed as one server's would (bench.agreement on an H100).
    prefill = build_command(EngineSpec(role="prefill", model="/m", port=1, device="gpu"))[0]
    decode = build_command(EngineSpec(role="decode", model="/m", port=1, device="gpu"))[0]
    assert "--enforce-eager" not in prefill
    graphs = [argv[argv.index("--compilation-config") + 1] for argv in (prefill, decode)]
    assert graphs[0] == graphs[1] == GPU_DECODE_GRAPHS
    cpu = build_command(EngineSpec(role="decode", model="/m", port=1))[0]
    assert "--enforce-eager" in cpu and "--compilation-config" not in cpu
    eager = build_command(EngineSpec(role="decode", model="/m", port=1, device="gpu", enforce_eager=True))[0]
    assert "--enforce-eager" in eager and "--compilation-config" not in eager
    mine = EngineSpec(role="decode", model="/m", port=1, device="gpu", extra_args=["-O0"])
    argv = build_command(mine)[0]
    assert "--enforce-eager" not in argv and "--compilation-config" not in argv  # the caller chose


def test_engine_check_reports_missing_model_and_busy_port(tmp_path: Path) -> None:
    import socket

    with pytest.raises(ModelNotFoundError, match="agentkv model tiny"):
        Engine(spec=EngineSpec(role="decode", model=str(tmp_path / "nope"), port=1), name="d").check()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUseError, match=str(port)):
            Engine(spec=EngineSpec(role="decode", model=str(tmp_path), port=port), name="d").check()


def test_cluster_config_file_errors_are_clear(tmp_path: Path) -> None:
    bad = tmp_path / "c.toml"
    bad.write_text('model = "/m"\nn_decoders = 2\n')
    with pytest.raises(ConfigError, match=r"unknown keys.*n_decoders"):
        ClusterConfig.from_file(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        ClusterConfig.from_file(tmp_path / "missing.toml")
    good = tmp_path / "ok.toml"
    good.write_text('[cluster]\nmodel = "/m"\nn_decode = 2\n')
    cfg = ClusterConfig.from_file(good, n_prefill=None)
    names = [n for n, _ in cfg.specs()]
    assert names == ["prefill0", "decode0", "decode1"]
    with pytest.raises(ConfigError):
        ClusterConfig(model="/m", n_decode=0)


def test_cluster_config_file_without_model_takes_the_default_only_when_needed(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("lease_s = 14\n")
    with pytest.raises(ConfigError, match="names no model"):
        ClusterConfig.from_file(f)
    calls: list[int] = []

    def default() -> dict[str, str]:
        calls.append(1)
        return {"model": "/tiny", "tool_call_parser": "hermes"}

    cfg = ClusterConfig.from_file(f, default_model=default)
    assert (cfg.model, cfg.tool_call_parser, cfg.lease_s, calls) == ("/tiny", "hermes", 14, [1])
    # A model named by the caller wins, and the default (which may build a model) is never called.
    cfg = ClusterConfig.from_file(f, default_model=default, model="/mine")
    assert (cfg.model, cfg.tool_call_parser, calls) == ("/mine", None, [1])


def test_cpu_engines_are_pinned_only_when_each_gets_its_own_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    pinned = ClusterConfig(model="/m", device="cpu").specs()
    assert [s.cpu_core for _, s in pinned] == [0, 1]
    assert all("VLLM_CPU_OMP_THREADS_BIND" not in s.env for _, s in pinned)
    floating = ClusterConfig(model="/m", device="cpu", n_prefill=2, n_decode=2).specs()
    assert [s.cpu_core for _, s in floating] == [None] * 4
    assert all(s.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" for _, s in floating)
    # The user's own environment for the engines wins.
    mine = ClusterConfig(model="/m", device="cpu", n_decode=3, env={"OMP_NUM_THREADS": "2"}).specs()
    assert all(s.env["OMP_NUM_THREADS"] == "2" for _, s in mine)


def test_a_clusters_host_tier_goes_to_its_decodes_only() -> None:
    specs = ClusterConfig(model="/m", device="cpu", n_decode=2, decode_kv_offload_bytes=64 << 20).specs()
    assert [(s.role, s.kv_offload_bytes) for _, s in specs] == [
        ("prefill", 0),
        ("decode", 64 << 20),
        ("decode", 64 << 20),
    ]


def test_each_engine_gets_its_own_gpus_in_order_prefills_first() -> None:
    specs = ClusterConfig(model="/m", device="gpu", n_prefill=1, n_decode=2, gpus=["0", "1", "2,3"]).specs()
    got = {name: build_command(spec)[1].get("CUDA_VISIBLE_DEVICES") for name, spec in specs}
    assert got == {"prefill0": "0", "decode0": "1", "decode1": "2,3"}
    shared = ClusterConfig(model="/m", device="gpu").specs()
    assert all("CUDA_VISIBLE_DEVICES" not in build_command(spec)[1] for _, spec in shared)
    with pytest.raises(ConfigError, match="one entry per engine, prefills first: 2, not 1"):
        ClusterConfig(model="/m", gpus=["0"])
    with pytest.raises(ConfigError, match="device indices"):
        ClusterConfig(model="/m", gpus=["0", "cuda:1"])


def test_a_shared_gpu_gets_a_router_that_prefills_every_turn_on_decode() -> None:
    shared = ClusterConfig(model="/m", device="gpu")
    assert shared.shares_a_gpu()
    assert shared.router_environment() == {"AGENTKV_PATH_POLICY": "always-local"}
    assert ClusterConfig(model="/m", device="gpu", gpus=["0", "0"]).shares_a_gpu()
    assert ClusterConfig(model="/m", device="gpu", n_decode=2, gpus=["0,1", "2", "1"]).shares_a_gpu()
    apart = ClusterConfig(model="/m", device="gpu", n_decode=2, gpus=["0", "1", "2,3"])
    assert not apart.shares_a_gpu() and apart.router_environment() == {}
    assert ClusterConfig(model="/m", device="cpu").router_environment() == {}
    # The user's choice wins, and exact mode (which never prefills on decode) is left alone.
    mine = ClusterConfig(model="/m", device="gpu", router_env={"AGENTKV_PATH_POLICY": "auto"})
    assert mine.router_environment() == {"AGENTKV_PATH_POLICY": "auto"}
    exact = ClusterConfig(model="/m", device="gpu", router_env={"AGENTKV_EXACT": "true"})
    assert exact.router_environment() == {"AGENTKV_EXACT": "true"}
    # Spelled as the router's settings accept it, which always-local would fail at the router's start.
    terse = ClusterConfig(model="/m", device="gpu", router_env={"AGENTKV_EXACT": "Y"})
    assert terse.router_environment() == {"AGENTKV_EXACT": "Y"}


def test_engine_check_refuses_an_unsupported_installed_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(spec=EngineSpec(role="decode", model=str(tmp_path), port=1), name="decode")
    monkeypatch.setattr("agentkv.server.launch._launcher.installed_version", lambda: "0.35.0")
    with pytest.raises(EngineVersionError, match=r"decode runs vLLM 0\.35\.0; agentkv supports vLLM >=0\.26"):
        engine.check()
    monkeypatch.setattr("agentkv.server.launch._launcher.installed_version", lambda: "0.34.0")
    monkeypatch.setattr("agentkv.server.launch._launcher.port_in_use", lambda *_: False)
    engine.check()


def test_cluster_up_refuses_engines_on_different_releases_and_stops_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One install runs every engine `up` starts, so this stands for engines that answer for another vLLM
    # (a port taken by an engine someone else started): refused before the warm-up and the router.
    from agentkv.server.launch._cluster import Cluster

    stopped: list[str] = []
    monkeypatch.setattr(Engine, "check", lambda self: None)
    monkeypatch.setattr(Engine, "start", lambda self: None)
    monkeypatch.setattr(Engine, "wait_healthy", lambda self, **_: 1.0)
    monkeypatch.setattr(Engine, "stop", lambda self, **_: stopped.append(self.name))
    versions = iter(["0.33.0", "0.34.0"])
    monkeypatch.setattr("agentkv.server.launch._cluster.engine_version", lambda http, url: next(versions))
    cluster = Cluster(config=ClusterConfig(model=str(tmp_path), router_port=None))
    monkeypatch.setattr(cluster, "warm_up", lambda: pytest.fail("warm-up after a version mismatch"))
    with pytest.raises(EngineVersionError, match=r"same vLLM release.*0\.33\.0.*0\.34\.0"):
        cluster.up()
    assert sorted(stopped) == sorted(e.name for e in cluster.engines)


def test_role_args_follow_the_common_ones_for_their_role_only() -> None:
    config = ClusterConfig(
        model="/m",
        device="gpu",
        extra_args=["--kv-cache-memory-bytes", "1"],
        decode_args=["--kv-cache-memory-bytes", "3"],
    )
    argv = {name: build_command(spec)[0] for name, spec in config.specs()}
    assert argv["prefill0"][-2:] == ["--kv-cache-memory-bytes", "1"]
    assert argv["decode0"][-4:] == ["--kv-cache-memory-bytes", "1", "--kv-cache-memory-bytes", "3"]


def test_engines_get_the_vllm_plugin_switched_on_and_a_cluster_config_can_switch_it() -> None:
    """agentkv's vLLM plugin acts only on its environment variables: the launcher sets them per engine."""
    env = build_command(EngineSpec(role="decode", model="/m", port=1))[1]
    assert env["AGENTKV_TOKENIZER_CACHE"] == "on" and env["AGENTKV_DETOKENIZER_PRIME_TOKENS"] == "128"
    assert env["AGENTKV_FORWARDED_IDS"] == "always" and env["AGENTKV_FAST_JSON"] == "on"
    assert env["AGENTKV_PREFILL_TOKEN"] == "on"
    stock = ClusterConfig(
        model="/m",
        device="cpu",
        tokenizer_cache="off",
        detokenizer_prime_tokens=0,
        forwarded_ids="off",
        fast_json=False,
        prefill_token=False,
    )
    for _, spec in stock.specs():
        env = build_command(spec)[1]
        assert env["AGENTKV_TOKENIZER_CACHE"] == "off" and env["AGENTKV_DETOKENIZER_PRIME_TOKENS"] == "0"
        assert env["AGENTKV_FORWARDED_IDS"] == "off" and env["AGENTKV_FAST_JSON"] == "off"
        assert env["AGENTKV_PREFILL_TOKEN"] == "off"
    with pytest.raises(ConfigError, match="tokenizer_cache"):
        ClusterConfig(model="/m", tokenizer_cache="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="forwarded_ids"):
        ClusterConfig(model="/m", forwarded_ids="sometimes")  # type: ignore[arg-type]


def test_the_state_file_masks_secrets_in_the_environments(tmp_path: Path) -> None:
    from agentkv.server.launch._cluster import Cluster

    config = ClusterConfig(
        model=str(tmp_path),
        device="cpu",
        router_env={"AGENTKV_API_KEYS": "sk-1,sk-2", "AGENTKV_PATH_POLICY": "auto"},
        env={"AGENTKV_SERVICE_TOKEN": "t0ken", "OMP_NUM_THREADS": "2"},
    )
    state = tmp_path / "cluster.json"
    Cluster(config=config).write_state(state)
    saved = json.loads(state.read_text())["config"]
    assert saved["router_env"] == {"AGENTKV_API_KEYS": "***", "AGENTKV_PATH_POLICY": "auto"}
    assert saved["env"] == {"AGENTKV_SERVICE_TOKEN": "***", "OMP_NUM_THREADS": "2"}
    assert "sk-1" not in state.read_text() and "t0ken" not in state.read_text()
    assert saved["log_dir"] == ".agentkv/logs"


def test_the_offload_tier_is_off_by_default() -> None:
    kv = _kv(build_command(EngineSpec(role="decode", model="/m", port=8200, service_port=9200))[0])
    assert kv["kv_connector"] == "NixlConnector"
    assert "connectors" not in kv["kv_connector_extra_config"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_offload_tier_goes_beside_nixl_through_multiconnector(role: str) -> None:
    spec = EngineSpec(role=role, model="/m", port=8200, service_port=9200, kv_offload_bytes=64 << 20)  # type: ignore[arg-type]
    kv = _kv(build_command(spec)[0])
    plain = _kv(build_command(EngineSpec(role=role, model="/m", port=8200, service_port=9200))[0])  # type: ignore[arg-type]
    assert kv["kv_connector"] == "MultiConnector"
    nixl, offload = kv["kv_connector_extra_config"]["connectors"]
    # NIXL first (MultiConnector gives a load to the first child that matches), exactly as without the tier.
    assert nixl == plain
    assert kv["kv_role"] == plain["kv_role"] and kv["kv_load_failure_policy"] == "recompute"
    assert kv["kv_buffer_device"] == "cpu"
    assert offload["kv_connector"] == "OffloadingConnector" and offload["kv_role"] == "kv_both"
    extra = offload["kv_connector_extra_config"]
    assert extra["cpu_bytes_to_use"] == 64 << 20
    assert extra["offload_prompt_only"] is False  # an answer's KV is the next prompt's too
    assert (extra["spec_name"], extra["spec_module_path"]) == (HOST_SPEC_NAME, HOST_SPEC_MODULE)
    # The tier's evictions ordered by lease state: vLLM's factory imports our policy by name and module.
    assert (extra["eviction_policy"], extra["cache_policy_module_path"]) == (
        HOST_POLICY_NAME,
        HOST_POLICY_MODULE,
    )


def test_the_tier_keeps_vllms_lru_when_asked_or_without_our_connector() -> None:
    from agentkv.server.engine._connector import _host_policy

    assert (HOST_POLICY_NAME, HOST_POLICY_MODULE) == (_host_policy.POLICY_NAME, _host_policy.POLICY_MODULE)
    for spec in (
        EngineSpec(
            role="decode",
            model="/m",
            port=8200,
            service_port=9200,
            kv_offload_bytes=1 << 20,
            lease_aware_host_tier=False,
        ),
        EngineSpec(
            role="decode", model="/m", port=8200, kv_offload_bytes=1 << 20, use_agentkv_connector=False
        ),
    ):
        _, offload = _kv(build_command(spec)[0])["kv_connector_extra_config"]["connectors"]
        assert "eviction_policy" not in offload["kv_connector_extra_config"]


def test_a_gpu_engine_gets_vllms_own_offloading_spec() -> None:
    spec = EngineSpec(role="decode", model="/m", port=8200, device="gpu", kv_offload_bytes=1 << 30)
    kv = _kv(build_command(spec)[0])
    _, offload = kv["kv_connector_extra_config"]["connectors"]
    assert "spec_name" not in offload["kv_connector_extra_config"]
    assert "spec_module_path" not in offload["kv_connector_extra_config"]
    assert "kv_buffer_device" not in kv


def test_a_single_server_refuses_the_offload_tier() -> None:
    with pytest.raises(ValueError, match="prefill or decode"):
        build_command(EngineSpec(role="single", model="/m", port=8000, kv_offload_bytes=1 << 20))


def test_the_host_spec_the_launcher_names_is_vllms_cpu_spec_with_agentkvs_worker() -> None:
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    from agentkv.server.engine._connector import _tiers

    assert HOST_SPEC_MODULE == _tiers.__name__ == _tiers.HOST_SPEC_MODULE
    assert HOST_SPEC_NAME == _tiers.HOST_SPEC_NAME
    assert issubclass(getattr(_tiers, HOST_SPEC_NAME), CPUOffloadingSpec)


def test_cpu_engines_of_one_thread_run_the_worker_in_the_engine_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    # Pinned (one core each) and floating (one OpenMP thread each): vLLM's uniproc executor, one thread.
    pinned = ClusterConfig(model="/m", device="cpu")
    floating = ClusterConfig(model="/m", device="cpu", n_decode=3)
    for config in (pinned, floating):
        for _, spec in config.specs():
            _, env = build_command(spec)
            assert (env["VLLM_ENABLE_V1_MULTIPROCESSING"], env["OMP_NUM_THREADS"]) == ("0", "1")
    # The user's thread count wins; turned off, or left to vLLM's own binding: vLLM's CPU default (mp).
    _, env = build_command(EngineSpec(role="decode", model="/m", port=1, env={"OMP_NUM_THREADS": "4"}))
    assert (env["VLLM_ENABLE_V1_MULTIPROCESSING"], env["OMP_NUM_THREADS"]) == ("0", "4")
    for spec in (
        EngineSpec(role="decode", model="/m", port=1, cpu_core=1, in_process_worker=False),
        EngineSpec(role="decode", model="/m", port=1),
        EngineSpec(role="decode", model="/m", port=1, device="gpu", cpu_core=1),
    ):
        _, env = build_command(spec)
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env and "OMP_NUM_THREADS" not in env
    off = ClusterConfig(model="/m", device="cpu", in_process_worker=False).specs()
    assert not any(spec.in_process_worker for _, spec in off)
