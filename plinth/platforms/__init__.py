"""Hardware platforms: the Platform contract, the in-tree platform plugins, platform selection.

Importing this package is cheap (no torch); platform classes are imported when selected.
"""

from plinth.platforms.selection import (
    OUT_OF_TREE_MIN_PRIORITY,
    PLATFORM_ENV,
    PlatformStatus,
    platform_report,
    select_platform,
)

__all__ = ["OUT_OF_TREE_MIN_PRIORITY", "PLATFORM_ENV", "PlatformStatus", "platform_report", "select_platform"]
