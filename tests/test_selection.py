"""Startup selection: correctness gate, timing, the on-disk record, forced choices, modes.

The candidates come from the fixture plugin package ``plinth-test-backends`` (a fast correct
backend, a slow correct one, a fast wrong one, one that refuses every spec, one that cannot be
imported). In-process tests register its module with a fresh plugin manager; the subprocess
tests install it for real and let entry points find it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from plinth.attention_backends.interface import AttentionSpec, Support
from plinth.attention_backends.probe import AttentionWorkload
from plinth.config import DeviceConfig, shared_mode
from plinth.core.selection import ATTENTION_ENV, describe_platform, select_attention_backend
from plinth.entrypoints.selection_report import format_selection_table, print_selection_table
from plinth.errors import SelectionError
from plinth.platforms.interface import Platform
from plinth.plugins import PluginManager

FIXTURE = Path(__file__).parent / "fixtures" / "plugin_packages" / "plinth-test-backends"
TEST_BACKENDS = ["test_slow", "test_fast", "test_wrong", "test_picky", "test_broken"]
QUICK = ["test_fast", "test_wrong", "test_picky"]  # still a real benchmark, without the sleeps
SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float32, block_size=4)
WORKLOAD = AttentionWorkload(prefill_seqs=1, prefill_len=12, decode_seqs=3, decode_context=9)


class FakeCpu(Platform):
    """A CPU platform that counts device synchronisations."""

    name = "fakecpu"
    device_type = "cpu"
    dist_backend = "gloo"

    def __init__(self) -> None:
        self.syncs = 0

    @classmethod
    def is_available(cls) -> Support:
        return Support.yes()

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32,)

    def total_memory(self, index: int = 0) -> int:
        return 1 << 30

    def free_memory(self, index: int = 0) -> int:
        return 1 << 30

    def device_name(self, index: int = 0) -> str:
        return "Fake CPU 9000"

    def synchronize(self) -> None:
        self.syncs += 1


@pytest.fixture
def backends(monkeypatch):
    """The fixture plugin's backends module, importable, with its call counter cleared."""
    monkeypatch.syspath_prepend(str(FIXTURE))
    import plinth_test_backends.backends as mod

    mod.CALLS.clear()
    return mod


@pytest.fixture
def pm(backends):
    import plinth_test_backends

    manager = PluginManager(env={"PLINTH_DISABLE_PLUGIN_AUTOLOAD": "1"})
    manager.register_module(plinth_test_backends, "test_backends")
    manager.records["test_backends"].version = "1.0.0"
    return manager


@pytest.fixture(autouse=True)
def _no_forced_env(monkeypatch):
    monkeypatch.delenv(ATTENTION_ENV, raising=False)


def run(pm, tmp_path, *, spec=SPEC, mode="cached", forced=None, candidates=TEST_BACKENDS, platform=None):
    platform = platform or FakeCpu()
    config = DeviceConfig(selection=mode, attention_backend=forced)
    result = select_attention_backend(spec, platform, config, pm=pm, cache_dir=tmp_path / "sel",
                                      workload=WORKLOAD, candidates=candidates)
    return result, platform


