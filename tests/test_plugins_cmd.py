"""``plinth plugins``, run as a user runs it: a subprocess, in text and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

from plinth.platforms import select_platform
from plinth.platforms.cuda.platform import CudaPlatform
from plinth.platforms.rocm.platform import RocmPlatform
from plinth.platforms.xpu.platform import XpuPlatform
from plinth.plugins import PluginManager

PLUGINS_TITLE = "plugins (entry-point group plinth.plugins"
ACCELERATORS = {"cuda": CudaPlatform, "rocm": RocmPlatform, "xpu": XpuPlatform}


def _npu_installed() -> bool:
    try:
        metadata.distribution("plinth-npu")
    except metadata.PackageNotFoundError:
        return False
    return True


needs_npu = pytest.mark.skipif(not _npu_installed(),
                               reason="plinth-npu is not installed (pip install ./plugins/plinth-npu)")


def expected_selection() -> str:
    """What selection picks in-process with the same plugins and no forced platform."""
    return select_platform(forced="", pm=PluginManager(env={})).name


def plinth_plugins(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PLINTH_")}
    return subprocess.run([sys.executable, "-m", "plinth.entrypoints.cli", "plugins", *args],
                          capture_output=True, text=True, timeout=120, env={**clean, **env})


@pytest.fixture(scope="module")
def text_report() -> str:
    proc = plinth_plugins()
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def json_report() -> dict:
    proc = plinth_plugins("--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _section(text: str, title: str) -> list[list[str]]:
    """The rows (header first) of the table under the line starting with ``title``, split into columns."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title)) + 1
    end = lines.index("", start) if "" in lines[start:] else len(lines)
    return [[c.strip() for c in line.split("  ") if c.strip()] for line in lines[start:end]]


def test_text_report_lists_in_tree_plugins(text_report: str) -> None:
    header, *table = _section(text_report, PLUGINS_TITLE)
    assert header == ["NAME", "DISTRIBUTION", "VERSION", "IN-TREE", "PROVIDES"]
    rows = {r[0]: r for r in table}
    for name in ("cpu", "cuda", "rocm", "xpu"):
        assert rows[name][1:] == ["plinth-llm", metadata.version("plinth-llm"), "yes", f"platforms: {name}"]


def test_text_report_gives_platform_availability(text_report: str) -> None:
    header, *rows = _section(text_report, "platforms (in selection order):")
    assert header == ["NAME", "PLUGIN", "PRIORITY", "AVAILABLE", "REASON"]
    by_name = {r[0]: r for r in rows}
    assert by_name["cpu"] == ["cpu", "cpu", "0", "yes"]
    for name, cls in ACCELERATORS.items():  # on a CPU-only machine: "no" and the probe's reason
        support = cls.is_available()
        assert by_name[name][:3] == [name, name, str(cls.priority)]
        assert by_name[name][3:] == (["yes"] if support.ok else ["no", support.reason])
    assert text_report.rstrip().endswith(f"selected platform: {expected_selection()}")


@needs_npu
def test_text_report_shows_npu_unavailable(text_report: str) -> None:
    plugins = {r[0]: r for r in _section(text_report, PLUGINS_TITLE)[1:]}
    assert plugins["npu"][1:] == ["plinth-npu", metadata.version("plinth-npu"), "no", "platforms: npu"]
    platforms = {r[0]: r for r in _section(text_report, "platforms (in selection order):")[1:]}
    assert platforms["npu"] == ["npu", "npu", "100", "no", "torch_npu not installed"]


def test_json_report(json_report: dict) -> None:
    assert json_report["entry_point_group"] == "plinth.plugins"
    plugins = {p["name"]: p for p in json_report["plugins"]}
    for name in ("cpu", "cuda", "rocm", "xpu"):
        assert plugins[name]["in_tree"] is True
        assert plugins[name]["distribution"] == "plinth-llm"
        assert plugins[name]["provides"] == {"platforms": [name]}
        assert plugins[name]["error"] is None
    platforms = {p["name"]: p for p in json_report["platforms"]}
    assert platforms["cpu"] == {"name": "cpu", "plugin": "cpu", "priority": 0, "available": True, "reason": ""}
    for name, cls in ACCELERATORS.items():
        support = cls.is_available()
        assert (platforms[name]["available"], platforms[name]["reason"]) == (support.ok, support.reason)
        assert support.ok or support.reason  # unavailable always comes with a reason
        assert platforms[name]["priority"] == cls.priority
    assert json_report["selected_platform"] == expected_selection()
    assert json_report["selection_error"] is None
    assert [p["priority"] for p in json_report["platforms"]] == sorted(
        (p["priority"] for p in json_report["platforms"]), reverse=True)


@needs_npu
def test_json_report_shows_npu_unavailable(json_report: dict) -> None:
    npu = next(p for p in json_report["plugins"] if p["name"] == "npu")
    assert (npu["distribution"], npu["in_tree"], npu["provides"]) == ("plinth-npu", False, {"platforms": ["npu"]})
    row = next(p for p in json_report["platforms"] if p["name"] == "npu")
    assert row == {"name": "npu", "plugin": "npu", "priority": 100, "available": False,
                   "reason": "torch_npu not installed"}


def test_forced_unavailable_platform_is_reported() -> None:
    # cuda and rocm are never both available, so one of them is unavailable on any machine
    name, cls = next((n, c) for n, c in ACCELERATORS.items() if not c.is_available())
    proc = plinth_plugins("--json", PLINTH_PLATFORM=name)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["environment"] == {"PLINTH_PLATFORM": name}
    assert report["selected_platform"] is None
    assert report["selection_error"] == (
        f"platform {name!r} (set by PLINTH_PLATFORM) cannot run here: {cls.is_available().reason}")


def test_bad_plugin_environment_is_a_one_line_error() -> None:
    proc = plinth_plugins(PLINTH_DISABLE_PLUGIN_AUTOLOAD="sometimes")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        "plinth plugins: error: PLINTH_DISABLE_PLUGIN_AUTOLOAD='sometimes' is not a boolean; use 1 or 0")
