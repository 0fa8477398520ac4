"""The Qwen2-VL / Qwen2.5-VL image encoder (:mod:`plinth.multimodal.qwen_vision`) against transformers' on tiny random
checkpoints: the same merged embeddings for one image, several images of different grids in one call (Qwen2.5-VL:
grids whose windows need padding), video-like grids of two frames; and the weight loading's checks."""

from __future__ import annotations

import pytest
import torch
import transformers

from plinth.errors import ModelLoadError, UnsupportedModelError
from plinth.multimodal.qwen_vision import QWEN_ENCODER_PREFIXES, QWEN_VL_TYPES, QwenVisionEncoder, is_qwen_vl

PATCH_VALUES = 3 * 2 * 14 * 14   # channels * temporal_patch_size * patch_size ** 2
TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=128,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 4]})


def _decisive(model):
    """``model`` with its encoder's weights larger than transformers' init (which leaves attention near-uniform, so
    positions would barely matter): matrices N(0, 1 / fan_in), norm scales 1 + N(0, 0.04), biases N(0, 0.04)."""
    with torch.no_grad():
        for name, p in model.model.visual.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p[0].numel() ** -0.5)
            elif "norm" in name or "ln_q" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
            else:
                p.normal_(0.0, 0.2)
    return model


def _qwen2():
    vision = dict(depth=3, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu")
    config = transformers.Qwen2VLConfig(text_config=TEXT, vision_config=vision, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return _decisive(transformers.Qwen2VLForConditionalGeneration(config).eval())


def _qwen25():
    # windows of 56 pixels: 2x2 merge groups of 2x2 patches of 14; block 1 attends over the whole frame
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=40, num_heads=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                  hidden_act="silu")
    config = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=vision, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return _decisive(transformers.Qwen2_5_VLForConditionalGeneration(config).eval())


@pytest.fixture(scope="module")
def models():
    """Each generation's transformers model and a :class:`QwenVisionEncoder` loaded from its state dict."""
    out = {}
    for kind, build in (("qwen2_vl", _qwen2), ("qwen2_5_vl", _qwen25)):
        model = build()
        encoder = QwenVisionEncoder(model.config).eval()
        encoder.load_weights(model.state_dict().items())   # the language model's tensors are skipped
        out[kind] = model, encoder
    return out


def _reference(model, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    out = model.model.visual(pixels, grid_thw=grid)
    return out.pooler_output   # transformers 5: BaseModelOutputWithPooling; the merged embeddings


CASES = {
    "qwen2_vl": [[(1, 4, 6)], [(1, 4, 6), (1, 8, 10)], [(2, 4, 4), (1, 6, 2)], [(1, 4, 6), (1, 4, 6), (1, 2, 2)]],
    # merged grids 3x5 (windows cut short on both sides), 6x4 (exact multiples of the 2x2 windows), 1x1
    "qwen2_5_vl": [[(1, 6, 10)], [(1, 6, 10), (1, 12, 8)], [(2, 6, 4), (1, 2, 2), (1, 12, 8)],
                   [(1, 4, 4), (1, 4, 4)]],
}


@pytest.mark.parametrize("kind,grids", [(k, g) for k, cases in CASES.items() for g in cases],
                         ids=lambda v: str(v).replace(" ", ""))
@torch.no_grad()
def test_matches_transformers(models, kind, grids):
    model, encoder = models[kind]
    grid = torch.tensor(grids, dtype=torch.int64)
    torch.manual_seed(1)
    pixels = torch.randn(int(grid.prod(-1).sum()), PATCH_VALUES)
    want = _reference(model, pixels, grid)
    got = encoder(pixels, grid)
    assert got.shape == want.shape == (pixels.shape[0] // 4, 48 if kind == "qwen2_vl" else 40)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # images in order: each image alone gives its rows of the batched call
    start = 0
    for g in grids:
        n = g[0] * g[1] * g[2]
        alone = encoder(pixels[start:start + n], torch.tensor([g]))
        torch.testing.assert_close(got[start // 4:(start + n) // 4], alone, rtol=1e-5, atol=1e-5)
        start += n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_half_precision(models, dtype):
    model, encoder = models["qwen2_5_vl"]
    half = QwenVisionEncoder(model.config).to(dtype).eval()
    half.load_weights(model.state_dict().items())
    grid = torch.tensor([(1, 6, 10), (1, 4, 4)])
    torch.manual_seed(2)
    pixels = torch.randn(76, PATCH_VALUES)
    got = half(pixels, grid)
    assert got.dtype == dtype
    tol = 0.1 if dtype == torch.bfloat16 else 0.02
    torch.testing.assert_close(got.float(), encoder(pixels, grid), rtol=tol, atol=tol)


@torch.no_grad()
def test_hub_layout_loads_the_same(models):
    model, encoder = models["qwen2_vl"]
    hub = QwenVisionEncoder(model.config).eval()
    hub.load_weights((name.removeprefix("model."), t) for name, t in model.state_dict().items()
                     if name.startswith("model.visual."))
    grid = torch.tensor([(1, 4, 6)])
    pixels = torch.randn(24, PATCH_VALUES)
    torch.testing.assert_close(hub(pixels, grid), encoder(pixels, grid), rtol=0, atol=0)


def _visual(model):
    return [(name, t) for name, t in model.state_dict().items() if name.startswith(QWEN_ENCODER_PREFIXES)]


def test_load_errors(models):
    model, _ = models["qwen2_5_vl"]
    encoder = QwenVisionEncoder(model.config)
    weights = _visual(model)
    missing = [(n, t) for n, t in weights if n != "model.visual.blocks.1.mlp.up_proj.bias"]
    with pytest.raises(ModelLoadError, match=r"lacks .*blocks\.1\.mlp\.up_proj\.bias"):
        encoder.load_weights(missing)
    encoder.load_weights(missing, partial=True)
    encoder.load_weights(weights[:3], partial=True, write=False)
    wrong = [(n, t[:-1] if n == "model.visual.merger.mlp.2.weight" else t) for n, t in weights]
    with pytest.raises(ModelLoadError, match=r"merger\.mlp\.2\.weight: shape \(39, 128\), expected \(40, 128\)"):
        encoder.load_weights(wrong)
    with pytest.raises(ModelLoadError, match="no such tensor"):
        encoder.load_weights([("visual.blocks.7.norm1.weight", torch.ones(32))], partial=True)
    with pytest.raises(ModelLoadError, match="floating-point"):
        encoder.load_weights([("visual.blocks.0.norm1.weight", torch.ones(32, dtype=torch.int64))], partial=True)


def test_write_false_and_partial_keep_other_weights(models):
    model, _ = models["qwen2_vl"]
    encoder = QwenVisionEncoder(model.config)
    before = {n: p.clone() for n, p in encoder.named_parameters()}
    encoder.load_weights(_visual(model), write=False)
    assert all(torch.equal(before[n], p) for n, p in encoder.named_parameters())
    new = torch.full((32,), 3.0)
    encoder.load_weights([("visual.blocks.2.norm2.bias", new)], partial=True)
    params = dict(encoder.named_parameters())
    assert torch.equal(params["blocks.2.norm2.bias"], new)
    assert torch.equal(params["blocks.0.norm1.bias"], before["blocks.0.norm1.bias"])


def test_config_checks(models):
    assert QWEN_VL_TYPES == ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
    assert is_qwen_vl(models["qwen2_vl"][0].config) and is_qwen_vl(models["qwen2_5_vl"][0].config)
    llava = transformers.LlavaConfig()
    assert not is_qwen_vl(llava)
    with pytest.raises(UnsupportedModelError, match="not a Qwen-VL model"):
        QwenVisionEncoder(llava)
