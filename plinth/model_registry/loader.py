"""Resolve what to load from a :class:`~plinth.config.ModelConfig`, then build and load the model.

Sources (``ModelSource.kind``):

``hf_dir``
    A Hugging Face style directory: ``config.json``, tokenizer files and one or more
    ``*.safetensors`` shards (with ``model.safetensors.index.json`` when sharded).
``gguf``
    A ``.gguf`` file (read by :mod:`plinth.model_registry.gguf_loader`).
``dummy``
    Random weights for a configuration: a shipped preset name (see :func:`list_presets`),
    a model directory's ``config.json`` or a ``.gguf`` file's metadata.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from plinth.config import ConfigError, ModelConfig
from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.model_registry.interface import CausalLM, ModelContext
from plinth.model_registry.registry import ModelRegistry
from plinth.model_registry.weights import (
    SafetensorsWeights,
    build_on_meta,
    init_dummy_weights,
    list_safetensors_files,
)

logger = logging.getLogger(__name__)

PRESET_DIR = Path(__file__).parent / "presets"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class ModelSource:
    """What to load, resolved without reading any weight.

    Attributes:
        kind: ``"hf_dir"``, ``"gguf"`` or ``"dummy"``.
        path: the model directory or ``.gguf`` file (``None`` for a dummy preset).
        hf_config: the model's transformers configuration.
        architecture: the registry key, e.g. ``"LlamaForCausalLM"``.
        tokenizer_path: a directory or ``.gguf`` file for ``AutoTokenizer``, or ``None``.
        headless: a base-model checkpoint (``architectures: ["MistralModel"]``, tensors without the ``model.``
            prefix, no LM head), run as its causal LM with the head tied to the embeddings: embedding
            models only (``task="embed"``).
        text_only: the language model of an image-and-text checkpoint (``Gemma3ForConditionalGeneration``,
            ``Mistral3ForConditionalGeneration``, ``LlavaForConditionalGeneration``, ...): ``hf_config`` is its
            ``text_config``, its tensors are read under the causal LM's names and the vision tower's are skipped.
        mm_config: the whole config of an image-and-text checkpoint whose images plinth encodes (LLaVA: see
            :mod:`plinth.multimodal`), else ``None``.
        classifier: a sequence classifier (``LlamaForSequenceClassification`` and the like: the decoder and a
            ``score`` projection of the last token's hidden state to the labels), run as its causal LM without the
            head (tied to the embeddings, unused); the engine applies ``score`` (:func:`load_classifier_head`).
    """

    kind: str
    path: str | None
    hf_config: Any
    architecture: str
    tokenizer_path: str | None
    headless: bool = False
    text_only: bool = False
    classifier: bool = False
    mm_config: Any = None

    @property
    def token_classifier(self) -> bool:
        """A token classifier (``BertForTokenClassification``, ``LlamaForTokenClassification`` and the like: its head
        labels every position; ``classifier`` is true too)."""
        names = getattr(self.hf_config, "architectures", None) or [self.architecture]
        return self.classifier and str(names[0]).endswith("ForTokenClassification")

    @property
    def encoder(self) -> bool:
        """An encoder-only model (BERT, RoBERTa, XLM-RoBERTa): embeddings and classifiers only, each input run whole
        in one step (:mod:`plinth.model_registry.models.bert`)."""
        return is_encoder_architecture(self.architecture)

    def check_task(self, task: str) -> None:
        """Refuse text generation from a checkpoint without an LM head, and classification from one without a
        classifier's.

        Raises:
            ModelLoadError: a headless checkpoint with ``task`` other than ``embed``; a sequence classifier asked to
                generate; ``classify`` for a checkpoint that is not a sequence classifier.
        """
        if self.headless and task != "embed":
            raise ModelLoadError(f"{self.path} is a base model without an LM head ({self.hf_config.architectures[0]}): "
                                 f"it cannot generate text; serve it as an embedding model with --task embed")
        if self.encoder and task == "generate":
            raise ModelLoadError(f"{self.path or 'the model'} is an encoder-only model "
                                 f"({self.hf_config.architectures[0]}): it cannot generate text; serve it with "
                                 f"--task embed" + (" or --task classify" if self.classifier else ""))
        what = "token" if self.token_classifier else "sequence"
        if self.classifier and task == "generate":
            raise ModelLoadError(f"{self.path} is a {what} classifier ({self.hf_config.architectures[0]}): it cannot "
                                 f"generate text; serve it with --task classify (or --task embed for its hidden states)")
        if task == "classify" and not self.classifier:
            arch = (getattr(self.hf_config, "architectures", None) or [self.architecture])[0]
            raise ModelLoadError(f"--task classify needs a sequence or token classifier (a checkpoint whose "
                                 f"architecture ends in ForSequenceClassification or ForTokenClassification, with a "
                                 f"'score' layer); {self.path or 'the model'} is {arch}")


def list_presets() -> list[str]:
    """Names of the shipped dummy presets (``model=NAME`` with ``load_format="dummy"``)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_preset(name: str, overrides: str | None = None) -> Any:
    """The transformers config of preset ``name`` (with ``hf_overrides``' JSON text on top).

    Raises:
        ModelLoadError: no such preset (the message lists them).
    """
    path = PRESET_DIR / f"{name}.json"
    if not path.is_file():
        raise ModelLoadError(f"unknown dummy preset {name!r}; presets: {', '.join(list_presets())}")
    return config_from_dict(_merged(json.loads(path.read_text()), _overrides(overrides)),
                            str(path) + (" with hf_overrides" if overrides else ""))


def config_from_dict(data: dict[str, Any], origin: str) -> Any:
    """A transformers config from ``config.json`` contents; unknown model types get a generic config."""
    from transformers import CONFIG_MAPPING, PretrainedConfig

    model_type = data.get("model_type")
    decode = getattr(PretrainedConfig, "_decode_special_floats", None)
    if decode is not None:   # transformers writes inf/nan as {"__float__": "Infinity"} (e.g. Falcon-H1's limits)
        data = decode(data)
    for key in _POSITIVE_SIZES:
        value = data.get(key)
        least = 0 if key == "head_dim" else 1   # a head_dim of 0 means none given (some configs write it so)
        if isinstance(value, int) and not isinstance(value, bool) and value < least:
            raise ModelLoadError(f"invalid model configuration in {origin}: {key} must be at least {least}, got "
                                 f"{value}")
    try:
        if model_type in CONFIG_MAPPING:
            return CONFIG_MAPPING[model_type].from_dict(data)
        return PretrainedConfig.from_dict(data)
    except Exception as exc:  # noqa: BLE001 - transformers' validators raise many types (ZeroDivisionError, ...)
        raise ModelLoadError(f"invalid model configuration in {origin}: {type(exc).__name__}: {exc}") from exc


# config.json sizes that must be positive where given (a negative one would fail deep inside the model's build)
_POSITIVE_SIZES = ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                   "head_dim", "num_hidden_layers", "moe_intermediate_size")


