"""The plinth plugin API: every extension point, as pluggy hookspecs.

A plinth plugin is a Python module registered under the entry-point group
``plinth.plugins``. It must define the module attribute ``PLINTH_PLUGIN_API``
(a ``"MAJOR.MINOR"`` string naming the plugin API it was written for) and
implement any of the hooks below with :data:`hookimpl`::

    # my_plugin.py
    from plinth.hookspecs import hookimpl

    PLINTH_PLUGIN_API = "1.0"

    @hookimpl
    def plinth_platforms():
        return {"npu": "my_plugin.platform:NpuPlatform"}

A plugin whose major API version differs from :data:`PLUGIN_API_VERSION` is
refused with a message naming both versions.

Registration hooks return ``{name: "package.module:Attribute"}`` mappings.
The references are resolved lazily, on first use, so discovering plugins never
imports a vendor SDK, ``torch.cuda`` state or model weights.

Hooks are always called with keyword arguments. Hooks not marked
``firstresult`` collect the results of every plugin (``None`` results are
dropped by pluggy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import argparse

    from plinth.config import EngineConfig

PROJECT_NAME = "plinth"

#: The version of this plugin API. A change of the major number breaks plugins.
PLUGIN_API_VERSION = "1.0"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def plinth_platforms() -> dict[str, str]:
    """Provide hardware platforms.

    Called once when the plugin manager builds the platform registry.

    Returns:
        ``{platform_name: "pkg.mod:PlatformClass"}``. Each class subclasses
        :class:`plinth.platforms.interface.Platform`. Importing the module must be
        cheap and must not initialise a device runtime.
    """


@hookspec
def plinth_attention_backends() -> dict[str, str]:
    """Provide attention backends.

    Called once when the attention-backend registry is built.

    Returns:
        ``{backend_name: "pkg.mod:BackendClass"}``; each class subclasses
        :class:`plinth.attention_backends.interface.AttentionBackend`.
    """


@hookspec
def plinth_quantization_methods() -> dict[str, str]:
    """Provide quantization methods.

    Called once when the quantization registry is built. Every name returned here
    is also accepted by ``--quantization`` on the command line.

    Returns:
        ``{method_name: "pkg.mod:QuantizationMethodClass"}``.
    """


@hookspec
def plinth_models() -> dict[str, str]:
    """Provide model architectures.

    Called once when the model registry is built.

    Returns:
        ``{hf_architecture_name: "pkg.mod:ModelClass"}``, keyed by the name found in a
        checkpoint's ``config.json`` ``architectures[0]`` (e.g. ``"LlamaForCausalLM"``).
    """


@hookspec
def plinth_tool_parsers() -> dict[str, str]:
    """Provide tool-call parsers (``plinth serve --tool-call-parser NAME``).

    Called once when the tool-parser registry is built.

    Returns:
        ``{parser_name: "pkg.mod:ParserClass"}``; each class subclasses
        :class:`plinth.entrypoints.openai.tool_parsers.ToolParser`.
    """


@hookspec
def plinth_reasoning_parsers() -> dict[str, str]:
    """Provide reasoning parsers (``plinth serve --reasoning-parser NAME``).

    Called once when the reasoning-parser registry is built.

    Returns:
        ``{parser_name: "pkg.mod:ParserClass"}``; each class subclasses
        :class:`plinth.entrypoints.openai.reasoning_parsers.ReasoningParser`.
    """


@hookspec
def plinth_logits_processors() -> dict[str, str]:
    """Provide custom logits processors (``plinth serve --logits-processors NAME``,
    ``LLM(model, logits_processors=["NAME"])``).

    Called once when the registry is built; a registered processor runs only where it is named.

    Returns:
        ``{processor_name: "pkg.mod:ProcessorClass"}``; each class subclasses
        :class:`plinth.core.logits_processors.LogitsProcessor`.
    """


@hookspec
def plinth_add_cli_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """Add command-line arguments to a plinth sub-command.

    Called for every plugin while the CLI parser of ``command`` (``"serve"``,
    ``"generate"``, ``"bench"``, ...) is built. Add an argument group; use long option
    names prefixed with the plugin's name to avoid clashes.
    """


@hookspec
def plinth_adjust_engine_config(config: EngineConfig, args: dict[str, Any]) -> dict[str, Any] | None:
    """Adjust the engine configuration before the engine starts.

    Called once per engine start, after the configuration is built from user input
    and before it is validated. ``args`` holds the parsed CLI or ``LLM(...)`` keyword
    arguments, including those the plugin added.

    Returns:
        ``None`` to leave the configuration alone, or a mapping of
        ``{"section.field": value}`` overrides (e.g. ``{"cache.block_size": 32}``);
        they are applied in plugin registration order and the result is validated again.
    """
