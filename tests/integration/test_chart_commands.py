"""The chart's commands serve a reused turn: the CPU example rendered, each container's command, arguments and
environment taken from the manifests and started as a local process the way the kubelet starts it in its
pod, then two turns of one conversation through the rendered router.

What stands in for the cluster: the downward API's pod address is 127.0.0.1 and `$(VAR)` references are
expanded as the kubelet expands them; the Secret the example names is "created" with the suite's token;
volumes are directories (each init container builds the model in its own; the engines then read one of the
two identical copies at one path, as pods read theirs at one mountPath: vLLM hashes the `--model` string
into NIXL's handshake); the Services' DNS names resolve to 127.0.0.1 (static discovery: no cluster DNS
here). Values set on top of the example, all of them chart values: distinct free ports (the "pods" share
one address), UCX on the loopback device (as agentkv's launcher runs engines on one host), every turn
through prefill (`path_policy` always-pd) and prefill without a prefix cache, so that the second turn is a
pull of decode's KV over NIXL, not prefill's own cache or a decode-local turn.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentkv._constants import H_PATH, H_PULLED_TOKENS, H_REUSE, H_REUSED_TOKENS, service_headers
from agentkv.server.launch._launcher import free_port, kill_group, tail
from tests.unit.deploy._chart import NAMESPACE, container, find, manifests, values

from ._clusters import LOG_DIR, Clusters
from ._helpers import conversation_script, new_id, run_conversation

POD_IP = "127.0.0.1"
TOKEN_SECRET = ("agentkv-service-token", "token")
LOGS = LOG_DIR / "chart"


def expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's expansion: `$(NAME)` of a variable defined so far, `$$` a literal `$`, the rest as is."""

    def one(m: re.Match[str]) -> str:
        return "$" if m[0] == "$$" else env.get(m[1], m[0])

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


class Pod:
    """One container of a rendered pod, run as a local process with its volumes as directories."""

    def __init__(
        self,
        name: str,
        c: dict[str, Any],
        *,
        secrets: Mapping[tuple[str, str], str],
        volumes: Mapping[str, Path],
    ) -> None:
        self.name = name
        self.c = c
        self.mounts = {
            m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", []) if m["name"] != "shm"
        }
        self.env: dict[str, str] = {}
        for item in c.get("env", []):
            if "value" in item:
                value = expand(item["value"], self.env)
            elif "fieldRef" in item["valueFrom"]:
                value = {"status.podIP": POD_IP, "metadata.namespace": NAMESPACE}[
                    item["valueFrom"]["fieldRef"]["fieldPath"]
                ]
            else:
                ref = item["valueFrom"]["secretKeyRef"]
                value = secrets[(ref["name"], ref["key"])]
            self.env[item["name"]] = self.local(value)
        argv = [self.local(expand(a, self.env)) for a in [*c["command"], *c.get("args", [])]]
        # The image's interpreter and console script are this environment's.
        if argv[0] == "python3":
            argv[0] = sys.executable
        elif argv[0] == "agentkv" and shutil.which("agentkv") is None:
            argv[:1] = [sys.executable, "-m", "agentkv.cli"]
        self.argv = argv
        self.log = LOGS / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def local(self, value: str) -> str:
        for mount, directory in self.mounts.items():
            if value == mount or value.startswith(mount + "/"):
                directory.mkdir(parents=True, exist_ok=True)
                return str(directory) + value[len(mount) :]
        return value

    def start(self) -> None:
        LOGS.mkdir(parents=True, exist_ok=True)
        # A pod's environment is its container's: none of this machine's agentkv, vLLM or UCX settings.
        base = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTKV_", "VLLM_", "UCX_"))}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                self.argv,
                env={**base, **self.env},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def port(self, name: str | int) -> int:
        if isinstance(name, int):
            return name
        return next(int(p["containerPort"]) for p in self.c["ports"] if p["name"] == name)

    def wait(self, probe_name: str, *, limit_s: float | None = None) -> None:
        """Until the probe passes (within periodSeconds x failureThreshold, or ``limit_s``)."""
        probe = self.c[probe_name]
        get = probe["httpGet"]
        url = f"http://{POD_IP}:{self.port(get['port'])}{get['path']}"
        budget = limit_s or probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
        deadline = time.monotonic() + budget
        while True:
            assert self.proc is not None and self.proc.poll() is None, (
                f"{self.name} exited:\n{tail(self.log)}"
            )
            try:
                if 200 <= httpx.get(url, timeout=probe.get("timeoutSeconds", 1)).status_code < 400:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (
                f"{self.name}: {probe_name} not passed in {budget:.0f}s:\n{tail(self.log)}"
            )
            time.sleep(1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc.pid, timeout_s=20)
            self.proc.wait(timeout=5)


