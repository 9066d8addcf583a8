"""One source of truth for the engines' flags: the chart's vLLM arguments and environment are the ones
agentkv's launcher builds (``build_command``) for the same settings, over the example values and variations.

The launcher serves one host, the chart a pod each. Three differences follow, and only these are allowed: the
HTTP server listens on 0.0.0.0 (probes, port-forwards and the Service reach the pod's address; the launcher
binds the one address it was given), the pod's address comes from the downward API (``$(POD_IP)``, which
stands for the launcher's host here), and on CPU the launcher's ``UCX_NET_DEVICES=lo`` is left out (P and D
are different pods, so UCX must use the pod network). The chart adds the retention-service token from a
Secret and, where one is given, its own ``UCX_NET_DEVICES``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentkv._constants import LEASE_PORT_OFFSET, SERVICE_TOKEN_ENV
from agentkv.server.launch._launcher import EngineSpec, build_command
from agentkv.server.launch._model import tiny_serving

from ._chart import coalesced, container, env, find, manifests, merge, values

POD_IP = "$(POD_IP)"


def role_values(chart_values: dict[str, Any], role: str) -> dict[str, Any]:
    """engine: with prefill: or decode: over it, as the chart's agentkv.engineValues merges them."""
    return merge(chart_values["engine"], chart_values[role])


def launcher_spec(chart_values: dict[str, Any], role: str) -> EngineSpec:
    """The EngineSpec of the same settings: the chart's values, field by field."""
    c = role_values(chart_values, role)
    extra_args = (
        ["--tensor-parallel-size", str(c["tensorParallelSize"])] if c["tensorParallelSize"] > 1 else []
    )
    return EngineSpec(
        role=role,  # type: ignore[arg-type]
        model=chart_values["model"]["path"],
        port=c["ports"]["http"],
        host=POD_IP,
        device=chart_values["device"],
        served_model_name=chart_values["model"]["servedModelName"] or None,
        side_channel_port=c["ports"]["nixl"],
        service_port=c["ports"]["http"] + LEASE_PORT_OFFSET,
        bidirectional=c["connector"]["bidirectional"],
        kv_recompute_threshold=c["connector"]["kvRecomputeThreshold"],
        decoder_kv_blocks_ttl=c["connector"]["decoderKvBlocksTtl"],
        kv_lease_duration=c["connector"]["kvLeaseDuration"],
        lease_s=chart_values["leaseS"],
        max_lease_s=chart_values["maxLeaseS"],
        prefix_check=c["connector"]["prefixCheck"],
        cost_model=c["connector"]["costModel"],
        prefix_caching=c["prefixCaching"],
        max_model_len=chart_values["model"]["maxModelLen"],
        enforce_eager=c["enforceEager"],
        cpu_kvcache_gib=c["cpuKvCacheGiB"],
        in_process_worker=c["inProcessWorker"],
        block_size=c.get("blockSize"),  # Helm drops a null default
        tool_call_parser=c["toolCallParser"] or None,
        scale_out=c["scaleOut"],
        tokenizer_cache=c["plugin"]["tokenizerCache"],
        detokenizer_prime_tokens=c["plugin"]["detokenizerPrimeTokens"],
        forwarded_ids=c["plugin"]["forwardedIds"],
        fast_json=c["plugin"]["fastJson"],
        prefill_token=c["plugin"]["prefillToken"],
        extra_kv_config=dict(c["extraKvConfig"]),
        extra_args=[*extra_args, *c["extraArgs"]],
        env={e["name"]: e["value"] for e in c["extraEnv"]},
    )


def normalised(argv: list[str]) -> list[Any]:
    """argv with --kv-transfer-config parsed (JSON: the same object, whatever its spacing and key order)."""
    out: list[Any] = list(argv)
    i = out.index("--kv-transfer-config") + 1
    out[i] = json.loads(out[i])
    return out


