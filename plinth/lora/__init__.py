"""LoRA adapters served next to the base model.

* :mod:`plinth.lora.request`: :class:`LoRARequest`, how a request names its adapter.
* :mod:`plinth.lora.adapter`: reading an adapter folder in PEFT's format on the host, checked against the model.
* :mod:`plinth.lora.layers`: the per-layer slot buffers on the device and the batched LoRA product.
* :mod:`plinth.lora.slots`: the engine's assignment of adapters to slots, step by step.
"""

from plinth.lora.request import LoRARequest

__all__ = ["LoRARequest"]
