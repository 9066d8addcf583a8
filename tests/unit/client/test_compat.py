import importlib.util

import httpx
import pytest

from agentkv.client import _compat


@pytest.mark.parametrize(("version", "major"), [("2.54.0", 2), ("3.0.0rc1", 3), ("10.1", 10), ("dev", 0)])
def test_openai_major(version: str, major: int) -> None:
    assert _compat.openai_major(version) == major


def test_openai_2_uses_httpx() -> None:
    assert _compat.select_http_module("2.54.0") is httpx


@pytest.mark.skipif(importlib.util.find_spec("httpx2") is None, reason="httpx2 not installed")
def test_openai_3_uses_httpx2() -> None:
    module = _compat.select_http_module("3.1.0")
    assert module.__name__ == "httpx2"
    # Once httpx2 is loaded, errors of both flavours must be recognised.
    assert module.ConnectError in _compat.exception_classes("ConnectError")
    assert httpx.ConnectError in _compat.exception_classes("ConnectError")


def test_installed_openai_matches_selected_module() -> None:
    import openai

    expected = "httpx2" if _compat.openai_major(openai.__version__) >= 3 else "httpx"
    assert _compat.http.__name__ == expected
