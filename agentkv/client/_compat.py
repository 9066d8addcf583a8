"""The one place that knows which httpx flavour the installed openai SDK speaks.

openai 3.x is built on ``httpx2`` (pydantic's fork); openai 2.x on ``httpx``. Our own control-plane
client always uses ``httpx`` (a direct dependency). Everything we hand to the openai SDK (its
``http_client``, timeouts) must come from :data:`http`, and error classification must accept the
exception classes of both, because openai 2.x also accepts an ``httpx2`` client.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

import httpx
import openai

__all__ = ["exception_classes", "http", "openai_major", "select_http_module"]


def openai_major(version: str) -> int:
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else 0


def select_http_module(openai_version: str) -> ModuleType:
    """``httpx2`` for openai>=3, else ``httpx``."""
    if openai_major(openai_version) >= 3:
        try:
            return importlib.import_module("httpx2")
        except ImportError as exc:  # pragma: no cover - openai 3 depends on httpx2
            raise ImportError("openai>=3 needs httpx2: pip install httpx2") from exc
    return httpx


http: ModuleType = select_http_module(openai.__version__)


def _loaded_modules() -> list[ModuleType]:
    # Only modules already imported can have produced an exception, so never import httpx2 here.
    modules: list[ModuleType] = [httpx]
    extra = sys.modules.get("httpx2")
    if extra is not None:
        modules.append(extra)
    return modules


def exception_classes(name: str) -> tuple[type[BaseException], ...]:
    """``exception_classes("ConnectError")`` -> the class from every loaded httpx flavour."""
    found: list[Any] = [getattr(m, name) for m in _loaded_modules() if hasattr(m, name)]
    return tuple(found)
