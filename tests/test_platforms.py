"""Platform detection, the CPU platform on this machine, and platform selection.

Accelerator detection is exercised by patching the probes torch exposes
(``torch.cuda.is_available``, ``torch.version.cuda``/``hip``, ``torch.xpu``); the CPU
platform runs for real and is checked against ``/proc/meminfo`` and psutil.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from plinth.attention_backends.interface import Support
from plinth.errors import SelectionError
from plinth.hookspecs import hookimpl
from plinth.platforms import OUT_OF_TREE_MIN_PRIORITY, platform_report, select_platform
from plinth.platforms.cpu.platform import CpuPlatform, has_fast_bf16
from plinth.platforms.cuda.platform import CudaPlatform
from plinth.platforms.interface import Platform
from plinth.platforms.rocm.platform import RocmPlatform
from plinth.platforms.xpu.platform import IPEX_MODULE, XpuPlatform
from plinth.plugins import PluginManager

IN_TREE = {"cpu": CpuPlatform, "cuda": CudaPlatform, "rocm": RocmPlatform, "xpu": XpuPlatform}


@pytest.fixture(autouse=True)
def _no_forced_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PLINTH_PLATFORM", raising=False)


@pytest.fixture
def pm() -> PluginManager:
    """A plugin manager with the in-tree plugins only (whatever else is installed)."""
    return PluginManager(env={"PLINTH_DISABLE_PLUGIN_AUTOLOAD": "1"})


def fake_torch(monkeypatch: pytest.MonkeyPatch, cuda: str | None = None, hip: str | None = None,
               gpu: bool = False, xpu: bool = False) -> None:
    """Make this CPU build of torch look like a CUDA/ROCm/XPU build with or without a device."""
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: xpu)


@pytest.fixture
def forget_modules():
    """Drop modules a test imported (fake vendor packages) from sys.modules afterwards."""
    names: list[str] = []
    yield names.append
    for name in names:
        sys.modules.pop(name, None)


# -- detection ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("cuda", "hip", "gpu", "cuda_ok", "rocm_ok", "cuda_reason", "rocm_reason"), [
    ("12.4", None, True, True, False, "", "not a ROCm build (torch.version.hip is None)"),
    ("12.4", None, False, False, False, "built for CUDA 12.4, but torch.cuda.is_available() is False",
     "not a ROCm build"),
    (None, "6.2.41133", True, False, True, "a ROCm build (HIP 6.2.41133); the rocm platform applies", ""),
    (None, "6.2.41133", False, False, False, "a ROCm build",
     "built for ROCm 6.2.41133, but torch.cuda.is_available() is False"),
    (None, None, False, False, False, "not a CUDA build (torch.version.cuda is None)", "not a ROCm build"),
])
def test_cuda_and_rocm_detection(monkeypatch: pytest.MonkeyPatch, cuda, hip, gpu, cuda_ok, rocm_ok,
                                 cuda_reason, rocm_reason) -> None:
    fake_torch(monkeypatch, cuda=cuda, hip=hip, gpu=gpu)
    for cls, ok, reason in ((CudaPlatform, cuda_ok, cuda_reason), (RocmPlatform, rocm_ok, rocm_reason)):
        support = cls.is_available()
        assert isinstance(support, Support)
        assert support.ok is ok
        assert (reason in support.reason) if reason else support.reason == ""


def test_cuda_reason_names_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch(monkeypatch, cuda="12.4", gpu=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "(CUDA_VISIBLE_DEVICES='')" in CudaPlatform.is_available().reason


def test_xpu_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch(monkeypatch, xpu=True)
    assert XpuPlatform.is_available() == Support.yes()
    fake_torch(monkeypatch, xpu=False)
    assert "torch.xpu.is_available() is False" in XpuPlatform.is_available().reason
    monkeypatch.delattr(torch, "xpu")
    support = XpuPlatform.is_available()
    assert not support.ok and "has no torch.xpu module" in support.reason


def test_xpu_imports_ipex_when_present(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, forget_modules) -> None:
    assert IPEX_MODULE not in sys.modules
    (tmp_path / IPEX_MODULE).mkdir()
    (tmp_path / IPEX_MODULE / "__init__.py").write_text("REGISTERED_XPU_OPS = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    forget_modules(IPEX_MODULE)
    fake_torch(monkeypatch, xpu=True)
    assert XpuPlatform.is_available().ok
    assert sys.modules[IPEX_MODULE].REGISTERED_XPU_OPS is True


def test_xpu_reports_a_broken_ipex_without_crashing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    forget_modules) -> None:
    (tmp_path / IPEX_MODULE).mkdir()
    (tmp_path / IPEX_MODULE / "__init__.py").write_text("raise OSError('libsycl.so: cannot open shared object')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    forget_modules(IPEX_MODULE)
    fake_torch(monkeypatch, xpu=False)
    reason = XpuPlatform.is_available().reason
    assert "torch.xpu.is_available() is False" in reason
    assert f"{IPEX_MODULE} failed to import: OSError: libsycl.so" in reason


def test_xpu_without_ipex_does_not_mention_it(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch(monkeypatch, xpu=False)
    assert IPEX_MODULE not in XpuPlatform.is_available().reason


@pytest.mark.parametrize(("capability", "expected"), [
    ((7, 5), (torch.float16, torch.float32)),
    ((8, 0), (torch.bfloat16, torch.float16, torch.float32)),
    ((9, 0), (torch.bfloat16, torch.float16, torch.float32)),
])
def test_cuda_dtypes_follow_compute_capability(monkeypatch: pytest.MonkeyPatch, capability, expected) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: capability)
    assert CudaPlatform().supported_dtypes() == expected
    assert CudaPlatform().default_dtype() == expected[0]


@pytest.mark.parametrize("bf16", [True, False])
def test_rocm_dtypes_follow_torch_bf16_support(monkeypatch: pytest.MonkeyPatch, bf16: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert RocmPlatform().supported_dtypes()[0] == (torch.bfloat16 if bf16 else torch.float16)


def test_static_properties() -> None:
    table = {name: (cls.device_type, cls.dist_backend, cls.supports_graph_capture) for name, cls in IN_TREE.items()}
    assert table == {
        "cpu": ("cpu", "gloo", False),
        "cuda": ("cuda", "nccl", True),
        "rocm": ("cuda", "nccl", True),  # RCCL behind torch's "nccl" backend
        "xpu": ("xpu", "xccl", False),
    }
    for name, cls in IN_TREE.items():
        assert cls.name == name
        assert cls.priority < OUT_OF_TREE_MIN_PRIORITY  # so that an out-of-tree platform at >= 100 wins


def test_platform_modules_do_not_touch_the_device_runtime_on_import() -> None:
    code = """
