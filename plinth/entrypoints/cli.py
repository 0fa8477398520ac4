"""The ``plinth`` command: ``serve``, ``generate``, ``run-batch``, ``bench``, ``plugins``.

Each sub-command lives in its own module exposing ``add_parser(subparsers)`` and
``run(args) -> int``; modules are imported only when their command runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from plinth import __version__
from plinth.errors import UserFacingError

SUBCOMMANDS = {
    "serve": ("plinth.entrypoints.serve_cmd", "run the OpenAI-compatible HTTP server"),
    "generate": ("plinth.entrypoints.generate_cmd", "offline batch generation from a prompt or a file"),
    "run-batch": ("plinth.entrypoints.run_batch_cmd", "run a file of OpenAI Batch API requests offline"),
    "bench": ("plinth.entrypoints.bench_cmd", "latency and throughput benchmarks"),
    "plugins": ("plinth.entrypoints.plugins_cmd", "list discovered plugins and what they provide"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plinth", description="plinth LLM inference engine")
    parser.add_argument("--version", action="version", version=f"plinth {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="default INFO")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        if wanted is None or name == wanted:
            importlib.import_module(module).add_parser(sub, name, help_text)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser(argv)   # discovers the plugins (PLINTH_PLUGINS may name a broken one)
    except UserFacingError as exc:
        print(f"plinth: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        from plinth.entrypoints.engine_args import reconcile_model

        reconcile_model(args)
        return int(args.func(args) or 0)
    except (UserFacingError, ValueError) as exc:   # CliError, config and model errors: one line
        print(f"plinth {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:   # a file that cannot be read or written (disk full, permissions)
        print(f"plinth {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"plinth {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
