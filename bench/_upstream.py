"""The upstream vLLM example proxy (``disagg_proxy_multiturn.py``), fetched at bench time, never committed.

It ships only in vLLM's source distribution. ``pip download --no-binary :all: vllm`` would try to build
vLLM's metadata (and its torch build dependencies), so we ask the package index pip is configured with
(PEP 691 JSON, the same protocol pip speaks), download the sdist once, check its sha256, and extract the
one file into ``~/.cache/agentkv/upstream/vllm-<version>/``.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tarfile
from pathlib import Path

import httpx

from agentkv._exceptions import ConfigError

__all__ = ["PROXY_MEMBER", "fetch_upstream_proxy", "proxy_command"]

PROXY_MEMBER = "examples/disaggregated/disaggregated_serving/disagg_proxy_multiturn.py"
DEFAULT_VERSION = "0.33.0"
_INDEX = os.environ.get("AGENTKV_BENCH_INDEX", "https://pypi.org/simple")


def _cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "agentkv" / "upstream"


def _sdist_url(version: str, client: httpx.Client) -> tuple[str, str]:
    response = client.get(
        f"{_INDEX.rstrip('/')}/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    response.raise_for_status()
    wanted = f"vllm-{version}.tar.gz"
    for entry in response.json()["files"]:
        if entry["filename"] == wanted:
            return str(entry["url"]), str(entry["hashes"]["sha256"])
    raise ConfigError(f"{wanted} is not on the package index {_INDEX}")


def fetch_upstream_proxy(version: str = DEFAULT_VERSION) -> Path:
    """Path to the cached proxy script, downloading vLLM's sdist (~47 MB) on first use."""
    target_dir = _cache_root() / f"vllm-{version}"
    target = target_dir / Path(PROXY_MEMBER).name
    if target.exists():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    archive = target_dir / f"vllm-{version}.tar.gz"
    with httpx.Client(timeout=httpx.Timeout(30.0, read=120.0), follow_redirects=True) as client:
        url, sha256 = _sdist_url(version, client)
        digest = hashlib.sha256()
        partial = archive.with_suffix(".part")
        with client.stream("GET", url) as response, partial.open("wb") as out:
            response.raise_for_status()
            for chunk in response.iter_bytes():
                digest.update(chunk)
                out.write(chunk)
    if digest.hexdigest() != sha256:
        partial.unlink(missing_ok=True)
        raise ConfigError(f"sha256 mismatch for {url}")
    partial.rename(archive)
    with tarfile.open(archive) as tar:
        member = tar.extractfile(f"vllm-{version}/{PROXY_MEMBER}")
        if member is None:
            raise ConfigError(f"{PROXY_MEMBER} missing from vllm-{version}.tar.gz")
        target.write_bytes(member.read())
    archive.unlink()  # only the one example file is needed; keep the cache small
    return target


def proxy_command(script: Path, *, port: int, prefill_port: int, decode_port: int) -> list[str]:
    """How the proxy's own docstring says to start it (argparse flags of the 0.33.0 example)."""
    return [
        sys.executable,
        str(script),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefiller-host",
        "127.0.0.1",
        "--prefiller-port",
        str(prefill_port),
        "--decoder-host",
        "127.0.0.1",
        "--decoder-port",
        str(decode_port),
    ]