def _json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``.

    Raises:
        ModelLoadError: the file cannot be read, is not JSON, or holds something else than an object.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def load_hf_config(model_dir: Path, trust_remote_code: bool = False, overrides: str | None = None) -> Any:
    """Read ``model_dir/config.json``, with ``overrides`` (``ModelConfig.hf_overrides``' JSON text) set on top.

    Raises:
        ModelLoadError: the file is missing, is not JSON, or holds an invalid configuration.
    """
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json; a model directory needs config.json and "
                             f"*.safetensors weights")
    data = _json_object(path)
    extra = _overrides(overrides)
    if trust_remote_code and "auto_map" in data:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=True)
            _set_on(config, extra)
        except Exception as exc:  # noqa: BLE001 - remote config classes and their validators raise anything
            raise ModelLoadError(f"invalid model configuration in {path}{' with hf_overrides' if extra else ''}: "
                                 f"{type(exc).__name__}: {exc}") from exc
        return config
    return config_from_dict(_merged(data, extra), str(path) + (" with hf_overrides" if extra else ""))


_LOGGED_OVERRIDES: set[str] = set()


def _overrides(text: str | None) -> dict[str, Any]:
    """``hf_overrides`` as a dict (its keys logged once)."""
    if not text:
        return {}
    extra = json.loads(text)
    if text not in _LOGGED_OVERRIDES:
        _LOGGED_OVERRIDES.add(text)
        logger.info("config.json keys overridden (hf_overrides): %s", ", ".join(sorted(extra)))
    return extra


def _merged(data: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``extra`` on top, key by key inside nested objects (``{"text_config": {"max_position_embeddings":
    ...}}`` changes that one key, as vLLM's overrides do)."""
    out = dict(data)
    for key, value in extra.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _set_on(config: Any, extra: dict[str, Any]) -> None:
    """Set ``extra`` on a built config, key by key inside nested configs."""
    for key, value in extra.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and current is not None and hasattr(current, "to_dict"):
            _set_on(current, value)
        elif isinstance(value, dict) and isinstance(current, dict):
            setattr(config, key, _merged(current, value))
        else:
            setattr(config, key, value)


def architecture_of(hf_config: Any, origin: str) -> str:
    """The registry key of a config: ``architectures[0]``, else the causal LM of its ``model_type``."""
    archs = getattr(hf_config, "architectures", None)
    if archs and (not isinstance(archs, list | tuple) or not all(isinstance(a, str) and a for a in archs)):
        raise ModelLoadError(f'{origin}: "architectures" must be a list of names, e.g. ["LlamaForCausalLM"], '
                             f"got {archs!r}")
    if archs:
        return archs[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf_config, "model_type", None))
    if arch is None:
        raise ModelLoadError(f"{origin} names no architecture (set \"architectures\": [\"...ForCausalLM\"])")
    return arch


#: files older GPTQ (AutoGPTQ) and AWQ (AutoAWQ) writers keep their settings in, with the method they imply
#: where the settings do not name one
QUANT_CONFIG_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))


def _adopt_quant_config_file(path: Path, cfg: Any) -> None:
    """Give ``cfg`` the quantization settings of a checkpoint that keeps them in its own file instead of
    ``config.json``'s ``quantization_config`` (AutoGPTQ's ``quantize_config.json``, AutoAWQ's ``quant_config.json``),
    where the weights are packed (``*.qweight`` tensors), as vLLM reads them."""
    if getattr(cfg, "quantization_config", None) is not None:
        return
    for name, method in QUANT_CONFIG_FILES:
        f = path / name
        if not f.is_file():
            continue
        settings = _json_object(f)
        if not _has_packed_weights(path):
            logger.warning("%s: ignoring %s (the weights hold no packed *.qweight tensors)", path, name)
            return
        settings.setdefault("quant_method", "awq" if "w_bit" in settings or "q_group_size" in settings else method)
        cfg.quantization_config = settings
        logger.info("%s: quantization settings from %s (quant_method %r)", path, name, settings["quant_method"])
        return


def _has_packed_weights(path: Path) -> bool:
    """Whether a shard of the checkpoint in ``path`` holds a ``*.qweight`` tensor (read from the headers)."""
    from safetensors import safe_open

    for shard in list_safetensors_files(path):
        try:
            with safe_open(str(shard), framework="pt") as f:
                if any(k.endswith(".qweight") for k in f.keys()):
                    return True
        except Exception:   # noqa: BLE001 - an unreadable shard is reported, naming it, when the weights load
            continue
    return False


