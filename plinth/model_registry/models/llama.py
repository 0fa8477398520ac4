"""Llama (1/2/3, with llama3 RoPE scaling) and Mistral (with sliding-window attention).

Both are the shared decoder as is: Llama's ``attention_bias``/``mlp_bias`` options are read
from the config, Mistral's ``sliding_window`` is applied by the shared attention block.
"""

from __future__ import annotations

from plinth.model_registry.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama: the reference decoder."""


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral: Llama's layout with a sliding attention window on every layer."""
