"""Exit 0 when every requirement of agentkv's extras named in argv is installed at a matching version.

scripts/setup.sh then skips pip's full resolve (40 s on a machine that has everything) and only points the
editable install at this checkout. Markers are honoured; anything unreadable counts as missing.
"""

from __future__ import annotations

import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement


def main(extras: list[str]) -> int:
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in map(Requirement, project["optional-dependencies"][extra]):
            if req.name == project["name"]:
                todo.extend(req.extras)
            else:
                wanted.append(req)
    return 0 if all(_installed(req) for req in wanted) else 1


def _installed(req: Requirement) -> bool:
    """``req`` (where its marker applies) is installed at a matching version, with what its own extras ask
    for."""
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        return True
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return False
    if not req.specifier.contains(version, prereleases=True):
        return False
    for wanted_extra in req.extras:
        for line in metadata.requires(req.name) or []:
            sub = Requirement(line)
            applies = sub.marker is not None and sub.marker.evaluate({"extra": wanted_extra})
            if applies and not _installed(Requirement(str(sub).split(";")[0])):
                return False
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
