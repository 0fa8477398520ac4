"""How a request names the LoRA adapter it runs with."""

from __future__ import annotations

import dataclasses
import numbers
import os


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request (vLLM's fields and order).

    Attributes:
        lora_name: the adapter's name (in the server: the ``model`` a request asks for).
        lora_int_id: a positive integer that identifies the adapter in the engine: requests with the same id share
            its slot and its prefix-cache entries, so one id must always name the same adapter files.
        lora_path: the adapter's folder (``adapter_config.json`` and ``adapter_model.safetensors``, as PEFT
            writes them).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, numbers.Integral)
                or self.lora_int_id <= 0):
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if isinstance(self.lora_path, os.PathLike):
            object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")
        object.__setattr__(self, "lora_path", os.path.expanduser(self.lora_path))   # "~/adapters/x", as vLLM takes it
