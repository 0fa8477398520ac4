"""The selection table of ``plinth plugins --benchmark [MODEL]``: every candidate of every kind,
whether it can run, its error against the reference, its times and which one won.

``print_selection_table(result)`` prints one kind's table (``SelectionResult`` from
:mod:`plinth.core.selection`); :func:`run_benchmark` is the command itself.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from plinth.core.selection import SelectionResult


def _fmt_times(times: dict[str, float] | None) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in times.items()) if times else "-"


def format_selection_table(result: SelectionResult) -> str:
    """One block of text for one kind: a header line, then a row per candidate, the winner marked."""
    head = (f"{result.kind}: {result.winner} ({result.how}"
            f"{', from cache' if result.from_cache else ''}; {result.elapsed_s:.2f} s)")
    header = ("", "NAME", "PLUGIN", "STATUS", "MAX ERROR", "TIMES (ms)", "REASON")
    rows = [
        ("*" if c.chosen else "", c.name, c.plugin, c.status,
         "-" if c.max_error is None else f"{c.max_error:.2e}",
         _fmt_times(c.times_ms) + ("" if c.score is None else f" (score {c.score:.3f})"), c.reason)
        for c in result.candidates
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = [head] + ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                      for row in (header, *rows)]
    return "\n".join(lines) + "\n"


def print_selection_table(result: SelectionResult, file: TextIO | None = None) -> None:
    """Print :func:`format_selection_table` (to stdout by default)."""
    (file or sys.stdout).write(format_selection_table(result))


def benchmark_model(config: Any) -> list[SelectionResult]:
    """Run selection for ``config``'s model (shapes from its config file; no weights are loaded),
    timing every candidate whatever the cache holds (the fresh result is stored).

    Returns:
        One result per kind: the platform, then the attention backend.
    """
    import dataclasses

    from plinth.core.selection import describe_platform, select_attention_backend
    from plinth.model_registry.loader import resolve_dtype, resolve_model_source
    from plinth.platforms.selection import select_platform
    from plinth.worker.setup import attention_spec

    platform = select_platform(config.device.platform)
    source = resolve_model_source(config.model)
    dtype = resolve_dtype(config.model, source.hf_config, platform.supported_dtypes())
    spec = attention_spec(source.hf_config, dtype, config.cache.block_size, config.cache.kv_cache_dtype)
    device = config.device
    if device.selection == "cached" and not device.attention_backend:
        device = dataclasses.replace(device, selection="benchmark")
    return [describe_platform(platform), select_attention_backend(spec, platform, device)]


def run_benchmark(model: str | None, *, as_json: bool = False, file: TextIO | None = None,
                  kv_cache_dtype: str = "auto") -> int:
    """``plinth plugins --benchmark [MODEL] [--kv-cache-dtype ...]``: select for ``model`` and print every kind's
    table."""
    import json
    from pathlib import Path

    from plinth.config import EngineConfig
    from plinth.model_registry.loader import list_presets

    out = file or sys.stdout
    fmt = "dummy" if model is not None and not Path(model).exists() and model in list_presets() else "auto"
    results = benchmark_model(EngineConfig.from_kwargs(model=model, load_format=fmt, kv_cache_dtype=kv_cache_dtype))
    if as_json:
        json.dump([r.to_dict() for r in results], out, indent=2)
        out.write("\n")
    else:
        out.write("\n".join(format_selection_table(r) for r in results))
    return 0
