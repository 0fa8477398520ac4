"""The model loader: sources, sharded safetensors, dummy weights and presets, dtype choice, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from paged_driver import PagedDriver
from safetensors.torch import load_file, save_file

from plinth.attention_backends.torch_sdpa import TorchSDPABackend
from plinth.config import ConfigError, ModelConfig
from plinth.errors import ModelLoadError
from plinth.model_registry.interface import ModelContext
from plinth.model_registry.loader import (
    build_model,
    list_presets,
    load_model,
    load_preset,
    resolve_dtype,
    resolve_model_source,
)
from plinth.model_registry.weights import build_on_meta

SMALL = dict(vocab_size=1003, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def _ctx(hf_config, dtype=torch.float32, backend=None):
    return ModelContext(hf_config=hf_config, dtype=dtype, device=torch.device("cpu"),
                        attention_backend=backend or TorchSDPABackend(), block_size=4)


def _load(model: str, **kw):
    source = resolve_model_source(ModelConfig(model=model, dtype="float32", **kw))
    return source, load_model(source, _ctx(source.hf_config), seed=kw.get("seed", 0))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture
def broken_dir(llama_dir, tmp_path):
    """A fresh copy of the small checkpoint to damage."""
    dst = tmp_path / "model"
    shutil.copytree(llama_dir[0], dst)
    return dst


def test_sharded_checkpoint_matches_single_file(llama_dir, tmp_path):
    _, hf = llama_dir
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    source, model = _load(str(tmp_path))
    assert source.kind == "hf_dir" and source.architecture == "LlamaForCausalLM"
    backend = model.ctx.attention_backend
    driver = PagedDriver(model, backend)
    driver.add(0, [4, 8, 15, 16, 23, 42])
    logits = driver.step({0: 6})[0]
    with torch.no_grad():
        ref = hf(torch.tensor([[4, 8, 15, 16, 23, 42]])).logits[0, -1]
    assert (logits - ref).abs().max().item() < 1e-4


def test_fused_projections_are_assembled(llama_dir):
    path, hf = llama_dir
    _, model = _load(str(path))
    attn = model.model.layers[1].self_attn
    ref = hf.model.layers[1].self_attn
    expected = torch.cat([ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight])
    assert torch.equal(attn.qkv_proj.weight, expected)
    mlp, ref_mlp = model.model.layers[0].mlp, hf.model.layers[0].mlp
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([ref_mlp.gate_proj.weight, ref_mlp.up_proj.weight]))


def test_tokenizer_path_only_when_tokenizer_files_exist(llama_dir, broken_dir):
    assert resolve_model_source(ModelConfig(model=str(llama_dir[0]))).tokenizer_path is None
    (broken_dir / "tokenizer.json").write_text("{}")
    assert resolve_model_source(ModelConfig(model=str(broken_dir))).tokenizer_path == str(broken_dir)
    explicit = resolve_model_source(ModelConfig(model=str(broken_dir), tokenizer="/tok"))
    assert explicit.tokenizer_path == "/tok"


# ---- dummy weights and presets ----

def test_presets_ship_and_load():
    names = list_presets()
    for name in ("llama-3-8b", "qwen3-8b", "mixtral-8x7b", "tiny-llama"):
        assert name in names
    assert load_preset("qwen3-8b").head_dim == 128


@pytest.mark.parametrize("preset,params", [
    ("llama-3-8b", 8_030_261_248),
    ("qwen3-8b", 8_190_735_360),
    ("mixtral-8x7b", 46_702_792_704),
    ("gemma-3-1b", 999_885_952),
    ("llama-3.2-1b", 1_235_814_400),   # published: 1.23B (tied embeddings)
    ("gemma-2-2b", 2_614_341_888),
    ("phi-3-mini", 3_821_079_552),
    ("smollm3-3b", 3_075_098_624),   # transformers' SmolLM3ForCausalLM of the same config (published: 3.08B)
    ("gpt-oss-20b", 20_914_757_184),   # transformers' GptOssForCausalLM of the same config (published: 21B)
    ("deepseek-v2-lite", 15_706_484_224),   # transformers' DeepseekV2ForCausalLM of the same config (published: 15.7B)
    ("llama-4-scout", 107_769_861_120),   # transformers' Llama4ForCausalLM of the same config (published: 109B with
                                          # the vision tower)
    ("bert-base", 108_891_648),   # transformers' BertModel without its pooler (published: 110M with it)
    ("bge-m3", 566_705_152),   # transformers' XLMRobertaModel without its pooler (published: 568M)
    ("modernbert-base", 149_014_272),   # published: 149M
])
def test_preset_parameter_counts(preset, params):
    """Built on the meta device (no memory): the published parameter counts."""
    cfg = load_preset(preset)
    source = resolve_model_source(ModelConfig(model=preset, load_format="dummy"))
    assert source.kind == "dummy" and source.path is None and source.tokenizer_path is None
    from plinth.model_registry.registry import ModelRegistry

    cls = ModelRegistry.resolve(source.architecture)
    with torch.device("meta"):
        model = cls(_ctx(cfg, dtype=torch.bfloat16))
    assert sum(p.numel() for p in model.parameters()) == params


def test_dummy_preset_is_sane_and_deterministic():
    _, a = _load("tiny-llama", load_format="dummy", seed=3)
    _, b = _load("tiny-llama", load_format="dummy", seed=3)
    _, c = _load("tiny-llama", load_format="dummy", seed=4)
    pa, pb, pc = dict(a.named_parameters()), dict(b.named_parameters()), dict(c.named_parameters())
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not torch.equal(pa["lm_head.weight"], pc["lm_head.weight"])
    for name, p in pa.items():
        if "norm" in name:
            assert torch.all(p == 1), name
        else:
            assert abs(p.std().item() - 0.02) < 0.003 and abs(p.mean().item()) < 0.003, name
    driver = PagedDriver(a, a.ctx.attention_backend)
    gen, _ = driver.generate_greedy([[1, 2, 3]], 4)
    assert len(gen[0]) == 4 and all(0 <= t < 1024 for t in gen[0])


def test_dummy_from_config_dir(llama_dir):
    source, model = _load(str(llama_dir[0]), load_format="dummy")
    assert source.kind == "dummy" and source.architecture == "LlamaForCausalLM"
    assert model.lm_head.weight.shape == (1003, 64)


def test_dummy_bfloat16_build():
    cfg = load_preset("tiny-llama")
    source = resolve_model_source(ModelConfig(model="tiny-llama", load_format="dummy"))
    model = load_model(source, _ctx(cfg, dtype=torch.bfloat16))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_meta_build_keeps_ties_and_loaders():
    cfg = transformers.Qwen2Config(**SMALL, tie_word_embeddings=True)
    cfg.architectures = ["Qwen2ForCausalLM"]
    model = build_model("Qwen2ForCausalLM", _ctx(cfg))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.lm_head.weight.is_meta
    assert callable(model.model.layers[0].self_attn.qkv_proj.weight.weight_loader)
    inv = model.model.rotary_emb.inv_freq
    assert torch.allclose(inv, 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16)))
    assert isinstance(build_on_meta(torch.nn.Linear, 3, 4, dtype=torch.float16, device=torch.device("cpu")).weight,
                      torch.nn.Parameter)


# ---- dtype ----

def test_resolve_dtype():
    cfg = transformers.LlamaConfig(**SMALL, dtype="bfloat16")
    cpu_bf16 = (torch.bfloat16, torch.float32)
    assert resolve_dtype(ModelConfig(), cfg, cpu_bf16) == torch.bfloat16
    assert resolve_dtype(ModelConfig(), cfg, (torch.float32,)) == torch.float32  # CPU without bf16
    assert resolve_dtype(ModelConfig(dtype="float32"), cfg, cpu_bf16) == torch.float32
    with pytest.raises(ConfigError, match="float16 is not supported"):
        resolve_dtype(ModelConfig(dtype="float16"), cfg, cpu_bf16)
    no_dtype = transformers.LlamaConfig(**SMALL)
    assert resolve_dtype(ModelConfig(), no_dtype, (torch.float16, torch.float32)) == torch.float16


# ---- errors ----

def test_missing_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_source(ModelConfig(model="/no/such/model"))


def test_preset_name_without_dummy_gets_a_hint():
    with pytest.raises(ModelLoadError, match="load_format='dummy'"):
        resolve_model_source(ModelConfig(model="llama-3-8b"))


def test_unknown_preset_lists_presets():
    with pytest.raises(ModelLoadError, match="tiny-llama"):
        resolve_model_source(ModelConfig(model="no-such-preset", load_format="dummy"))


def test_dir_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model_source(ModelConfig(model=str(tmp_path)))


def test_invalid_config_json(broken_dir):
    (broken_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model_source(ModelConfig(model=str(broken_dir)))


@pytest.mark.parametrize("change,match", [
    (dict(num_attention_heads=5), "not a multiple"),          # transformers' strict dataclass validation
    (dict(num_attention_heads=0), "num_attention_heads must be at least 1"),
    (dict(hidden_size=-64), "hidden_size must be at least 1, got -64"),
    (dict(intermediate_size=-128), "intermediate_size must be at least 1"),
    (dict(head_dim=-16), "head_dim must be at least 0"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}), "rope_theta must be a positive number"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 0}), "rope_theta must be a positive number"),
    (dict(hidden_size="64"), "hidden_size"),
    (dict(quantization_config="awq"), "invalid model configuration"),
    (dict(architectures="LlamaForCausalLM"), "must be a list of names"),
])
def test_invalid_config_values_are_model_load_errors(broken_dir, change, match):
    path = broken_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ModelLoadError, match=match):
        _load(str(broken_dir))


def test_config_without_architecture(broken_dir):
    (broken_dir / "config.json").write_text(json.dumps({"model_type": "mystery", "hidden_size": 8}))
    with pytest.raises(ModelLoadError, match="names no architecture"):
        resolve_model_source(ModelConfig(model=str(broken_dir)))


def test_dir_without_weights(broken_dir):
    (broken_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors files"):
        resolve_model_source(ModelConfig(model=str(broken_dir)))


def test_index_names_missing_shard(broken_dir):
    (broken_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        resolve_model_source(ModelConfig(model=str(broken_dir)))


@pytest.mark.parametrize("shard, message", [
    (1, "must map tensor names to shard file names"), (None, "must map tensor names"),
    ("../outside/model.safetensors", "outside the model directory"), ("/etc/passwd", "outside the model directory")])
def test_index_with_a_shard_name_that_is_not_a_file_name_in_the_directory(broken_dir, shard, message):
    """A shard index whose value is not a file name, or names a file outside the model directory (which would be
    read as the model's weights), is refused."""
    (broken_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": shard}}))
    with pytest.raises(ModelLoadError, match=message):
        resolve_model_source(ModelConfig(model=str(broken_dir)))


def test_sharded_checkpoint_of_symlinks_out_of_its_folder_loads(llama_dir, tmp_path):
    """Shards that are symlinks to files elsewhere (the Hugging Face cache: snapshots/<rev>/*.safetensors ->
    ../../blobs/<hash>) load; only the index's names are checked."""
    _, hf = llama_dir
    hf.save_pretrained(tmp_path / "saved", max_shard_size="100KB")
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for f in (tmp_path / "saved").iterdir():
        if f.suffix == ".safetensors":
            f.rename(blobs / f.name)
            (snap / f.name).symlink_to(Path("../..") / "blobs" / f.name)
        else:
            f.rename(snap / f.name)
    source, _ = _load(str(snap))
    assert source.kind == "hf_dir"


def test_non_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_model_source(ModelConfig(model=str(f)))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_shard(broken_dir, damage):
    shard = broken_dir / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a safetensors file" * 8)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*(corrupt or truncated|header)"):
        _load(str(broken_dir))


def _rewrite(shard: Path, edit) -> None:
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard)


