"""In-tree quantization methods, registered through the plugin hook like any third-party one."""

from plinth.hookspecs import hookimpl

PLINTH_PLUGIN_API = "1.0"

_Q = "plinth.quantization"


@hookimpl
def plinth_quantization_methods() -> dict[str, str]:
    return {
        "awq": f"{_Q}.awq:AWQMethod",
        "compressed-tensors": f"{_Q}.compressed_tensors:CompressedTensorsMethod",
        "fp8": f"{_Q}.fp8:FP8Method",
        "gguf": f"{_Q}.gguf:GGUFMethod",
        "gptq": f"{_Q}.gptq:GPTQMethod",
        "int4": f"{_Q}.int4:Int4Method",
    }
