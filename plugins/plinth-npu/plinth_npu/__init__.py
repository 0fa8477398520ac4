"""plinth-npu: the Ascend NPU platform plugin.

This module is what the ``plinth.plugins`` entry point names. It only registers a
lazy reference; ``torch_npu`` is imported when the platform is probed, never here.
"""

from plinth.hookspecs import hookimpl

PLINTH_PLUGIN_API = "1.0"


@hookimpl
def plinth_platforms() -> dict[str, str]:
    return {"npu": "plinth_npu.platform:NpuPlatform"}