def test_fast_correct_backend_wins(pm, backends, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="plinth.core.selection"):
        result, platform = run(pm, tmp_path)
    assert result.winner == "test_fast" and result.winner_cls is backends.FastBackend
    assert not result.from_cache and result.how == "benchmark"
    fast, slow, wrong = (result.report(n) for n in ("test_fast", "test_slow", "test_wrong"))
    assert fast.chosen and fast.status == "chosen" and fast.max_error < 1e-5
    # the wrong one is rejected with its error figure, and never timed
    assert wrong.status == "rejected" and wrong.times_ms is None
    assert wrong.max_error > 0.1 and f"{wrong.max_error:.3g}" in wrong.reason and "tolerance" in wrong.reason
    # the slow one is correct but loses on time, in every workload step
    assert slow.status == "slower" and slow.max_error < 1e-5
    assert set(slow.times_ms) == {"prefill", "decode"}
    assert all(t >= backends.SLOW_SECONDS * 1e3 for t in slow.times_ms.values())
    assert slow.total_ms > fast.total_ms
    assert result.runner_up is slow
    assert platform.syncs > 0  # timing synchronised the device
    # unsupported candidates keep their reasons
    picky, broken = result.report("test_picky"), result.report("test_broken")
    assert not picky.supported and "head size 16 unsupported" in picky.reason
    assert not broken.supported and broken.reason.startswith("unsupported:") and "missing_module" in broken.reason
    line = result.summary()
    assert line.startswith("attention_backend: test_fast (prefill") and "runner-up test_slow" in line
    # a rejected candidate is named in the start-up line, with why, at WARNING level (its author needs to see it)
    assert f"test_wrong rejected: max error {wrong.max_error:.3g}" in line
    assert [r.levelno for r in caplog.records if "attention_backend: test_fast" in r.getMessage()] == [logging.WARNING]
    exposed = json.loads(json.dumps(result.to_dict()))
    assert exposed["winner"] == "test_fast"
    assert {c["name"]: c["status"] for c in exposed["candidates"]} == {
        "test_fast": "chosen", "test_slow": "slower", "test_wrong": "rejected",
        "test_picky": "unsupported", "test_broken": "unsupported"}


def test_second_selection_reads_the_cache_and_times_nothing(pm, backends, tmp_path):
    first, _ = run(pm, tmp_path)
    assert sum(backends.CALLS.values()) > 0
    backends.CALLS.clear()
    second, platform = run(pm, tmp_path)
    assert second.from_cache and second.how == "cache"
    assert sum(backends.CALLS.values()) == 0 and platform.syncs == 0
    assert second.winner == "test_fast" and second.winner_cls is backends.FastBackend
    assert second.report("test_wrong").max_error == pytest.approx(first.report("test_wrong").max_error)
    assert second.report("test_slow").times_ms == pytest.approx(first.report("test_slow").times_ms)
    files = list((tmp_path / "sel").iterdir())
    assert len(files) == 1 and files[0].name.startswith("attention_backend-") and files[0].suffix == ".json"
    assert files[0].stat().st_mode & 0o777 == shared_mode(0o644)   # shared like the models (mkstemp: 0600)
    key = json.loads(files[0].read_text())["key"]
    assert key["device"] == "Fake CPU 9000" and key["platform"] == "fakecpu"
    assert key["torch"] == torch.__version__ and "triton" in key
    assert key["candidates"]["test_fast"]["version"] == "1.0.0"
    assert key["dtype"] == "float32" and key["spec"]["head_size"] == 16
    assert key["workload"]["decode_seqs"] == WORKLOAD.decode_seqs


@pytest.mark.parametrize("damage", [
    lambda r: r.update(candidates=[]), lambda r: r.update(candidates=[1]), lambda r: r.update(winner=["x"]),
    lambda r: r["candidates"][0].update(times_ms="abc"), lambda r: r["candidates"][0].update(reason=None),
    lambda r: r["candidates"][0].update(max_error="0.1"), lambda r: r.update(winner="test_gone"),
], ids=["no_candidates", "not_objects", "winner_a_list", "times_text", "reason_null", "error_text", "winner_gone"])
def test_a_damaged_record_is_timed_again(pm, backends, tmp_path, caplog, damage):
    """A record whose key still matches but whose body is damaged or edited (fields of the wrong type, a winner
    that is not among its candidates) is ignored with a warning and the candidates are timed again."""
    run(pm, tmp_path, candidates=QUICK)
    [file] = (tmp_path / "sel").iterdir()
    stored = json.loads(file.read_text())
    damage(stored)
    file.write_text(json.dumps(stored))
    backends.CALLS.clear()
    with caplog.at_level(logging.WARNING):
        again, _ = run(pm, tmp_path, candidates=QUICK)
    assert not again.from_cache and again.winner == "test_fast" and sum(backends.CALLS.values()) > 0
    assert "ignoring malformed selection record" in caplog.text


