"""The cuda platform plugin (to be completed)."""

from plinth.hookspecs import hookimpl

PLINTH_PLUGIN_API = "1.0"


@hookimpl
def plinth_platforms() -> dict[str, str]:
    return {"cuda": "plinth.platforms.cuda.platform:CudaPlatform"}
