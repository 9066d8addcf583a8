"""vLLM's source distribution, fetched on demand and never committed: the upstream example proxy
(``disagg_proxy_multiturn.py``) for the router benchmark, and vLLM's Python source for the connector's
API-compatibility test (``tests/unit/compat``).

Both ship only in the sdist. ``pip download --no-binary :all: vllm`` would try to build vLLM's metadata (and
its torch build dependencies), so we ask the package index pip is configured with (PEP 691 JSON, the same
protocol pip speaks), download the sdist once, check its sha256, extract what is needed and drop the archive.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import httpx

from agentkv._exceptions import ConfigError

__all__ = ["PROXY_MEMBER", "fetch_upstream_proxy", "fetch_upstream_source", "proxy_command", "upstream_cache"]

PROXY_MEMBER = "examples/disaggregated/disaggregated_serving/disagg_proxy_multiturn.py"
DEFAULT_VERSION = "0.33.0"
_INDEX = os.environ.get("AGENTKV_BENCH_INDEX", "https://pypi.org/simple")
_COMPLETE = ".complete"  # written last: a cache directory without it is an interrupted extraction


def upstream_cache() -> Path:
    """Where fetched vLLM sources are kept: outside any checkout, so a fresh clone finds them."""
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


def _extract(version: str, target_dir: Path, keep: Callable[[str], bool]) -> None:
    """Download vLLM ``version``'s sdist (40-50 MB) into ``target_dir`` and extract the members (paths
    relative to the sdist's top directory) that ``keep`` accepts; raises httpx.HTTPError when the index
    cannot be reached."""
    target_dir.mkdir(parents=True, exist_ok=True)
    archive = target_dir / f"vllm-{version}.tar.gz"
    partial = archive.with_suffix(".part")
    with httpx.Client(timeout=httpx.Timeout(30.0, read=120.0), follow_redirects=True) as client:
        url, sha256 = _sdist_url(version, client)
        digest = hashlib.sha256()
        with client.stream("GET", url) as response, partial.open("wb") as out:
            response.raise_for_status()
            for chunk in response.iter_bytes():
                digest.update(chunk)
                out.write(chunk)
    if digest.hexdigest() != sha256:
        partial.unlink(missing_ok=True)
        raise ConfigError(f"sha256 mismatch for {url}")
    partial.rename(archive)
    top = f"vllm-{version}/"
    try:
        with tarfile.open(archive) as tar:
            for member in tar:
                name = member.name.removeprefix(top)
                if not member.isfile() or name == member.name or ".." in PurePosixPath(name).parts:
                    continue
                if keep(name):
                    data = tar.extractfile(member)
                    assert data is not None  # a regular file
                    dest = target_dir / name
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(data.read())
    finally:
        archive.unlink()  # only the extracted files are needed; keep the cache small


def fetch_upstream_proxy(version: str = DEFAULT_VERSION) -> Path:
    """Path to the cached proxy script, downloading vLLM's sdist on first use."""
    target_dir = upstream_cache() / f"vllm-{version}"
    target = target_dir / Path(PROXY_MEMBER).name
    if target.exists():
        return target
    _extract(version, target_dir, lambda name: name == PROXY_MEMBER)
    extracted = target_dir / PROXY_MEMBER
    if not extracted.exists():
        raise ConfigError(f"{PROXY_MEMBER} missing from vllm-{version}.tar.gz")
    extracted.rename(target)
    return target


def fetch_upstream_source(version: str, *, cache: Path) -> Path:
    """vLLM ``version``'s source tree (the ``vllm/`` package's Python files and ``requirements/``) under
    ``cache/vllm-<version>/``, downloaded and extracted on first use; returns that directory."""
    target_dir = cache / f"vllm-{version}"
    if (target_dir / _COMPLETE).exists():
        return target_dir
    _extract(
        version,
        target_dir,
        lambda name: (
            (name.startswith("vllm/") and name.endswith(".py"))
            or (name.startswith("requirements/") and name.endswith(".txt"))
        ),
    )
    (target_dir / _COMPLETE).touch()
    return target_dir


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
