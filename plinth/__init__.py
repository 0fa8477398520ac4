"""plinth: a plugin-based, hardware-abstracting LLM inference and serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "RequestOutputKind", "PoolingRequestOutput", "EmbeddingRequestOutput", "ScoringRequestOutput", "ClassificationRequestOutput",
           "PoolingOutput", "EmbeddingOutput", "ClassificationOutput", "ScoringOutput", "StructuredOutputsParams",
           "GuidedDecodingParams", "TextPrompt", "TokensPrompt", "EmbedsPrompt", "LoRARequest", "ModelRegistry", "__version__"]

# Public names resolve lazily so that `import plinth` (and plugin discovery) stays cheap.
_LAZY = {
    "LLM": "plinth.entrypoints.llm:LLM",
    "SamplingParams": "plinth.core.request:SamplingParams",
    "BeamSearchParams": "plinth.entrypoints.beam_search:BeamSearchParams",
    "PoolingParams": "plinth.core.pooling:PoolingParams",
    "RequestOutput": "plinth.core.request:RequestOutput",
    "CompletionOutput": "plinth.core.request:CompletionOutput",
    "RequestOutputKind": "plinth.core.request:RequestOutputKind",
    "PoolingRequestOutput": "plinth.core.pooling:PoolingRequestOutput",
    "EmbeddingRequestOutput": "plinth.core.pooling:PoolingRequestOutput",
    "ScoringRequestOutput": "plinth.core.pooling:ScoringRequestOutput",
    "ClassificationRequestOutput": "plinth.core.pooling:ClassificationRequestOutput",
    "PoolingOutput": "plinth.core.pooling:PoolingOutput",
    "EmbeddingOutput": "plinth.core.pooling:EmbeddingOutput",
    "ClassificationOutput": "plinth.core.pooling:ClassificationOutput",
    "ScoringOutput": "plinth.core.pooling:ScoringOutput",
    "StructuredOutputsParams": "plinth.core.structured:StructuredOutputsParams",
    "GuidedDecodingParams": "plinth.core.structured:StructuredOutputsParams",
    "TextPrompt": "plinth.core.request:TextPrompt",
    "TokensPrompt": "plinth.core.request:TokensPrompt",
    "EmbedsPrompt": "plinth.core.request:EmbedsPrompt",
    "LoRARequest": "plinth.lora.request:LoRARequest",
    "ModelRegistry": "plinth.model_registry.registry:ModelRegistry",
}

if TYPE_CHECKING:
    from plinth.core.pooling import (
        ClassificationOutput,
        ClassificationRequestOutput,
        EmbeddingOutput,
        PoolingOutput,
        PoolingParams,
        PoolingRequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from plinth.core.pooling import PoolingRequestOutput as EmbeddingRequestOutput
    from plinth.core.request import (
        CompletionOutput,
        EmbedsPrompt,
        RequestOutput,
        RequestOutputKind,
        SamplingParams,
        TextPrompt,
        TokensPrompt,
    )
    from plinth.core.structured import StructuredOutputsParams
    from plinth.core.structured import StructuredOutputsParams as GuidedDecodingParams
    from plinth.entrypoints.beam_search import BeamSearchParams
    from plinth.entrypoints.llm import LLM
    from plinth.lora.request import LoRARequest
    from plinth.model_registry.registry import ModelRegistry


def __getattr__(name: str) -> Any:
    ref = _LAZY.get(name)
    if ref is None:
        raise AttributeError(f"module 'plinth' has no attribute {name!r}")
    import importlib

    module_name, _, attr = ref.partition(":")
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value
