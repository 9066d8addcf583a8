from __future__ import annotations

import json
import math
import re

import httpx
import pytest

from bench._common import percentile, sse_chunks, summarize, write_results


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 90, 4.6),
        ([10.0], 99, 10.0),
        ([3.0, 1.0, 2.0], 50, 2.0),  # unsorted input
    ],
)
def test_percentile_interpolates_linearly_between_ranks(
    values: list[float], q: float, expected: float
) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_matches_numpy_default() -> None:
    np = pytest.importorskip("numpy")
    values = [0.3, 7.1, 2.2, 9.9, 4.4, 4.4, 0.0, 12.5, 3.3]
    for q in (1, 25, 50, 75, 90, 99):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_nothing_is_nan_not_zero() -> None:
    assert math.isnan(percentile([], 50))


@pytest.mark.parametrize("q", [-1, 100.5])
def test_percentile_rejects_out_of_range(q: float) -> None:
    with pytest.raises(ValueError):
        percentile([1.0], q)


def test_summarize_scales_every_statistic_but_the_count() -> None:
    summary = summarize([0.001, 0.002, 0.003], scale=1000)
    assert summary["count"] == 3
    assert summary["p50"] == pytest.approx(2.0)
    assert summary["mean"] == pytest.approx(2.0)
    assert summary["max"] == pytest.approx(3.0)


def test_write_results_records_command_versions_and_nulls_for_nan(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.setenv("VLLM_API_KEY", "sk-not-for-results")
    monkeypatch.setenv("AGENTKV_UPSTREAM_TOKEN", "not-for-results")
    monkeypatch.setenv("AGENTKV_REDIS_URL", "redis://:not-for-results@r:6379")
    monkeypatch.setenv("AGENTKV_API_KEYS", "not-for-results")
    monkeypatch.setenv("AGENTKV_TOKENIZER_CACHE", "on")
    monkeypatch.setenv("VLLMX_OTHER", "1")
    path = write_results(
        "demo",
        {"p50": math.nan, "ratio": math.inf, "rows": [1, -math.inf]},
        "python -m bench.demo --x 1",
        out_dir=tmp_path,
    )
    text = path.read_text()
    document = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert path == tmp_path / "demo.json"
    assert document["command"] == "python -m bench.demo --x 1"
    assert document["data"] == {"p50": None, "ratio": None, "rows": [1, None]}
    assert document["versions"]["python"]
    assert "httpx" in document["versions"]["packages"]
    # What the engines inherited and no command line shows; never a credential.
    assert document["versions"]["env"]["VLLM_BATCH_INVARIANT"] == "1"
    assert "not-for-results" not in text
    assert "VLLMX_OTHER" not in document["versions"]["env"]
    assert document["versions"]["env"]["AGENTKV_TOKENIZER_CACHE"] == "on"


def test_sse_chunks_reads_a_streamed_answer_and_fails_on_errors() -> None:
    answer = (
        b'data: {"choices":[{"delta":{"content":"he"}}]}\n\n: a comment\n\n'
        b'data: {"choices":[{"delta":{"content":"y"}}]}\n\ndata: [DONE]\n\n'
    )
    bodies = {
        "/ok": (200, answer),
        "/bad": (500, b"boom"),
        "/err": (200, b'data: {"error": {"message": "x"}}\n\n'),
    }
    client = httpx.Client(
        transport=httpx.MockTransport(
            lambda r: httpx.Response(bodies[r.url.path][0], content=bodies[r.url.path][1])
        )
    )
    with client.stream("POST", "http://engine/ok") as r:
        assert [c["choices"][0]["delta"]["content"] for c in sse_chunks(r)] == ["he", "y"]
    for path, said in (("/bad", "500: b'boom'"), ("/err", "{'message': 'x'}")):
        with (
            client.stream("POST", f"http://engine{path}") as r,
            pytest.raises(RuntimeError, match=re.escape(said)),
        ):
            list(sse_chunks(r))