@pytest.mark.parametrize("change", ["plugin_version", "revision", "dtype", "shapes", "device", "cpu_flags"])
def test_cache_is_invalidated_when_a_key_part_changes(pm, backends, tmp_path, change, monkeypatch):
    run(pm, tmp_path, candidates=QUICK)
    backends.CALLS.clear()
    spec, platform = SPEC, FakeCpu()
    if change == "plugin_version":
        pm.records["test_backends"].version = "1.0.1"
    elif change == "revision":   # a new implementation in the same package version (its selection_revision)
        monkeypatch.setattr(backends.FastBackend, "selection_revision", 2, raising=False)
    elif change == "dtype":
        spec = AttentionSpec(4, 2, 16, torch.float64, 4)
    elif change == "shapes":
        spec = AttentionSpec(4, 4, 16, torch.float32, 4)
    elif change == "cpu_flags":   # the same model name, other instruction sets (AMX or not)
        from plinth.core import selection_cache

        monkeypatch.setattr(selection_cache, "_cpu_digest", lambda: "0" * 16)
    else:
        platform.device_name = lambda index=0: "Fake CPU 9001"
    result, _ = run(pm, tmp_path, spec=spec, platform=platform, candidates=QUICK)
    assert not result.from_cache and sum(backends.CALLS.values()) > 0
    assert result.winner == "test_fast"
    assert len(list((tmp_path / "sel").iterdir())) == 2  # both records kept


def test_a_record_made_without_a_candidate_that_runs_now_is_timed_again(pm, backends, tmp_path, monkeypatch, caplog):
    """A candidate may be unsupported for one run only (its native kernels turned off by an environment variable,
    a compiler that failed once): the record of that run names a slower winner under the same key, and it must
    not hold every later start to it. A start where that candidate runs again times anew; the next reads that."""
    candidates = ["test_slow", "test_fast", "test_wrong"]
    supports = backends.FastBackend.supports.__func__

    def refusing(refused):   # the others derive from FastBackend: only ``refused`` itself says no
        return classmethod(lambda cls, spec, device_type: Support.no("off") if cls is refused
                           else supports(cls, spec, device_type))

    with monkeypatch.context() as m:
        m.setattr(backends.FastBackend, "supports", refusing(backends.FastBackend))
        first, _ = run(pm, tmp_path, candidates=candidates)
    assert first.winner == "test_slow" and not first.report("test_fast").supported
    backends.CALLS.clear()
    with caplog.at_level(logging.INFO, logger="plinth.core.selection"):
        second, _ = run(pm, tmp_path, candidates=candidates)
    assert not second.from_cache and second.winner == "test_fast" and sum(backends.CALLS.values()) > 0
    assert "made without test_fast (unsupported or failing then)" in caplog.text
    backends.CALLS.clear()
    third, _ = run(pm, tmp_path, candidates=candidates)
    assert third.from_cache and third.winner == "test_fast" and sum(backends.CALLS.values()) == 0
    # the other way round (a candidate of the record unsupported now, not the winner) keeps the record
    with monkeypatch.context() as m:
        m.setattr(backends.FastBackend, "supports", refusing(backends.SlowBackend))
        fourth, _ = run(pm, tmp_path, candidates=candidates)
    assert fourth.from_cache and fourth.winner == "test_fast"


