"""Choosing the platform to run on: the available one of highest priority, unless one is forced.

Priorities of the in-tree platforms: cuda 30, rocm 30 (never both available: a torch
build is one or the other), xpu 20, cpu 0. Out-of-tree platforms should use a priority
of 100 or more, so that installing a platform plugin makes it the default wherever its
hardware is present; at equal priority an out-of-tree platform ranks before an in-tree one.

``PLINTH_PLATFORM=name`` (or ``--platform name``) forces a platform; forcing one that is
unknown or cannot run here is a :class:`~plinth.errors.SelectionError` with the reason.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, NamedTuple

from plinth.core.selection_records import construct
from plinth.errors import SelectionError
from plinth.plugins import PluginError, PluginManager, Registration, get_plugin_manager

if TYPE_CHECKING:
    from plinth.platforms.interface import Platform

logger = logging.getLogger(__name__)

PLATFORM_ENV = "PLINTH_PLATFORM"
#: the lowest priority an out-of-tree platform should declare; every in-tree one is below it
OUT_OF_TREE_MIN_PRIORITY = 100


class PlatformStatus(NamedTuple):
    """One row of the platform report, in selection order."""

    name: str
    plugin: str
    priority: int | None  # None when the class could not be loaded
    available: bool
    reason: str  # why it is unavailable; "" when available


def _probe(reg: Registration) -> tuple[type[Platform] | None, PlatformStatus]:
    """Load one registered platform class and ask whether it can run here. Never raises."""
    from plinth.attention_backends.interface import Support
    from plinth.platforms.interface import Platform

    try:
        cls = reg.load()
    except PluginError as exc:
        return None, PlatformStatus(reg.name, reg.plugin, None, False, f"cannot load {reg.ref}: {exc}")
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        return None, PlatformStatus(reg.name, reg.plugin, None, False,
                                    f"{reg.ref} is not a subclass of plinth.platforms.interface.Platform")
    if getattr(cls, "name", None) != reg.name:
        return None, PlatformStatus(reg.name, reg.plugin, None, False,
                                    f"{reg.ref} has name {getattr(cls, 'name', None)!r} but is registered "
                                    f"as {reg.name!r}")
    priority = getattr(cls, "priority", None)
    if isinstance(priority, bool) or not isinstance(priority, int):
        return None, PlatformStatus(reg.name, reg.plugin, None, False,
                                    f"{reg.ref} has priority {priority!r}, not an integer")
    try:
        support = cls.is_available()
    except Exception as exc:  # is_available() must not raise; report the plugin bug as the reason
        return cls, PlatformStatus(reg.name, reg.plugin, priority, False,
                                   f"is_available() raised {type(exc).__name__}: {exc}")
    if not isinstance(support, Support):
        return cls, PlatformStatus(reg.name, reg.plugin, priority, False,
                                   f"is_available() returned {support!r}, not a Support")
    reason = "" if support.ok else (support.reason or "unavailable (no reason given)")
    return cls, PlatformStatus(reg.name, reg.plugin, priority, bool(support.ok), reason)


def _ranked(pm: PluginManager) -> list[tuple[type[Platform] | None, PlatformStatus]]:
    def key(item: tuple[type[Platform] | None, PlatformStatus]) -> tuple:
        status = item[1]
        record = pm.records.get(status.plugin)
        in_tree = record.in_tree if record is not None else False
        priority = status.priority if status.priority is not None else float("-inf")
        return (-priority, in_tree, status.name)

    return sorted((_probe(reg) for reg in pm.registrations("platforms").values()), key=key)


def platform_report(pm: PluginManager | None = None) -> list[PlatformStatus]:
    """Every registered platform with its priority and availability, in selection order."""
    return [status for _cls, status in _ranked(pm or get_plugin_manager())]


def select_platform(forced: str | None = None, pm: PluginManager | None = None) -> Platform:
    """Return the platform to run on.

    Args:
        forced: a platform name that must be used (from ``--platform``); when ``None``,
            ``$PLINTH_PLATFORM`` is read; when that is unset or empty, the available
            platform of highest priority is chosen.
        pm: the plugin manager to take platforms from (default: the process-wide one).

    Raises:
        SelectionError: the forced platform is unknown (the message lists the known
            ones) or not available here (the message gives the reason), or no platform
            is available at all.
    """
    pm = pm or get_plugin_manager()
    source = "forced"
    if forced is None:
        forced, source = os.environ.get(PLATFORM_ENV), f"set by {PLATFORM_ENV}"
    forced = forced.strip() if forced else None
    regs = pm.registrations("platforms")
    if forced:
        if forced not in regs:
            raise SelectionError(f"unknown platform {forced!r} ({source}); known platforms: "
                                 f"{', '.join(sorted(regs)) or 'none'}")
        cls, status = _probe(regs[forced])
        if cls is None or not status.available:
            raise SelectionError(f"platform {forced!r} ({source}) cannot run here: {status.reason}")
        logger.info("platform: %s (%s)", forced, source)
        return construct(cls, "platform", status.name, status.plugin)
    ranked = _ranked(pm)
    for cls, status in ranked:
        if cls is not None and status.available:
            logger.info("platform: %s (priority %d, plugin %r)", status.name, status.priority, status.plugin)
            return construct(cls, "platform", status.name, status.plugin)
    reasons = "; ".join(f"{s.name}: {s.reason}" for _c, s in ranked) or "no platform plugin is loaded"
    raise SelectionError(f"no platform is available: {reasons}")
