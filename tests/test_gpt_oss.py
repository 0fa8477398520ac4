"""gpt-oss specifics beyond the shared architecture tests (tests/test_models.py, tests/test_distributed.py): its
MXFP4 checkpoints, the transformers fallback's sinks, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_models import (
    COMMON,
    _hf_logits,
    _load,
    _prompts,
    fallback_against_transformers,
    follow_config_swiglu,
    paged_prefill_logits,
    randomize_zero_parameters,
)

from plinth.attention_backends.torch_sdpa import TorchSDPABackend
from plinth.errors import ModelLoadError
from plinth.model_registry.models.gpt_oss import dequantize_mxfp4

# swiglu_limit left at the released 7.0, which every transformers release applies (some ignore the config's)
CONFIG = dict(COMMON, head_dim=16, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
              layer_types=["sliding_attention", "full_attention"])


def _model(seed: int = 3) -> transformers.GptOssForCausalLM:
    torch.manual_seed(seed)
    return follow_config_swiglu(randomize_zero_parameters(
        transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG)).eval()))


def save_mxfp4(path, seed: int = 4) -> None:
    """A gpt-oss checkpoint whose experts are MXFP4 (random codes, scales 2**-7 .. 2**-3), as the released
    checkpoints store them: ``*_blocks`` ``[E, out, in / 32, 16]`` and ``*_scales`` ``[E, out, in / 32]``."""
    _model().save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, n_in, n_out = tensors.pop(name).shape
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (e, n_out, n_in // 32, 16), generator=g, dtype=torch.uint8)
        tensors[f"{name}_scales"] = torch.randint(120, 125, (e, n_out, n_in // 32), generator=g, dtype=torch.uint8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))


def test_mxfp4_values_follow_the_format():
    """FP4 E2M1 codes, the low nibble first, times 2 ** (scale - 127), against a float64 decoding of the OCP
    microscaling rules (sign, two exponent bits with bias 1, one mantissa bit; exponent 0 is subnormal)."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 2), generator=g, dtype=torch.uint8)

    def e2m1(code: int) -> float:
        sign = -1.0 if code & 8 else 1.0
        exponent, mantissa = (code >> 1) & 3, code & 1
        return sign * (mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1))

    expected = torch.empty(3, 64, dtype=torch.float64)
    for r in range(3):
        for b in range(2):
            for j in range(16):
                byte = int(blocks[r, b, j])
                for half, code in enumerate((byte & 15, byte >> 4)):
                    expected[r, b * 32 + 2 * j + half] = e2m1(code) * 2.0 ** (int(scales[r, b]) - 127)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float64), expected)
    assert dequantize_mxfp4(blocks, scales, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ModelLoadError, match="do not match"):
        dequantize_mxfp4(blocks, scales[:, :1], torch.float32)
    with pytest.raises(ModelLoadError, match="uint8"):
        dequantize_mxfp4(blocks.to(torch.int16), scales, torch.float32)


def test_mxfp4_checkpoint_matches_transformers_dequantizing_it(tmp_path):
    """The same MXFP4 file: plinth widens the experts while loading; transformers (``Mxfp4Config(dequantize=True)``)
    does too; their logits agree, and the experts hold exactly transformers' values."""
    save_mxfp4(tmp_path)
    hf = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    follow_config_swiglu(hf)
    backend = TorchSDPABackend()
    model = _load(str(tmp_path), backend)
    ours, theirs = model.model.layers[1].mlp.experts, hf.model.layers[1].mlp.experts
    i = theirs.down_proj.shape[1]
    gate_up = theirs.gate_up_proj.transpose(1, 2)                                 # [E, 2I, H], interleaved
    assert torch.equal(ours.w13_weight, torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1))
    assert torch.equal(ours.w2_weight, theirs.down_proj.transpose(1, 2)) and ours.w2_weight.shape[2] == i
    prompt = _prompts(hf.config.vocab_size)[2]
    assert (paged_prefill_logits(model, backend, prompt) - _hf_logits(hf, prompt)).abs().max().item() < 1e-4


def test_mxfp4_checkpoint_refusals(tmp_path):
    """--quantization on an MXFP4 checkpoint is refused (the model reads it itself); a block tensor without its
    scales names the missing tensor."""
    import plinth
    from plinth.config import ConfigError

    save_mxfp4(tmp_path)
    with pytest.raises(ConfigError, match="mxfp4.*leave --quantization out"):
        plinth.LLM(str(tmp_path), dtype="float32", quantization="fp8")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="down_proj_scales"):
        _load(str(tmp_path), TorchSDPABackend())


def test_the_transformers_fallback_passes_the_sinks(tmp_path, monkeypatch):
    """transformers' own gpt-oss code on plinth's paged attention: its sinks (``s_aux``) reach the backend (they
    were dropped before), and the logits equal transformers'."""
    model, error = fallback_against_transformers(_model(), tmp_path, monkeypatch)
    assert all(layer.has_sinks for layer in model._attn_layers) and error < 1e-4


def test_sinks_loader_refuses_a_wrong_count(tmp_path):
    hf = _model()
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.sinks"] = tensors["model.layers.0.self_attn.sinks"][:3].clone()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"self_attn.sinks.*one sink per head"):
        _load(str(tmp_path), TorchSDPABackend())


@pytest.mark.skipif(not hasattr(transformers, "GraniteSWAConfig"), reason="transformers without Granite SWA")
def test_another_architecture_with_sinks_runs_on_a_backend_that_applies_them(tmp_path):
    """A transformers architecture with sinks that plinth has no class for (Granite SWA, through the fallback):
    selection keeps to backends that apply sinks (it picked cpu_paged and failed before), and the prompt's
    logprobs equal transformers'."""
    import plinth
    from plinth.worker.setup import attention_spec

    cfg = transformers.GraniteSWAConfig(**{**COMMON, "num_hidden_layers": 2, "sliding_window": 5, "eos_token_id": 2,
                                           "bos_token_id": 1, "pad_token_id": 0,
                                           "layer_types": ["sliding_attention", "full_attention"]})
    assert attention_spec(cfg, torch.float32, 4).sinks
    torch.manual_seed(0)
    hf = randomize_zero_parameters(transformers.GraniteSWAForCausalLM(cfg).eval())
    hf.save_pretrained(tmp_path)
    llm = plinth.LLM(str(tmp_path), dtype="float32", block_size=4)
    prompt = _prompts(cfg.vocab_size)[2]
    out = llm.generate([{"prompt_token_ids": prompt}], plinth.SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                                             detokenize=False), use_tqdm=False)[0]
    ref = torch.log_softmax(_hf_logits(hf, prompt), dim=-1)
    got = [lp[prompt[i]].logprob for i, lp in enumerate(out.prompt_logprobs) if lp]
    want = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert got == pytest.approx(want, abs=1e-4)
