"""bench.agreement's comparison with the single server: Fisher's exact test on textbook tables."""

from __future__ import annotations

import argparse

import pytest

from bench._plugin_args import kv_config_item
from bench.agreement import _against_single, fisher_p


def test_fisher_p_on_textbook_tables() -> None:
    # Fisher's tea tasting (3 of 4 against 1 of 4): 17/35; Wikipedia's 1 of 10 against 11 of 14.
    assert fisher_p(3, 4, 1, 4) == pytest.approx(17 / 35)
    assert fisher_p(1, 10, 11, 14) == pytest.approx(0.0027594561852)
    assert fisher_p(5, 10, 5, 10) == pytest.approx(1.0)
    assert fisher_p(1, 10, 11, 14) == pytest.approx(fisher_p(11, 14, 1, 10))


def test_each_pd_side_is_compared_with_the_single_servers_agreement() -> None:
    summary = {
        "P/D default": {"turns": 192, "same_tokens": 163, "same_as_reference": 162},
        "single server": {"turns": 192, "same_tokens": 179, "same_as_reference": None},
    }
    _against_single(summary)
    side = summary["P/D default"]
    assert side["p_vs_single"] == round(fisher_p(163, 192, 179, 192), 4)
    assert side["p_vs_single_reference"] == round(fisher_p(162, 192, 179, 192), 4)
    assert 0 < side["p_vs_single_reference"] < side["p_vs_single"] < 0.05
    assert "p_vs_single" not in summary["single server"]


def test_connector_keys_from_the_command_line() -> None:
    items = ["agentkv_decode_tail_tokens=2", "agentkv_prefix_check=false", "mode=fast"]
    assert dict(map(kv_config_item, items)) == {
        "agentkv_decode_tail_tokens": 2,
        "agentkv_prefix_check": False,
        "mode": "fast",
    }
    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        kv_config_item("agentkv_decode_tail_tokens")
