"""`agentkv.server.engine.internals.INTERNALS` names every vLLM internal agentkv wraps, replaces or overrides,
and each target exists in exactly the checked releases its entry says."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from agentkv.server.engine.internals import API_CHECKED, INTERNALS, Internal

from ._api import REPO, Tree, uses

# Run in a child process: installing the plugin and the connector's hasher patches vLLM and starlette for
# good, which the rest of the suite must not see.
_FIND_PATCHES = r"""
import json, os, sys, types
os.environ.update(
    AGENTKV_TOKENIZER_CACHE="on", AGENTKV_DETOKENIZER_PRIME_TOKENS="128", AGENTKV_FORWARDED_IDS="always",
    AGENTKV_FAST_JSON="on", AGENTKV_PREFILL_TOKEN="on",
)
from agentkv.server.engine.plugin import register
from agentkv.server.engine._connector import _block_hashes

register()
assert _block_hashes.install(max_tokens=1024) is not None
ROOTS = ("vllm", "starlette")

def ours(value):
    # A wrapper copies its original's name and module (functools.wraps), never its code object.
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    return isinstance(value, types.FunctionType) and "/agentkv/" in value.__code__.co_filename

found = set()
for name, module in list(sys.modules.items()):
    if name.split(".")[0] not in ROOTS or module is None:
        continue
    for attr, value in list(vars(module).items()):
        if ours(value):
            found.add(f"{name}.{attr}")
        if isinstance(value, type) and value.__module__ == name:
            found.update(f"{name}.{value.__qualname__}.{a}" for a, v in list(vars(value).items()) if ours(v))
print(json.dumps(sorted(found)))
"""


def _by_how(*hows: str) -> set[str]:
    return {i.target for i in INTERNALS if i.how in hows}


def test_every_function_of_ours_on_a_vllm_or_starlette_object_is_listed() -> None:
    """With every plugin part switched on and the connector's hasher installed (as in an engine), each vLLM or
    starlette attribute that holds agentkv's code is a listed wrap or replacement, and each listed one that
    this vLLM has is found there."""
    pytest.importorskip("vllm")
    from agentkv.server.launch._versions import installed_version

    out = subprocess.run(
        [sys.executable, "-c", _FIND_PATCHES], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert found, "the plugin installed nothing: the search itself is broken"
    assert found <= _by_how("wrapped", "replaced"), f"not in INTERNALS: {sorted(found - _by_how('wrapped'))}"
    installed = (installed_version() or "").split("+")[0]
    expected = {
        i.target
        for i in INTERNALS
        if i.how in ("wrapped", "replaced") and (not i.releases or installed in i.releases)
    }
    assert expected <= found, f"listed but not installed on vLLM {installed}: {sorted(expected - found)}"


def test_every_method_our_connector_overrides_is_listed() -> None:
    overridden = {f"{u.module}.{u.owner}.{u.name}" for u in uses() if u.kind == "override"}
    assert overridden, "the override search found nothing: it is broken"
    assert overridden == _by_how("overridden")


def test_entries_name_code_of_ours_that_exists() -> None:
    import importlib

    for entry in INTERNALS:
        module, _, attr = entry.by.rpartition(".")
        try:
            importlib.import_module(entry.by)  # a module of ours
            continue
        except ImportError:
            pass
        assert hasattr(importlib.import_module(module), attr), entry
        assert set(entry.releases) <= set(API_CHECKED), entry


def _exists(tree: Tree, target: str) -> bool:
    """Whether `target` (module[.Class].name) is in this vLLM source tree."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        if tree.module(module) is None:
            continue
        rest = parts[cut:]
        if len(rest) == 1:
            return tree.resolve(module, rest[0]) is not None
        cls = tree.cls(module, rest[0])
        return cls is not None and len(rest) == 2 and cls.has_member(rest[1])
    return False


@pytest.mark.parametrize(
    "entry", [i for i in INTERNALS if i.releases], ids=lambda i: i.target.split(".", 2)[-1]
)
def test_each_target_is_in_exactly_the_releases_its_entry_names(
    entry: Internal, trees: dict[str, Tree]
) -> None:
    present = tuple(v for v, tree in trees.items() if _exists(tree, entry.target))
    assert present == entry.releases, f"{entry.target}: in {present}, listed for {entry.releases}"


@pytest.fixture(scope="module")
def trees() -> dict[str, Tree]:
    import httpx

    from bench._upstream import fetch_upstream_source, upstream_cache

    out = {}
    for version in API_CHECKED:
        try:
            out[version] = Tree(fetch_upstream_source(version, cache=upstream_cache()))
        except httpx.HTTPError as exc:
            pytest.skip(f"vLLM {version}'s source could not be fetched from the package index: {exc!r}")
    return out


def test_the_existence_check_sees_a_missing_target(trees: dict[str, Tree]) -> None:
    tree = trees[API_CHECKED[-1]]
    assert _exists(tree, "vllm.renderers.base.BaseRenderer._tokenize_prompt")
    assert not _exists(tree, "vllm.renderers.base.BaseRenderer.no_such_method")
    assert not _exists(tree, "vllm.no_such_module.Thing.x")
    assert isinstance(tree.module("vllm.renderers.base"), ast.Module)
