"""The pure vLLM version rules behind ``serve``, ``up`` and the warm-up (their wiring: test_warmup.py,
test_launcher.py)."""

from __future__ import annotations

import httpx
import pytest

from agentkv import EngineVersionError
from agentkv.server.launch._versions import API_CHECKED, check_versions, engine_version, is_supported


@pytest.mark.parametrize("version", [*API_CHECKED, "0.29.1", "0.34.0+cu130", "0.33.1rc1", "0.32.0+cpu"])
def test_supported_releases(version: str) -> None:
    assert is_supported(version)


@pytest.mark.parametrize("version", ["0.25.9", "0.35.0", "1.0.0", "0.4.0", "dev", ""])
def test_unsupported_releases(version: str) -> None:
    assert not is_supported(version)


def test_one_engine_is_checked_for_support_only() -> None:
    check_versions({"decode": "0.33.0"})
    with pytest.raises(EngineVersionError, match=r"decode runs vLLM 0\.35\.0"):
        check_versions({"decode": "0.35.0"})


def test_prefill_and_decode_must_run_the_same_release() -> None:
    check_versions({"prefill": "0.34.0", "decode": "0.34.0"})
    # Patch releases differ in vLLM's compatibility hash too (it includes the whole version string).
    with pytest.raises(EngineVersionError, match=r"same vLLM release.*prefill 0\.34\.0, decode 0\.34\.1"):
        check_versions({"prefill": "0.34.0", "decode": "0.34.1"})


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(200, json={"version": 34}),
        httpx.Response(200, json={"v": "0.34.0"}),
        httpx.Response(404),
        httpx.Response(200, text="not json"),
    ],
)
def test_an_engine_without_a_version_is_one_clear_error(answer: httpx.Response) -> None:
    with (
        httpx.Client(transport=httpx.MockTransport(lambda _: answer)) as http,
        pytest.raises(EngineVersionError, match=r"http://e:1/version did not report a vLLM version"),
    ):
        engine_version(http, "http://e:1")


def test_engine_version_reads_vllms_answer() -> None:
    answer = httpx.Response(200, json={"version": "0.32.0"})
    with httpx.Client(transport=httpx.MockTransport(lambda _: answer)) as http:
        assert engine_version(http, "http://e:1") == "0.32.0"


def _installed(monkeypatch: pytest.MonkeyPatch, dists: dict[str, str]) -> None:
    from agentkv.server.launch import _versions

    def version(name: str) -> str:
        if name not in dists:
            raise _versions.metadata.PackageNotFoundError(name)
        return dists[name]

    monkeypatch.setattr(_versions.metadata, "version", version)


@pytest.mark.parametrize(
    "dists",
    [
        {"torch": "2.13.0+cpu"},
        {"torch": "2.13.0+cpu", "torchvision": "0.28.0+cpu"},
        {"torch": "2.13.0", "torchvision": "0.28.0"},  # CUDA torch with its CUDA companions
        {},
    ],
)
def test_torch_companions_that_load_pass(monkeypatch: pytest.MonkeyPatch, dists: dict[str, str]) -> None:
    from agentkv.server.launch._versions import check_torch_companions

    _installed(monkeypatch, dists)
    check_torch_companions()


def test_a_cuda_torchvision_beside_a_cpu_torch_says_what_to_uninstall(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What `pip install 'agentkv[cpu]'` brings from PyPI: the error names the package and the command."""
    from agentkv import EngineNotInstalledError
    from agentkv.server.launch._model import make_tiny_model
    from agentkv.server.launch._versions import check_torch_companions

    _installed(monkeypatch, {"torch": "2.13.0+cpu", "torchvision": "0.28.0", "torchaudio": "2.13.0+cpu"})
    with pytest.raises(
        EngineNotInstalledError, match=r"torchvision 0\.28\.0 .*pip uninstall -y torchvision"
    ) as e:
        check_torch_companions()
    assert "torchaudio" not in str(e.value).split("pip uninstall")[0]
    with pytest.raises(EngineNotInstalledError, match="pip uninstall -y torchvision"):
        make_tiny_model("/nonexistent/never-written")
