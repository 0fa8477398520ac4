"""Run any transformers causal LM with plinth's paged attention.

The transformers modeling class is used as is, except for attention: the model is built with
``attn_implementation="plinth_paged"``, a function registered in transformers'
``AttentionInterface`` that hands each layer's (already rotated) q/k/v to a plinth
:class:`~plinth.model_registry.layers.attention.Attention`, which writes the paged KV cache and
attends through the selected backend. The flat batch of a step is fed as one row of ``T``
tokens with explicit positions, so requests batch together and no transformers cache is used.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from plinth.attention_backends.interface import AttentionMetadata
from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.model_registry.interface import CausalLM, ModelContext
from plinth.model_registry.layers.attention import Attention

ATTN_IMPLEMENTATION = "plinth_paged"


#: the layer kinds (``config.layer_types``) the paged attention computes; others (linear attention, state-space
#: layers, chunked attention) are refused
_PAGED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


class _StepState:
    """The metadata of the step in progress, shared by one model's attention hooks, and the step's number."""

    def __init__(self) -> None:
        self.metadata: AttentionMetadata | None = None
        self.step = 0


class _PagedHook:
    """Attached to a transformers attention module: its plinth layer, the step state and the last step it ran
    in (a module attends once per step: its cache slots hold one set of keys and values)."""

    def __init__(self, layer: Attention, state: _StepState):
        self.layer = layer
        self.state = state
        self.last_step = -1


def _paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None,
                     dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: q ``[1, Hq, T, D]``, k/v ``[1, Hkv, T, D]`` -> ``[1, T, Hq, D]``."""
    hook: _PagedHook | None = getattr(module, "plinth_paged", None)
    if hook is None or hook.state.metadata is None:
        raise RuntimeError("plinth paged attention called outside a plinth forward pass")
    layer = hook.layer
    if hook.last_step == hook.state.step:
        raise UnsupportedModelError(f"attention layer {layer.layer_idx} attends more than once per forward pass "
                                    "(several value sets or reused layers): its paged cache holds one")
    hook.last_step = hook.state.step
    if query.shape[1] != layer.num_heads or key.shape[1] != layer.num_kv_heads:
        raise UnsupportedModelError(f"attention layer {layer.layer_idx} passes {query.shape[1]} query and "
                                    f"{key.shape[1]} key/value heads, its module and config say {layer.num_heads} "
                                    f"and {layer.num_kv_heads}")
    window = kwargs.get("sliding_window")
    if window is not None and window != layer.sliding_window:
        raise UnsupportedModelError(f"attention layer {layer.layer_idx} asks for a sliding window of {window}, its "
                                    f"module and config say {layer.sliding_window}")
    if scaling is not None and not math.isclose(scaling, layer.scale, rel_tol=1e-6):
        query = query * (scaling / layer.scale)   # e.g. OPT scales its queries itself and passes scaling=1
    cap = kwargs.get("softcap")
    if cap != layer.soft_cap and (cap is not None or layer.soft_cap is not None):
        raise UnsupportedModelError(f"the model's attention asks for logit soft cap {cap}, its config says "
                                    f"{layer.soft_cap} (attn_logit_softcapping)")
    sinks = kwargs.get("s_aux")   # each head's sink logit (gpt-oss)
    if (sinks is not None) != layer.has_sinks:
        raise UnsupportedModelError(f"the model's attention {'passes' if sinks is not None else 'lacks'} sink logits "
                                    f"(s_aux) its module {'lacks' if sinks is not None else 'has'}")
    v_dim = value.shape[-1]
    if v_dim < key.shape[-1]:   # values narrower than keys (multi-head latent attention): zero-padded in the cache
        value = nn.functional.pad(value, (0, key.shape[-1] - v_dim))
    out = layer(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                hook.state.metadata, sinks=sinks)  # [T, Hq, D]
    return out[..., :v_dim].unsqueeze(0), None


@functools.cache
def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _paged_attention)