def resolve_model_source(model_config: ModelConfig) -> ModelSource:
    """Work out what ``model_config`` asks to load, reading configs but no weights.

    Raises:
        ModelLoadError: a missing path, a directory without ``config.json`` or weights, an
            unknown preset, or a file that is not a ``.gguf``.
    """
    fmt = model_config.load_format
    model = model_config.model
    if model is None:
        from plinth.model_registry.default_model import default_model_path

        model = str(default_model_path())
    path = Path(os.path.expanduser(model))   # (os.path: a "~name" naming no user stays as it is)
    if not path.exists():
        if fmt == "dummy":
            cfg = load_preset(model, model_config.hf_overrides)
            arch, headless, classifier = _decoder_of(cfg, architecture_of(cfg, _origin(f"preset {model}", model_config)),
                                                     f"preset {model}")
            return ModelSource("dummy", None, cfg, arch, model_config.tokenizer, headless, classifier=classifier)
        hint = " (a dummy preset: pass load_format='dummy')" if model in list_presets() else ""
        raise ModelLoadError(f"model path {model!r} does not exist{hint}")
    if path.is_file():
        if fmt == "safetensors":
            raise ModelLoadError(f"load_format 'safetensors' needs a model directory, got the file {path}")
        if path.suffix.lower() != ".gguf" and fmt != "gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf file; pass a .gguf file or a model "
                                 f"directory (config.json + *.safetensors)")
        from plinth.model_registry.gguf_loader import read_gguf_config

        if model_config.hf_overrides:
            raise ModelLoadError(f"hf_overrides sets config.json keys of a model directory; {path} is a GGUF file, "
                                 f"whose settings are its metadata")
        cfg, arch = read_gguf_config(str(path), plain=True)
        kind = "dummy" if fmt == "dummy" else "gguf"
        return ModelSource(kind, str(path), cfg, arch, model_config.tokenizer or str(path))
    if fmt == "gguf":
        raise ModelLoadError(f"load_format 'gguf' needs a .gguf file, got the directory {path}")
    cfg = load_hf_config(path, model_config.trust_remote_code, model_config.hf_overrides)
    if fmt != "dummy":
        _adopt_quant_config_file(path, cfg)
    arch, headless, classifier = _decoder_of(cfg, architecture_of(cfg, _origin(path / "config.json", model_config)),
                                             path)
    text_only = False
    mm_config = None
    text = _text_model(cfg, arch)
    if text is not None:
        if _runs_images(cfg, arch):
            from plinth.multimodal.qwen_vision import deepstack_count

            mm_config = cfg
            text[0].deepstack_layers = deepstack_count(cfg)   # (Qwen3-VL: the layers that take DeepStack embeddings)
            # (Gemma 3: an image's positions attend to each other)
            text[0].bidirectional_image_attention = getattr(cfg, "model_type", None) == "gemma3"
            logger.info("%s: %s with image inputs (its vision tower %s)", path, arch,
                        cfg.vision_config.model_type)
        else:
            logger.info("%s: running its language model (%s) alone; image inputs are not supported",
                        path, text[1])
        cfg, arch, text_only = text[0], text[1], True
        if fmt != "dummy":
            _tie_by_tensors(cfg, path)
    elif getattr(cfg, "text_config", None) is not None and arch.endswith("ForConditionalGeneration") \
            and not ModelRegistry.is_native(arch) and getattr(cfg, "num_attention_heads", None) is None:
        raise UnsupportedModelError(
            f"{path}: {arch} is an image-and-text model whose language model "
            f"({getattr(cfg.text_config, 'model_type', '?')}) plinth does not run natively; plinth runs LLaVA, "
            f"LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Mistral 3, Gemma 3, Idefics3, SmolVLM, InternVL and Llama 4 "
            f"checkpoints with "
            f"images, and the language "
            f"model alone of other image-and-text models, where "
            f"that language model is one it runs (Llama, Mistral, Qwen2, Gemma 3, ...)")
    if fmt != "dummy":
        list_safetensors_files(path)  # fail now rather than after building the model
    tokenizer = model_config.tokenizer
    if tokenizer is None and any((path / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = str(path)
    return ModelSource("dummy" if fmt == "dummy" else "hf_dir", str(path), cfg, arch, tokenizer, headless, text_only,
                       classifier, mm_config)


#: image-and-text architectures whose images plinth encodes (:mod:`plinth.multimodal`)
IMAGE_ARCHITECTURES = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                       "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                       "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
                       "Mistral3ForConditionalGeneration", "Gemma3ForConditionalGeneration",
                       "Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration",
                       "InternVLForConditionalGeneration", "Llama4ForConditionalGeneration")

#: language models of image-and-text checkpoints that plinth runs as a native causal LM, and their multimodal RoPE:
#: transformers' default sections where the config names none, and whether they interleave (Qwen3-VL always does)
_MROPE_TEXT_MODELS = {"qwen2_vl_text": ("Qwen2ForCausalLM", [16, 24, 24], False),
                      "qwen2_5_vl_text": ("Qwen2ForCausalLM", [16, 24, 24], False),
                      "qwen3_vl_text": ("Qwen3ForCausalLM", [24, 20, 20], True),
                      "qwen3_vl_moe_text": ("Qwen3MoeForCausalLM", [24, 20, 20], True)}


def _runs_images(cfg: Any, arch: str) -> bool:
    """Whether plinth runs the image side of image-and-text checkpoint ``cfg`` (a LLaVA model over a CLIP or
    SigLIP vision tower, or a Qwen2-VL / Qwen2.5-VL model)."""
    from plinth.multimodal.idefics3 import is_idefics3
    from plinth.multimodal.internvl import is_internvl
    from plinth.multimodal.llama4 import is_llama4
    from plinth.multimodal.pixtral import is_pixtral
    from plinth.multimodal.qwen_vision import is_qwen_vl
    from plinth.multimodal.vision import VISION_TOWERS

    vision = getattr(cfg, "vision_config", None)
    return arch in IMAGE_ARCHITECTURES and (getattr(vision, "model_type", None) in VISION_TOWERS or is_qwen_vl(cfg)
                                            or is_pixtral(cfg) or is_idefics3(cfg) or is_internvl(cfg)
                                            or is_llama4(cfg))


def _origin(where: Any, model_config: ModelConfig) -> str:
    """Where a config came from, for messages: its file, "with hf_overrides" where those were set on top."""
    return f"{where} with hf_overrides" if model_config.hf_overrides else str(where)


def _decoder_of(cfg: Any, arch: str, where: Any) -> tuple[str, bool, bool]:
    """``(architecture, headless, classifier)``: a base model (``MistralModel``) or a sequence or token classifier
    (``LlamaForSequenceClassification``, ``LlamaForTokenClassification``) runs as the causal LM of its decoder, its
    head tied to the embeddings (unused); any other architecture as it is.

    Raises:
        UnsupportedModelError: a classifier whose decoder plinth does not run, or one of an image-and-text model.
    """
    suffix = next((s for s in _CLASSIFIER_SUFFIXES if arch.endswith(s)), None)
    if suffix is not None and is_encoder_architecture(arch):
        return arch, False, True   # (an encoder's classifier: its pooler and head run in the engine)
    if suffix is not None and not ModelRegistry.is_native(arch):
        causal = _causal_of(cfg, arch.removesuffix(suffix))
        if not ModelRegistry.is_native(causal):
            raise UnsupportedModelError(f"{where}: classifiers run on plinth's native decoders; {arch} has "
                                        f"none ({causal} is not among them)")
        if getattr(cfg, "text_config", None) is not None:
            raise UnsupportedModelError(f"{where}: {arch} is the classifier of an image-and-text model; plinth runs "
                                        f"text-only sequence classifiers (e.g. Gemma3TextForSequenceClassification)")
        cfg.tie_word_embeddings = True   # the (unused) head reads the embedding matrix
        return causal, False, True
    if arch.endswith("Model") and not arch.endswith("ForCausalLM"):
        causal = _causal_of(cfg, arch.removesuffix("Model"))
        if not ModelRegistry.is_native(arch) and ModelRegistry.is_native(causal):
            cfg.tie_word_embeddings = True   # the (unused) head reads the embedding matrix
            return causal, True, False
    return arch, False, False


#: the architecture names of classifiers: a label set for the input, or for each of its tokens
_CLASSIFIER_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification")


def is_encoder_architecture(arch: str) -> bool:
    """Whether ``arch`` is a native encoder-only model (its class says ``is_encoder``)."""
    if not ModelRegistry.is_native(arch):
        return False
    try:
        return bool(getattr(ModelRegistry.resolve(arch), "is_encoder", False))
    except UnsupportedModelError:
        return False


def _causal_of(cfg: Any, stem: str) -> str:
    """The causal LM architecture of ``{stem}Model`` / ``{stem}ForSequenceClassification``: ``{stem}ForCausalLM``
    where plinth runs it, else the causal LM of the config's model type (e.g. ``Gemma3TextModel``)."""
    causal = stem + "ForCausalLM"
    if not ModelRegistry.is_native(causal):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(cfg, "model_type", None), causal)
    return causal