import torch
def refuse(*args, **kwargs):
    raise AssertionError("a device runtime was probed at import time")
for mod, attr in ((torch.cuda, "is_available"), (torch.cuda, "_lazy_init"), (torch.cuda, "init"),
                  (torch.cuda, "device_count"), (torch.cuda, "get_device_capability"), (torch.xpu, "is_available")):
    setattr(mod, attr, refuse)
import plinth.platforms.cpu.platform, plinth.platforms.cuda.platform
import plinth.platforms.rocm.platform, plinth.platforms.xpu.platform
assert not torch.cuda.is_initialized()
assert "intel_extension_for_pytorch" not in __import__("sys").modules
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


# -- the CPU platform, for real -----------------------------------------------------------------


def _meminfo_bytes(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="needs /proc/meminfo (Linux)")
def test_cpu_memory_is_plausible() -> None:
    psutil = pytest.importorskip("psutil")
    cpu = CpuPlatform()
    total, free = cpu.total_memory(), cpu.free_memory()
    physical = psutil.virtual_memory().total
    assert physical == _meminfo_bytes("MemTotal")
    assert 0 < free <= total <= physical
    if not any(Path(p).exists() for p in ("/sys/fs/cgroup/memory.max",
                                          "/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        assert total == physical
    # free memory moves while other processes run; read the reference right around ours
    before = psutil.virtual_memory().available
    free = cpu.free_memory()
    after = psutil.virtual_memory().available
    slack = 0.05 * physical
    assert min(before, after) - slack <= free <= max(before, after) + slack


def test_cpu_runs_work_on_its_device() -> None:
    cpu = CpuPlatform()
    assert cpu.is_available() == Support.yes()
    assert cpu.device(0) == torch.device("cpu")
    x = torch.arange(6, dtype=cpu.default_dtype(), device=cpu.device()).reshape(2, 3)  # [2, 3]
    cpu.synchronize()
    assert (x @ x.T).tolist() == [[5.0, 14.0], [14.0, 50.0]]
    assert cpu.device_count() == 1
    assert cpu.device_name()


def test_cpu_dtypes_follow_torch_capability() -> None:
    probes = [getattr(torch.cpu, p, lambda: False)() for p in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    fast = torch.backends.cpu.get_cpu_capability().startswith("AVX512") and any(probes)
    expected = (torch.bfloat16, torch.float32) if fast else (torch.float32, torch.bfloat16)
    assert CpuPlatform().supported_dtypes() == expected


@pytest.mark.parametrize(("capability", "bf16_probe", "fast"), [
    ("AVX2", True, False),  # bfloat16 is emulated by AVX2 kernels whatever the probe says
    ("DEFAULT", False, False),
    ("AVX512", False, False),
    ("AVX512", True, True),
])
def test_cpu_bf16_preference(monkeypatch: pytest.MonkeyPatch, capability: str, bf16_probe: bool, fast: bool) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16_probe, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert has_fast_bf16() is fast
    assert CpuPlatform().default_dtype() == (torch.bfloat16 if fast else torch.float32)


# -- selection ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("probes", "expected"), [
    ({}, "cpu"),
    ({"xpu": True}, "xpu"),
    ({"cuda": "12.4", "gpu": True, "xpu": True}, "cuda"),
    ({"hip": "6.2", "gpu": True, "xpu": True}, "rocm"),
    ({"cuda": "12.4", "gpu": False, "xpu": False}, "cpu"),
])
def test_selection_picks_the_available_platform_of_highest_priority(monkeypatch, pm, probes, expected) -> None:
    fake_torch(monkeypatch, **probes)
    assert select_platform(pm=pm).name == expected


def test_forced_platform(monkeypatch: pytest.MonkeyPatch, pm: PluginManager) -> None:
    fake_torch(monkeypatch, cuda="12.4", gpu=True)
    assert isinstance(select_platform("cpu", pm=pm), CpuPlatform)
    monkeypatch.setenv("PLINTH_PLATFORM", "cpu")
    assert select_platform(pm=pm).name == "cpu"
    assert select_platform("cuda", pm=pm).name == "cuda"  # an explicit choice beats the environment
    monkeypatch.setenv("PLINTH_PLATFORM", "")
    assert select_platform(pm=pm).name == "cuda"  # empty means automatic


def test_forcing_an_unknown_platform_lists_the_known_ones(pm: PluginManager) -> None:
    with pytest.raises(SelectionError, match=r"unknown platform 'tpu' \(forced\); known platforms: cpu, cuda, rocm, xpu"):
        select_platform("tpu", pm=pm)


def test_forcing_an_unavailable_platform_gives_its_reason(monkeypatch: pytest.MonkeyPatch, pm: PluginManager) -> None:
    fake_torch(monkeypatch)
    with pytest.raises(SelectionError) as info:
        select_platform("cuda", pm=pm)
    assert str(info.value) == ("platform 'cuda' (forced) cannot run here: "
                               "this torch is not a CUDA build (torch.version.cuda is None)")
    assert isinstance(info.value, ValueError)
    monkeypatch.setenv("PLINTH_PLATFORM", "xpu")
    with pytest.raises(SelectionError, match=r"platform 'xpu' \(set by PLINTH_PLATFORM\) cannot run here: "
                                             r"torch.xpu.is_available\(\) is False"):
        select_platform(pm=pm)


def _platform_plugin(monkeypatch: pytest.MonkeyPatch, pm: PluginManager, name: str, priority: Any,
                     available: Any, cls_name: str | None = None, start_error: Exception | None = None) -> None:
    """Register an out-of-tree platform plugin whose class lives in a module of its own (``available``: a bool, an
    exception to raise, or anything else for ``is_available()`` to return; ``start_error``: raised when built)."""

    class Accel(Platform):
        device_type = "cpu"
        dist_backend = "gloo"

        def __init__(self):
            if start_error is not None:
                raise start_error

        @classmethod
        def is_available(cls) -> Support:
            if isinstance(available, Exception):
                raise available
            if not isinstance(available, bool):
                return available
            return Support.yes() if available else Support.no(f"no {name} card")

        def supported_dtypes(self):
            return (torch.float32,)

        def total_memory(self, index=0):
            return 0

        def free_memory(self, index=0):
            return 0

    Accel.name = cls_name or name
    Accel.priority = priority
    module_name = f"plinth_test_{name}"
    monkeypatch.setitem(sys.modules, module_name, types.SimpleNamespace(Accel=Accel))

    @hookimpl
    def plinth_platforms():
        return {name: f"{module_name}:Accel"}

    plugin = types.ModuleType(f"{module_name}_plugin")
    plugin.PLINTH_PLUGIN_API = "1.0"
    plugin.plinth_platforms = plinth_platforms
    pm.register_module(plugin, name)


@pytest.mark.parametrize(("priority", "available", "expected"), [
    (OUT_OF_TREE_MIN_PRIORITY, True, "accel"),
    (30, True, "accel"),  # equal priority: the out-of-tree platform ranks first
    (10, True, "cuda"),  # below the convention: priority still decides
    (OUT_OF_TREE_MIN_PRIORITY, False, "cuda"),
])
def test_out_of_tree_priority_rule(monkeypatch, pm, priority: int, available: bool, expected: str) -> None:
    fake_torch(monkeypatch, cuda="12.4", gpu=True)
    _platform_plugin(monkeypatch, pm, "accel", priority, available)
    assert select_platform(pm=pm).name == expected
    names = [row.name for row in platform_report(pm)]
    assert names.index("accel") < names.index("cuda") if priority >= 30 else names.index("accel") > names.index("cuda")


def test_platform_report(monkeypatch: pytest.MonkeyPatch, pm: PluginManager) -> None:
    fake_torch(monkeypatch)
    _platform_plugin(monkeypatch, pm, "flaky", 100, RuntimeError("driver hung"))
    _platform_plugin(monkeypatch, pm, "misnamed", 100, True, cls_name="other")
    rows = {row.name: row for row in platform_report(pm)}
    # invalid candidates (no priority) come last
    assert [r.name for r in platform_report(pm)] == ["flaky", "cuda", "rocm", "xpu", "cpu", "misnamed"]
    assert tuple(rows["cpu"]) == ("cpu", "cpu", 0, True, "")
    for name in ("cuda", "rocm", "xpu"):
        assert rows[name].available is False
        assert rows[name].reason == IN_TREE[name].is_available().reason != ""
        assert rows[name].plugin == name
    assert rows["flaky"].reason == "is_available() raised RuntimeError: driver hung"
    assert rows["misnamed"].priority is None and "has name 'other' but is registered as 'misnamed'" in rows[
        "misnamed"].reason
    assert select_platform(pm=pm).name == "cpu"  # neither broken candidate is chosen


def test_platform_plugins_that_break_the_contract_are_skipped_or_named(monkeypatch, pm) -> None:
    """``is_available()`` returning something else than a Support, a priority that is not an integer: reported and
    skipped; an available platform whose constructor fails: a SelectionError naming it (never a traceback)."""
    fake_torch(monkeypatch)
    _platform_plugin(monkeypatch, pm, "nothing", 300, None)
    _platform_plugin(monkeypatch, pm, "truthy", 300, 1)
    _platform_plugin(monkeypatch, pm, "wordy", "300", True)
    rows = {row.name: row for row in platform_report(pm)}
    assert rows["nothing"].available is False and rows["nothing"].reason == "is_available() returned None, not a Support"
    assert rows["truthy"].available is False and rows["truthy"].reason == "is_available() returned 1, not a Support"
    assert rows["wordy"].available is False and "has priority '300', not an integer" in rows["wordy"].reason
    assert select_platform(pm=pm).name == "cpu"
    _platform_plugin(monkeypatch, pm, "broken", 300, True, start_error=RuntimeError("device init failed"))
    for forced in (None, "broken"):
        with pytest.raises(SelectionError, match="platform 'broken' \\(plugin 'broken'\\) failed to start: "
                                                 "RuntimeError: device init failed"):
            select_platform(forced, pm=pm)


def test_unloadable_platform_is_reported_and_skipped(monkeypatch: pytest.MonkeyPatch, pm: PluginManager) -> None:
    fake_torch(monkeypatch)
    @hookimpl
    def plinth_platforms():
        return {"ghost": "plinth_no_such_module:GhostPlatform"}

    plugin = types.ModuleType("ghost_plugin")
    plugin.PLINTH_PLUGIN_API = "1.0"
    plugin.plinth_platforms = plinth_platforms
    pm.register_module(plugin, "ghost")
    [row] = [r for r in platform_report(pm) if r.name == "ghost"]
    assert (row.available, row.priority) == (False, None)
    assert row.reason.startswith("cannot load plinth_no_such_module:GhostPlatform")
    with pytest.raises(SelectionError, match="platform 'ghost' .* cannot run here: cannot load"):
        select_platform("ghost", pm=pm)
    assert select_platform(pm=pm).name == "cpu"


def test_no_platform_at_all_is_a_selection_error() -> None:
    pm = PluginManager(env={}, entry_points=[])
    with pytest.raises(SelectionError, match="no platform is available: no platform plugin is loaded"):
        select_platform(pm=pm)


# -- the plinth-npu plugin package ----------------------------------------------------------------


@pytest.fixture
def npu_pm() -> PluginManager:
    pytest.importorskip("plinth_npu", reason="plinth-npu is not installed (pip install ./plugins/plinth-npu)")
    return PluginManager(env={"PLINTH_PLUGINS": "npu"})


def test_npu_unavailable_without_torch_npu(npu_pm: PluginManager) -> None:
    assert "torch_npu" not in sys.modules
    [row] = [r for r in platform_report(npu_pm) if r.name == "npu"]
    assert row == ("npu", "npu", 100, False, "torch_npu not installed")
    assert npu_pm.records["npu"].distribution == "plinth-npu"


def test_npu_selected_when_torch_npu_finds_a_device(npu_pm, monkeypatch, tmp_path, forget_modules) -> None:
    # a stand-in for torch_npu: like the real one, importing it adds torch.npu
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(
        "import types, torch\n"
        "torch.npu = types.SimpleNamespace(is_available=lambda: True, is_bf16_supported=lambda: True)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch, "npu", None, raising=False)  # restored (removed) after the test
    forget_modules("torch_npu")
    platform = select_platform(pm=npu_pm)
    assert (platform.name, platform.device_type, platform.dist_backend) == ("npu", "npu", "hccl")
    assert platform.supported_dtypes()[0] == torch.bfloat16
    assert select_platform("cpu", pm=npu_pm).name == "cpu"


def test_async_engine_thread_takes_the_cpu_thread_count_and_the_builder_releases_its_pool(
        tiny_llama_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenMP's thread count is per thread: the engine thread sizes its own pool; the thread that built the
    engine frees its pool first (while it exists, the engine thread's parallel regions run ~3x slower)."""
    import asyncio
    import threading

    import plinth.platforms.cpu.platform as cpu_platform
    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.core.request import SamplingParams

    before = torch.get_num_threads()
    released: list[str] = []
    monkeypatch.setattr(cpu_platform, "release_openmp_threads", lambda: released.append(threading.current_thread().name))
    monkeypatch.setenv("PLINTH_CPU_THREADS", "1")
    try:
        engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama_dir), dtype="float32", selection="off"))
        seen: list[int] = []
        step = engine.step
        engine.step = lambda *a, **k: seen.append(torch.get_num_threads()) or step(*a, **k)  # type: ignore[method-assign]
        async_engine = AsyncLLMEngine(engine)
        assert released == [threading.current_thread().name]

        async def run() -> int:
            n = 0
            async for _ in async_engine.generate("t", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)):
                n += 1
            return n

        assert asyncio.run(run()) >= 1
        assert seen and set(seen) == {1}
        async_engine.shutdown()
    finally:
        torch.set_num_threads(before)


def test_release_openmp_threads_where_gnu_openmp_is_loaded() -> None:
    from plinth.platforms.cpu.platform import release_openmp_threads

    loaded = "libgomp" in Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else False
    assert release_openmp_threads() is loaded
    assert torch.ones(64, 64).sum().item() == 4096.0   # torch's kernels still run (the pool comes back)
