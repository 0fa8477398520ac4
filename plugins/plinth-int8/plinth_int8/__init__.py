"""plinth-int8: an INT8 weight-only quantization method, the worked example of a quantization plugin.

This module is what the ``plinth.plugins`` entry point names. It only registers a lazy reference;
the method module (and torch) are imported when ``--quantization int8`` is used.
"""

from plinth.hookspecs import hookimpl

PLINTH_PLUGIN_API = "1.0"


@hookimpl
def plinth_quantization_methods() -> dict[str, str]:
    return {"int8": "plinth_int8.method:Int8WeightOnly"}
