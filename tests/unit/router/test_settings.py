"""RouterSettings from keywords, env and files; the exported surface."""

from __future__ import annotations

import json

import pytest

import agentkv.server.router as router
from agentkv._exceptions import ConfigError
from agentkv.server.router import RouterSettings


def test_exported_members_are_sorted_and_real() -> None:
    assert router.__all__ == sorted(router.__all__)
    assert all(hasattr(router, name) for name in router.__all__)


def test_env_with_comma_separated_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTKV_PREFILL", "http://p:8100, p2:8101")
    monkeypatch.setenv("AGENTKV_DECODE", "http://d:8200")
    monkeypatch.setenv("AGENTKV_API_KEYS", "a,b")
    monkeypatch.setenv("AGENTKV_TIMEOUTS__CONNECT_S", "1.5")
    monkeypatch.setenv("AGENTKV_REUSE", "false")
    s = RouterSettings()
    assert s.prefill == ["http://p:8100", "p2:8101"] and s.api_keys == ["a", "b"]
    assert s.timeouts.connect_s == 1.5 and s.reuse is False
    prefill, decode = s.backends()
    assert prefill[1].url == "http://p2:8101"
    assert decode[0].control_url == "http://d:9200"  # HTTP port + LEASE_PORT_OFFSET


def test_from_file_toml_and_json_with_overrides(tmp_path) -> None:
    toml = tmp_path / "r.toml"
    toml.write_text(
        '[router]\nprefill = ["http://p:1"]\ndecode = ["http://d:2"]\ndecode_control = ["http://c:3"]\n'
        "[router.timeouts]\nprefill_s = 9\n"
    )
    s = RouterSettings.from_file(toml, port=20001)
    assert s.port == 20001 and s.timeouts.prefill_s == 9 and s.backends()[1][0].control_url == "http://c:3"
    js = tmp_path / "r.json"
    js.write_text(
        json.dumps(
            {"prefill": "http://p:1", "decode": ["http://d:2"], "path_policy": "always-local", "exact": False}
        )
    )
    assert RouterSettings.from_file(js).path_policy == "always-local"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"decode": ["http://d:1"]}, "at least one --prefill URL is required"),
        ({"prefill": ["http://p:1"]}, "at least one --decode URL is required"),
        ({"prefill": ["ftp://p:1"], "decode": ["http://d:1"]}, "invalid backend URL"),
        ({"prefill": ["p:1"], "decode": ["d:1"], "decode_control": ["a", "b"]}, "one entry per --decode"),
        ({"prefill": ["p:1"], "decode": ["d:1"], "path_policy": "sometimes"}, "path_policy"),
        ({"prefill": ["p:1"], "decode": ["d:1"], "store_url": "memcached://x"}, "redis://"),
        ({"prefill": ["p:1"], "decode": ["d:1"], "lease_s": 700}, "max_lease_s"),
        (
            {"prefill": ["p:1"], "decode": ["d:1"], "path_policy": "always-local", "exact": True},
            "needs exact=false",
        ),
    ],
)
def test_readable_validation_errors(values: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RouterSettings.build(**values)


def test_from_file_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        RouterSettings.from_file(tmp_path / "missing.toml")
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    with pytest.raises(ConfigError, match="table/object"):
        RouterSettings.from_file(bad)