def test_a_candidate_that_raised_is_timed_again(pm, backends, tmp_path, monkeypatch):
    """A candidate that raised while it was checked or timed (memory another process held, a malformed tuning
    variable) lost that start only: the next start times it again instead of reading the record it lost in."""
    candidates = ["test_slow", "test_fast", "test_wrong"]
    forward = backends.FastBackend.forward

    def out_of_memory(self, *args, **kwargs):
        if type(self) is backends.FastBackend:
            raise MemoryError("simulated")
        return forward(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(backends.FastBackend, "forward", out_of_memory)
        first, _ = run(pm, tmp_path, candidates=candidates)
    assert first.winner == "test_slow" and first.report("test_fast").reason.startswith("rejected: failed")
    second, _ = run(pm, tmp_path, candidates=candidates)
    assert not second.from_cache and second.winner == "test_fast"
    third, _ = run(pm, tmp_path, candidates=candidates)
    assert third.from_cache and third.winner == "test_fast"
    # a candidate rejected for its error against the reference stays rejected: the record holds
    assert third.report("test_wrong").reason.startswith("rejected: max error")
    # one that fails every time is timed again once, then the record is trusted (it must not turn the cache off)
    with monkeypatch.context() as m:
        m.setattr(backends.FastBackend, "forward", out_of_memory)
        hows = [run(pm, tmp_path / "always", candidates=candidates)[0].how for _ in range(4)]
    assert hows == ["benchmark", "benchmark", "cache", "cache"]


def test_kernel_switches_are_part_of_the_key_and_nothing_else_of_the_environment(pm, backends, tmp_path, monkeypatch):
    """A record timed under a kernel switch (PLINTH_CPU_SDPA_PREFILL, PLINTH_W4A16_CUDA, ...) is not read without it
    (the switch changes how fast a candidate runs); other variables (an API key) never reach the records."""
    from plinth.core.selection_cache import KERNEL_SWITCHES

    for name in KERNEL_SWITCHES:   # (whatever the environment running the tests sets)
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PLINTH_API_KEY", "sk-secret-value")
    monkeypatch.setenv("PLINTH_CPU_SDPA_PREFILL", "1")
    run(pm, tmp_path, candidates=QUICK)
    monkeypatch.delenv("PLINTH_CPU_SDPA_PREFILL")
    backends.CALLS.clear()
    again, _ = run(pm, tmp_path, candidates=QUICK)
    assert not again.from_cache and sum(backends.CALLS.values()) > 0
    records = [json.loads(f.read_text()) for f in (tmp_path / "sel").iterdir()]
    assert len(records) == 2
    assert sorted(json.dumps(r["key"]["switches"]) for r in records) == ['{"PLINTH_CPU_SDPA_PREFILL": "1"}', "{}"]
    assert all(r["key"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability() for r in records)
    assert all(len(r["key"]["cpu"]) == 16 for r in records) and records[0]["key"]["cpu"] == records[1]["key"]["cpu"]
    assert not any("sk-secret-value" in f.read_text() for f in (tmp_path / "sel").iterdir())


def test_records_unused_for_months_are_pruned(pm, backends, tmp_path):
    """Every new key adds a record; one no start has read for 90 days (and a writer's temporary file left over an
    hour ago) is removed when another record is written, while a record that starts read stays."""
    run(pm, tmp_path, candidates=QUICK)
    [used] = (tmp_path / "sel").iterdir()
    old = tmp_path / "sel" / "attention_backend-0123456789abcdef01234567.json"
    old.write_text("{}")
    leftover = tmp_path / "sel" / ".tmp-abc.json"
    leftover.write_text("{")
    long_ago = 1_000_000_000
    for f in (used, old, leftover):
        os.utime(f, (long_ago, long_ago))
    assert run(pm, tmp_path, candidates=QUICK)[0].from_cache   # read: kept fresh
    run(pm, tmp_path, spec=AttentionSpec(4, 4, 16, torch.float32, 4), candidates=QUICK)   # another key: a write
    assert used.exists() and not old.exists() and not leftover.exists()
    assert len(list((tmp_path / "sel").iterdir())) == 2


def test_benchmark_mode_always_times(pm, backends, tmp_path):
    run(pm, tmp_path, candidates=QUICK)
    backends.CALLS.clear()
    result, _ = run(pm, tmp_path, mode="benchmark", candidates=QUICK)
    assert not result.from_cache and backends.CALLS["test_fast"] > 0


def test_unreadable_record_is_a_miss_and_is_rewritten(pm, backends, tmp_path):
    run(pm, tmp_path, candidates=QUICK)
    (record,) = (tmp_path / "sel").iterdir()
    record.write_text("{ half a record")
    backends.CALLS.clear()
    result, _ = run(pm, tmp_path, candidates=QUICK)
    assert not result.from_cache and sum(backends.CALLS.values()) > 0
    assert json.loads(record.read_text())["winner"] == "test_fast"
    assert [p.name for p in (tmp_path / "sel").iterdir()] == [record.name]  # no temporary files left


def test_selection_off_takes_highest_priority_without_timing(pm, backends, tmp_path):
    result, platform = run(pm, tmp_path, mode="off")
    assert result.winner == "test_slow"  # priority 50 beats test_fast (10) and test_wrong (1)
    assert result.how == "priority (selection off)"
    assert sum(backends.CALLS.values()) == 0 and platform.syncs == 0
    assert not (tmp_path / "sel").exists()


def test_single_supported_candidate_is_taken_untimed(pm, backends, tmp_path):
    result, _ = run(pm, tmp_path, candidates=["test_wrong", "test_picky"])
    assert result.winner == "test_wrong" and result.how == "only candidate"
    assert sum(backends.CALLS.values()) == 0


def test_forced_choice(pm, backends, tmp_path, monkeypatch):
    result, _ = run(pm, tmp_path, forced="test_slow")
    assert result.winner == "test_slow" and result.winner_cls is backends.SlowBackend
    assert "forced" in result.how and sum(backends.CALLS.values()) == 0
    monkeypatch.setenv(ATTENTION_ENV, "test_wrong")
    result, _ = run(pm, tmp_path)
    assert result.winner == "test_wrong" and ATTENTION_ENV in result.how
    result, _ = run(pm, tmp_path, forced="test_fast")  # the config wins over the environment
    assert result.winner == "test_fast"


def test_forced_unknown_lists_known_backends(pm, tmp_path, monkeypatch):
    with pytest.raises(SelectionError) as err:
        run(pm, tmp_path, forced="nope")
    assert "'nope'" in str(err.value) and "torch_sdpa" in str(err.value) and "test_fast" in str(err.value)
    monkeypatch.setenv(ATTENTION_ENV, "nope2")
    with pytest.raises(SelectionError, match=f"nope2.*{ATTENTION_ENV}"):
        run(pm, tmp_path)


@pytest.mark.parametrize("name,reason", [("test_picky", "head size 16 unsupported"),
                                         ("test_broken", "missing_module")])
def test_forced_but_unsupported_gives_the_reason(pm, tmp_path, name, reason):
    with pytest.raises(SelectionError, match=reason) as err:
        run(pm, tmp_path, forced=name)
    assert name in str(err.value) and "cannot run here" in str(err.value)


def test_no_usable_candidate(pm, tmp_path):
    with pytest.raises(SelectionError, match="no attention backend can run here.*test_picky.*head size"):
        run(pm, tmp_path, candidates=["test_picky", "test_broken"])
    with pytest.raises(SelectionError, match="unknown attention backend 'bogus'"):
        run(pm, tmp_path, candidates=["test_fast", "bogus"])


def test_real_cpu_selection_between_sdpa_and_batched(tmp_path, capsys):
    from plinth.platforms.cpu.platform import CpuPlatform

    pm = PluginManager(env={"PLINTH_DISABLE_PLUGIN_AUTOLOAD": "1"})
    platform = CpuPlatform()
    spec = AttentionSpec(num_heads=9, num_kv_heads=3, head_size=64, dtype=torch.float32, block_size=16)
    workload = AttentionWorkload(prefill_seqs=2, prefill_len=64, decode_seqs=8, decode_context=128)
    pair = ["torch_sdpa", "torch_batched"]
    result = select_attention_backend(spec, platform, DeviceConfig(), pm=pm, cache_dir=tmp_path, workload=workload,
                                      candidates=pair)
    assert result.winner in pair and not result.from_cache
    for name in ("torch_sdpa", "torch_batched"):
        report = result.report(name)
        assert report.supported and not report.reason and set(report.times_ms) == {"prefill", "decode"}
        assert report.max_error < 1e-4
    print_selection_table(describe_platform(platform, pm))
    print_selection_table(result)
    out = capsys.readouterr().out
    assert "platform: cpu" in out and f"attention_backend: {result.winner} (benchmark" in out
    winner_row = next(line for line in out.splitlines() if line.startswith("*") and "torch_" in line)
    assert result.winner in winner_row and "chosen" in winner_row
    assert "MAX ERROR" in out and "TIMES (ms)" in out
    again = select_attention_backend(spec, platform, DeviceConfig(), pm=pm, cache_dir=tmp_path, workload=workload,
                                     candidates=pair)
    assert again.from_cache and again.winner == result.winner and again.elapsed_s < 2.0
    assert "from cache" in format_selection_table(again)


# -- the plugin package installed for real, selection in a fresh interpreter --------------------


def _install(tmp_path_factory, version: str) -> Path:
    src = tmp_path_factory.mktemp(f"src-{version}") / "pkg"
    shutil.copytree(FIXTURE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    pyproject = src / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('version = "1.0.0"', f'version = "{version}"'))
    target = tmp_path_factory.mktemp(f"site-{version}")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(src)], check=True, capture_output=True, timeout=300)
    return target


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    return {v: _install(tmp_path_factory, v) for v in ("1.0.0", "1.1.0")}


