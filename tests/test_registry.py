"""The model registry: built-in plugin registrations, user registrations, fallback, unknown architectures."""

from __future__ import annotations

import json
import types

import pytest
import torch
import transformers
from paged_driver import PagedDriver

import plinth
from plinth.attention_backends.torch_sdpa import TorchSDPABackend
from plinth.config import ModelConfig
from plinth.errors import UnsupportedModelError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.loader import load_model, resolve_model_source
from plinth.model_registry.models.llama import LlamaForCausalLM
from plinth.model_registry.models.transformers_fallback import TransformersForCausalLM
from plinth.model_registry.registry import ModelRegistry
from plinth.plugins import get_plugin_manager, reset_plugin_manager

NATIVE = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
          "MixtralForCausalLM", "Qwen3MoeForCausalLM"]
SMALL = dict(vocab_size=211, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.1)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


class DoubledLlama(LlamaForCausalLM):
    """A custom architecture: Llama with logits scaled by two."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return 2 * super().compute_logits(hidden)


@pytest.fixture
def custom_checkpoint(tmp_path):
    """A Llama checkpoint whose config.json names a custom architecture."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    hf.save_pretrained(tmp_path)

    def with_arch(arch: str) -> str:
        cfg = json.loads((tmp_path / "config.json").read_text())
        cfg["architectures"] = [arch]
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        return str(tmp_path)

    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0, -1]
    return with_arch, ref


@pytest.fixture
def registered():
    names: list[str] = []
    yield names
    for n in names:
        ModelRegistry.unregister_model(n)


def _run(path: str):
    source = resolve_model_source(ModelConfig(model=path, dtype="float32"))
    backend = TorchSDPABackend()
    ctx = ModelContext(hf_config=source.hf_config, dtype=torch.float32, device=torch.device("cpu"),
                       attention_backend=backend, block_size=4)
    model = load_model(source, ctx)
    driver = PagedDriver(model, backend)
    driver.add(0, PROMPT)
    return model, driver.step({0: len(PROMPT)})[0]


def test_public_name_is_the_registry():
    assert plinth.ModelRegistry is ModelRegistry


def test_builtin_architectures_come_from_the_plugin_hook():
    provided = get_plugin_manager().registrations("models")
    for arch in NATIVE:
        assert arch in provided and provided[arch].plugin == "models"
        assert arch in ModelRegistry.supported_architectures()
        assert ModelRegistry.is_native(arch)
    assert ModelRegistry.resolve("LlamaForCausalLM") is LlamaForCausalLM


def test_unknown_architecture_lists_supported():
    with pytest.raises(UnsupportedModelError) as info:
        ModelRegistry.resolve("NoSuchModelForCausalLM")
    msg = str(info.value)
    assert "'NoSuchModelForCausalLM'" in msg
    for arch in NATIVE:
        assert arch in msg
    assert "register_model" in msg


def test_transformers_architecture_without_native_class_uses_the_fallback():
    cls = ModelRegistry.resolve("GPTNeoXForCausalLM")
    assert issubclass(cls, TransformersForCausalLM) and cls.hf_architecture == "GPTNeoXForCausalLM"
    assert ModelRegistry.resolve("GPTNeoXForCausalLM") is cls
    assert not ModelRegistry.is_native("GPTNeoXForCausalLM")
    with pytest.raises(UnsupportedModelError):  # known to transformers, but not a causal LM
        ModelRegistry.resolve("T5EncoderModel")


def test_register_class_object(custom_checkpoint, registered):
    with_arch, ref = custom_checkpoint
    ModelRegistry.register_model("DoubledLlamaForCausalLM", DoubledLlama)
    registered.append("DoubledLlamaForCausalLM")
    assert "DoubledLlamaForCausalLM" in ModelRegistry.supported_architectures()
    model, logits = _run(with_arch("DoubledLlamaForCausalLM"))
    assert type(model) is DoubledLlama
    assert (logits - 2 * ref).abs().max().item() < 1e-4


def test_register_lazy_reference(custom_checkpoint, registered):
    with_arch, ref = custom_checkpoint
    plinth.ModelRegistry.register_model("MyLlamaForCausalLM", "plinth.model_registry.models.llama:LlamaForCausalLM")
    registered.append("MyLlamaForCausalLM")
    model, logits = _run(with_arch("MyLlamaForCausalLM"))
    assert type(model) is LlamaForCausalLM
    assert (logits - ref).abs().max().item() < 1e-4


def test_user_registration_overrides_builtin(registered):
    ModelRegistry.register_model("LlamaForCausalLM", DoubledLlama)
    registered.append("LlamaForCausalLM")
    assert ModelRegistry.resolve("LlamaForCausalLM") is DoubledLlama
    ModelRegistry.unregister_model("LlamaForCausalLM")
    assert ModelRegistry.resolve("LlamaForCausalLM") is LlamaForCausalLM


def test_bad_registrations(registered):
    with pytest.raises(ValueError, match="package.module:Class"):
        ModelRegistry.register_model("X", "not_a_reference")
    with pytest.raises(ValueError):
        ModelRegistry.register_model("X", 42)  # type: ignore[arg-type]
    ModelRegistry.register_model("BrokenForCausalLM", "no_such_package.models:Broken")
    registered.append("BrokenForCausalLM")
    with pytest.raises(UnsupportedModelError, match="cannot be loaded"):
        ModelRegistry.resolve("BrokenForCausalLM")


def test_plugin_hook_registration():
    """A plugin module providing ``plinth_models`` adds an architecture."""
    from plinth.hookspecs import hookimpl

    plugin = types.ModuleType("toy_model_plugin")
    plugin.PLINTH_PLUGIN_API = "1.0"

    @hookimpl
    def plinth_models():
        return {"ToyLlamaForCausalLM": "plinth.model_registry.models.llama:LlamaForCausalLM"}

    plugin.plinth_models = plinth_models
    try:
        get_plugin_manager().register_module(plugin, "toy_model_plugin")
        assert "ToyLlamaForCausalLM" in ModelRegistry.supported_architectures()
        assert ModelRegistry.resolve("ToyLlamaForCausalLM") is LlamaForCausalLM
    finally:
        reset_plugin_manager()
    assert "ToyLlamaForCausalLM" not in ModelRegistry.supported_architectures()


def test_plugin_model_type_loads_its_tokenizer_without_a_warning(tmp_path, registered):
    """A checkpoint of a model_type transformers does not know (a plugin's architecture) runs with its
    tokenizer, and transformers is not left to warn that the checkpoint "is otherwise not supported"."""
    import logging

    from conftest import save_tiny_model

    save_tiny_model(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(architectures=["DoubledLlamaForCausalLM"], model_type="doubled_llama")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ModelRegistry.register_model("DoubledLlamaForCausalLM", DoubledLlama)
    registered.append("DoubledLlamaForCausalLM")
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())   # transformers' logger does not propagate
    logging.getLogger("transformers").addHandler(handler)
    try:
        llm = plinth.LLM(str(tmp_path), dtype="float32")
        out = llm.generate(["hello world"], plinth.SamplingParams(max_tokens=3, temperature=0))
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert type(llm.engine.model_source.hf_config) is transformers.PretrainedConfig   # the generic config
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].outputs[0].text == llm.get_tokenizer().decode(
        out[0].outputs[0].token_ids)
    assert not [m for m in seen if "to instantiate a model of type" in m], seen
