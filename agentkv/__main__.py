"""``python -m agentkv``: the CLI without relying on the console script being on PATH (pyenv shims)."""

from agentkv.cli import main

main()