def transformers_class(architecture: str) -> type | None:
    """The transformers causal-LM class named ``architecture``, or ``None``."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if architecture not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        return None
    return getattr(transformers, architecture, None)


@functools.cache
def fallback_class(architecture: str) -> type[TransformersForCausalLM]:
    """A :class:`TransformersForCausalLM` subclass bound to ``architecture``."""
    return type(f"Transformers{architecture}", (TransformersForCausalLM,), {"hf_architecture": architecture})


def _no_init_weights() -> contextlib.AbstractContextManager:
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


@functools.cache
def _source_of(module_name: str) -> str:
    import inspect
    import sys

    try:
        return inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return ""


def _modeling_source(hf_model: nn.Module) -> str:
    """The source of the transformers modeling file of ``hf_model``'s class ("" where it cannot be read)."""
    return _source_of(type(hf_model).__module__)


def _logit_scale(hf_model: nn.Module, cfg: Any) -> float | None:
    """The factor transformers' causal-LM class applies to the LM head's output, read from its modeling code:
    Cohere's ``logits * self.logit_scale``, Granite's ``logits / config.logits_scaling``, HyperCLOVA X's
    ``... * config.logits_scaling``; ``None`` for none (a config field the code does not use is ignored, as
    transformers ignores it)."""
    source = _modeling_source(hf_model)
    factor = 1.0
    scale = getattr(cfg, "logit_scale", None)
    if isinstance(scale, (int, float)) and re.search(r"\*\s*self\.logit_scale\b", source):
        factor *= float(scale)
    scaling = getattr(cfg, "logits_scaling", None)
    if isinstance(scaling, (int, float)) and scaling:
        if re.search(r"/\s*self\.config\.logits_scaling\b", source):
            factor /= float(scaling)
        elif re.search(r"\*\s*self\.config\.logits_scaling\b", source):
            factor *= float(scaling)
    return None if factor == 1.0 else factor


def _head_counts(module: nn.Module, cfg: Any) -> tuple[int, int]:
    """Query and key/value heads of one attention module: its own attributes where it has them (GPT-BigCode's
    ``kv_heads``, ``num_key_value_heads``, ``num_key_value_groups``), else the config's."""
    heads = getattr(module, "num_heads", None) or getattr(module, "num_attention_heads", None)
    heads = heads if isinstance(heads, int) else cfg.num_attention_heads
    for name in ("kv_heads", "num_key_value_heads"):
        kv = getattr(module, name, None)
        if isinstance(kv, int) and kv > 0:
            return heads, kv
    groups = getattr(module, "num_key_value_groups", None)
    if isinstance(groups, int) and groups > 0 and heads % groups == 0:
        return heads, heads // groups
    return heads, getattr(cfg, "num_key_value_heads", None) or heads


def _natural_key(name: str) -> tuple:
    """``name`` ordered with its numbers as numbers (expert 10 after expert 9)."""
    return tuple((0, int(part), "") if part.isdecimal() else (1, 0, part) for part in re.split(r"(\d+)", name))


