"""Plugin discovery and validation.

The first half installs the fixture packages of ``tests/fixtures/plugin_packages`` with pip
into a private directory and runs discovery in subprocesses with that directory on
``PYTHONPATH``, so real ``.dist-info`` entry points are read. The second half checks the
manager's validation rules in-process on plugin modules built by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import types
from importlib import metadata
from pathlib import Path

import pytest

from plinth import hookspecs
from plinth.hookspecs import hookimpl
from plinth.platforms import select_platform
from plinth.plugins import (
    ENTRY_POINT_GROUP,
    PluginApiVersionError,
    PluginError,
    PluginManager,
    get_plugin_manager,
    reset_plugin_manager,
    resolve_ref,
)

FIXTURES = Path(__file__).parent / "fixtures" / "plugin_packages"
IN_TREE_PLATFORMS = ("cpu", "cuda", "rocm", "xpu")
# fixture package directory -> the plugin (entry-point) name it installs
FIXTURE_PACKAGES = {"good": "test_good", "broken": "test_broken", "api_mismatch": "test_api_mismatch",
                    "misspelled": "test_misspelled"}


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the fixture plugin packages, installed by pip (real dist-info)."""
    src = tmp_path_factory.mktemp("plugin_src")
    site = tmp_path_factory.mktemp("plugin_site")
    packages = []
    for pkg in FIXTURE_PACKAGES:
        # build from a copy so that setuptools' build/ and egg-info stay out of the source tree
        shutil.copytree(FIXTURES / pkg, src / pkg, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        packages.append(str(src / pkg))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--target", str(site), *packages],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


def _env(site: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLINTH_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


_DISCOVER = r"""
import dataclasses, json, sys
from plinth.plugins import KINDS, PluginError, PluginManager
try:
    pm = PluginManager()
except PluginError as exc:
    print(json.dumps({"error": str(exc), "error_type": type(exc).__name__}))
    sys.exit(0)
out = {
    "records": {n: dataclasses.asdict(r) for n, r in pm.records.items()},
    "failures": {r.name: r.error for r in pm.failures},
    "registrations": {k: {n: [r.ref, r.plugin] for n, r in pm.registrations(k).items()} for k in KINDS},
    "vendor_modules": sorted(m for m in sys.modules if m.split(".")[0] in ("torch_npu", "intel_extension_for_pytorch")),
    "platform_modules": sorted(m for m in sys.modules if m.endswith(".platform")),
    "cuda_initialized": "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized(),
}
print(json.dumps(out))
"""


def discover(site: Path, **env: str) -> dict:
    """Build a PluginManager in a fresh interpreter that sees the installed fixture plugins."""
    proc = subprocess.run([sys.executable, "-c", _DISCOVER], env=_env(site, **env), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def third_party(out: dict) -> set[str]:
    return {n for n, r in out["records"].items() if not r["in_tree"]}


# -- discovery of real installed packages -------------------------------------------------------


def test_good_plugin_is_discovered_with_its_registrations(plugin_site: Path) -> None:
    out = discover(plugin_site)
    assert set(FIXTURE_PACKAGES.values()) <= set(out["records"])  # every installed fixture was found
    rec = out["records"]["test_good"]
    assert rec["distribution"] == "plinth-test-good"
    assert rec["version"] == "0.1.0"
    assert rec["in_tree"] is False
    assert rec["module"] == "plinth_test_good"
    assert rec["api_version"] == "1.0"
    assert rec["error"] is None
    assert rec["provides"] == {"platforms": ["testdev"], "models": ["TestGoodForCausalLM"]}
    assert out["registrations"]["platforms"]["testdev"] == ["plinth_test_good.platform:TestDevPlatform", "test_good"]
    assert out["registrations"]["models"]["TestGoodForCausalLM"][1] == "test_good"
    # the in-tree plugins come through the same entry points, from plinth's own distribution
    for name in IN_TREE_PLATFORMS:
        assert out["records"][name]["in_tree"] is True
        assert out["records"][name]["distribution"] == "plinth-llm"
        assert out["registrations"]["platforms"][name][1] == name


def test_broken_plugin_is_reported_and_skipped(plugin_site: Path) -> None:
    out = discover(plugin_site)
    assert out["failures"]["test_broken"] == (
        "ImportError: plinth_test_broken needs libtestaccel.so, which is not installed")
    assert out["records"]["test_broken"]["distribution"] == "plinth-test-broken"
    assert out["records"]["test_broken"]["version"] == "0.2.0"
    # everything else still loaded
    assert out["records"]["test_good"]["error"] is None
    assert set(IN_TREE_PLATFORMS) <= set(out["registrations"]["platforms"])


def test_api_version_mismatch_is_refused_with_both_versions(plugin_site: Path) -> None:
    out = discover(plugin_site)
    error = out["failures"]["test_api_mismatch"]
    assert "written for plinth plugin API 2.0" in error
    assert f"provides API {hookspecs.PLUGIN_API_VERSION}" in error
    assert "MismatchForCausalLM" not in out["registrations"]["models"]


def test_misspelled_hook_is_rejected_by_validation(plugin_site: Path) -> None:
    out = discover(plugin_site)
    error = out["failures"]["test_misspelled"]
    assert "unknown hook 'plinth_platfroms'" in error
    assert "did you mean 'plinth_platforms'" in error
    assert "typo" not in out["registrations"]["platforms"]


def test_allow_list_loads_only_named_third_party_plugins(plugin_site: Path) -> None:
    out = discover(plugin_site, PLINTH_PLUGINS="test_good")
    assert third_party(out) == {"test_good"}
    assert out["failures"] == {}  # the broken ones were never imported
    assert set(IN_TREE_PLATFORMS) <= set(out["registrations"]["platforms"])  # in-tree always load
    assert "testdev" in out["registrations"]["platforms"]


def test_autoload_switch_loads_only_in_tree_plugins(plugin_site: Path) -> None:
    out = discover(plugin_site, PLINTH_DISABLE_PLUGIN_AUTOLOAD="1")
    assert third_party(out) == set()
    assert out["failures"] == {}
    assert set(out["registrations"]["platforms"]) == set(IN_TREE_PLATFORMS)


def test_autoload_off_still_loads_explicitly_named_plugins(plugin_site: Path) -> None:
    out = discover(plugin_site, PLINTH_DISABLE_PLUGIN_AUTOLOAD="1", PLINTH_PLUGINS="test_good")
    assert third_party(out) == {"test_good"}


@pytest.mark.parametrize(("plugin", "expected"), [
    ("test_broken", "ImportError: plinth_test_broken needs libtestaccel.so"),
    ("test_api_mismatch", "written for plinth plugin API 2.0"),
    ("test_misspelled", "unknown hook 'plinth_platfroms'"),
])
def test_failing_plugin_named_explicitly_stops_startup(plugin_site: Path, plugin: str, expected: str) -> None:
    out = discover(plugin_site, PLINTH_PLUGINS=f"test_good,{plugin}")
    assert out["error_type"] == "PluginError"
    assert f"plugin {plugin!r} (named in PLINTH_PLUGINS) failed to load" in out["error"]
    assert expected in out["error"]


def test_allow_list_naming_a_missing_plugin_stops_startup(plugin_site: Path) -> None:
    out = discover(plugin_site, PLINTH_PLUGINS="test_good,test_nonexistent")
    assert out["error_type"] == "PluginError"
    assert "not installed: test_nonexistent" in out["error"]
    assert "test_good" in out["error"] and "test_broken" in out["error"]  # lists what is installed


def test_discovery_imports_no_device_runtime(plugin_site: Path) -> None:
    out = discover(plugin_site)
    assert out["vendor_modules"] == []
    assert out["platform_modules"] == []  # platform classes are lazy references until selection
    assert out["cuda_initialized"] is False


def test_installed_platform_plugin_is_selected_when_its_device_is_present(plugin_site: Path) -> None:
    code = "from plinth.platforms import select_platform; print(select_platform().name)"
    builtin = select_platform(forced="", pm=PluginManager(env={"PLINTH_DISABLE_PLUGIN_AUTOLOAD": "1"})).name
    for device, expected in (("1", "testdev"), ("0", builtin)):  # builtin: cpu here, cuda on a GPU host
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env=_env(plugin_site, PLINTH_PLUGINS="test_good", PLINTH_TEST_GOOD_DEVICE=device))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == expected


def test_cli_lists_failed_plugins_and_refuses_an_explicit_broken_one(plugin_site: Path) -> None:
    cmd = [sys.executable, "-m", "plinth.entrypoints.cli", "plugins"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(plugin_site))
    assert proc.returncode == 0, proc.stderr
    failed = proc.stdout.split("failed plugins (skipped):")[1].split("\n\n")[0]
    assert "test_broken (plinth-test-broken 0.2.0): ImportError: plinth_test_broken needs libtestaccel.so" in failed
    assert "test_api_mismatch" in failed and "test_misspelled" in failed and "test_good" not in failed

    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env=_env(plugin_site, PLINTH_PLUGINS="test_broken"))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "plinth plugins: error: plugin 'test_broken' (named in PLINTH_PLUGINS) failed to load: "
        "ImportError: plinth_test_broken needs libtestaccel.so, which is not installed")


