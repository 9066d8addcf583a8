"""What the chart renders: the settings a P/D deployment must get right (connector module, NIXL side channel,
retention-service port and token, probes, Redis, discovery, NetworkPolicy), asserted on the rendered
manifests of the example values and of variations on them."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import pytest
from helm_python import HelmError

from agentkv._constants import LEASE_PORT_OFFSET, SERVICE_TOKEN_ENV

from ._chart import (
    EXAMPLE_NAMES,
    NAMESPACE,
    Manifest,
    arg,
    container,
    env,
    find,
    kinds,
    port,
    render,
    values,
)

ROLES = ("prefill", "decode")
TOKEN_SECRET = {"serviceToken": {"existingSecret": "agentkv-service-token"}}


def kv_config(c: dict[str, Any]) -> dict[str, Any]:
    return json.loads(arg(c, "--kv-transfer-config"))


def engines(docs: list[Manifest]) -> dict[str, Manifest]:
    return {role: find(docs, "Deployment", f"agentkv-{role}") for role in ROLES}


def pod_labels(deployment: Manifest) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and In expressions) against a pod's labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_engines_load_agentkvs_connector_with_their_role(name: str) -> None:
    for role, deployment in engines(render(name)).items():
        cfg = kv_config(container(deployment))
        assert cfg["kv_connector"] == "NixlConnector"
        assert cfg["kv_connector_module_path"] == "agentkv.server.engine.connector"
        assert cfg["kv_role"] == ("kv_producer" if role == "prefill" else "kv_consumer")
        assert cfg["kv_load_failure_policy"] == "recompute"
        assert cfg["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_both_roles_serve_one_model_path(name: str) -> None:
    # vLLM hashes the --model string into NIXL's handshake: P and D at different paths refuse each other.
    models = {arg(container(d), "--model") for d in engines(render(name)).values()}
    names = {arg(container(d), "--served-model-name") for d in engines(render(name)).values()}
    assert len(models) == 1 and len(names) == 1


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_agentkv_service_listens_on_the_pod_address_at_http_plus_offset(name: str) -> None:
    docs = render(name)
    for role, deployment in engines(docs).items():
        c = container(deployment)
        extra = kv_config(c)["kv_connector_extra_config"]
        http = port(c, "http")
        assert int(arg(c, "--port")) == http
        # Prefill calls the address decode advertises: the pod's own, never 0.0.0.0.
        assert extra["agentkv_service_host"] == "$(POD_IP)"
        assert extra["agentkv_service_port"] == port(c, "agentkv") == http + LEASE_PORT_OFFSET
        service = find(docs, "Service", f"agentkv-{role}")
        by_name = {p["name"]: p for p in service["spec"]["ports"]}
        assert by_name["agentkv"]["port"] == http + LEASE_PORT_OFFSET  # where the router looks for it
        assert by_name["http"]["port"] == http


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_nixl_side_channel_is_the_pod_ip_on_a_named_port(name: str) -> None:
    for deployment in engines(render(name)).values():
        c = container(deployment)
        items = [e["name"] for e in c["env"]]
        e = env(c)
        assert e["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        # The kubelet expands $(POD_IP) only from variables defined before it.
        assert items.index("POD_IP") < items.index("VLLM_NIXL_SIDE_CHANNEL_HOST")
        assert e["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
        assert int(e["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == port(c, "nixl")


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_engine_probes_graceful_stop_and_shared_memory(name: str) -> None:
    for deployment in engines(render(name)).values():
        c = container(deployment)
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["httpGet"] == {"path": "/v1/models", "port": "http"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
        pod = deployment["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > c["lifecycle"]["preStop"]["sleep"]["seconds"]
        shm = next(v for v in pod["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]


def test_gpu_engines_ask_for_tensor_parallel_gpus_rdma_and_ipc_lock() -> None:
    for deployment in engines(render("4p2d")).values():
        c = container(deployment)
        assert arg(c, "--tensor-parallel-size") == "2"
        limits = c["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 2
        assert limits["rdma/rdma_shared_device_a"] == 1
        assert limits["memory"] == "128Gi"  # the user's limits are kept beside the added ones
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert env(c)["UCX_NET_DEVICES"] == "mlx5_0:1"
        assert "--compilation-config" in c["args"] and arg(c, "--block-size") == "64"
    one = container(engines(render("1p1d"))["decode"])
    assert one["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "--tensor-parallel-size" not in one["args"] and "securityContext" not in one


def test_gpu_resource_name_is_a_value() -> None:
    docs = render("1p1d", engine={"gpuResourceName": "amd.com/gpu"})
    for deployment in engines(docs).values():
        limits = container(deployment)["resources"]["limits"]
        assert limits["amd.com/gpu"] == 1 and "nvidia.com/gpu" not in limits


def test_cpu_engines_run_eager_with_a_cpu_kv_buffer_and_the_tiny_model() -> None:
    for deployment in engines(render("cpu")).values():
        c = container(deployment)
        assert "--enforce-eager" in c["args"] and "--compilation-config" not in c["args"]
        assert kv_config(c)["kv_buffer_device"] == "cpu"
        assert "nvidia.com/gpu" not in (c.get("resources", {}).get("limits") or {})
        # The init container builds the model where the engine reads it, on the volume both mount.
        pod = deployment["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        assert init["command"] == ["agentkv", "model", "tiny", arg(c, "--model")]
        assert init["volumeMounts"][0]["name"] == "model"
        assert arg(c, "--model").startswith(init["volumeMounts"][0]["mountPath"] + "/")
        assert {"name": "model", "emptyDir": {}} in pod["volumes"]
        assert arg(c, "--served-model-name") == "tiny"


def test_tiny_model_outside_its_volume_fails() -> None:
    with pytest.raises(HelmError, match=re.escape("must lie under model.mountPath")):
        render("cpu", model={"path": "/elsewhere/tiny"})


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_every_process_reads_the_service_token_from_one_secret(name: str) -> None:
    docs = render(name)
    deployments = [*engines(docs).values(), find(docs, "Deployment", "agentkv-router")]
    want = {"secretKeyRef": {"name": "agentkv-service-token", "key": "token"}}
    for deployment in deployments:
        assert env(container(deployment))[SERVICE_TOKEN_ENV] == want


def test_a_token_value_is_kept_in_a_secret_never_in_a_command_line() -> None:
    docs = render("1p1d", serviceToken={"existingSecret": "", "value": "s3cret-token"})
    secret = find(docs, "Secret", "agentkv-service-token")
    assert base64.b64decode(secret["data"]["token"]).decode() == "s3cret-token"
    for d in docs:
        if d["kind"] == "Deployment":
            c = container(d)
            assert "s3cret-token" not in json.dumps([c.get("command"), c.get("args"), c.get("env")])
            # A new token restarts the pods that read it at start.
            assert "checksum/service-token" in d["spec"]["template"]["metadata"]["annotations"]


def test_no_service_token_fails_the_render() -> None:
    with pytest.raises(HelmError, match="decode's retention service must not be open"):
        render("1p1d", serviceToken={"existingSecret": ""})


def test_lease_settings_are_the_same_on_decode_and_router() -> None:
    docs = render("1p1d", leaseS=45, maxLeaseS=900)
    decode = kv_config(container(engines(docs)["decode"]))["kv_connector_extra_config"]
    router = env(container(find(docs, "Deployment", "agentkv-router")))
    assert decode["agentkv_lease_s"] == 45 and float(router["AGENTKV_LEASE_S"]) == 45
    assert decode["agentkv_max_lease_s"] == 900 and float(router["AGENTKV_MAX_LEASE_S"]) == 900


def test_dns_discovery_names_the_headless_services_ports() -> None:
    docs = render("1p1d")
    e = env(container(find(docs, "Deployment", "agentkv-router")))
    assert e["AGENTKV_DISCOVERY"] == "dns"
    for role in ROLES:
        host, _, number = e[f"AGENTKV_{role.upper()}_DNS"].rpartition(":")
        service = find(docs, "Service", f"agentkv-{role}")
        assert host == f"agentkv-{role}.{NAMESPACE}.svc.cluster.local"
        assert service["spec"]["clusterIP"] == "None"  # one address per engine, never load-balanced
        assert int(number) in [p["port"] for p in service["spec"]["ports"] if p["name"] == "http"]
        assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(engines(docs)[role]))
    assert ("ServiceAccount", "agentkv-router") not in kinds(docs)


def test_kubernetes_discovery_gets_a_role_to_watch_endpointslices() -> None:
    docs = render("4p2d")
    router = find(docs, "Deployment", "agentkv-router")
    e = env(container(router))
    assert e["AGENTKV_DISCOVERY"] == "kubernetes"
    assert e["AGENTKV_PREFILL_SERVICE"] == "agentkv-prefill"
    assert e["AGENTKV_DECODE_SERVICE"] == "agentkv-decode"
    assert e["AGENTKV_DISCOVERY_NAMESPACE"] == NAMESPACE
    pod = router["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "agentkv-router" and pod["automountServiceAccountToken"] is True
    (rule,) = find(docs, "Role", "agentkv-router")["rules"]
    assert rule["apiGroups"] == ["discovery.k8s.io"] and rule["resources"] == ["endpointslices"]
    assert set(rule["verbs"]) == {"get", "list", "watch"}
    binding = find(docs, "RoleBinding", "agentkv-router")
    assert binding["roleRef"]["name"] == "agentkv-router"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "agentkv-router", "namespace": NAMESPACE}
    ]


def test_static_discovery_defaults_to_the_services_with_one_engine_each() -> None:
    docs = render("1p1d", router={"discovery": {"mode": "static"}})
    e = env(container(find(docs, "Deployment", "agentkv-router")))
    assert e["AGENTKV_PREFILL"] == f"http://agentkv-prefill.{NAMESPACE}.svc.cluster.local:8100"
    assert e["AGENTKV_DECODE"] == f"http://agentkv-decode.{NAMESPACE}.svc.cluster.local:8200"
    assert "AGENTKV_DISCOVERY_INTERVAL_S" not in e
    listed = render(
        "1p1d", router={"discovery": {"mode": "static", "static": {"decode": ["http://d0:1", "http://d1:1"]}}}
    )
    assert (
        env(container(find(listed, "Deployment", "agentkv-router")))["AGENTKV_DECODE"]
        == "http://d0:1,http://d1:1"
    )
    with pytest.raises(HelmError, match="static with several decodes"):
        render("4p2d", router={"discovery": {"mode": "static", "static": {"prefill": ["http://p:1"]}}})


def test_router_settings_become_agentkv_variables_but_not_the_charts_own() -> None:
    docs = render(
        "1p1d", router={"settings": {"path_policy": "always-pd", "exact": True, "decode_load_cap": 32}}
    )
    e = env(container(find(docs, "Deployment", "agentkv-router")))
    assert (e["AGENTKV_PATH_POLICY"], e["AGENTKV_EXACT"], e["AGENTKV_DECODE_LOAD_CAP"]) == (
        "always-pd",
        "true",
        "32",
    )
    for key in ("lease_s", "store_url", "prefill", "discovery_interval_s"):
        with pytest.raises(HelmError, match=re.escape(f"router.settings.{key}")):
            render("1p1d", router={"settings": {key: "1"}})


def test_several_routers_need_redis() -> None:
    with pytest.raises(HelmError, match="through Redis"):
        render("1p1d", router={"replicas": 2})
    with pytest.raises(HelmError, match="through Redis"):
        render("1p1d", router={"autoscaling": {"enabled": True}})


def test_in_chart_redis_is_the_routers_store_and_admits_only_routers() -> None:
    docs = render("4p2d")
    url = env(container(find(docs, "Deployment", "agentkv-router")))["AGENTKV_STORE_URL"]
    service = find(docs, "Service", "agentkv-redis")
    assert url == f"redis://agentkv-redis:{service['spec']['ports'][0]['port']}/0"
    assert selects(
        {"matchLabels": service["spec"]["selector"]}, pod_labels(find(docs, "Deployment", "agentkv-redis"))
    )
    policy = find(docs, "NetworkPolicy", "agentkv-redis")
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert selects(peer["podSelector"], pod_labels(find(docs, "Deployment", "agentkv-router")))
    assert not any(selects(peer["podSelector"], pod_labels(d)) for d in engines(docs).values())


def test_external_redis_from_a_url_or_a_secret() -> None:
    docs = render("1p1d", router={"replicas": 3}, redis={"externalUrl": "redis://cache:6379/2"})
    assert (
        env(container(find(docs, "Deployment", "agentkv-router")))["AGENTKV_STORE_URL"]
        == "redis://cache:6379/2"
    )
    assert ("Deployment", "agentkv-redis") not in kinds(docs)
    docs = render("1p1d", router={"replicas": 3}, redis={"existingSecret": "redis-url"})
    assert env(container(find(docs, "Deployment", "agentkv-router")))["AGENTKV_STORE_URL"] == {
        "secretKeyRef": {"name": "redis-url", "key": "url"}
    }


def test_api_keys_are_a_mounted_secret_file() -> None:
    router = find(render("4p2d"), "Deployment", "agentkv-router")
    c = container(router)
    path = env(c)["AGENTKV_API_KEYS_FILE"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "api-keys"]
    assert path == f"{mount['mountPath']}/api-keys" and mount["readOnly"] is True
    (volume,) = [v for v in router["spec"]["template"]["spec"]["volumes"] if v["name"] == "api-keys"]
    assert volume["secret"]["secretName"] == "agentkv-api-keys"
    assert volume["secret"]["items"] == [{"key": "api-keys", "path": "api-keys"}]
    assert "AGENTKV_API_KEYS_FILE" not in env(container(find(render("1p1d"), "Deployment", "agentkv-router")))


def test_router_runs_unprivileged_and_stays_alive_while_engines_are_down() -> None:
    router = find(render("1p1d"), "Deployment", "agentkv-router")
    c = container(router)
    assert c["command"] == ["agentkv", "router"] and arg(c, "--host") == "0.0.0.0"
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # /health answers 503 without a healthy prefill and decode: liveness must not restart on that.
    assert "httpGet" not in c["livenessProbe"] and c["livenessProbe"]["tcpSocket"] == {"port": "http"}
    assert router["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    service = find(render("1p1d"), "Service", "agentkv-router")
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_autoscaling_owns_the_router_replicas() -> None:
    docs = render("4p2d")
    assert "replicas" not in find(docs, "Deployment", "agentkv-router")["spec"]
    hpa = find(docs, "HorizontalPodAutoscaler", "agentkv-router")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "agentkv-router",
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_engines_accept_traffic_only_from_the_router_and_each_other(name: str) -> None:
    docs = render(name)
    policy = find(docs, "NetworkPolicy", "agentkv-engines")["spec"]
    router = pod_labels(find(docs, "Deployment", "agentkv-router"))
    engine_pods = [pod_labels(d) for d in engines(docs).values()]
    assert all(selects(policy["podSelector"], labels) for labels in engine_pods)
    assert not selects(policy["podSelector"], router)
    assert policy["policyTypes"] == ["Ingress"]
    rules = policy["ingress"]
    assert len(rules) == 2
    # Engines reach each other on every port (UCX picks its data-path ports).
    peers = [r for r in rules if "ports" not in r]
    assert len(peers) == 1 and all(
        selects(peers[0]["from"][0]["podSelector"], labels) for labels in engine_pods
    )
    assert not selects(peers[0]["from"][0]["podSelector"], router)
    # The router reaches the HTTP and agentkv ports only.
    (from_router,) = [r for r in rules if "ports" in r]
    assert selects(from_router["from"][0]["podSelector"], router)
    wanted = set()
    for d in engines(docs).values():
        c = container(d)
        wanted |= {port(c, "http"), port(c, "agentkv")}
    assert {p["port"] for p in from_router["ports"]} == wanted


def test_metrics_peers_reach_the_engines_metrics_ports() -> None:
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    docs = render("1p1d", networkPolicy={"metricsFrom": [peer]})
    rules = find(docs, "NetworkPolicy", "agentkv-engines")["spec"]["ingress"]
    (rule,) = [r for r in rules if r["from"] == [peer]]
    assert {p["port"] for p in rule["ports"]} == {8100, 9100, 8200, 9200}


def test_network_policy_can_be_turned_off() -> None:
    docs = render("4p2d", networkPolicy={"enabled": False})
    assert not [d for d in docs if d["kind"] == "NetworkPolicy"]


def test_pod_disruption_budgets_and_service_monitor_are_off_by_default() -> None:
    docs = render("1p1d")
    assert not [d for d in docs if d["kind"] in ("PodDisruptionBudget", "ServiceMonitor")]


def test_pod_disruption_budgets_select_each_component() -> None:
    docs = render("4p2d")
    for component in ("router", "prefill", "decode"):
        pdb = find(docs, "PodDisruptionBudget", f"agentkv-{component}")
        assert pdb["spec"]["maxUnavailable"] == 1
        assert selects(pdb["spec"]["selector"], pod_labels(find(docs, "Deployment", f"agentkv-{component}")))


def test_service_monitor_scrapes_router_engines_and_connector() -> None:
    docs = render("1p1d", serviceMonitor={"enabled": True, "labels": {"release": "prom"}})
    monitor = find(docs, "ServiceMonitor", "agentkv")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    selected = [
        d
        for d in docs
        if d["kind"] == "Service" and selects(monitor["spec"]["selector"], d["metadata"]["labels"])
    ]
    assert {d["metadata"]["name"] for d in selected} == {
        "agentkv-router",
        "agentkv-prefill",
        "agentkv-decode",
    }
    endpoints = {(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]}
    assert endpoints == {("http", "/metrics"), ("agentkv", "/metrics")}
    names = {p["name"] for d in selected for p in d["spec"]["ports"]}
    assert {port for port, _ in endpoints} <= names


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_services_and_probes_name_ports_the_containers_have(name: str) -> None:
    docs = render(name)
    for d in docs:
        if d["kind"] != "Service":
            continue
        pods = [
            x
            for x in docs
            if x["kind"] == "Deployment" and selects({"matchLabels": d["spec"]["selector"]}, pod_labels(x))
        ]
        assert len(pods) == 1, d["metadata"]["name"]
        names = {p["name"] for p in container(pods[0])["ports"]}
        assert {p["targetPort"] for p in d["spec"]["ports"]} <= names


def test_extra_engine_settings_reach_vllm_after_agentkvs() -> None:
    docs = render(
        "1p1d",
        decode={
            "extraKvConfig": {"agentkv_max_retained_blocks": 1000},
            "extraArgs": ["--max-num-seqs", "64"],
        },
    )
    c = container(engines(docs)["decode"])
    assert kv_config(c)["kv_connector_extra_config"]["agentkv_max_retained_blocks"] == 1000
    assert c["args"][-2:] == ["--max-num-seqs", "64"]
    assert "--max-num-seqs" not in container(engines(docs)["prefill"])["args"]


@pytest.mark.parametrize(
    "overrides",
    [
        {"device": "tpu"},
        {"engine": {"plugin": {"tokenizerCache": True}}},  # an unquoted `on` in YAML is a boolean
        {"engine": {"replica": 2}},
        {"router": {"discovery": {"mode": "consul"}}},
        {"prefill": {"ports": {"http": 65000}}},  # its agentkv service port would not exist
        {"router": {"settings": {"timeouts": {"prefill_s": 300}}}},
        {"redis": {"externalUrl": "cache:6379"}},
    ],
)
def test_values_schema_rejects_what_would_deploy_wrong(overrides: dict[str, Any]) -> None:
    with pytest.raises(HelmError):
        render("1p1d", **overrides)


def test_values_files_merge_as_helm_merges_them() -> None:
    merged = values("1p1d", overrides={"engine": {"resources": {"requests": {"cpu": "4"}}}})
    assert merged["engine"]["resources"] == {
        "requests": {"cpu": "4", "memory": "64Gi"},
        "limits": {"memory": "64Gi"},
    }
    assert merged["serviceToken"] == TOKEN_SECRET["serviceToken"]