SCRIPT = textwrap.dedent("""
    import json, torch
    from plinth.attention_backends.interface import AttentionSpec
    from plinth.attention_backends.probe import AttentionWorkload
    from plinth.config import DeviceConfig
    from plinth.core.selection import select_attention_backend
    from plinth.platforms.cpu.platform import CpuPlatform
    from plinth.plugins import get_plugin_manager
    import plinth_test_backends.backends as tb

    spec = AttentionSpec(4, 2, 16, torch.float32, 4)
    workload = AttentionWorkload(prefill_seqs=1, prefill_len=12, decode_seqs=3, decode_context=9)
    result = select_attention_backend(spec, CpuPlatform(), DeviceConfig(), workload=workload,
                                      candidates=["test_slow", "test_fast", "test_wrong", "test_broken"])
    pm = get_plugin_manager()
    print(json.dumps({"result": result.to_dict(), "calls": dict(tb.CALLS),
                      "version": pm.records["test_backends"].version, "file": tb.__file__}))
""")


def _select_in_subprocess(site: Path, cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLINTH_")}
    env.update(PYTHONPATH=str(site), PLINTH_CACHE_DIR=str(cache))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_installed_plugin_package_selection_and_cache(installed, tmp_path):
    cache = tmp_path / "cache"
    first = _select_in_subprocess(installed["1.0.0"], cache)
    assert first["version"] == "1.0.0" and first["file"].startswith(str(installed["1.0.0"]))
    assert first["result"]["winner"] == "test_fast" and not first["result"]["from_cache"]
    statuses = {c["name"]: c for c in first["result"]["candidates"]}
    assert statuses["test_wrong"]["status"] == "rejected" and statuses["test_wrong"]["max_error"] > 0.1
    assert statuses["test_slow"]["status"] == "slower"
    assert statuses["test_broken"]["status"] == "unsupported"
    assert first["calls"]["test_fast"] > 0
    assert len(list((cache / "selection").glob("attention_backend-*.json"))) == 1

    second = _select_in_subprocess(installed["1.0.0"], cache)
    assert second["result"]["from_cache"] and second["result"]["winner"] == "test_fast"
    assert second["calls"] == {}  # no candidate ran

    bumped = _select_in_subprocess(installed["1.1.0"], cache)
    assert bumped["version"] == "1.1.0"
    assert not bumped["result"]["from_cache"] and bumped["calls"]["test_fast"] > 0
    assert len(list((cache / "selection").glob("attention_backend-*.json"))) == 2


def test_crashing_or_invalid_candidates_lose_but_do_not_stop_selection(pm, backends, tmp_path):
    import types

    from plinth.hookspecs import hookimpl

    class CrashingBackend(backends.FastBackend):
        name = "test_crash"

        def forward(self, *args, **kwargs):
            raise RuntimeError("kernel exploded")

    class FalsyBackend(backends.FastBackend):   # check() answers False, not a Support
        name = "test_falsy"

        @classmethod
        def check(cls, spec, device_type):
            return False

    class WordyBackend(backends.FastBackend):   # a priority that is not an integer
        name = "test_wordy"
        priority = "high"

    plugin = types.ModuleType("plinth_test_crash")
    plugin.PLINTH_PLUGIN_API = "1.0"
    plugin.CrashingBackend, plugin.FalsyBackend, plugin.WordyBackend = CrashingBackend, FalsyBackend, WordyBackend
    plugin.NotABackend = object

    @hookimpl
    def plinth_attention_backends():
        return {"test_crash": "plinth_test_crash:CrashingBackend", "test_object": "plinth_test_crash:NotABackend",
                "test_falsy": "plinth_test_crash:FalsyBackend", "test_wordy": "plinth_test_crash:WordyBackend"}

    plugin.plinth_attention_backends = plinth_attention_backends
    sys.modules["plinth_test_crash"] = plugin
    try:
        pm.register_module(plugin, "test_crash_plugin")
        result, _ = run(pm, tmp_path, candidates=["test_fast", "test_crash", "test_object", "test_falsy",
                                                  "test_wordy"])
        off, _ = run(pm, tmp_path, mode="off", candidates=["test_fast", "test_falsy", "test_wordy"])
    finally:
        del sys.modules["plinth_test_crash"]
    assert result.winner == "test_fast" and off.winner == "test_fast"
    assert result.report("test_falsy").reason == "supports() returned False, not a Support"
    assert "has priority 'high', not an integer" in result.report("test_wordy").reason
    crash = result.report("test_crash")
    assert crash.status == "rejected" and "RuntimeError: kernel exploded" in crash.reason
    assert not result.report("test_object").supported
    assert "not a subclass" in result.report("test_object").reason


def test_plugins_benchmark_command_prints_the_table(tmp_path, monkeypatch, capsys):
    """``plinth plugins --benchmark MODEL`` on a tiny random Llama saved to disk."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from plinth.entrypoints.cli import main
    from plinth.plugins import reset_plugin_manager

    model_dir = tmp_path / "tiny-llama"
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir, safe_serialization=True)
    for key in [k for k in os.environ if k.startswith("PLINTH_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PLINTH_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PLINTH_PLATFORM", "cpu")
    monkeypatch.setenv("PLINTH_CACHE_DIR", str(tmp_path / "cache"))
    reset_plugin_manager()
    try:
        assert main(["plugins", "--benchmark", str(model_dir)]) == 0
        out = capsys.readouterr().out
        assert main(["plugins", "--benchmark", str(model_dir), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
    finally:
        reset_plugin_manager()
    assert out.startswith("platform: cpu") and "attention_backend: " in out
    for name in ("torch_sdpa", "torch_batched", "triton", "flash_attn"):
        assert name in out
    platform, attention = data
    assert platform["kind"] == "platform" and platform["winner"] == "cpu"
    assert attention["how"] == "benchmark" and not attention["from_cache"]  # --benchmark always times
    timed = {c["name"] for c in attention["candidates"] if c["times_ms"]}
    assert {"torch_sdpa", "torch_batched"} <= timed
    assert list((tmp_path / "cache" / "selection").glob("attention_backend-*.json"))


def test_relative_steps_count_each_step_alike(monkeypatch):
    """A kind with ``relative_steps`` ranks by the geometric mean over steps of each time relative to the
    fastest candidate at that step: a candidate 30% faster at one-row decodes wins over one 3% faster at prefill,
    although its plain sum of times is larger (the sum decides without the option); and one much slower
    at the batched decode loses, however fast its one-row decode."""
    from plinth.core import selection
    from plinth.core.selection_records import CandidateReport

    times = {"prefill_fast": {"decode-1": 0.100, "decode": 0.200, "prefill": 0.970},
             "decode_fast": {"decode-1": 0.070, "decode": 0.200, "prefill": 1.020},
             "batch_slow": {"decode-1": 0.050, "decode": 0.660, "prefill": 0.980}}
    monkeypatch.setattr(selection, "_time_interleaved", lambda kind, runners: {n: times[n] for n in runners})

    class Kind:
        kind, reference = "gemm_kernel", None

        def step_runners(self, cls):
            return {label: (lambda: None) for label in times[cls]}

        def tolerance(self):
            return 0.0

    for relative, winner in ((True, "decode_fast"), (False, "prefill_fast")):
        kind = Kind()
        kind.relative_steps = relative
        for order in (list(times), list(reversed(times))):
            reports = [CandidateReport(name, "test", supported=True) for name in order]
            assert selection._benchmark(kind, {}, {name: name for name in order}, reports) == winner, (relative, order)
            scores = {r.name: r.score for r in reports}
            if relative:
                assert scores["decode_fast"] == pytest.approx((0.070 / 0.050 * 1 * 1.020 / 0.970) ** (1 / 3))
                assert scores["batch_slow"] == pytest.approx((1 * 3.3 * 0.980 / 0.970) ** (1 / 3))
            else:
                assert set(scores.values()) == {None}


def test_relative_order_does_not_depend_on_a_third_candidate(monkeypatch):
    """With the geometric mean, adding a candidate that is fastest at one step leaves the order of two
    others unchanged (an arithmetic mean of ratios flips it for these times)."""
    from plinth.core import selection
    from plinth.core.selection_records import CandidateReport

    a = {"decode-1": 0.052, "decode": 0.10, "prefill": 1.0}
    b = {"decode-1": 0.060, "decode": 0.09, "prefill": 0.95}
    c = {"decode-1": 0.040, "decode": 0.30, "prefill": 5.0}
    orders = []
    for times in ({"a": a, "b": b}, {"a": a, "b": b, "c": c}):
        reports = [CandidateReport(n, "test", supported=True, times_ms=t) for n, t in times.items()]
        selection._relative_scores(reports)
        ranked = sorted(reports, key=lambda r: r.score)
        orders.append([r.name for r in ranked if r.name in "ab"])
    assert orders[0] == orders[1] == ["b", "a"]


def test_cached_records_without_scores_still_load(tmp_path):
    """A record written before scores existed (no ``score`` field; or with a field this version does not
    know) is read back from the cache and ranks by the sum of its times."""
    from plinth.core import selection

    reports = selection._cached_reports({"winner": "a", "candidates": [
        {"name": "a", "plugin": "p", "supported": True, "times_ms": {"x": 1.0, "y": 2.0}, "chosen": True},
        {"name": "b", "plugin": "p", "supported": True, "times_ms": {"x": 2.0, "y": 2.0}, "weights": None},
    ]})
    assert reports is not None and [r.score for r in reports] == [None, None]
    assert [r.rank for r in reports] == [3.0, 4.0]


def test_a_runner_may_report_its_own_time(monkeypatch):
    """A step runner that returns milliseconds (device time) is recorded with that figure instead of the
    host clock's; one that returns None is timed by the host clock."""
    from plinth.core import selection

    class Kind:
        def synchronize(self):
            pass

    runners = {"a": {"own": lambda: 123.0, "host": lambda: None}}
    times = selection._time_interleaved(Kind(), runners, warmup=1, repeats=3)
    assert times["a"]["own"] == 123.0
    assert 0 <= times["a"]["host"] < 50.0


def test_a_winner_that_fails_to_start_is_a_selection_error_naming_it():
    from plinth.core.selection_records import CandidateReport, SelectionResult

    class Broken:
        def __init__(self, *args):
            raise RuntimeError("backend init failed")

    result = SelectionResult("attention_backend", "broken", Broken, [CandidateReport("broken", "acme", True)], False,
                             0.0)
    with pytest.raises(SelectionError, match="attention backend 'broken' \\(plugin 'acme'\\) failed to start: "
                                             "RuntimeError: backend init failed"):
        result.instantiate()