def test_missing_tensor(broken_dir):
    _rewrite(broken_dir / "model.safetensors", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        _load(str(broken_dir))


def test_unexpected_tensor(broken_dir):
    _rewrite(broken_dir / "model.safetensors", lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*'model\.extra\.weight'"):
        _load(str(broken_dir))


def test_shape_mismatch(broken_dir):
    def edit(t):
        t["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 95)
    _rewrite(broken_dir / "model.safetensors", edit)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*'model\.layers\.0\.mlp\.down_proj\.weight'.*"
                                             r"expected \(64, 96\), checkpoint has \(64, 95\)"):
        _load(str(broken_dir))


def test_fused_shard_shape_mismatch(broken_dir):
    def edit(t):
        t["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(48, 64)
    _rewrite(broken_dir / "model.safetensors", edit)
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.self_attn\.v_proj\.weight'.*shape mismatch"):
        _load(str(broken_dir))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_unsupported_dtype(broken_dir, dtype):
    def edit(t):
        t["model.norm.weight"] = t["model.norm.weight"].to(dtype)
    _rewrite(broken_dir / "model.safetensors", edit)
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ModelLoadError, match=rf"model\.safetensors.*'model\.norm\.weight'.*unsupported dtype {name}"):
        _load(str(broken_dir))


def test_a_tokenizer_path_that_is_not_a_directory_is_a_clear_error(tiny_llama_dir, tmp_path):
    """``--tokenizer`` names local files (as the model does): a missing path is not looked up on a model hub."""
    import plinth
    from plinth.errors import ModelLoadError

    for path, what in ((tmp_path / "missing", "does not exist"), (tiny_llama_dir / "config.json", "is not a directory")):
        with pytest.raises(ModelLoadError, match=f"tokenizer '.*' {what}: give a directory"):
            plinth.LLM(str(tiny_llama_dir), tokenizer=str(path), selection="off")


def test_a_checkpoint_without_tokenizer_files_takes_token_ids_and_names_the_remedy_for_text(tmp_path):
    """A real checkpoint whose directory has no tokenizer runs token ids; a text prompt is refused with a message
    that says how to give a tokenizer (not as if the weights were dummy ones)."""
    from conftest import save_tiny_model

    from plinth import LLM, SamplingParams
    from plinth.core.scheduler import RequestRejectedError

    model = save_tiny_model(tmp_path / "m")
    for f in model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink()
    llm = LLM(str(model), dtype="float32", selection="off")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(RequestRejectedError, match=r"no tokenizer.*tokenizer= / --tokenizer"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
