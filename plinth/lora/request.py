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
            writes them); ``~`` is expanded and the path normalized (``a/`` and ``a`` name one adapter).
        lora_local_path: vLLM's deprecated name of ``lora_path`` (taken where ``lora_path`` is empty).
        long_lora_max_len, tensorizer_config_dict: vLLM's; plinth has neither long-context LoRA nor tensorizer
            loading, and refuses a value.
        base_model_name: vLLM's; informational.
        load_inplace: vLLM's reload of the files under an id already loaded; offline, plinth refuses it (give new
            files another ``lora_int_id``; the server's ``/v1/load_lora_adapter`` takes ``load_inplace``).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_local_path: str | None = None
    long_lora_max_len: int | None = None
    base_model_name: str | None = None
    tensorizer_config_dict: dict | None = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        if not self.lora_path and self.lora_local_path:
            object.__setattr__(self, "lora_path", self.lora_local_path)
        for name in ("long_lora_max_len", "tensorizer_config_dict"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is not supported (plinth has no long-context LoRA or tensorizer loading)")
        if self.load_inplace:
            raise ValueError("load_inplace is not supported offline: give the new adapter files another lora_int_id "
                             "(the server's /v1/load_lora_adapter reloads in place)")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, numbers.Integral)
                or self.lora_int_id <= 0):
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if isinstance(self.lora_path, os.PathLike):
            object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")
        # "~/adapters/x", as vLLM takes it; "a/" and "a" are one adapter
        object.__setattr__(self, "lora_path", os.path.normpath(os.path.expanduser(self.lora_path)))
