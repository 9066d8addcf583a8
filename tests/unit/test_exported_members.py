"""Every public name is listed in ``__all__`` and importable (like httpx's test of the same name)."""

import importlib

import pytest

import agentkv
from agentkv import _exceptions

PACKAGES = ["agentkv", "agentkv.client", "agentkv.session", "agentkv.integrations"]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_unique_and_importable(name: str) -> None:
    # Order is ruff's job (RUF022, isort-style); here: no duplicates, nothing dangling.
    module = importlib.import_module(name)
    assert len(set(module.__all__)) == len(module.__all__)
    for member in module.__all__:
        assert getattr(module, member) is not None, member


@pytest.mark.parametrize("name", PACKAGES[1:])
def test_every_public_attribute_is_exported(name: str) -> None:
    module = importlib.import_module(name)
    public = {
        n for n, v in vars(module).items() if not n.startswith("_") and not isinstance(v, type(importlib))
    }
    assert public == set(module.__all__)


def test_top_level_exports_exceptions_and_version() -> None:
    assert set(_exceptions.__all__) <= set(agentkv.__all__)
    assert agentkv.__version__ == "0.1.0"
    for name in agentkv.__all__:
        if name != "__version__":
            assert getattr(agentkv, name).__module__.startswith("agentkv"), name
