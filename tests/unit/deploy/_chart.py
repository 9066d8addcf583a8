"""The chart rendered by Helm's own engine, read back as plain manifests.

Rendering goes through helm-python-sdk (Helm's Go SDK behind ctypes, pinned in the `dev` extra): no binary,
no cluster, a few milliseconds a render. Everything else here and in the tests works on the rendered YAML,
so another renderer (the `helm template` binary) can replace ``render_templates`` alone.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import helm_python
import yaml

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "deploy" / "helm" / "agentkv"
EXAMPLES = ROOT / "deploy" / "helm" / "examples"
IMAGES = ROOT / "deploy" / "images"
GOLDEN = Path(__file__).resolve().parent / "golden"
RELEASE = "agentkv"
NAMESPACE = "agentkv"
EXAMPLE_NAMES = ("1p1d", "4p2d", "cpu")

Manifest = dict[str, Any]


def example(name: str) -> Path:
    return EXAMPLES / f"values-{name}.yaml"


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Helm's merge of values files: maps merge key by key, anything else in ``over`` replaces."""
    out = copy.deepcopy(dict(base))
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def values(*files: Path | str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The user values of ``-f file ...`` (example names or paths), then ``overrides``, as Helm merges."""
    out: dict[str, Any] = {}
    for f in files:
        path = example(f) if isinstance(f, str) and f in EXAMPLE_NAMES else Path(f)
        out = merge(out, yaml.safe_load(path.read_text()) or {})
    return merge(out, overrides or {})


def render_templates(user_values: Mapping[str, Any]) -> dict[str, str]:
    """Template path -> rendered text, as `helm template agentkv deploy/helm/agentkv -n agentkv` renders it
    (the chart's values.schema.json checked first; a failure raises helm_python's HelmError)."""
    with helm_python.Chart.load(CHART) as chart:
        return chart.render(dict(user_values), name=RELEASE, namespace=NAMESPACE, is_install=True)


def coalesced(user_values: Mapping[str, Any]) -> dict[str, Any]:
    """The chart's defaults with ``user_values`` over them, as the templates see ``.Values``."""
    with helm_python.Chart.load(CHART) as chart:
        return chart.merge_values(dict(user_values))


def stream(user_values: Mapping[str, Any]) -> str:
    """The manifests as one YAML stream, templates in name order (what the golden files hold)."""
    parts = []
    for name, text in sorted(render_templates(user_values).items()):
        if not name.endswith(".yaml") or not text.strip():
            continue
        # A template that starts with its own separator would leave an empty document after the comment.
        body = text.strip().removeprefix("---").strip()
        parts.append(f"---\n# Source: {name}\n{body}\n")
    return "".join(parts)


def manifests(user_values: Mapping[str, Any]) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(stream(user_values)) if doc]


def render(*files: Path | str, **overrides: Any) -> list[Manifest]:
    """The manifests of ``-f files`` with ``overrides`` (nested dicts) over them."""
    return manifests(values(*files, overrides=overrides))


def find(docs: Iterable[Manifest], kind: str, name: str) -> Manifest:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def kinds(docs: Iterable[Manifest]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


def container(deployment: Manifest, name: str | None = None) -> dict[str, Any]:
    """The one container (or the one named) of a Deployment's pod."""
    containers = deployment["spec"]["template"]["spec"]["containers"]
    if name is None:
        assert len(containers) == 1, [c["name"] for c in containers]
        return containers[0]
    return next(c for c in containers if c["name"] == name)


def env(c: Mapping[str, Any]) -> dict[str, Any]:
    """A container's environment by name: the value, or the valueFrom object."""
    out: dict[str, Any] = {}
    for item in c.get("env") or []:
        assert item["name"] not in out, f"{item['name']} set twice"
        out[item["name"]] = item["value"] if "value" in item else item["valueFrom"]
    return out


def port(c: Mapping[str, Any], name: str) -> int:
    return next(int(p["containerPort"]) for p in c["ports"] if p["name"] == name)


def arg(c: Mapping[str, Any], flag: str) -> str:
    """The value after ``flag`` in a container's args."""
    args = c["args"]
    assert args.count(flag) == 1, f"{flag} given {args.count(flag)} times"
    return str(args[args.index(flag) + 1])
