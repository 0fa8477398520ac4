"""``plinth plugins``: every discovered plugin, what it provides, and which platforms can run here."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from plinth import hookspecs
from plinth.config import KV_CACHE_DTYPES
from plinth.plugins import ENTRY_POINT_GROUP, PluginManager, PluginRecord, get_plugin_manager

_ENV_VARS = ("PLINTH_PLUGINS", "PLINTH_DISABLE_PLUGIN_AUTOLOAD", "PLINTH_PLATFORM")


def add_parser(subparsers: Any, name: str, help: str) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(name, help=help, description=help)
    parser.add_argument("--json", action="store_true", help="print the report as one JSON document")
    parser.add_argument("--benchmark", nargs="?", const="", default=None, metavar="MODEL",
                        help="time every attention-backend candidate on MODEL's shapes (default: the default "
                             "model) and print the selection table")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="with --benchmark: the KV cache's element type the candidates must read")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.benchmark is not None:
        from plinth.entrypoints.selection_report import run_benchmark

        return run_benchmark(args.benchmark or None, as_json=args.json, kv_cache_dtype=args.kv_cache_dtype)
    report = build_report(get_plugin_manager())
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_report(report))
    return 0


def build_report(pm: PluginManager) -> dict[str, Any]:
    """The whole report as plain data (what ``--json`` prints)."""
    from plinth.errors import SelectionError
    from plinth.platforms.selection import platform_report, select_platform

    platforms = [status._asdict() for status in platform_report(pm)]
    try:
        selected, selection_error = select_platform(pm=pm).name, None
    except SelectionError as exc:
        selected, selection_error = None, str(exc)
    return {
        "entry_point_group": ENTRY_POINT_GROUP,
        "plugin_api": hookspecs.PLUGIN_API_VERSION,
        "environment": {k: os.environ[k] for k in _ENV_VARS if k in os.environ},
        "plugins": [_record(r) for r in pm.records.values() if r.loaded],
        "failures": [_record(r) for r in pm.failures],
        "platforms": platforms,
        "selected_platform": selected,
        "selection_error": selection_error,
    }


def _record(r: PluginRecord) -> dict[str, Any]:
    return {
        "name": r.name, "distribution": r.distribution, "version": r.version, "in_tree": r.in_tree,
        "module": r.module, "api_version": r.api_version, "provides": r.provides, "error": r.error,
    }


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in (header, *rows)]


def format_report(report: dict[str, Any]) -> str:
    """The report as text tables."""
    lines = [f"plugins (entry-point group {report['entry_point_group']}, plugin API {report['plugin_api']})"]
    for key, value in report["environment"].items():
        lines.append(f"  {key}={value}")
    rows = [
        (p["name"], p["distribution"] or "-", p["version"] or "-", "yes" if p["in_tree"] else "no",
         "; ".join(f"{kind}: {', '.join(names)}" for kind, names in p["provides"].items()) or "-")
        for p in report["plugins"]
    ]
    lines += _table(("NAME", "DISTRIBUTION", "VERSION", "IN-TREE", "PROVIDES"), rows)
    if report["failures"]:
        lines += ["", "failed plugins (skipped):"]
        for f in report["failures"]:
            origin = f"{f['distribution']} {f['version']}" if f["distribution"] else f["module"]
            lines.append(f"  {f['name']} ({origin}): {f['error']}")
    lines += ["", "platforms (in selection order):"]
    rows = [
        (s["name"], s["plugin"], "-" if s["priority"] is None else str(s["priority"]),
         "yes" if s["available"] else "no", s["reason"])
        for s in report["platforms"]
    ]
    lines += _table(("NAME", "PLUGIN", "PRIORITY", "AVAILABLE", "REASON"), rows)
    if report["selected_platform"] is not None:
        lines += ["", f"selected platform: {report['selected_platform']}"]
    else:
        lines += ["", f"no platform can be selected: {report['selection_error']}"]
    return "\n".join(lines) + "\n"
