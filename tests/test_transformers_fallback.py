"""The transformers fallback on architectures whose attention differs from Llama's in ways the fallback must honour
or refuse (float32, CPU, against transformers' own logits; the fallback's basics are in ``test_models.py``)."""

from __future__ import annotations

import pytest
import torch
import transformers
from test_models import fallback_against_transformers, randomize_zero_parameters

from plinth.errors import UserFacingError

TINY = dict(vocab_size=1003, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _model(model_type: str, **kw) -> transformers.PreTrainedModel:
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **kw})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return randomize_zero_parameters(transformers.AutoModelForCausalLM.from_config(config).eval())


@pytest.mark.parametrize("model_type,kw", [
    ("opt", {}),                                                   # scales its queries itself, passes scaling=1
    ("starcoder2", dict(num_key_value_heads=2, sliding_window=6)),   # passes its window to the attention call
    ("phimoe", dict(num_key_value_heads=2, sliding_window=6, num_local_experts=4, num_experts_per_tok=2)),  # mask
    ("cohere", dict(num_key_value_heads=2, logit_scale=0.3)),      # logits times logit_scale
    ("gpt_bigcode", dict(multi_query=True)),                       # one key/value head on the module, none in config
    ("olmo", dict(num_key_value_heads=2, sliding_window=6)),       # a window in the config the model never applies
    ("gpt2", dict(add_cross_attention=True)),                      # cross-attention modules that never run
    ("hyperclovax", dict(num_key_value_heads=2, logits_scaling=0.25)),   # multiplies (Granite divides)
    ("granite_swa", dict(num_key_value_heads=2, logits_scaling=4.0)),
    # every module holds the window; the full-attention layers pass none (`is_sliding` false)
    ("exaone4", dict(num_key_value_heads=2, sliding_window=6, num_hidden_layers=4,
                     layer_types=["sliding_attention"] * 3 + ["full_attention"])),
])
def test_attention_variants_match_transformers(model_type, kw, tmp_path, monkeypatch):
    """Each variant used to give logits off by 1e-3 to 3 (or crash writing the cache): within 1e-4 now."""
    _, error = fallback_against_transformers(_model(model_type, **kw), tmp_path, monkeypatch)
    assert error < 1e-4


@pytest.mark.parametrize("model_type,kw,match", [
    ("llama4_text", dict(num_key_value_heads=2, attention_chunk_size=8, num_local_experts=4, num_experts_per_tok=1),
     "chunked_attention"),
    ("minimax", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2), "linear_attention"),
    ("diffllama", dict(num_key_value_heads=2), "attends more than once"),
    ("xglm", {}, "compute attention themselves"),
])
def test_attention_the_paged_cache_cannot_hold_is_refused(model_type, kw, match, tmp_path, monkeypatch):
    """Chunked and linear attention layers, a layer that attends twice per pass (DiffLlama's two value sets) and
    a module computing its attention itself (XGLM): a clear error at load or at the first pass, not wrong logits."""
    with pytest.raises(UserFacingError, match=match):
        fallback_against_transformers(_model(model_type, **kw), tmp_path, monkeypatch)


def test_config_with_infinite_floats_loads(tmp_path):
    """transformers writes inf as {"__float__": "Infinity"} (Falcon-H1's time_step_limit): the config loads, and
    the model runs (natively: Falcon-H1's Mamba layers read the limit)."""
    from plinth.config import ModelConfig
    from plinth.model_registry.loader import resolve_model_source

    hf = _model("falcon_h1", num_key_value_heads=2)
    hf.save_pretrained(tmp_path)
    assert '"__float__": "Infinity"' in (tmp_path / "config.json").read_text()
    source = resolve_model_source(ModelConfig(model=str(tmp_path), dtype="float32"))
    assert source.hf_config.time_step_limit[1] == float("inf")
    import plinth
    from plinth.model_registry.models.falcon_h1 import FalconH1ForCausalLM

    llm = plinth.LLM(str(tmp_path), dtype="float32", max_model_len=64)
    model = llm.engine.runner.model
    assert isinstance(model, FalconH1ForCausalLM)
    assert all(m.dt_max == float("inf") for m in model.mamba_layers())
    llm.close()


def test_the_engine_refuses_at_start_up_what_only_a_pass_shows(tmp_path):
    """XGLM's attention never reaches the paged layers: the engine's first pass at start-up says so (it used to
    fail only with the first request)."""
    import plinth
    from plinth.errors import UnsupportedModelError

    _model("xglm").save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="compute attention themselves"):
        plinth.LLM(str(tmp_path), dtype="float32")


@pytest.mark.parametrize("model_type,kw", [
    ("gpt_neox", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0,
                                       "partial_rotary_factor": 0.5})),
    ("phimoe", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, original_max_position_embeddings=32,
                    rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 32,
                                     "short_mscale": 1.0, "long_mscale": 1.2,
                                     "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                     "long_factor": [2.0 + 0.7 * i for i in range(8)]})),
], ids=["dynamic", "longrope"])
def test_rope_set_by_the_longest_position_follows_each_sequence(model_type, kw, tmp_path, monkeypatch):
    """RoPE whose frequencies transformers sets from the longest position in the pass (``dynamic``'s NTK base,
    ``longrope``'s factors): batched with a long prompt, a short one's logits are those transformers gives it alone
    (they took the long prompt's frequencies), and the long one's are its own."""
    from paged_driver import PagedDriver

    hf = _model(model_type, **{**kw, "max_position_embeddings": 64, "initializer_range": 0.2})  # sharp attention
    model, _ = fallback_against_transformers(hf, tmp_path, monkeypatch)
    g = torch.Generator().manual_seed(7)
    short, long = (torch.randint(0, 1003, (n,), generator=g).tolist() for n in (12, 120))
    with torch.no_grad():
        ref_short, ref_long = (hf(torch.tensor([p])).logits[0, -1].float() for p in (short, long))
    driver = PagedDriver(model, model.attention_layers()[0].backend, block_size=4, num_blocks=64)
    driver.add(0, short)
    driver.add(1, long)
    with torch.inference_mode():
        out = driver.step({0: len(short), 1: len(long)})
    assert (out[0] - ref_short).abs().max() < 1e-4 and (out[1] - ref_long).abs().max() < 1e-4
