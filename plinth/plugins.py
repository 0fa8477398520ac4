"""Plugin discovery: entry points, allow-list, validation and the discovery report.

Every plugin, in-tree or third-party, is a module named by an entry point in the
group ``plinth.plugins``. Environment variables:

``PLINTH_PLUGINS=a,b``
    Load only the third-party plugins named here (in-tree plugins always load).
    A plugin named here that fails to import or validate stops startup, and so does
    a name that no installed plugin has.
``PLINTH_DISABLE_PLUGIN_AUTOLOAD=1``
    Load no third-party plugin automatically; only the in-tree ones, plus those
    named explicitly in ``PLINTH_PLUGINS``.

A plugin that fails to import or to validate and was not named explicitly is
recorded in :attr:`PluginManager.failures` and skipped.

Validation of each plugin, in order: its module imports; it declares a compatible
``PLINTH_PLUGIN_API``; pluggy accepts its hook implementations (argument names match
the hookspecs); it implements no hook that plinth does not define (a misspelled hook
name would otherwise be ignored silently) and defines no hook-named function without
the ``@hookimpl`` marker; its registration hooks return ``{name: "pkg.mod:Attr"}``
mappings. Registration hooks are called once, at load; the references they return
are resolved only when used, so discovery never imports a device runtime.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import logging
import os
import re
import threading
from collections.abc import Mapping
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy

from plinth import hookspecs
from plinth.errors import UserFacingError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "plinth.plugins"
IN_TREE_DISTRIBUTION = "plinth-llm"

KINDS = ("platforms", "attention_backends", "quantization_methods", "models", "tool_parsers",
         "reasoning_parsers", "logits_processors")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
_REF = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


class PluginError(UserFacingError, RuntimeError):
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
    """Return the plugin's declared API version, or raise if plinth cannot host it.

    The major numbers must be equal; the plugin's minor number must not exceed
    plinth's (a plugin for API 1.3 may use hooks that plinth 1.0 lacks).
    """
    declared = getattr(module, "PLINTH_PLUGIN_API", None)
    if declared is None:
        raise PluginApiVersionError(
            f"plugin {name!r} does not declare PLINTH_PLUGIN_API; "
            f"set PLINTH_PLUGIN_API = {hookspecs.PLUGIN_API_VERSION!r} in module {module.__name__!r}"
        )
    if not isinstance(declared, str) or not re.fullmatch(r"\d+\.\d+", declared):
        raise PluginApiVersionError(
            f"plugin {name!r} declares an invalid PLINTH_PLUGIN_API {declared!r}; expected 'MAJOR.MINOR', "
            f"e.g. {hookspecs.PLUGIN_API_VERSION!r}"
        )
    have_major, have_minor = (int(p) for p in hookspecs.PLUGIN_API_VERSION.split("."))
    want_major, want_minor = (int(p) for p in declared.split("."))
    if want_major != have_major or want_minor > have_minor:
        raise PluginApiVersionError(
            f"plugin {name!r} was written for plinth plugin API {declared}, but this plinth provides "
            f"API {hookspecs.PLUGIN_API_VERSION}; upgrade the plugin or install a matching plinth"
        )
    return declared


def _env_flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise PluginError(f"{name}={raw!r} is not a boolean; use 1 or 0")


def _normalize(dist_name: str) -> str:
    return re.sub(r"[-_.]+", "-", dist_name).lower()


_DIST_IDS: dict[int, tuple[Any, str, str]] = {}   # id(distribution) -> (it, name, version), per discovery


def _dist_id(ep: Any) -> tuple[str, str] | None:
    """The name and version of the distribution that declares ``ep`` (None without one). Read once per
    distribution: each read parses its whole METADATA file, the README included."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None
    known = _DIST_IDS.get(id(dist))
    if known is None or known[0] is not dist:
        try:
            meta = dist.metadata
            name, version = meta["Name"], meta["Version"]
        except Exception:   # an unreadable METADATA (an interrupted install): the distribution is unknown
            name = version = None
        if not isinstance(name, str) or not name:
            logger.warning("entry point %r: its distribution's METADATA names no package; taken as unknown",
                           getattr(ep, "value", ep))
            known = _DIST_IDS[id(dist)] = (dist, None, None)
        else:
            known = _DIST_IDS[id(dist)] = (dist, name, version if isinstance(version, str) else "")
    return None if known[1] is None else (known[1], known[2])