class _CheckpointConversion:
    """transformers' own checkpoint conversions for a model (``conversion_mapping``): renamings, and converters that
    merge several checkpoint tensors into one parameter, e.g. a mixture of experts' per-expert ``gate_proj`` /
    ``up_proj`` / ``down_proj`` into the stacked ``experts.gate_up_proj`` / ``experts.down_proj`` its modeling
    class holds. Applied to a stream of tensors: a merged tensor is emitted as soon as all its parts are in."""

    def __init__(self, hf_model: nn.Module, param_numel: dict[str, int]):
        self.renamings: list[Any] = []
        self.converters: list[Any] = []
        self._model = hf_model
        self._numel = param_numel
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter
        except ImportError:   # a transformers release without checkpoint conversions
            return
        for transform in get_model_conversion_mapping(hf_model):
            (self.converters if isinstance(transform, WeightConverter) else self.renamings).append(transform)

    def __bool__(self) -> bool:
        return bool(self.renamings or self.converters)

    def apply(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        # (converter index, target name) -> {source pattern: {checkpoint name: tensor}}
        pending: dict[tuple[int, str], dict[str, dict[str, torch.Tensor]]] = {}
        for name, tensor in weights:
            key = name
            for renaming in self.renamings:
                key, _ = renaming.rename_source_key(key)
            match = self._match(key)
            if match is None:
                yield key, tensor
                continue
            index, target, pattern = match
            parts = pending.setdefault((index, target), {})
            parts.setdefault(pattern, {})[name] = tensor
            if self._complete(self.converters[index], target, parts):
                yield from self._convert(self.converters[index], target, pending.pop((index, target)))
        for (index, target), parts in pending.items():   # incomplete: converted as they are (the load names a gap)
            yield from self._convert(self.converters[index], target, parts)

    def _match(self, key: str) -> tuple[int, str, str] | None:
        """The first converter taking ``key``: its index, the merged tensor's name and the source pattern matched."""
        for index, converter in enumerate(self.converters):
            target, pattern = converter.rename_source_key(key)
            if pattern is not None:
                return index, target, pattern
        return None

    def _targets(self, converter: Any, target: str) -> list[str]:
        first = converter.target_patterns[0]
        return [target.replace(first, pattern, 1) for pattern in converter.target_patterns]

    def _complete(self, converter: Any, target: str, parts: dict[str, dict[str, torch.Tensor]]) -> bool:
        if not any("*" in pattern for pattern in converter.source_patterns):
            return len(parts) == len(converter.source_patterns)
        wanted = sum(self._numel.get(name, -1) for name in self._targets(converter, target))
        return sum(t.numel() for tensors in parts.values() for t in tensors.values()) == wanted

    def _convert(self, converter: Any, target: str,
                 parts: dict[str, dict[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        tensors: dict[str, Any] = {pattern: [group[k] for k in sorted(group, key=_natural_key)]
                                   for pattern, group in parts.items()}
        try:
            for op in converter.operations:
                tensors = op.convert(tensors, source_patterns=converter.source_patterns,
                                     target_patterns=converter.target_patterns, full_layer_name=target,
                                     model=self._model, config=self._model.config)
        except Exception as exc:   # transformers' own conversion refused these tensors
            names = sorted(n for group in parts.values() for n in group)
            raise ModelLoadError(f"checkpoint tensors {names[0]!r}..{names[-1]!r} could not be merged into "
                                 f"{target!r}: {exc}") from exc
        for out_pattern, tensor in tensors.items():
            prefix, found, suffix = target.partition(converter.target_patterns[0])
            yield (prefix + out_pattern + suffix if found else out_pattern), tensor


# RoPE types whose transformers code sets its frequencies from the longest position in the pass
# (``dynamic_rope_update``): the NTK base of ``dynamic``, the short or long factors of ``longrope``
_POSITION_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


def _per_sequence_rotary(forward: Any, state: _StepState) -> Any:
    """A rotary embedding's ``forward(x, position_ids, ...)`` run once per sequence of the flat batch, so that each
    sequence's frequencies follow its own positions, as when transformers runs it alone (not the batch's longest
    position)."""

    def per_sequence(x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        metadata = state.metadata
        if metadata is None or metadata.num_seqs <= 1 or x.shape[1] != position_ids.shape[1]:
            return forward(x, position_ids, *args, **kwargs)
        bounds = list(metadata.query_start_loc_cpu)
        if bounds[-1] < position_ids.shape[1]:    # padding rows after the last sequence
            bounds.append(position_ids.shape[1])
        parts = [forward(x[:, a:b], position_ids[:, a:b], *args, **kwargs)
                 for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
        return tuple(torch.cat(pieces, dim=1) for pieces in zip(*parts, strict=True))  # (cos, sin) [1, T, dim]

    return per_sequence


class TransformersForCausalLM(CausalLM):
    """A transformers causal LM with plinth's paged attention (set ``hf_architecture``)."""

    hf_architecture: str = ""
    #: the engine runs one small pass at start-up: what the model refuses only while running (a module computing
    #: attention itself, attending twice, passing other shapes) fails there, not with the first request
    checks_a_first_pass: bool = True

    def __init__(self, ctx: ModelContext):
        super().__init__(ctx)
        cls = transformers_class(self.hf_architecture)
        if cls is None:
            raise UnsupportedModelError(f"transformers has no causal LM named {self.hf_architecture!r}")
        _register_attention()
        from plinth.model_registry.gguf_loader import transformers_config

        cfg = transformers_config(ctx.hf_config)
        with torch.device(ctx.device), _no_init_weights():
            self.hf_model = cls._from_config(cfg, attn_implementation=ATTN_IMPLEMENTATION, dtype=ctx.dtype)
        self.hf_model.tie_weights()  # skipped with the weight initialisation
        self.hf_model.requires_grad_(False)
        self._state = _StepState()
        self._check_layer_types(cfg)
        self._attn_layers = self._attach_attention(ctx)
        if not self._attn_layers:
            raise UnsupportedModelError(
                f"{self.hf_architecture}: found no attention layers to page (plinth pages the attention modules that "
                "have a layer_idx and a softmax scale and call transformers' attention functions; models with "
                "ALiBi biases or state-space layers only have none)")
        layers = getattr(cfg, "num_hidden_layers", None)
        if layers and len(self._attn_layers) < layers:
            raise UnsupportedModelError(
                f"{self.hf_architecture}: {len(self._attn_layers)} of its {layers} layers have attention plinth can "
                "page; the others (recurrent, linear or state-space layers) would need a state cache of their own")
        self._decoder = self._find_decoder()
        for module in self.hf_model.modules():
            if getattr(module, "rope_type", None) in _POSITION_DEPENDENT_ROPE:
                module.forward = _per_sequence_rotary(module.forward, self._state)
        self._hooks = [m.plinth_paged for m in self.hf_model.modules() if isinstance(getattr(m, "plinth_paged", None),
                                                                                    _PagedHook)]
        self._all_attended = False
        self._logit_scale = _logit_scale(self.hf_model, cfg)

    @classmethod
    def create(cls, ctx: ModelContext) -> TransformersForCausalLM:
        """Built directly on ``ctx.device`` (transformers computes its buffers at construction)."""
        return cls(ctx)

    def _check_layer_types(self, cfg: Any) -> None:
        kinds = set(getattr(cfg, "layer_types", None) or ()) - _PAGED_LAYER_TYPES
        if kinds:
            raise UnsupportedModelError(f"{self.hf_architecture}: layers of kind {', '.join(sorted(kinds))} "
                                        "(config.layer_types) are not supported; plinth pages full and "
                                        "sliding-window attention")

    def _find_decoder(self) -> nn.Module:
        """The decoder stack (``get_decoder()``: ``base_model`` is not it where the prefix names another module,
        e.g. Llama 4's ``language_model``)."""
        get = getattr(self.hf_model, "get_decoder", None)
        decoder = get() if get is not None else None
        return decoder if isinstance(decoder, nn.Module) and decoder is not self.hf_model else self.hf_model.base_model

    def _attach_attention(self, ctx: ModelContext) -> list[Attention]:
        from plinth.model_registry.models.decoder import sliding_window_of

        cfg = ctx.hf_config
        source = _modeling_source(self.hf_model)
        # cross-attention modules (a decoder exported with add_cross_attention) never run without encoder states
        found = [m for m in self.hf_model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")
                 and not getattr(m, "is_cross_attention", False)]
        found.sort(key=lambda m: m.layer_idx)
        layers = []
        for m in found:
            num_heads, num_kv_heads = _head_counts(m, cfg)
            # a module whose keys are wider than its values names the key width qk_head_dim (DeepSeek's MLA)
            head_dim = (getattr(m, "qk_head_dim", None) or getattr(m, "head_dim", None)
                        or cfg.hidden_size // cfg.num_attention_heads)
            # the module's own window, else the config's for its layer where the model masks with it (PhiMoE
            # applies it only through its mask; other models keep an unused sliding_window in their config); a
            # module may hold the window while its layer attends to everything (EXAONE 4's `is_sliding`, a
            # `full_attention` layer type)
            layer_types = getattr(cfg, "layer_types", None)
            full = getattr(m, "is_sliding", True) is False or (
                isinstance(layer_types, list | tuple) and m.layer_idx < len(layer_types)
                and layer_types[m.layer_idx] == "full_attention")
            if hasattr(m, "sliding_window"):
                window = None if full else m.sliding_window
            else:
                window = sliding_window_of(cfg, m.layer_idx) if "create_sliding_window_causal_mask" in source else None
            layer = Attention(num_heads, head_dim, float(m.scaling), num_kv_heads, ctx.attention_backend,
                              window, m.layer_idx,
                              soft_cap=getattr(cfg, "attn_logit_softcapping", None) or None,
                              has_sinks=isinstance(getattr(m, "sinks", None), torch.Tensor))
            m.plinth_paged = _PagedHook(layer, self._state)
            layers.append(layer)
        return layers

    def attention_layers(self) -> list[Attention]:
        return list(self._attn_layers)

    @contextlib.contextmanager
    def _step(self, metadata: AttentionMetadata) -> Iterator[None]:
        if self._state.metadata is not None:
            raise RuntimeError("nested forward passes on one model are not supported")
        self._state.metadata = metadata
        self._state.step += 1
        try:
            yield
        finally:
            self._state.metadata = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        with self._step(metadata):
            out = self._decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        if not self._all_attended:
            self._check_every_layer_attended()
        return out.last_hidden_state[0]  # [T, hidden]

    def _check_every_layer_attended(self) -> None:
        """After the first pass: every paged layer attended through plinth (a module that computes its attention
        itself, e.g. XGLM's, would attend to the step's own tokens only)."""
        idle = [h.layer.layer_idx for h in self._hooks if h.last_step != self._state.step]
        if idle:
            raise UnsupportedModelError(f"{self.hf_architecture}: attention layers {idle[:4]}"
                                        f"{' ...' if len(idle) > 4 else ''} compute attention themselves instead of "
                                        "calling transformers' attention functions, which plinth pages")
        self._all_attended = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head, then what transformers' causal-LM classes do to its output: Cohere's ``logit_scale``
        (times), Granite's ``logits_scaling`` (divided by), the final soft cap."""
        cfg = self.ctx.hf_config
        logits = self.hf_model.get_output_embeddings()(hidden).float()
        if self._logit_scale is not None:
            logits = logits * self._logit_scale
        cap = getattr(cfg, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if name == "lm_head.weight" and getattr(self.ctx.hf_config, "tie_word_embeddings", False):
            return None
        return f"hf_model.{name}", None

    def checkpoint_name(self, param_name: str, shard_id: Any = None) -> str:
        return param_name.removeprefix("hf_model.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors renamed and merged as transformers' own loading would (per-expert checkpoint tensors
        into stacked experts), then loaded by name."""
        numel = {name: p.numel() for name, p in self.hf_model.named_parameters()}
        conversion = _CheckpointConversion(self.hf_model, numel)
        super().load_weights(self._into_buffers(conversion.apply(weights) if conversion else weights))

    def _into_buffers(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors of persistent buffers (e.g. DeepSeek-V3's router score correction) copied in; the
        rest passed on."""
        buffers = {name: b for name, b in self.hf_model.named_buffers()
                   if name.rpartition(".")[2] not in self._non_persistent(name)}
        for name, tensor in weights:
            buffer = buffers.get(name)
            if buffer is None:
                yield name, tensor
            elif buffer.shape != tensor.shape:
                raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model's "
                                     f"buffer {tuple(buffer.shape)}")
            elif self.weight_update != "check":   # (a weight update's checking pass writes nothing)
                buffer.copy_(tensor)

    def _non_persistent(self, name: str) -> set[str]:
        module = self.hf_model.get_submodule(name.rpartition(".")[0])
        return getattr(module, "_non_persistent_buffers_set", set())
