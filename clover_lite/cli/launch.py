"""The `clover` executable's entry point: imports the command (and with it torch, a second or two) inside a
Ctrl-C guard, so that an interrupt during that import ends as one made later does (click's "Aborted!", exit
1) instead of a KeyboardInterrupt traceback."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from clover_lite.cli.main import main as clover
    except KeyboardInterrupt:
        print("\nAborted!", file=sys.stderr)
        sys.exit(1)
    clover()