def _text_model(cfg: Any, arch: str) -> tuple[Any, str] | None:
    """``(text_config, causal LM)`` of an image-and-text architecture whose language model plinth runs natively
    (and that has no implementation of its own), else ``None``."""
    text = getattr(cfg, "text_config", None)
    if text is None or not arch.endswith("ForConditionalGeneration") or ModelRegistry.is_native(arch):
        return None
    names = getattr(text, "architectures", None)
    mrope = _MROPE_TEXT_MODELS.get(getattr(text, "model_type", None))
    if mrope is not None:
        causal, sections, interleaved = mrope
        params = getattr(text, "rope_parameters", None)
        if not isinstance(params, dict):
            params = dict(getattr(text, "rope_scaling", None) or {})
            text.rope_scaling = params
        params.setdefault("mrope_section", list(sections))
        if interleaved:
            params["mrope_interleaved"] = True
    elif names and isinstance(names, list | tuple) and isinstance(names[0], str):
        causal = names[0]
    else:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(text, "model_type", None))
    if not causal or not ModelRegistry.is_native(causal):
        return None
    # the checkpoint's dtype is often given at the top level only, its quantization always (a bitsandbytes
    # checkpoint's language model is widened while loading only if its config says so)
    # (and Qwen2-VL's tie of the LM head to the embeddings, which its text config does not repeat)
    for key in ("dtype", "torch_dtype", "quantization_config", "tie_word_embeddings"):
        if getattr(text, key, None) is None and getattr(cfg, key, None) is not None:
            setattr(text, key, getattr(cfg, key))
    # transformers ties the image-and-text model's LM head by the top-level flag (its own config's): a checkpoint it
    # wrote tied has no LM head tensor, and one it wrote untied has one, whatever the text config's flag says
    # (Qwen3.5's defaults to false, Qwen3-VL-MoE's to true)
    if getattr(cfg, "tie_word_embeddings", None) is not None:
        text.tie_word_embeddings = bool(cfg.tie_word_embeddings)
    text.architectures = [causal]
    return text, causal


