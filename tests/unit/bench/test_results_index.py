"""bench/README.md is the benchmarks' first page and must stay true to what is committed: its links (and the
run READMEs' and METHODS.md's) resolve to committed files, each headline row links to a run that holds a
result, every value a page quotes from a JSON (a code span `FILE.json: PATH=VALUE`) reads so in that JSON,
every `*_met` target a committed JSON computes is quoted in its run's README, and a table row quoting a
`*_met` value says **met** or **not met** as the value does."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
FIRST_PAGE = BENCH / "README.md"

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`[^`\n]*`")
# `FILE.json: PATH=VALUE`: FILE relative to the page, PATH dotted keys (list indexes as numbers) under `data`.
MARKER = re.compile(r"`([^`\s]+\.json): ([^`=]+)=([^`]+)`")


def _pages() -> list[Path]:
    return [FIRST_PAGE, BENCH / "METHODS.md", *(run / "README.md" for run in _runs())]


def _runs() -> list[Path]:
    """Run folders with committed files (a bench writing its results right now is not a run yet)."""
    committed = _committed()
    runs = sorted(p for p in RESULTS.iterdir() if p.is_dir())
    if committed is None:
        return runs
    return [p for p in runs if any(f.startswith(f"bench/results/{p.name}/") for f in committed)]


@cache
def _committed() -> frozenset[str] | None:
    """Paths in git's index (committed or staged), or None outside a git checkout."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return None
    out = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True, check=True
    ).stdout
    return frozenset(p for p in out.split("\0") if p)


def _slug(heading: str) -> str:
    # GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens.
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", page.read_text(), re.M)}


def _section(text: str, heading: str) -> list[str]:
    lines = text.split("\n")
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def _table_rows(lines: list[str]) -> list[str]:
    rows = [line for line in lines if line.startswith("|")]
    return rows[2:]  # past the header and its separator


def _lookup(doc: dict[str, Any], path: str) -> Any:
    value: Any = doc.get("data", doc)
    for key in path.split("."):
        value = value[int(key)] if isinstance(value, list) else value[key]
    return value


def _agrees(quoted: str, actual: Any) -> bool:
    quoted = quoted.strip()
    if quoted in ("true", "false", "null"):
        return actual is json.loads(quoted)
    try:
        number = float(quoted.replace(",", ""))
    except ValueError:
        return str(actual) == quoted
    if isinstance(actual, bool) or not isinstance(actual, int | float):
        return False
    # The quoted digits are the claim: 0.21 stands for anything that rounds to it.
    decimals = len(quoted.split(".")[1]) if "." in quoted else 0
    return abs(actual - number) <= 0.5 * 10**-decimals + 1e-9


def test_first_page_is_short() -> None:
    assert len(FIRST_PAGE.read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(BENCH)))
def test_relative_links_resolve_to_committed_files(page: Path) -> None:
    committed = _committed()
    missing = []
    for target in LINK.findall(CODE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve()
        rel = resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else None
        if not resolved.exists():
            missing.append(f"{target} (no such path)")
        elif committed is not None and rel is not None and rel != ".":
            tracked = (
                rel in committed if resolved.is_file() else any(p.startswith(rel + "/") for p in committed)
            )
            if not tracked:
                missing.append(f"{target} (not committed)")
        if anchor and resolved.suffix == ".md" and resolved.exists() and anchor not in _anchors(resolved):
            missing.append(f"{target} (no heading for #{anchor})")
    assert not missing, f"{page.relative_to(ROOT)}: " + "; ".join(missing)


def test_headline_rows_link_runs_with_results() -> None:
    rows = _table_rows(_section(FIRST_PAGE.read_text(), "## Headline figures"))
    assert len(rows) >= 10, "the headline table was not found"
    for row in rows:
        runs = re.findall(r"\]\(results/([^/)]+)/\)", row)
        assert runs, f"headline row links no run: {row[:80]}"
        for run in runs:
            assert any((RESULTS / run).rglob("*.json")), f"{run} holds no JSON result"


def test_quoted_values_match_their_json() -> None:
    checked, wrong = 0, []
    for page in _pages():
        for file, path, quoted in MARKER.findall(page.read_text()):
            doc = json.loads((page.parent / file).read_text())
            try:
                actual = _lookup(doc, path)
            except (KeyError, IndexError, TypeError, ValueError):
                wrong.append(f"{page.relative_to(BENCH)}: {file} has no {path}")
                continue
            checked += 1
            if not _agrees(quoted, actual):
                wrong.append(f"{page.relative_to(BENCH)}: {file} {path} is {actual!r}, quoted {quoted}")
    assert checked >= 30, checked  # the pages quote their JSONs; a parse that finds none checks nothing
    assert not wrong, "\n".join(wrong)


def test_every_met_target_is_quoted_in_its_run_readme() -> None:
    missing = []
    for run in _runs():
        readme = (run / "README.md").read_text()
        for path in sorted(run.rglob("*.json")):
            doc = json.loads(path.read_text())
            targets = doc.get("data", {}).get("targets") if isinstance(doc, dict) else None
            if not isinstance(targets, dict):
                continue
            rel = path.relative_to(run).as_posix()
            for key, value in targets.items():
                if key.endswith("_met") and value is not None:
                    marker = f"`{rel}: targets.{key}={json.dumps(value)}`"
                    if marker not in readme:
                        missing.append(f"{run.name}: {marker}")
    assert not missing, "run READMEs do not quote these targets: " + "; ".join(missing)


def test_rows_say_met_as_their_json_does() -> None:
    checked, wrong = 0, []
    for page in _pages():
        for row in (line for line in page.read_text().split("\n") if line.startswith("|")):
            values = {q.strip() for _, path, q in MARKER.findall(row) if path.endswith("_met")}
            if not values:
                continue
            checked += 1
            says_not_met = "not met" in row
            says_met = bool(re.search(r"(?<!not )\*\*met\*\*", row))
            if values == {"true"} and (says_not_met or not says_met):
                wrong.append(f"{page.relative_to(BENCH)}: reads met: {row[:90]}")
            elif values == {"false"} and not says_not_met:
                wrong.append(f"{page.relative_to(BENCH)}: reads not met: {row[:90]}")
            elif values - {"true", "false"} or len(values) > 1:
                wrong.append(f"{page.relative_to(BENCH)}: one row, one verdict: {row[:90]}")
    assert checked >= 5, checked
    assert not wrong, "\n".join(wrong)


def test_every_run_is_indexed_and_superseded_runs_say_by_what() -> None:
    index = "\n".join(_section(FIRST_PAGE.read_text(), "## Every run"))
    for run in _runs():
        readme = run / "README.md"
        assert readme.exists(), f"{run.name} has no README"
        line = next((x for x in index.split("\n") if f"](results/{run.name}/)" in x), None)
        assert line is not None, f"{run.name} is not in bench/README.md's index"
        first = readme.read_text().split("\n", 1)[0]
        superseded = first.startswith("Superseded by")
        assert ("*(superseded)*" in line) == superseded, run.name
        if superseded:
            by = re.match(r"Superseded by \[[^\]]+\]\(\.\./([^/)]+)/\)", first)
            assert by and (RESULTS / by.group(1) / "README.md").exists(), first
