"""The engine's side of the adapter slots: which adapter each device slot holds, step by step."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np


class LoRASlotTable:
    """Assigns each step's adapters to the ``max_loras`` device slots.

    An adapter keeps its slot while it is there; a new one takes an empty slot, else the least recently used slot
    whose adapter no running request uses (the scheduler admits at most ``max_loras`` adapters among the running
    requests, so there is always one). The loads travel with the step that needs them, so the workers copy an
    adapter in before running it, in step order.
    """

    def __init__(self, max_loras: int):
        self.holder: list[int | None] = [None] * max_loras   # adapter id per slot
        self._slot_of: dict[int, int] = {}
        self._last_use = [0] * max_loras
        self._clock = 0

    def assign(self, requests: Sequence[Any], running: Iterable[Any]) -> tuple[np.ndarray | None, list[tuple[int, Any]]]:
        """The slot of each request (``[N]`` int64, -1 for the base model; ``None`` when none has an adapter)
        and the ``(slot, adapter)`` loads the step needs first."""
        if not any(r.lora is not None for r in requests):
            return None, []
        self._clock += 1
        slots = np.full(len(requests), -1, dtype=np.int64)
        loads: list[tuple[int, Any]] = []
        pinned: set[int] | None = None
        for i, req in enumerate(requests):
            adapter = req.lora
            if adapter is None:
                continue
            slot = self._slot_of.get(adapter.lora_id)   # an id always names the same files (LLMEngine.add_lora)
            if slot is None:
                if pinned is None:
                    pinned = {r.lora_id for r in running if r.lora is not None}
                slot = self._free_slot(pinned)
                old = self.holder[slot]
                if old is not None:
                    del self._slot_of[old]
                self.holder[slot] = adapter.lora_id
                self._slot_of[adapter.lora_id] = slot
                loads.append((slot, adapter))
            self._last_use[slot] = self._clock
            slots[i] = slot
        return slots, loads

    def _free_slot(self, pinned: set[int]) -> int:
        free = [s for s, held in enumerate(self.holder) if held is None or held not in pinned]
        if not free:
            raise RuntimeError("no free LoRA slot: more adapters among the running requests than max_loras")
        return min(free, key=lambda s: (self.holder[s] is not None, self._last_use[s]))