def _tie_by_tensors(text: Any, path: Path) -> None:
    """An image-and-text checkpoint's LM head is its own where the checkpoint stores one, else the embedding matrix
    (what transformers loads, whatever the configs' tie flags say: Mistral 3's top-level flag defaults to true
    though its checkpoints carry a head; Qwen3.5's text flag to false though they do not)."""
    from safetensors import safe_open

    from plinth.model_registry.weights import list_safetensors_files

    heads = ("lm_head.weight", "language_model.lm_head.weight", "model.language_model.lm_head.weight")
    for file in list_safetensors_files(path):
        with safe_open(str(file), "pt") as f:
            if any(name in heads for name in f.keys()):  # noqa: SIM118 - (safe_open has no __contains__)
                text.tie_word_embeddings = False
                return
    text.tie_word_embeddings = True


# the language model's tensors in an image-and-text checkpoint: (prefix, what it becomes), both layouts
# transformers has written (``language_model.model.`` before 4.52, ``model.language_model.`` since)
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("model.text_model.", "model."),   # (Idefics3's and SmolVLM's)
                  ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."),
                  # Qwen2-VL's original layout: the language model's tensors at the top, the encoder's under visual.
                  ("model.embed_tokens.", "model.embed_tokens."), ("model.layers.", "model.layers."),
                  ("model.norm.", "model.norm."))


def _language_model_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's tensors under the causal LM's names; the vision tower's and projector's skipped."""
    for name, tensor in weights:
        for prefix, target in _TEXT_PREFIXES:
            if name.startswith(prefix):
                yield target + name[len(prefix):], tensor
                break


def _language_model_prefix(model_dir: Path) -> str:
    """What an image-and-text checkpoint calls its language model's ``model.`` (``language_model.model.``,
    ``model.language_model.``, ...), read from its shards' headers."""
    names = SafetensorsWeights(list_safetensors_files(model_dir)).names()
    for prefix, target in _TEXT_PREFIXES:
        if target.startswith("model.") and any(name.startswith(prefix) for name in names):
            return prefix.removesuffix(target.removeprefix("model."))
    return "model."