@pytest.fixture
def pods() -> Iterator[list[Pod]]:
    started: list[Pod] = []
    yield started
    for pod in reversed(started):
        pod.stop()


def test_rendered_cpu_commands_serve_a_reused_turn(
    clusters: Clusters, service_token: str, tmp_path: Path, pods: list[Pod]
) -> None:
    clusters.stop()  # two cores run one cluster at a time
    prefill_http = free_port(18410, offsets=(1000,))
    decode_http = free_port(18420, offsets=(1000,))
    router_port = free_port(18430)
    overrides = {
        "engine": {"rdma": {"ucxNetDevices": "lo"}},
        "prefill": {"ports": {"http": prefill_http, "nixl": free_port(18440)}, "prefixCaching": False},
        "decode": {"ports": {"http": decode_http, "nixl": free_port(18450)}},
        "router": {
            "port": router_port,
            "discovery": {"mode": "static"},
            "settings": {"path_policy": "always-pd"},
        },
    }
    docs = manifests(values("cpu", overrides=overrides))
    secrets = {TOKEN_SECRET: service_token}
    services = {f"agentkv-{role}.{NAMESPACE}.svc.cluster.local" for role in ("prefill", "decode")}

    inits, specs = [], {}
    for role in ("prefill", "decode"):
        specs[role] = find(docs, "Deployment", f"agentkv-{role}")["spec"]["template"]["spec"]
        (init,) = specs[role]["initContainers"]
        inits.append(Pod(f"{role}-init", init, secrets=secrets, volumes={"model": tmp_path / role}))
    for pod in inits:  # each pod builds its own model: the same seed must give both the same files
        pods.append(pod)
        pod.start()
    for pod in inits:
        assert pod.proc is not None
        assert pod.proc.wait(timeout=600) == 0, f"{pod.name}:\n{tail(pod.log)}"
    built = [tmp_path / role / "tiny" for role in ("prefill", "decode")]
    assert sorted(p.name for p in built[0].iterdir()) == sorted(p.name for p in built[1].iterdir())
    for f in built[0].iterdir():
        assert f.read_bytes() == (built[1] / f.name).read_bytes(), f"{f.name} differs between the pods"

    # One copy at one path for both engines (the module's docstring says why).
    engines = {
        role: Pod(role, spec["containers"][0], secrets=secrets, volumes={"model": tmp_path / "prefill"})
        for role, spec in specs.items()
    }
    for pod in engines.values():
        pods.append(pod)
        pod.start()
    for pod in engines.values():
        pod.wait("startupProbe")
        pod.wait("readinessProbe")

    router_container = container(find(docs, "Deployment", "agentkv-router"))
    router = Pod("router", router_container, secrets=secrets, volumes={"tmp": tmp_path / "router"})
    for key in ("AGENTKV_PREFILL", "AGENTKV_DECODE"):
        for host in services:
            router.env[key] = router.env[key].replace(host, POD_IP)
    pods.append(router)
    router.start()
    router.wait("readinessProbe", limit_s=120)

    url = f"http://{POD_IP}:{router.port('http')}"
    first, second = run_conversation(url, conversation_script(7301, 2), conversation_id=new_id("chart"))
    assert first.headers[H_REUSE] != "hit", first.headers
    assert second.headers[H_REUSE] == "hit", second.headers
    assert second.headers[H_PATH] == "pull", second.headers
    assert int(second.headers[H_PULLED_TOKENS]) > 0, second.headers
    assert int(second.headers[H_REUSED_TOKENS]) >= int(second.headers[H_PULLED_TOKENS]), second.headers

    # Decode's retention service took the Secret's token: it refuses a call without it.
    info = f"http://{POD_IP}:{engines['decode'].port('agentkv')}/agentkv/v1/info"
    assert httpx.get(info, timeout=5).status_code == 401
    answer = httpx.get(info, headers=service_headers(service_token), timeout=5)
    assert answer.status_code == 200 and answer.json()["retained"] >= 1, answer.text
