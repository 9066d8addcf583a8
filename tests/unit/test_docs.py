"""docs/architecture.md names only code that exists: every code name it quotes is defined in agentkv or
bench, is a string the code uses (a setting's key, a metric, a header value) or a word of pyproject.toml,
is a Python builtin, or is one of the outside names listed below. A rename or a removal that leaves the
page behind fails here."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

OUTSIDE_NAMES = {
    # vLLM's, quoted to say where agentkv hooks in: NixlConnector's internals and the renderer it patches.
    "_reqs_need_send",
    "finished_sending",
    "reqs_to_send",
    "OnlineRenderer",
    "preprocess_chat",
    "AsyncLLM",  # the engine client whose `generate` the plugin wraps
    # A chat request field the router's token check covers.
    "chat_template_kwargs",
    # The standard library's.
    "perf_counter",
    # The page's worked example names its conversation.
    "c1",
}


def _names_and_strings() -> tuple[set[str], set[str]]:
    """Names defined in agentkv and bench (modules, classes, functions, arguments, assigned names and
    attributes), and the words of their string literals other than docstrings."""
    defined: set[str] = set()
    words: set[str] = set()
    for top in ("agentkv", "bench"):
        for path in (ROOT / top).rglob("*.py"):
            defined.add(path.stem)
            tree = ast.parse(path.read_text())
            docstrings = {
                id(node.value)
                for node in ast.walk(tree)
                if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            }
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    defined.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    defined.add(node.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    defined.add(node.attr)
                elif isinstance(node, ast.arg):
                    defined.add(node.arg)
                elif (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and id(node) not in docstrings
                ):
                    words.update(re.findall(r"\w+", node.value))
    words.update(re.findall(r"\w+", (ROOT / "pyproject.toml").read_text()))
    return defined, words | set(dir(builtins))


def _known(part: str, defined: set[str], words: set[str]) -> bool:
    candidates = {part}
    # Connector settings are read as `agentkv_<field>`; prometheus adds `_total` to a counter's name.
    if part.startswith("agentkv_"):
        candidates.add(part.removeprefix("agentkv_"))
    candidates |= {c.removesuffix("_total") for c in candidates}
    return any(c in defined or c in words for c in candidates)


def test_architecture_names_only_code_that_exists() -> None:
    defined, words = _names_and_strings()
    text = (ROOT / "docs" / "architecture.md").read_text()
    quoted = set(re.findall(r"`([^`\n]+)`", text))
    unknown = []
    checked = 0
    for token in sorted(quoted):
        name = re.sub(r"\(.*\)$", "", token)  # `Session.chat(..., final=True)` names Session.chat
        if not re.fullmatch(r"[A-Za-z_]\w*(\.\w+)*", name):
            continue  # a route, an expression, a number
        checked += 1
        parts = [p for p in name.split(".") if p != "py"]
        if any(p in OUTSIDE_NAMES for p in parts):
            continue
        missing = [p for p in parts if not _known(p, defined, words)]
        if missing:
            unknown.append(f"`{token}` ({', '.join(missing)})")
    assert checked > 100, checked  # the page quotes its code; a parse that finds none checks nothing
    assert not unknown, "docs/architecture.md names code that does not exist: " + "; ".join(unknown)
