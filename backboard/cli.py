"""`backboard serve | generate | bench | draft | tiny-model | convert`."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module with `register(subparsers)`; each module adds its parser and sets
# `func` (called with the parsed args; returns an exit code)
SUBCOMMANDS = {
    "serve": "backboard.server.cli",
    "generate": "backboard.engine.cli",
    "bench": "backboard.bench.cli",
    "draft": "backboard.spec_decode.cli",
    "tiny-model": "backboard.models.cli",
    "convert": "backboard.models.convert_cli",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="backboard", description="Backboard LLM inference engine")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for mod in SUBCOMMANDS.values():
        try:
            importlib.import_module(mod).register(sub)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
    return p


def _version() -> str:
    from backboard import __version__

    return f"backboard {__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