def _is_in_tree(ep: Any) -> bool:
    ident = _dist_id(ep)
    if ident is not None:
        return _normalize(ident[0]) == IN_TREE_DISTRIBUTION
    return ep.value == "plinth" or ep.value.startswith("plinth.")


def _new_record(ep: Any) -> PluginRecord:
    """The record of an entry point before its module is loaded."""
    ident = _dist_id(ep)
    return PluginRecord(
        name=ep.name,
        distribution=ident[0] if ident is not None else None,
        version=ident[1] if ident is not None else None,
        in_tree=_is_in_tree(ep),
        module=ep.value,
    )


class PluginManager:
    """plinth's plugin manager: a pluggy manager plus the discovery report.

    Args:
        env: environment mapping read for ``PLINTH_PLUGINS`` and
            ``PLINTH_DISABLE_PLUGIN_AUTOLOAD`` (default: ``os.environ``).
        entry_points: entry points to load (default: the installed ones in
            ``plinth.plugins``); tests may pass a subset.

    Raises:
        PluginError: a plugin named in ``PLINTH_PLUGINS`` is missing or failed to load,
            or an environment variable is malformed.
    """

    def __init__(self, env: Mapping[str, str] | None = None, entry_points: list | None = None):
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        # plugin name -> kind -> {registered name: ref}, in load order
        self._provided: dict[str, dict[str, dict[str, str]]] = {}
        self._shadowed: list[PluginRecord] = []
        self._registry_cache: dict[str, dict[str, Registration]] = {}
        self._explicit: set[str] = set()   # named in PLINTH_PLUGINS: their failures stop start-up
        self._in_code: dict[str, str] = {}  # register_module's plugins: name -> module name
        self._load(os.environ if env is None else env, entry_points)

    @property
    def hook(self) -> Any:
        return self._pm.hook

    @property
    def failures(self) -> list[PluginRecord]:
        """Plugins that were discovered but not loaded, with their errors."""
        return [r for r in self.records.values() if r.error is not None] + self._shadowed

    # -- loading --------------------------------------------------------------------

    def _load(self, env: Mapping[str, str], entry_points: list | None) -> None:
        _DIST_IDS.clear()   # each discovery reads its own distribution objects
        allow_raw = env.get("PLINTH_PLUGINS", "").strip()
        allow = {n.strip() for n in allow_raw.split(",") if n.strip()} if allow_raw else None
        no_autoload = _env_flag(env, "PLINTH_DISABLE_PLUGIN_AUTOLOAD")
        eps = metadata.entry_points(group=ENTRY_POINT_GROUP) if entry_points is None else entry_points
        eps = sorted(eps, key=lambda e: (not _is_in_tree(e), e.name))  # in-tree first: third-party override
        discovered: dict[str, Any] = {}
        for ep in eps:
            if ep.name in discovered:
                self._note_duplicate(ep, discovered[ep.name])
                continue
            discovered[ep.name] = ep
            in_tree = _is_in_tree(ep)
            explicit = allow is not None and ep.name in allow
            if explicit:
                self._explicit.add(ep.name)
            if not in_tree and not explicit and (no_autoload or allow is not None):
                continue
            self._load_entry_point(ep, explicit)
        if allow is not None:
            missing = sorted(allow - set(discovered))
            if missing:
                raise PluginError(
                    f"PLINTH_PLUGINS names plugins that are not installed: {', '.join(missing)}; "
                    f"installed: {', '.join(sorted(discovered)) or 'none'}"
                )

    def _note_duplicate(self, ep: Any, first: Any) -> None:
        record, first_name = _new_record(ep), _new_record(first).distribution
        if record.distribution is not None and first_name is not None \
                and _normalize(record.distribution) == _normalize(first_name):
            return  # the same distribution found twice on sys.path
        record.error = (f"plugin name {ep.name!r} is already used by {first.value!r} "
                        f"(distribution {first_name or 'unknown'}); skipped")
        logger.warning("skipping plugin %r from %r: %s", ep.name, ep.value, record.error)
        self._shadowed.append(record)

    def _load_entry_point(self, ep: Any, explicit: bool) -> None:
        record = self.records[ep.name] = _new_record(ep)
        try:
            module = ep.load()
        except (Exception, SystemExit) as exc:  # any import-time error (an exit too) is reported with the plugin's name
            self._fail(record, exc, explicit)
            return
        if not isinstance(module, ModuleType):
            self._fail(record, PluginError(f"entry point {ep.value!r} must name a module, not an attribute"),
                       explicit)
            return
        try:
            self._register(module, record)
        except PluginError as exc:
            self._fail(record, exc, explicit)

    def _fail(self, record: PluginRecord, exc: BaseException, explicit: bool) -> None:
        record.error = str(exc) if isinstance(exc, PluginError) else f"{type(exc).__name__}: {exc}"
        if explicit:
            raise PluginError(f"plugin {record.name!r} (named in PLINTH_PLUGINS) failed to load: {record.error}") \
                from exc
        log = logger.error if record.in_tree else logger.warning
        log("skipping plugin %r: %s", record.name, record.error)

    def _register(self, module: ModuleType, record: PluginRecord) -> None:
        """Validate and register one plugin module; on failure leave no trace in pluggy.

        Raises:
            PluginError: any validation failure, with a message naming the plugin.
        """
        name = record.name
        record.api_version = _check_api_version(name, module)
        self._check_unmarked(module, name)
        try:
            self._pm.register(module, name=name)
        except (pluggy.PluginValidationError, ValueError) as exc:
            raise PluginError(f"plugin {name!r} is invalid: {exc}") from exc
        try:
            provided = self._validate_hooks(module, name)
        except PluginError:
            self._pm.unregister(module)
            raise
        self._provided[name] = provided
        record.provides = {kind: sorted(regs) for kind, regs in provided.items() if regs}
        others = sorted(caller.name for caller in self._pm.get_hookcallers(module) or []
                        if caller.name.removeprefix("plinth_") not in KINDS)
        if others:   # hooks that register nothing (CLI flags, engine configuration): shown by `plinth plugins`
            record.provides["hooks"] = others
        self._registry_cache.clear()

    def _check_unmarked(self, module: ModuleType, name: str) -> None:
        for hook_name in _hook_names():
            func = getattr(module, hook_name, None)
            if callable(func) and self._pm.parse_hookimpl_opts(module, hook_name) is None:
                raise PluginError(
                    f"plugin {name!r} defines {hook_name}() without the @hookimpl marker "
                    f"(from plinth.hookspecs import hookimpl); it would never be called"
                )

    def _validate_hooks(self, module: ModuleType, name: str) -> dict[str, dict[str, str]]:
        """Reject unknown hooks and wrappers; call the registration hooks once."""
        provided: dict[str, dict[str, str]] = {}
        for caller in self._pm.get_hookcallers(module) or []:
            impls = [i for i in caller.get_hookimpls() if i.plugin is module]
            if not caller.has_spec() and not all(i.optionalhook for i in impls):
                close = difflib.get_close_matches(caller.name, _hook_names(), n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise PluginError(
                    f"plugin {name!r} implements unknown hook {caller.name!r}; {hint}"
                    f"known hooks: {', '.join(_hook_names())}"
                )
            if any(i.hookwrapper or i.wrapper for i in impls):
                raise PluginError(f"plugin {name!r}: {caller.name} must not be a hook wrapper")
            kind = caller.name.removeprefix("plinth_")
            if kind in KINDS:
                for impl in impls:
                    provided.setdefault(kind, {}).update(_call_registration(impl, name, kind))
        return provided

    def register_module(self, module: ModuleType, name: str) -> None:
        """Register an already-imported plugin module (used by tests and embedders).

        Raises:
            PluginError: the module fails validation (the same checks as entry points).
        """
        if name in self.records:
            raise PluginError(f"a plugin named {name!r} is already registered")
        record = PluginRecord(name=name, distribution=None, version=None, in_tree=False, module=module.__name__)
        self._register(module, record)
        self.records[name] = record
        self._explicit.add(name)   # registered by code: its hooks' failures are the caller's to see
        self._in_code[name] = module.__name__

    def code_registrations(self) -> dict[str, str]:
        """The plugins :meth:`register_module` added, ``{name: module name}``, for worker processes to register
        too (they discover entry points only).

        Raises:
            PluginError: one's module cannot be imported by its name in another process (the ``__main__``
                script, a module built in code).
        """
        import sys

        for name, module_name in self._in_code.items():
            module = sys.modules.get(module_name)
            if module_name in ("__main__", "__mp_main__") or getattr(module, "__spec__", None) is None:
                raise PluginError(f"plugin {name!r} was registered from module {module_name!r}, which worker "
                                  "processes cannot import by name; register a module they can import (a file "
                                  "on the path, an installed package), or install the plugin with an entry point")
        return dict(self._in_code)

    def _register_code_plugins(self, registrations: Mapping[str, str]) -> None:
        for name, module_name in registrations.items():
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:  # noqa: BLE001 - any import failure names the plugin
                raise PluginError(f"plugin {name!r}: worker process cannot import {module_name!r} "
                                  f"({type(exc).__name__}: {exc})") from None
            self.register_module(module, name)

    # -- queries --------------------------------------------------------------------

    def registrations(self, kind: str) -> dict[str, Registration]:
        """All registrations of one kind (``"platforms"``, ``"models"``, ...), by name.

        When two plugins register the same name, the one registered last wins and a
        warning is logged (third-party plugins load after the in-tree ones, so they can
        replace a built-in).

        Raises:
            KeyError: ``kind`` is not one of :data:`KINDS`.
        """
        if kind not in KINDS:
            raise KeyError(f"unknown plugin kind {kind!r}; known: {', '.join(KINDS)}")
        if kind in self._registry_cache:
            return self._registry_cache[kind]
        out: dict[str, Registration] = {}
        for plugin, provided in self._provided.items():  # load order: in-tree first, then third-party
            for name, ref in provided.get(kind, {}).items():
                if name in out:
                    logger.warning("%s %r from plugin %r replaces the one from %r", kind, name, plugin,
                                   out[name].plugin)
                out[name] = Registration(kind=kind, name=name, ref=ref, plugin=plugin)
        self._registry_cache[kind] = out
        return out

    def add_cli_arguments(self, parser: Any, command: str) -> None:
        """Let every plugin add its flags to the parser of ``command``.

        A third-party plugin whose hook raises (e.g. a clashing option name) is reported and its flags left
        out, as a plugin that fails to load is skipped; an in-tree one, or one named in ``PLINTH_PLUGINS``,
        stops the command.

        Raises:
            PluginError: an in-tree or explicitly named plugin's hook raised.
        """
        for impl in self._pm.hook.plinth_add_cli_arguments.get_hookimpls():
            before = list(parser._actions)
            try:
                _call_impl(impl, parser=parser, command=command)
            except PluginError as exc:
                record = self.records.get(impl.plugin_name)
                if record is None or record.in_tree or impl.plugin_name in self._explicit:
                    raise
                _drop_actions(parser, [a for a in parser._actions if a not in before])   # the flags it added first
                logger.warning("skipping the command-line flags of plugin %r: %s", impl.plugin_name, exc)

    def cli_option_names(self) -> frozenset[str]:
        """The ``dest`` names of the flags plugins add to any command (what ``LLM(...)`` accepts for them)."""
        import argparse

        names: set[str] = set()
        for command in ("serve", "generate", "run-batch", "bench"):
            parser = argparse.ArgumentParser(add_help=False)
            try:
                self.add_cli_arguments(parser, command)
            except PluginError:
                continue   # the command reports it when it builds its parser
            names.update(action.dest for action in parser._actions)
        return frozenset(names)

    def apply_engine_config_overrides(self, config: Any, args: dict[str, Any]) -> Any:
        """``config`` with every plugin's overrides applied in turn (see :meth:`engine_config_overrides`).

        Raises:
            PluginError: a plugin's hook raised, returned something other than a mapping, or an override that
                the configuration refuses (named with the plugin).
        """
        from plinth.config import ConfigError

        for name, overrides in self._named_overrides(config, args):
            try:
                config = config.with_overrides(overrides)
            except ConfigError as exc:
                raise PluginError(f"plugin {name!r}: its engine configuration override {overrides!r} is refused: "
                                  f"{exc}") from None
        return config

    def engine_config_overrides(self, config: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
        """Collect the non-empty override mappings of every plugin, in registration order.

        Raises:
            PluginError: a plugin's hook raised or returned something other than a mapping.
        """
        return [overrides for _, overrides in self._named_overrides(config, args)]

    def _named_overrides(self, config: Any, args: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for impl in self._pm.hook.plinth_adjust_engine_config.get_hookimpls():
            result = _call_impl(impl, config=config, args=args)
            if result is None:
                continue
            if not isinstance(result, Mapping):
                raise PluginError(f"plugin {impl.plugin_name!r}: plinth_adjust_engine_config() must return "
                                  f"a mapping or None, got {type(result).__name__}")
            if result:
                out.append((impl.plugin_name, dict(result)))
        return out


def _hook_names() -> list[str]:
    return sorted(n for n in vars(hookspecs) if n.startswith("plinth_"))


def _drop_actions(parser: Any, actions: list[Any]) -> None:
    """Take ``actions`` (flags a failed plugin hook added) back out of an argparse parser and its groups."""
    for action in actions:
        parser._remove_action(action)
        for option in action.option_strings:
            parser._option_string_actions.pop(option, None)
        for group in [*parser._action_groups, *parser._mutually_exclusive_groups]:
            if action in group._group_actions:
                group._group_actions.remove(action)


def _call_impl(impl: Any, **kwargs: Any) -> Any:
    """Call one hook implementation with the keyword arguments it declares."""
    try:
        return impl.function(**{k: kwargs[k] for k in impl.argnames})
    except (Exception, SystemExit) as exc:  # attribute the failure (an exit too) to the plugin that raised it
        hook = getattr(impl.function, "__name__", "hook")
        raise PluginError(f"plugin {impl.plugin_name!r} failed in {hook}(): {type(exc).__name__}: {exc}") \
            from exc


def _call_registration(impl: Any, plugin: str, kind: str) -> dict[str, str]:
    result = _call_impl(impl)
    if result is None:
        return {}
    if not isinstance(result, Mapping):
        raise PluginError(f"plugin {plugin!r}: plinth_{kind}() must return a dict, got {type(result).__name__}")
    for name, ref in result.items():
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {plugin!r}: plinth_{kind}() returned an invalid name {name!r}")
        if not isinstance(ref, str) or not _REF.match(ref):
            raise PluginError(f"plugin {plugin!r}: plinth_{kind}() maps {name!r} to {ref!r}; "
                              f"expected a 'package.module:Attribute' string")
    return dict(result)


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


def adopt_code_plugins(registrations: Mapping[str, str]) -> None:
    """In a worker process: the plugins registered in code become exactly the driver's
    :meth:`PluginManager.code_registrations` (imported by name and registered; a process that served an earlier
    engine first forgets what that engine's driver had registered).

    Raises:
        PluginError: a module fails to import or to validate.
    """
    pm = get_plugin_manager()
    if pm._in_code == dict(registrations):
        return
    if pm._in_code:
        reset_plugin_manager()
        pm = get_plugin_manager()
    pm._register_code_plugins(registrations)