# -- validation rules, in-process -------------------------------------------------------------


def make_plugin(name: str, api: str | None = "1.0", **attrs: object) -> types.ModuleType:
    module = types.ModuleType(name)
    if api is not None:
        module.PLINTH_PLUGIN_API = api
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


@pytest.fixture
def empty_pm() -> PluginManager:
    return PluginManager(env={}, entry_points=[])


def test_in_tree_plugins_load_from_entry_points_in_process() -> None:
    pm = PluginManager(env={"PLINTH_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert pm.failures == []
    assert all(r.in_tree for r in pm.records.values())
    assert set(pm.registrations("platforms")) == set(IN_TREE_PLATFORMS)
    assert pm.registrations("platforms")["cpu"].load().__name__ == "CpuPlatform"


@pytest.mark.parametrize(("api", "expected"), [
    (None, "does not declare PLINTH_PLUGIN_API"),
    ("one", "invalid PLINTH_PLUGIN_API 'one'"),
    ("2.0", "written for plinth plugin API 2.0"),
    ("1.99", "written for plinth plugin API 1.99"),  # newer minor: may use hooks this plinth lacks
])
def test_api_version_rules(empty_pm: PluginManager, api: str | None, expected: str) -> None:
    with pytest.raises(PluginApiVersionError, match=expected):
        empty_pm.register_module(make_plugin("p", api=api), "p")
    assert "p" not in empty_pm.records


def test_older_minor_api_version_is_accepted(empty_pm: PluginManager) -> None:
    major = hookspecs.PLUGIN_API_VERSION.split(".")[0]
    empty_pm.register_module(make_plugin("p", api=f"{major}.0"), "p")
    assert empty_pm.records["p"].api_version == f"{major}.0"


def test_hookimpl_with_unknown_argument_is_rejected_by_pluggy(empty_pm: PluginManager) -> None:
    @hookimpl
    def plinth_add_cli_arguments(parser, command, verbose):
        pass

    with pytest.raises(PluginError, match="verbose"):
        empty_pm.register_module(make_plugin("p", plinth_add_cli_arguments=plinth_add_cli_arguments), "p")
    assert empty_pm.hook.plinth_add_cli_arguments.get_hookimpls() == []


def test_hook_function_without_marker_is_rejected(empty_pm: PluginManager) -> None:
    def plinth_platforms():
        return {"x": "m:X"}

    with pytest.raises(PluginError, match="without the @hookimpl marker"):
        empty_pm.register_module(make_plugin("p", plinth_platforms=plinth_platforms), "p")


@pytest.mark.parametrize(("result", "expected"), [
    (["cpu"], "must return a dict, got list"),
    ({"x": "no_colon_here"}, "expected a 'package.module:Attribute' string"),
    ({"x": 3}, "expected a 'package.module:Attribute' string"),
    ({"": "m:X"}, "invalid name ''"),
])
def test_malformed_registration_results_are_rejected(empty_pm: PluginManager, result: object, expected: str) -> None:
    @hookimpl
    def plinth_models():
        return result

    with pytest.raises(PluginError, match=expected):
        empty_pm.register_module(make_plugin("p", plinth_models=plinth_models), "p")
    assert empty_pm.registrations("models") == {}
    assert empty_pm.hook.plinth_models.get_hookimpls() == []  # unregistered again


def test_later_plugin_overrides_a_name_and_unknown_kind_is_a_key_error(empty_pm: PluginManager) -> None:
    @hookimpl
    def first():
        return {"LlamaForCausalLM": "a.mod:Llama", "Other": "a.mod:Other"}

    @hookimpl
    def second():
        return {"LlamaForCausalLM": "b.mod:Llama"}

    empty_pm.register_module(make_plugin("a", plinth_models=first), "a")
    empty_pm.register_module(make_plugin("b", plinth_models=second), "b")
    regs = empty_pm.registrations("models")
    assert (regs["LlamaForCausalLM"].ref, regs["LlamaForCausalLM"].plugin) == ("b.mod:Llama", "b")
    assert regs["Other"].plugin == "a"
    with pytest.raises(KeyError, match="unknown plugin kind 'gadgets'; known: platforms"):
        empty_pm.registrations("gadgets")
    with pytest.raises(PluginError, match="already registered"):
        empty_pm.register_module(make_plugin("a2"), "a")


def test_engine_config_overrides_pass_only_declared_arguments_in_order(empty_pm: PluginManager) -> None:
    seen = []

    @hookimpl
    def adjust_from_args(args):  # declares a subset of the hookspec's arguments
        seen.append(("a", args["level"]))
        return {"cache.block_size": 32}

    @hookimpl
    def adjust_nothing(config, args):
        seen.append(("b", config))
        return None

    @hookimpl
    def adjust_from_config(config):
        return {"scheduler.max_num_seqs": config}

    for name, fn in (("a", adjust_from_args), ("b", adjust_nothing), ("c", adjust_from_config)):
        empty_pm.register_module(make_plugin(name, plinth_adjust_engine_config=fn), name)
    out = empty_pm.engine_config_overrides(config=7, args={"level": 3})
    assert out == [{"cache.block_size": 32}, {"scheduler.max_num_seqs": 7}]
    assert seen == [("a", 3), ("b", 7)]


def test_engine_config_override_of_wrong_type_names_the_plugin(empty_pm: PluginManager) -> None:
    @hookimpl
    def plinth_adjust_engine_config(config):
        return ["cache.block_size", 32]

    empty_pm.register_module(make_plugin("bad", plinth_adjust_engine_config=plinth_adjust_engine_config), "bad")
    with pytest.raises(PluginError, match="plugin 'bad'.*must return a mapping or None, got list"):
        empty_pm.engine_config_overrides(config=None, args={})


def test_plugin_options_reach_the_hook_from_llm_and_bad_overrides_name_the_plugin(monkeypatch, tiny_llama_dir) -> None:
    """``LLM(...)`` takes the options plugins add as flags (any command's) and hands them to their
    ``plinth_adjust_engine_config``, as the CLI does; an unknown option is still refused; an override the
    configuration refuses names the plugin."""
    import plinth.plugins as plugins
    from plinth import LLM
    from plinth.config import ConfigError

    @hookimpl
    def plinth_add_cli_arguments(parser, command):
        if command == "serve":
            parser.add_argument("--acme-block-size", type=int, default=None)

    @hookimpl
    def plinth_adjust_engine_config(args):
        size = args.get("acme_block_size")
        return {"cache.block_size": size} if size else None

    pm = PluginManager(env={"PLINTH_DISABLE_PLUGIN_AUTOLOAD": "1"})
    pm.register_module(make_plugin("acme", plinth_add_cli_arguments=plinth_add_cli_arguments,
                                   plinth_adjust_engine_config=plinth_adjust_engine_config), "acme")
    # `plinth plugins` shows the hooks that register nothing too
    assert pm.records["acme"].provides == {"hooks": ["plinth_add_cli_arguments", "plinth_adjust_engine_config"]}
    monkeypatch.setattr(plugins, "_manager", pm)
    with LLM(str(tiny_llama_dir), acme_block_size=32, selection="off") as llm:
        assert llm.engine.config.cache.block_size == 32
    with pytest.raises(ConfigError, match="unknown engine option 'acme_blok_size'"):
        LLM(str(tiny_llama_dir), acme_blok_size=32)
    with pytest.raises(PluginError, match="plugin 'acme': its engine configuration override .* is refused: "
                                          ".*block_size"):
        LLM(str(tiny_llama_dir), acme_block_size=-5, selection="off")


def test_cli_arguments_hook_adds_flags_and_clashes_name_the_plugin(empty_pm: PluginManager) -> None:
    @hookimpl
    def plinth_add_cli_arguments(parser, command):
        if command == "serve":
            parser.add_argument("--acme-level", type=int, default=1)

    empty_pm.register_module(make_plugin("acme", plinth_add_cli_arguments=plinth_add_cli_arguments), "acme")
    parser = argparse.ArgumentParser()
    empty_pm.add_cli_arguments(parser, "serve")
    assert parser.parse_args(["--acme-level", "4"]).acme_level == 4
    parser = argparse.ArgumentParser()
    empty_pm.add_cli_arguments(parser, "generate")
    assert not hasattr(parser.parse_args([]), "acme_level")

    parser = argparse.ArgumentParser()
    parser.add_argument("--acme-level")
    with pytest.raises(PluginError, match="plugin 'acme' failed in plinth_add_cli_arguments"):
        empty_pm.add_cli_arguments(parser, "serve")


@pytest.mark.parametrize("named", [False, True])
def test_a_third_party_plugin_whose_flags_clash_is_skipped_unless_named(monkeypatch, caplog, named) -> None:
    """Installed but not named in PLINTH_PLUGINS: its flags are left out with a warning (the command still runs,
    as when a plugin fails to load); named: the clash stops the command."""
    @hookimpl
    def plinth_add_cli_arguments(parser, command):
        parser.add_argument_group("clash options").add_argument("--clash-first", default="x")   # added, then taken back
        parser.add_argument("--dtype")

    monkeypatch.setitem(sys.modules, "clash_mod", make_plugin("clash_mod", plinth_add_cli_arguments=plinth_add_cli_arguments))
    pm = PluginManager(env={"PLINTH_PLUGINS": "clash"} if named else {},
                       entry_points=[metadata.EntryPoint("clash", "clash_mod", ENTRY_POINT_GROUP)])
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="auto")
    if named:
        with pytest.raises(PluginError, match="plugin 'clash' failed in plinth_add_cli_arguments"):
            pm.add_cli_arguments(parser, "serve")
        return
    with caplog.at_level("WARNING"):
        pm.add_cli_arguments(parser, "serve")
    assert parser.parse_args([]).dtype == "auto"
    assert "skipping the command-line flags of plugin 'clash'" in caplog.text
    assert "--clash-first" not in parser.format_help() and not hasattr(parser.parse_args([]), "clash_first")
    with pytest.raises(SystemExit):
        parser.parse_args(["--clash-first", "y"])


def test_plugin_errors_while_building_the_command_line_are_one_line(monkeypatch, capsys) -> None:
    from plinth.entrypoints import cli
    from plinth.plugins import reset_plugin_manager

    monkeypatch.setenv("PLINTH_PLUGINS", "no_such_plugin_anywhere")
    reset_plugin_manager()
    try:
        assert cli.main(["generate", "--prompt", "hi"]) == 2
    finally:
        monkeypatch.delenv("PLINTH_PLUGINS")
        reset_plugin_manager()
    err = capsys.readouterr().err
    assert err.startswith("plinth: error: PLINTH_PLUGINS names plugins that are not installed: no_such_plugin_anywhere")
    assert "Traceback" not in err


def test_malformed_autoload_switch_is_a_clear_error() -> None:
    with pytest.raises(PluginError, match="PLINTH_DISABLE_PLUGIN_AUTOLOAD='maybe' is not a boolean"):
        PluginManager(env={"PLINTH_DISABLE_PLUGIN_AUTOLOAD": "maybe"}, entry_points=[])


def test_broken_in_tree_plugin_is_reported_not_fatal() -> None:
    eps = [metadata.EntryPoint("cpu", "plinth.platforms.cpu", ENTRY_POINT_GROUP),
           metadata.EntryPoint("gone", "plinth.platforms.no_such_module", ENTRY_POINT_GROUP)]
    pm = PluginManager(env={}, entry_points=eps)
    assert pm.records["gone"].in_tree is True
    assert pm.records["gone"].error.startswith("ModuleNotFoundError: No module named 'plinth.platforms.no_such_module'")
    assert set(pm.registrations("platforms")) == {"cpu"}


def test_second_plugin_with_the_same_name_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    @hookimpl
    def plinth_models():
        return {"Dup": "dup_b:Dup"}

    monkeypatch.setitem(sys.modules, "dup_a", make_plugin("dup_a"))
    monkeypatch.setitem(sys.modules, "dup_b", make_plugin("dup_b", plinth_models=plinth_models))
    eps = [metadata.EntryPoint("dup", "dup_a", ENTRY_POINT_GROUP), metadata.EntryPoint("dup", "dup_b", ENTRY_POINT_GROUP)]
    pm = PluginManager(env={}, entry_points=eps)
    assert pm.records["dup"].module == "dup_a"
    [shadowed] = pm.failures
    assert shadowed.module == "dup_b"
    assert "plugin name 'dup' is already used by 'dup_a'" in shadowed.error
    assert pm.registrations("models") == {}


@pytest.mark.parametrize(("ref", "expected"), [
    ("no_colon", "invalid reference 'no_colon'"),
    ("plinth_no_such_module:X", "cannot import 'plinth_no_such_module'"),
    ("plinth.hookspecs:no_such_name", "'plinth.hookspecs' has no attribute 'no_such_name'"),
])
def test_resolve_ref_errors(ref: str, expected: str) -> None:
    with pytest.raises(PluginError, match=expected):
        resolve_ref(ref)


def test_resolve_ref_follows_dotted_attributes() -> None:
    assert resolve_ref("plinth.hookspecs:hookimpl") is hookimpl
    assert resolve_ref("plinth.plugins:PluginManager.registrations") is PluginManager.registrations


def test_process_wide_manager_is_cached_until_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLINTH_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_plugin_manager()
    try:
        first = get_plugin_manager()
        assert get_plugin_manager() is first
        reset_plugin_manager()
        assert get_plugin_manager() is not first
    finally:
        reset_plugin_manager()


def test_plugins_that_exit_or_lack_metadata_are_reported_not_fatal(monkeypatch, tmp_path, caplog) -> None:
    """A plugin module that calls sys.exit() on import, a registration hook that raises SystemExit, and an entry
    point whose distribution's METADATA names no package (an interrupted install): each is reported and the rest
    of plinth goes on."""
    (tmp_path / "plinth_exiting_plugin.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    @hookimpl
    def plinth_models():
        raise SystemExit(4)

    monkeypatch.setitem(sys.modules, "plinth_exit_hook", make_plugin("plinth_exit_hook", plinth_models=plinth_models))
    monkeypatch.setitem(sys.modules, "plinth_nameless", make_plugin("plinth_nameless"))
    nameless = types.SimpleNamespace(name="nameless", value="plinth_nameless", group=ENTRY_POINT_GROUP,
                                     dist=types.SimpleNamespace(metadata={"Name": None, "Version": None}),
                                     load=lambda: sys.modules["plinth_nameless"])
    eps = [metadata.EntryPoint("exiting", "plinth_exiting_plugin", ENTRY_POINT_GROUP),
           metadata.EntryPoint("exit_hook", "plinth_exit_hook", ENTRY_POINT_GROUP), nameless]
    pm = PluginManager(env={}, entry_points=eps)
    assert pm.records["exiting"].error == "SystemExit: 3"
    assert pm.records["nameless"].error is None and pm.records["nameless"].distribution is None
    assert pm.records["exit_hook"].error == "plugin 'exit_hook' failed in plinth_models(): SystemExit: 4"
    assert pm.registrations("models") == {}


def test_an_override_keyed_by_something_else_than_a_name_is_refused(empty_pm: PluginManager) -> None:
    from plinth.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="'section.field' strings, got 1"):
        EngineConfig.from_kwargs(model="m").with_overrides({1: 2})


def test_a_model_plugin_class_must_be_a_causal_lm() -> None:
    from plinth.errors import UnsupportedModelError
    from plinth.model_registry.registry import ModelRegistry

    class NotAModel:
        pass

    ModelRegistry.register_model("NotAModelForCausalLM", NotAModel)
    try:
        with pytest.raises(UnsupportedModelError, match="not a plinth.model_registry.interface.CausalLM subclass"):
            ModelRegistry.resolve("NotAModelForCausalLM")
    finally:
        ModelRegistry._user.pop("NotAModelForCausalLM", None)