def assert_chart_runs_the_launchers_command(chart_values: dict[str, Any], docs: list[dict[str, Any]]) -> None:
    for role in ("prefill", "decode"):
        spec = launcher_spec(chart_values, role)
        argv, launcher_env = build_command(spec)
        c = container(find(docs, "Deployment", f"agentkv-{role}"))
        assert c["command"] == ["python3"]
        want = argv[1:]  # the launcher runs this interpreter, the image's python3
        want[want.index("--host") + 1] = "0.0.0.0"
        assert normalised(c["args"]) == normalised(want)

        chart_env = env(c)
        assert chart_env.pop("POD_IP") == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert set(chart_env.pop(SERVICE_TOKEN_ENV)) == {"secretKeyRef"}
        ucx = role_values(chart_values, role)["rdma"]["ucxNetDevices"]
        if spec.device == "cpu":
            assert launcher_env.pop("UCX_NET_DEVICES") == "lo"
        if ucx:
            launcher_env["UCX_NET_DEVICES"] = ucx
        assert chart_env == launcher_env


VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("1p1d", {}),
    ("4p2d", {}),
    ("cpu", {}),
    ("1p1d", {"engine": {"enforceEager": True, "blockSize": 16, "prefixCaching": False}}),
    ("1p1d", {"engine": {"extraArgs": ["--compilation-config", '{"mode": 3}']}}),  # the user's choice wins
    ("1p1d", {"engine": {"extraArgs": ["-O0"], "scaleOut": False, "toolCallParser": "hermes"}}),
    ("1p1d", {"model": {"servedModelName": "qwen"}, "leaseS": 20, "maxLeaseS": 300}),
    (
        "1p1d",
        {
            "engine": {
                "connector": {"bidirectional": False, "prefixCheck": False, "costModel": False},
                "plugin": {"tokenizerCache": "verify", "forwardedIds": "off", "fastJson": False},
            },
            "decode": {"plugin": {"prefillToken": False, "detokenizerPrimeTokens": 0}},
        },
    ),
    (
        "1p1d",
        {
            "prefill": {
                "extraKvConfig": {"agentkv_idle_sleep_max_ms": 5, "enable_cross_layers_blocks": "False"}
            }
        },
    ),
    (
        "cpu",
        {
            "engine": {"cpuKvCacheGiB": 4, "inProcessWorker": False, "rdma": {"ucxNetDevices": "eth0"}},
            "prefill": {"prefixCaching": False},
        },
    ),
    ("4p2d", {"prefill": {"tensorParallelSize": 4, "ports": {"http": 8300, "nixl": 5800}}}),
    ("1p1d", {"decode": {"extraKvConfig": {"kv_note": 'it\'s "quoted"'}}}),  # quotes inside the JSON arg
]


@pytest.mark.parametrize(("example", "overrides"), VARIANTS)
def test_chart_runs_the_launchers_command(example: str, overrides: dict[str, Any]) -> None:
    user = values(example, overrides=overrides)
    assert_chart_runs_the_launchers_command(coalesced(user), manifests(user))


def test_cpu_example_serves_the_tiny_model_as_agentkv_up_does() -> None:
    """The CPU example's engines are `agentkv up`'s for the tiny model (tiny_serving), floating over the cores
    with one OpenMP thread each as `agentkv up` runs engines that outnumber the cores."""
    user = values("cpu")
    chart_values = coalesced(user)
    docs = manifests(user)
    tiny = tiny_serving()
    floating = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    for role in ("prefill", "decode"):
        spec = launcher_spec(chart_values, role)
        assert spec.tool_call_parser == tiny["tool_call_parser"]
        assert spec.extra_args == tiny["extra_args"]
        assert spec.env == {**tiny["env"], **floating}
        assert spec.model.rsplit("/", 1)[-1] == "tiny"
    assert_chart_runs_the_launchers_command(chart_values, docs)


def test_a_difference_from_the_launcher_is_caught() -> None:
    """The comparison itself can fail: the same chart against a launcher given another setting."""
    user = values("1p1d")
    chart_values = coalesced(user)
    docs = manifests(user)
    for changed in ({"leaseS": 31}, {"engine": {"plugin": {"prefillToken": False}}}, {"device": "cpu"}):
        with pytest.raises(AssertionError):
            assert_chart_runs_the_launchers_command(merge(chart_values, changed), docs)