def language_model_names(pairs: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """An image-and-text model's tensors with its language model's names as the causal LM's (a transformers
    ``LlavaForConditionalGeneration.state_dict()`` handed to ``update_weights``); other names (the causal LM's own,
    the vision tower's) as they are."""
    out = []
    for name, tensor in pairs:
        for prefix, target in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = target + name[len(prefix):]
                break
        out.append((name, tensor))
    return out


def _decoder_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A sequence classifier's tensors without its ``score`` layer (:func:`load_classifier_head` reads it), or a
    causal LM's read as a classifier without its LM head (whose rows it takes)."""
    for name, tensor in weights:
        if not name.startswith((CLASSIFIER_PREFIX, "lm_head.")):
            yield name, tensor


#: the tensors of a sequence classifier's head (transformers' ``*ForSequenceClassification.score``)
CLASSIFIER_PREFIX = "score."


def load_classifier_head(source: ModelSource, seed: int = 0, tokenizer: Any = None) -> tuple[Any, Any, Any, Any]:
    """A sequence classifier's ``score`` layer as float64 arrays: ``(weight [labels, hidden], bias [labels] or
    None, label names or None for the config's, None)``; random (seeded) for dummy weights. A causal LM read as a
    classifier (``classifier_from_token``, set with ``hf_overrides``) takes its LM head's rows of those tokens
    instead (:func:`_head_from_tokens`). An encoder's classifier has a ``tanh`` projection before its head, the
    fourth item (:func:`_encoder_head`).

    Raises:
        ModelLoadError: no ``score.weight``, a quantized one, or one whose shape disagrees with the config.
    """
    cfg = source.hf_config
    from plinth.core.pooling import head_from_tokens

    if head_from_tokens(cfg):
        return (*_head_from_tokens(source, tokenizer, seed), None)
    if source.encoder:
        return _encoder_head(source, seed)
    hidden = int(cfg.hidden_size)
    if source.token_classifier and source.kind == "dummy":   # (a bias, as transformers' score layer has)
        gen = torch.Generator().manual_seed(seed)
        std = float(getattr(cfg, "initializer_range", 0.02) or 0.02)
        labels = int(getattr(cfg, "num_labels", 0) or 0)
        draw = lambda *shape: (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).numpy()  # noqa: E731
        return draw(labels, hidden), draw(labels), None, None
    labels = int(getattr(cfg, "num_labels", 0) or 0)
    if source.kind == "dummy":
        gen = torch.Generator().manual_seed(seed)
        std = float(getattr(cfg, "initializer_range", 0.02) or 0.02)
        return (torch.randn(labels, hidden, generator=gen, dtype=torch.float64) * std).numpy(), None, None, None
    assert source.path is not None
    head = SafetensorsWeights(list_safetensors_files(Path(source.path)), only=CLASSIFIER_PREFIX)
    found = dict(widened_if_bnb(head, source, torch.float32, torch.device("cpu")))
    weight, bias = found.pop("score.weight", None), found.pop("score.bias", None)
    if weight is None:
        raise ModelLoadError(f"{source.path}: the classifier has no 'score.weight' tensor")
    if found:
        raise ModelLoadError(f"{source.path}: unexpected classifier tensors {sorted(found)} (plinth reads "
                             f"score.weight and score.bias)")
    if not weight.is_floating_point() or weight.dim() != 2 or weight.shape[1] != hidden:
        raise ModelLoadError(f"{source.path}: 'score.weight' must be a float matrix [labels, {hidden}], got "
                             f"{weight.dtype} {list(weight.shape)}")
    if labels and weight.shape[0] != labels:
        raise ModelLoadError(f"{source.path}: 'score.weight' has {weight.shape[0]} rows, but the config has "
                             f"{labels} labels (num_labels / id2label)")
    if bias is not None and list(bias.shape) != [weight.shape[0]]:
        raise ModelLoadError(f"{source.path}: 'score.bias' must have {weight.shape[0]} values, got {list(bias.shape)}")
    as_array = lambda t: t.to(torch.float64).numpy()   # noqa: E731
    return as_array(weight), None if bias is None else as_array(bias), None, None


#: an encoder classifier's tensors: (projection before the tanh, head) as BERT and RoBERTa name them
_ENCODER_HEADS = {"bert": ("bert.pooler.dense.", "classifier."),
                  "roberta": ("classifier.dense.", "classifier.out_proj.")}


def _encoder_head(source: ModelSource, seed: int) -> tuple[Any, Any, None, Any]:
    """An encoder classifier's head as float64 arrays: ``(weight, bias, None, projection)``, read from the first
    token's state as ``weight @ tanh(projection @ h + projection bias) + bias``: BERT's pooler and classifier,
    RoBERTa's classification head (the same computation; a :class:`~plinth.core.pooling.Projection`).

    Raises:
        ModelLoadError: a missing tensor, or shapes that disagree with the config.
    """
    from plinth.core.pooling import Projection
    from plinth.model_registry.models.bert import ROBERTA_TYPES

    cfg = source.hf_config
    hidden = int(cfg.hidden_size)
    labels = int(getattr(cfg, "num_labels", 0) or 0)
    if source.kind == "dummy":
        gen = torch.Generator().manual_seed(seed)
        std = float(getattr(cfg, "initializer_range", 0.02) or 0.02)
        draw = lambda *shape: (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).numpy()  # noqa: E731
        weight, bias = draw(labels, hidden), draw(labels)
        return weight, bias, None, None if source.token_classifier else Projection(draw(hidden, hidden), draw(hidden))
    assert source.path is not None
    if getattr(cfg, "model_type", None) == "modernbert":
        return _modernbert_head(source)
    if source.token_classifier:   # BERT's and RoBERTa's: a linear layer over each position's state
        out = _head_tensors(source, {"classifier.weight": (labels or None, hidden), "classifier.bias": (labels or None,)})
        return out["classifier.weight"], out["classifier.bias"], None, None
    pre, head = _ENCODER_HEADS["roberta" if getattr(cfg, "model_type", None) in ROBERTA_TYPES else "bert"]
    out = _head_tensors(source, {pre + "weight": (hidden, hidden), pre + "bias": (hidden,),
                                 head + "weight": (labels or None, hidden), head + "bias": (labels or None,)})
    return out[head + "weight"], out[head + "bias"], None, Projection(out[pre + "weight"], out[pre + "bias"])


def _modernbert_head(source: ModelSource) -> tuple[Any, Any, None, Any]:
    """ModernBERT's classifier: ``head.dense`` (a bias where ``classifier_bias``), ``classifier_activation``, the
    LayerNorm ``head.norm`` (a bias where ``norm_bias``), then ``classifier``; as :func:`_encoder_head`.

    Raises:
        ModelLoadError: a missing tensor, shapes that disagree with the config, an unknown activation.
    """
    from transformers.activations import ACT2FN

    from plinth.core.pooling import Projection

    cfg = source.hf_config
    hidden = int(cfg.hidden_size)
    labels = int(getattr(cfg, "num_labels", 0) or 0) or None
    shapes = {"head.dense.weight": (hidden, hidden), "head.norm.weight": (hidden,),
              "classifier.weight": (labels, hidden), "classifier.bias": (labels,)}
    if getattr(cfg, "classifier_bias", False):
        shapes["head.dense.bias"] = (hidden,)
    if getattr(cfg, "norm_bias", False):
        shapes["head.norm.bias"] = (hidden,)
    out = _head_tensors(source, shapes, strip="model.")
    activation = getattr(cfg, "classifier_activation", "gelu")
    if activation not in ACT2FN:
        raise ModelLoadError(f"{source.path}: classifier_activation {activation!r} is not an activation transformers "
                             f"knows")
    norm = (out["head.norm.weight"], out.get("head.norm.bias"), float(cfg.norm_eps))
    return (out["classifier.weight"], out["classifier.bias"], None,
            Projection(out["head.dense.weight"], out.get("head.dense.bias"), activation, norm))


def _head_tensors(source: ModelSource, shapes: dict[str, tuple[int | None, ...]],
                  strip: str = "") -> dict[str, Any]:
    """The checkpoint tensors ``shapes`` names (read under the names with ``strip`` in front too), as float64
    arrays of those shapes (``None``: any size, the same for every tensor: the label count).

    Raises:
        ModelLoadError: a missing tensor, or one of another dtype or shape.
    """
    prefixes = tuple(dict.fromkeys(name.rsplit(".", 1)[0] + "." for name in shapes))   # (their layers only)
    only = prefixes + tuple(strip + p for p in prefixes) if strip else prefixes
    files = list_safetensors_files(Path(source.path or ""))
    found = {name.removeprefix(strip) if strip else name: t for name, t in widened_if_bnb(
        SafetensorsWeights(files, only=only), source, torch.float32, torch.device("cpu"))}
    out, sizes = {}, set()
    for name, shape in shapes.items():
        tensor = found.get(name)
        if tensor is None:
            raise ModelLoadError(f"{source.path}: the classifier has no {name!r} tensor")
        if not tensor.is_floating_point() or tensor.dim() != len(shape) or any(
                want is not None and got != want for got, want in zip(tensor.shape, shape, strict=True)):
            raise ModelLoadError(f"{source.path}: {name!r} must be a float tensor of shape "
                                 f"{[d if d is not None else 'labels' for d in shape]}, got {tensor.dtype} "
                                 f"{list(tensor.shape)}")
        sizes.update(got for got, want in zip(tensor.shape, shape, strict=True) if want is None)
        out[name] = tensor.to(torch.float64).numpy()
    if len(sizes) > 1:
        raise ModelLoadError(f"{source.path}: the classifier's tensors disagree on the label count ({sorted(sizes)})")
    return out


#: config attributes that change a causal LM's logits after its head (a classifier made of head rows would not)
_LOGIT_CHANGES = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _head_from_tokens(source: ModelSource, tokenizer: Any, seed: int) -> tuple[Any, None, tuple[str, ...]]:
    """The classifier of a causal LM read as one (vLLM's recipe for rerankers such as Qwen3-Reranker, set with
    ``hf_overrides``): ``classifier_from_token`` names tokens whose LM-head rows are the labels' weights; with
    ``method: "from_2_way_softmax"`` (or ``is_original_qwen3_reranker``, whose tokens default to ``["no",
    "yes"]``) the two rows' difference is one label, whose sigmoid is the second token's probability in a softmax
    over the two.

    Raises:
        ModelLoadError: tokens the tokenizer does not have, a method plinth does not know, a model whose logits
            change after the head, or a head that is not a float matrix.
    """
    cfg = source.hf_config
    qwen3 = bool(getattr(cfg, "is_original_qwen3_reranker", False))
    tokens = getattr(cfg, "classifier_from_token", None) or (["no", "yes"] if qwen3 else None)
    method = getattr(cfg, "method", None) or ("from_2_way_softmax" if qwen3 else "no_post_processing")
    where = source.path or "the model"
    if not isinstance(tokens, list | tuple) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelLoadError(f"{where}: classifier_from_token must be a list of tokens, got {tokens!r}")
    if method not in ("from_2_way_softmax", "no_post_processing"):
        raise ModelLoadError(f"{where}: method {method!r} is not one plinth knows (from_2_way_softmax, "
                             f"no_post_processing)")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ModelLoadError(f"{where}: from_2_way_softmax needs two classifier_from_token tokens, got {tokens!r}")
    changed = [name for name in _LOGIT_CHANGES if getattr(cfg, name, None) not in (None, 1, 1.0)]
    if changed:
        raise ModelLoadError(f"{where}: this model changes its logits after the LM head ({', '.join(changed)}); "
                             f"a classifier made of the head's rows would not match it")
    if tokenizer is None:
        raise ModelLoadError(f"{where}: classifier_from_token needs the model's tokenizer")
    vocab = tokenizer.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ModelLoadError(f"{where}: classifier_from_token names {missing}, which the tokenizer does not have "
                             f"as single tokens")
    ids = [vocab[t] for t in tokens]
    if source.kind == "dummy":
        gen = torch.Generator().manual_seed(seed)
        rows = torch.randn(len(ids), int(cfg.hidden_size), generator=gen, dtype=torch.float64) * 0.02
    else:
        assert source.path is not None
        rows = _head_rows(Path(source.path), ids, source)
    weight = rows.to(torch.float64).numpy()
    if method == "from_2_way_softmax":
        return (weight[1] - weight[0])[None, :], None, (tokens[1],)
    return weight, None, tuple(tokens)


def _head_rows(model_dir: Path, ids: list[int], source: ModelSource | None = None) -> torch.Tensor:
    """Rows ``ids`` of the checkpoint's LM head (``lm_head.weight``, else the tied ``model.embed_tokens.weight``),
    read alone (a bitsandbytes-quantized head: widened whole, then the rows taken)."""
    from safetensors import safe_open

    files = list_safetensors_files(model_dir)
    if source is not None and _is_bnb(source):
        head = SafetensorsWeights(files, only="lm_head.")
        weight = dict(widened_if_bnb(head, source, torch.float32, torch.device("cpu"))).get("lm_head.weight")
        if weight is not None:
            if weight.dim() != 2 or max(ids) >= weight.shape[0]:
                raise ModelLoadError(f"{model_dir}: 'lm_head.weight' of shape {list(weight.shape)} has no rows {ids}")
            return weight[ids]
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                if name not in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    continue
                part = handle.get_slice(name)
                shape = part.get_shape()
                if len(shape) != 2 or max(ids) >= shape[0]:
                    raise ModelLoadError(f"{file}: {name!r} of shape {shape} has no rows {ids}")
                rows = torch.stack([part[i:i + 1][0] for i in ids])
                if not rows.is_floating_point():
                    raise ModelLoadError(f"{file}: {name!r} is not a float matrix ({rows.dtype}): a quantized head "
                                         f"cannot give a classifier's rows")
                return rows
    raise ModelLoadError(f"{model_dir}: no lm_head.weight or model.embed_tokens.weight to take the classifier's rows "
                         f"from")


def resolve_dtype(model_config: ModelConfig, hf_config: Any, platform_dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The compute dtype: the one asked for, else the checkpoint's when the platform runs it well,
    else the platform's preferred one.

    Raises:
        ConfigError: an explicit dtype the platform does not support.
    """
    if model_config.dtype != "auto":
        dtype = _DTYPES[model_config.dtype]
        if platform_dtypes and dtype not in platform_dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in platform_dtypes)
            raise ConfigError(f"dtype {model_config.dtype} is not supported on this platform; supported: {names}")
        return dtype
    ckpt = getattr(hf_config, "dtype", None)
    if ckpt is None and "torch_dtype" in getattr(hf_config, "__dict__", {}):
        ckpt = hf_config.torch_dtype
    if isinstance(ckpt, str):
        ckpt = _DTYPES.get(ckpt.removeprefix("torch."))
    if ckpt in platform_dtypes or not platform_dtypes:
        return ckpt or torch.float32
    return platform_dtypes[0]


def build_model(architecture: str, ctx: ModelContext) -> CausalLM:
    """Build an architecture's model with uninitialised weights on ``ctx.device``."""
    cls = ModelRegistry.resolve(architecture)
    create = getattr(cls, "create", None)
    if callable(create):
        return create(ctx)
    return build_on_meta(cls, ctx, dtype=ctx.dtype, device=ctx.device)


@torch.no_grad()
def _with_model_prefix(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A base model's tensors under the causal LM's names (``layers.0...`` -> ``model.layers.0...``)."""
    for name, tensor in weights:
        yield (name if name.startswith("model.") else f"model.{name}"), tensor


def update_stream(source: ModelSource) -> Callable[[Iterable[tuple[str, torch.Tensor]]], Iterable[Any]] | None:
    """The renaming a checkpoint of ``source``'s layout needs before its tensors reach the model (as at load time):
    a base model's prefix, an image-and-text checkpoint's language model; ``None``: none.

    Raises:
        ModelLoadError: a layout whose tensors cannot be loaded as they are (a bitsandbytes checkpoint's quantized
            tensors: give the new weights as floats).
    """
    if _is_bnb(source):
        raise ModelLoadError("a bitsandbytes checkpoint's tensors are quantized: give the new weights as float "
                             "tensors (a state dict)")
    return _with_model_prefix if source.headless else _language_model_weights if source.text_only else None


def widened_if_bnb(weights: SafetensorsWeights, source: ModelSource, dtype: torch.dtype,
                    device: torch.device) -> Iterable[tuple[str, torch.Tensor]]:
    """``weights``, with a bitsandbytes checkpoint's quantized layers widened to ``dtype`` as they are read
    (:mod:`plinth.quantization.bitsandbytes`)."""
    from plinth.quantization.bitsandbytes import dequantized_weights

    return dequantized_weights(weights, weights.names(), dtype, device) if _is_bnb(source) else weights


def _is_bnb(source: ModelSource) -> bool:
    """Whether ``source`` is a bitsandbytes checkpoint (its config's ``quantization_config``)."""
    from plinth.quantization.bitsandbytes import is_bnb
    from plinth.quantization.resolve import checkpoint_quant_config

    return is_bnb(checkpoint_quant_config(source.hf_config))


def load_model(source: ModelSource, ctx: ModelContext, *, seed: int = 0) -> CausalLM:
    """Build the model of ``source`` on ``ctx.device`` and fill its weights.

    Args:
        source: from :func:`resolve_model_source`.
        ctx: the model context (its ``hf_config`` is normally ``source.hf_config``).
        seed: the seed of random (dummy) weights.

    Raises:
        ModelLoadError: a weight problem; the message names the file and the tensor.
        UnsupportedModelError: the architecture has no implementation.
    """
    model = build_model(source.architecture, ctx)
    quant = ctx.quant_method
    if quant is not None:  # which layers it quantizes, and its GEMM kernel (plinth.quantization)
        if source.text_only and source.kind == "hf_dir":   # (its settings name the checkpoint's modules)
            quant.checkpoint_prefix = _language_model_prefix(Path(source.path or ""))  # type: ignore[attr-defined]
        quant.prepare_model(model)  # type: ignore[attr-defined]
    if source.kind == "dummy":
        init_dummy_weights(model, seed)
    elif source.kind == "hf_dir":
        assert source.path is not None
        weights = SafetensorsWeights(list_safetensors_files(Path(source.path)))
        stream = widened_if_bnb(weights, source, ctx.dtype, ctx.device)
        try:
            model.load_weights(_with_model_prefix(stream) if source.headless
                               else _language_model_weights(stream) if source.text_only
                               else _decoder_weights(stream) if source.classifier else stream)
        except ModelLoadError as exc:
            where = str(weights.current_file or source.path)
            if where in str(exc):
                raise
            raise ModelLoadError(f"{where}: {exc}") from exc
    elif source.kind == "gguf":
        from plinth.model_registry.gguf_loader import iter_gguf_weights

        assert source.path is not None
        raw = quant.weights_iterator(source, model) if quant is not None else None  # type: ignore[attr-defined]
        try:
            model.load_weights(raw if raw is not None else iter_gguf_weights(source.path, ctx.dtype))
        except ModelLoadError as exc:
            if source.path in str(exc):
                raise
            raise ModelLoadError(f"{source.path}: {exc}") from exc
    else:
        raise ModelLoadError(f"unknown model source kind {source.kind!r}")
    for name, module in model.named_modules():
        method = getattr(module, "linear_method", None) or getattr(module, "weight_method", None)
        if method is not None:
            try:
                method.process_weights_after_loading(module)
            except ModelLoadError as exc:   # name the layer whose tensors do not fit together
                raise ModelLoadError(f"{source.path or source.kind}: layer {name}: {exc}") from exc
    head = getattr(model, "lm_head", None)
    if quant is not None and quant.ctx.quantize_lm_head and head is not None:  # type: ignore[attr-defined]
        tied = any(p is head.weight for name, p in model.named_parameters(remove_duplicate=False)
                   if not name.startswith("lm_head."))
        quant.quantize_lm_head(head, tied=tied)  # type: ignore[attr-defined] # False: the float head stays
    model.eval()
    return model
