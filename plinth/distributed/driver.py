"""The driver side of a distributed engine: check the parallel layout against the model, start the
executor, and gather what the engine needs (tokenizer, limits, KV block count) without loading
any weight in the driver's process."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from plinth.config import ConfigError, EngineConfig, ParallelConfig

logger = logging.getLogger(__name__)


def validate_parallel_layout(hf: Any, architecture: str, par: ParallelConfig) -> None:
    """Refuse layouts the model cannot be split into, before any worker starts.

    Raises:
        ConfigError: the message names the size that does not divide, or the missing support.
    """
    from plinth.model_registry.registry import ModelRegistry

    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    cls = ModelRegistry.resolve(architecture)
    if pp > 1 and not getattr(cls, "supports_pipeline_parallel", False):
        raise ConfigError(f"{architecture} ({cls.__name__}) does not support pipeline parallelism; "
                          f"use pipeline_parallel_size=1")
    if tp > 1 and getattr(cls, "create", None) is not None:   # built by other code (the transformers fallback)
        raise ConfigError(f"{architecture} ({cls.__name__}) does not support tensor parallelism; "
                          f"use tensor_parallel_size=1")
    layers = hf.num_hidden_layers
    if pp > layers:
        raise ConfigError(f"pipeline_parallel_size {pp} exceeds the model's {layers} layers")
    heads = getattr(hf, "num_attention_heads", None)   # (a model without attention layers has none: Mamba-2)
    kv = getattr(hf, "num_key_value_heads", None) or heads
    if heads and heads % tp:
        raise ConfigError(f"tensor_parallel_size {tp} must divide the number of attention heads ({heads})")
    if kv and ((kv >= tp and kv % tp) or (kv < tp and tp % kv)):
        raise ConfigError(f"tensor_parallel_size {tp} and the number of KV heads ({kv}) must divide one another")
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "shared_intermediate_size"):
        size = getattr(hf, name, None)
        if isinstance(size, int) and size % tp:
            raise ConfigError(f"tensor_parallel_size {tp} must divide the model's {name} ({size})")


def build_distributed_parts(config: EngineConfig, platform: Any, executor_name: str,
                            executor_factory: Any = None) -> Any:
    """What :class:`~plinth.core.engine.LLMEngine` needs, with the model on the workers.

    ``executor_factory(config)``, when given, builds the executor instead of ``executor_name``.

    Returns:
        :class:`~plinth.worker.setup.EngineParts` whose ``runner`` is ``None`` and whose
        ``executor`` runs the steps.
    """
    from plinth.distributed.executor import create_distributed_executor
    from plinth.model_registry.loader import resolve_dtype, resolve_model_source
    from plinth.worker.setup import (
        EngineParts,
        generation_defaults,
        load_tokenizer,
        read_chat_template,
        resolve_max_model_len,
    )

    source = resolve_model_source(config.model)
    source.check_task(config.model.task)
    hf = source.hf_config
    validate_parallel_layout(hf, source.architecture, config.parallel)
    dtype = resolve_dtype(config.model, hf, platform.supported_dtypes())
    tokenizer = load_tokenizer(source, config)
    max_model_len = resolve_max_model_len(config, hf)
    chat_template = read_chat_template(config.model.chat_template)
    default_sampling, eos = generation_defaults(source, config, tokenizer)
    executor = (executor_factory(config) if executor_factory is not None
                else create_distributed_executor(executor_name, config))
    if executor.selection is not None:
        logger.info("%s", executor.selection.summary())
    name = os.path.basename(str(source.path or config.model.model or "model")).removesuffix(".gguf")
    if config.model.model is None:
        from plinth.model_registry.default_model import DEFAULT_MODEL_NAME

        name = DEFAULT_MODEL_NAME
    return EngineParts(
        platform=platform, device=torch.device("cpu"), source=source, model_name=name, tokenizer=tokenizer,
        chat_template=chat_template, dtype=dtype, max_model_len=max_model_len, vocab_size=hf.vocab_size,
        eos_token_ids=eos, selection=executor.selection, runner=None,
        num_blocks=executor.num_blocks, executor=executor, default_sampling=default_sampling,
    )
