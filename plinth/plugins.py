"""Plugin discovery: entry points, allow-list, validation and the discovery report.

Every plugin, in-tree or third-party, is a module named by an entry point in the
group ``plinth.plugins``. Environment variables:

``PLINTH_PLUGINS=a,b``
    Load only the third-party plugins named here (in-tree plugins always load).
    A plugin named here that fails to import or validate stops startup.
``PLINTH_DISABLE_PLUGIN_AUTOLOAD=1``
    Load no third-party plugin at all; only the in-tree ones.

A plugin that fails to import or to validate and was not named explicitly is
recorded in :attr:`PluginManager.failures` and skipped.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import threading
from collections.abc import Mapping
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy

from plinth import hookspecs

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "plinth.plugins"
IN_TREE_DISTRIBUTION = "plinth-llm"

KINDS = ("platforms", "attention_backends", "quantization_methods", "models")


class PluginError(RuntimeError):
    """A plugin could not be loaded, validated or resolved."""


class PluginApiVersionError(PluginError):
    """A plugin was written for an incompatible plugin API version."""


def resolve_ref(ref: str) -> Any:
    """Import ``"package.module:Attribute"`` and return the attribute.

    Raises:
        PluginError: the reference is malformed, the module cannot be imported or
            lacks the attribute.
    """
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise PluginError(f"invalid reference {ref!r}: expected 'package.module:Attribute'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import error of any kind is the plugin's fault
        raise PluginError(f"cannot import {module_name!r} (from {ref!r}): {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise PluginError(f"{module_name!r} has no attribute {attr!r} (from {ref!r})") from exc
    return obj


@dataclasses.dataclass(frozen=True)
class Registration:
    """One thing a plugin provides: a name and a lazy reference to its implementation."""

    kind: str
    name: str
    ref: str
    plugin: str

    def load(self) -> Any:
        return resolve_ref(self.ref)


@dataclasses.dataclass
class PluginRecord:
    """What is known about one discovered plugin."""

    name: str
    distribution: str | None
    version: str | None
    in_tree: bool
    module: str
    api_version: str | None = None
    provides: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    error: str | None = None

    @property
    def loaded(self) -> bool:
        return self.error is None


def _check_api_version(name: str, module: ModuleType) -> str:
    declared = getattr(module, "PLINTH_PLUGIN_API", None)
    if declared is None:
        raise PluginApiVersionError(
            f"plugin {name!r} does not declare PLINTH_PLUGIN_API; "
            f"set PLINTH_PLUGIN_API = {hookspecs.PLUGIN_API_VERSION!r} in module {module.__name__!r}"
        )
    if not isinstance(declared, str) or not declared.split(".")[0].isdigit():
        raise PluginApiVersionError(f"plugin {name!r} declares an invalid PLINTH_PLUGIN_API {declared!r}")
    want_major = hookspecs.PLUGIN_API_VERSION.split(".")[0]
    if declared.split(".")[0] != want_major:
        raise PluginApiVersionError(
            f"plugin {name!r} was written for plinth plugin API {declared}, but this plinth provides "
            f"API {hookspecs.PLUGIN_API_VERSION}; upgrade the plugin or install a matching plinth"
        )
    return declared


class PluginManager:
    """plinth's plugin manager: a pluggy manager plus the discovery report.

    Args:
        env: environment mapping read for ``PLINTH_PLUGINS`` and
            ``PLINTH_DISABLE_PLUGIN_AUTOLOAD`` (default: ``os.environ``).
        entry_points: entry points to load (default: the installed ones in
            ``plinth.plugins``); tests may pass a subset.
    """

    def __init__(self, env: Mapping[str, str] | None = None, entry_points: list | None = None):
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self._registry_cache: dict[str, dict[str, Registration]] = {}
        env = os.environ if env is None else env
        self._load(env, entry_points)

    @property
    def hook(self) -> Any:
        return self._pm.hook

    @property
    def failures(self) -> list[PluginRecord]:
        return [r for r in self.records.values() if r.error is not None]

    def _load(self, env: Mapping[str, str], entry_points: list | None) -> None:
        allow_raw = env.get("PLINTH_PLUGINS", "").strip()
        allow = {n.strip() for n in allow_raw.split(",") if n.strip()} if allow_raw else None
        no_autoload = env.get("PLINTH_DISABLE_PLUGIN_AUTOLOAD", "").strip().lower() in ("1", "true", "yes")
        eps = list(metadata.entry_points(group=ENTRY_POINT_GROUP)) if entry_points is None else entry_points
        seen: set[str] = set()
        for ep in sorted(eps, key=lambda e: (not _is_in_tree(e), e.name)):
            if ep.name in seen:
                continue  # the same distribution found twice on sys.path
            seen.add(ep.name)
            in_tree = _is_in_tree(ep)
            if not in_tree:
                if no_autoload:
                    continue
                if allow is not None and ep.name not in allow:
                    continue
            dist = getattr(ep, "dist", None)
            record = PluginRecord(
                name=ep.name,
                distribution=dist.metadata["Name"] if dist is not None else None,
                version=dist.version if dist is not None else None,
                in_tree=in_tree,
                module=ep.value,
            )
            self.records[ep.name] = record
            explicit = allow is not None and ep.name in allow
            module = None
            try:
                module = ep.load()
                record.api_version = _check_api_version(ep.name, module)
                self._pm.register(module, name=ep.name)
            except Exception as exc:  # report every plugin failure; fatal only when asked for
                record.error = f"{type(exc).__name__}: {exc}"
                if module is not None and self._pm.is_registered(module):
                    self._pm.unregister(name=ep.name)
                if explicit or in_tree:
                    raise PluginError(f"plugin {ep.name!r} failed to load: {record.error}") from exc
                logger.warning("skipping plugin %r: %s", ep.name, record.error)
        if allow is not None:
            missing = sorted(allow - set(self.records))
            if missing and not no_autoload:
                raise PluginError(
                    f"PLINTH_PLUGINS names plugins that are not installed: {', '.join(missing)}; "
                    f"installed: {', '.join(sorted(self.records)) or 'none'}"
                )
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(str(exc)) from exc
        for kind in KINDS:
            for reg in self.registrations(kind).values():
                self.records[reg.plugin].provides.setdefault(kind, []).append(reg.name)

    def register_module(self, module: ModuleType, name: str) -> None:
        """Register an already-imported plugin module (used by tests and embedders)."""
        _check_api_version(name, module)
        self._pm.register(module, name=name)
        self.records[name] = PluginRecord(
            name=name, distribution=None, version=None, in_tree=False, module=module.__name__,
            api_version=module.PLINTH_PLUGIN_API,
        )
        self._registry_cache.clear()
        for kind in KINDS:
            for reg in self.registrations(kind).values():
                if reg.plugin == name:
                    self.records[name].provides.setdefault(kind, []).append(reg.name)

    def registrations(self, kind: str) -> dict[str, Registration]:
        """All registrations of one kind (``"platforms"``, ``"models"``, ...), by name.

        When two plugins register the same name, the one registered last wins and a
        warning is logged (third-party plugins load after the in-tree ones, so they can
        replace a built-in).
        """
        if kind not in KINDS:
            raise KeyError(f"unknown plugin kind {kind!r}; known: {', '.join(KINDS)}")
        if kind in self._registry_cache:
            return self._registry_cache[kind]
        caller = getattr(self._pm.hook, f"plinth_{kind}")
        out: dict[str, Registration] = {}
        # Call implementations one by one so each result is attributed to its plugin.
        for impl in caller.get_hookimpls():  # registration order: in-tree first, then third-party
            result = impl.function()
            if result is None:
                continue
            if not isinstance(result, Mapping):
                raise PluginError(f"plugin {impl.plugin_name!r}: plinth_{kind}() must return a dict, got {type(result).__name__}")
            for name, ref in result.items():
                if name in out and out[name].plugin != impl.plugin_name:
                    logger.warning("%s %r from plugin %r replaces the one from %r", kind, name, impl.plugin_name, out[name].plugin)
                out[name] = Registration(kind=kind, name=name, ref=ref, plugin=impl.plugin_name)
        self._registry_cache[kind] = out
        return out

    def add_cli_arguments(self, parser: Any, command: str) -> None:
        self._pm.hook.plinth_add_cli_arguments(parser=parser, command=command)

    def engine_config_overrides(self, config: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        impls = self._pm.hook.plinth_adjust_engine_config.get_hookimpls()
        return [r for impl in impls if (r := impl.function(config=config, args=args))]


def _is_in_tree(ep: Any) -> bool:
    dist = getattr(ep, "dist", None)
    if dist is not None:
        return dist.metadata["Name"] == IN_TREE_DISTRIBUTION
    return ep.value.startswith("plinth.")


_lock = threading.Lock()
_manager: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, built on first use."""
    global _manager
    with _lock:
        if _manager is None:
            _manager = PluginManager()
        return _manager


def reset_plugin_manager() -> None:
    """Forget the process-wide plugin manager (the next call rebuilds it)."""
    global _manager
    with _lock:
        _manager = None
