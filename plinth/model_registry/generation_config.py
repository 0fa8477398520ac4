"""A model's recommended sampling settings: its ``generation_config.json``.

Model folders often carry ``generation_config.json`` next to ``config.json``: the settings their authors
recommend (Llama-3-Instruct: temperature 0.6, top-p 0.9; Qwen2.5-Instruct: temperature 0.7, top-p 0.8, top-k
20, repetition penalty 1.05) and, for chat models, every token that ends a turn (``eos_token_id`` may list
several where ``config.json`` names one). The engine reads it (``--generation-config auto``, the default) and

- makes its sampling keys the defaults for fields a request leaves unset (a request's own value wins; the
  server's and ``LLM.get_default_sampling_params``'s defaults; ``max_new_tokens`` becomes the default
  ``max_tokens``);
- ends sequences at each of its ``eos_token_id`` too (unless a request sets ``ignore_eos``).

``--generation-config none`` ignores the file; ``--generation-config DIR`` reads ``DIR/generation_config.json``
(or a JSON file named directly) instead, e.g. for a GGUF file, which has no such settings.
``--override-generation-config JSON`` sets or replaces keys on top of either. Keys other than these are
ignored in the file (``do_sample`` among them, as vLLM does) and refused in the override.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from plinth.errors import ModelLoadError

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
#: generation-config key -> :class:`~plinth.core.request.SamplingParams` field
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
_INTEGER_KEYS = ("top_k", "max_new_tokens")


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """What a generation config contributes.

    Attributes:
        sampling: :class:`~plinth.core.request.SamplingParams` keyword -> value, only the keys given.
        eos_token_ids: the config's end-of-sequence ids (added to the model's).
        origin: where they came from (a file, ``--override-generation-config``), for messages; ``None``
            when nothing was read.
    """

    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    origin: str | None = None


def _config_file(setting: str, model_path: str | None, kind: str) -> Path | None:
    """The JSON file ``setting`` (``auto``, ``none``, a folder or a file) names for this model."""
    if setting in ("none", "vllm"):   # vLLM's name for its own defaults, taken for scripts written for it
        return None
    if setting == "auto":
        if model_path is None or kind == "gguf" or not Path(model_path).is_dir():
            return None
        path = Path(model_path) / FILE_NAME
        return path if path.is_file() else None
    path = Path(os.path.expanduser(setting))
    if path.is_dir():
        path = path / FILE_NAME
    if not path.is_file():
        raise ModelLoadError(f"--generation-config {setting!r}: no {FILE_NAME} there (give a folder holding one, "
                             f"a JSON file, 'auto' for the model's own or 'none')")
    return path


def _checked_value(key: str, value: Any, origin: str) -> Any:
    integer = key in _INTEGER_KEYS
    ok = (isinstance(value, int) if integer else isinstance(value, int | float)) and not isinstance(value, bool)
    try:
        ok = ok and math.isfinite(value)
    except OverflowError:   # an integer too large for a float
        ok = False
    if not ok:
        kind = "an integer" if integer else "a number"
        raise ModelLoadError(f"{origin}: {key} must be {kind}, got {value!r}")
    return value


def _eos_ids(value: Any, origin: str) -> tuple[int, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in items):
        raise ModelLoadError(f"{origin}: eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(items)


def read_generation_defaults(setting: str, override: dict[str, Any] | None, model_path: str | None,
                             kind: str) -> GenerationDefaults:
    """The defaults ``setting`` (``--generation-config``) and ``override`` (``--override-generation-config``)
    give for a model at ``model_path`` of source ``kind`` (``hf_dir``, ``gguf``, ``dummy``).

    Raises:
        ModelLoadError: a named file that is missing or not a JSON object, a value of the wrong type, an
            unknown key in ``override``, or values :class:`~plinth.core.request.SamplingParams` refuses.
    """
    from plinth.core.request import SamplingParams, SamplingParamsError

    path = _config_file(setting, model_path, kind)
    sampling: dict[str, Any] = {}
    eos: tuple[int, ...] = ()
    origins: list[str] = []
    if path is not None:
        origin = str(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"cannot read {origin}: {exc} (--generation-config none ignores it)") from None
        if not isinstance(data, dict):
            raise ModelLoadError(f"{origin} is not a JSON object (--generation-config none ignores it)")
        for key, field in SAMPLING_KEYS.items():
            if data.get(key) is not None:
                sampling[field] = _checked_value(key, data[key], origin)
        eos = _eos_ids(data.get("eos_token_id"), origin)
        origins.append(origin)
    if override:
        origin = "--override-generation-config"
        unknown = sorted(set(override) - set(SAMPLING_KEYS))
        if unknown:
            raise ModelLoadError(f"{origin}: unknown key(s) {', '.join(map(repr, unknown))}; it takes "
                                 f"{', '.join(SAMPLING_KEYS)}")
        for key, value in override.items():
            if value is None:
                sampling.pop(SAMPLING_KEYS[key], None)
            else:
                sampling[SAMPLING_KEYS[key]] = _checked_value(key, value, origin)
        origins.append(origin)
    if "max_tokens" in sampling and sampling["max_tokens"] < 1:
        raise ModelLoadError(f"{' and '.join(origins)}: max_new_tokens must be at least 1, got {sampling['max_tokens']}")
    try:
        SamplingParams(**sampling)
    except SamplingParamsError as exc:
        raise ModelLoadError(f"{' and '.join(origins)}: {exc}") from None
    if not origins:
        return GenerationDefaults()
    if sampling:
        logger.info("default sampling parameters from %s: %s (a request's own values win; --generation-config "
                    "none ignores the model's)", " and ".join(origins),
                    ", ".join(f"{k}={v}" for k, v in sampling.items()))
    return GenerationDefaults(sampling, eos, " and ".join(origins))
