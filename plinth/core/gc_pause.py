"""Python's cyclic garbage collector paused while an engine starts.

A start-up imports torch and transformers and builds the model: about half a million objects, most of them
long-lived. The collector, triggered by the allocation counts, scans them again and again (on a 2-core machine
~0.9 s of the default model's ~7 s start, six full collections among them). :class:`GcPause` turns it off for
the start and back on after, as it was. A server that owns its process also freezes what the start left
(``gc.freeze``), so that later collections, which would stall a decode step, never scan those objects again:
first one collection of the youngest generation, where everything made during the pause still is, frees the
start's own garbage (~10k objects in reference cycles for the default model), so that none of it is frozen.
``LLM`` also pauses it while it queues a batch of prompts (each prompt's token list is a tracked object, and
the collections that thousands of new requests trigger rescan every earlier one's).
"""

from __future__ import annotations

import gc
from types import TracebackType


class GcPause:
    """The collector off from construction (or ``with``) until :meth:`end`, then back to its former state.

    Args:
        freeze: at the end, collect the youngest generation, then move every object tracked so far to the
            permanent generation (``gc.freeze``): for a process that plinth owns and keeps one engine in
            (``plinth serve``), not for a library caller's, whose engines may come and go.
    """

    def __init__(self, freeze: bool = False):
        self.freeze = freeze
        self._was_enabled = gc.isenabled()
        self._ended = False
        gc.disable()

    def end(self) -> None:
        """Turn the collector back on if it was on before (idempotent)."""
        if self._ended:
            return
        self._ended = True
        if self.freeze:
            gc.collect(0)
            gc.freeze()
        if self._was_enabled:
            gc.enable()

    def __enter__(self) -> GcPause:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.end()
